//! The Jupyter wire format: `[ids..., "<IDS|MSG>", hmac, header,
//! parent_header, metadata, content, buffers...]`, signed with
//! HMAC-SHA256 over the four JSON frames; messages whose signature does
//! not match are refused.

use hmac::{Hmac, Mac};
use serde_json::{json, Value};
use sha2::Sha256;

/// The protocol version this kernel speaks.
pub const PROTOCOL_VERSION: &str = "5.3";

const DELIMITER: &[u8] = b"<IDS|MSG>";

/// Most routing identities and buffers accepted in one message.
const MAX_FRAMES: usize = 64;

/// One message, decoded.
#[derive(Debug, Clone)]
pub struct Message {
    /// The ROUTER identities it came with (a reply goes back with them).
    pub ids: Vec<Vec<u8>>,
    /// `msg_id`, `session`, `username`, `date`, `msg_type`, `version`.
    pub header: Value,
    /// The header of the request this message answers (`{}` if none).
    pub parent_header: Value,
    /// Free-form metadata.
    pub metadata: Value,
    /// The message type's own fields.
    pub content: Value,
    /// Binary buffers (kept, not signed).
    pub buffers: Vec<Vec<u8>>,
}

/// Why a message was refused.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// No `<IDS|MSG>` delimiter, or too few frames after it.
    #[error("not a Jupyter message: {0}")]
    Malformed(String),
    /// The HMAC did not match the key of the connection file.
    #[error("the message's signature does not match the connection key")]
    BadSignature,
}

/// Signs and checks messages with the connection file's key.
#[derive(Clone)]
pub struct Signer {
    key: Option<Vec<u8>>,
}

impl std::fmt::Debug for Signer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The key never reaches a log.
        f.debug_struct("Signer")
            .field("signed", &self.key.is_some())
            .finish()
    }
}

impl Signer {
    /// A signer with `key` (empty: messages are neither signed nor checked,
    /// as the protocol says for an empty key).
    pub fn new(key: &str) -> Self {
        Self {
            key: (!key.is_empty()).then(|| key.as_bytes().to_vec()),
        }
    }

    fn mac(&self, parts: &[&[u8]; 4]) -> Option<Hmac<Sha256>> {
        let key = self.key.as_ref()?;
        let mut mac = Hmac::<Sha256>::new_from_slice(key).ok()?;
        for p in parts {
            mac.update(p);
        }
        Some(mac)
    }

    /// The hex signature of the four JSON frames (empty without a key).
    pub fn sign(&self, parts: &[&[u8]; 4]) -> String {
        match self.mac(parts) {
            None => String::new(),
            Some(mac) => hex(&mac.finalize().into_bytes()),
        }
    }

    /// Whether `signature` (hex) is the one of `parts`, compared in
    /// constant time.
    pub fn verify(&self, signature: &[u8], parts: &[&[u8]; 4]) -> bool {
        let Some(mac) = self.mac(parts) else {
            return true;
        };
        match unhex(signature) {
            Some(sig) => mac.verify_slice(&sig).is_ok(),
            None => false,
        }
    }
}

/// Lowercase hex (every message's signature; a `format!` per byte was 2%
/// of a kernel host's CPU a cell).
fn hex(bytes: &[u8]) -> String {
    rvisor::ids::hex(bytes)
}

fn unhex(s: &[u8]) -> Option<Vec<u8>> {
    if s.len() % 2 != 0 {
        return None;
    }
    let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    s.chunks(2)
        .map(|p| Some(digit(p[0])? << 4 | digit(p[1])?))
        .collect()
}

impl Message {
    /// Decodes the frames of one multipart message, checking its signature.
    pub fn decode(frames: Vec<Vec<u8>>, signer: &Signer) -> Result<Self, WireError> {
        let Some(at) = frames.iter().position(|f| f == DELIMITER) else {
            return Err(WireError::Malformed("no <IDS|MSG> delimiter".into()));
        };
        if at > MAX_FRAMES || frames.len() - at > MAX_FRAMES + 6 {
            return Err(WireError::Malformed(format!(
                "{} frames, more than the {MAX_FRAMES} identities or buffers accepted",
                frames.len()
            )));
        }
        if frames.len() < at + 6 {
            return Err(WireError::Malformed(
                "fewer than the signature and four JSON frames after the delimiter".into(),
            ));
        }
        let mut it = frames.into_iter();
        let ids: Vec<Vec<u8>> = it.by_ref().take(at).collect();
        it.next();
        let sig = it.next().unwrap_or_default();
        let parts: Vec<Vec<u8>> = it.by_ref().take(4).collect();
        if !signer.verify(&sig, &[&parts[0], &parts[1], &parts[2], &parts[3]]) {
            return Err(WireError::BadSignature);
        }
        let json = |i: usize, what: &str| -> Result<Value, WireError> {
            serde_json::from_slice(&parts[i])
                .map_err(|e| WireError::Malformed(format!("the {what} is not JSON: {e}")))
        };
        Ok(Self {
            ids,
            header: json(0, "header")?,
            parent_header: json(1, "parent header")?,
            metadata: json(2, "metadata")?,
            content: json(3, "content")?,
            buffers: it.collect(),
        })
    }

    /// The frames of this message, signed.
    pub fn encode(&self, signer: &Signer) -> Vec<Vec<u8>> {
        let enc = |v: &Value| serde_json::to_vec(v).unwrap_or_else(|_| b"{}".to_vec());
        let parts = [
            enc(&self.header),
            enc(&self.parent_header),
            enc(&self.metadata),
            enc(&self.content),
        ];
        let sig = signer.sign(&[&parts[0], &parts[1], &parts[2], &parts[3]]);
        let mut frames = self.ids.clone();
        frames.push(DELIMITER.to_vec());
        frames.push(sig.into_bytes());
        frames.extend(parts);
        frames.extend(self.buffers.iter().cloned());
        frames
    }

    /// The header's `msg_type` (`""` if missing).
    pub fn msg_type(&self) -> &str {
        self.header["msg_type"].as_str().unwrap_or("")
    }

    /// A message of type `msg_type` answering `self`: same identities (a
    /// shell or control reply), `self`'s header as parent, the same
    /// client session.
    pub fn reply(&self, msg_type: &str, content: Value) -> Self {
        Self {
            ids: self.ids.clone(),
            header: header(msg_type, &self.header["session"]),
            parent_header: self.header.clone(),
            metadata: json!({}),
            content,
            buffers: Vec::new(),
        }
    }

    /// An iopub message of type `msg_type` caused by `self` (topic: the
    /// message type, as ipykernel sends).
    pub fn broadcast(&self, msg_type: &str, content: Value) -> Self {
        let mut m = self.reply(msg_type, content);
        m.ids = vec![msg_type.as_bytes().to_vec()];
        m
    }
}

/// A new header.
pub fn header(msg_type: &str, session: &Value) -> Value {
    json!({
        "msg_id": rvisor::ids::random_hex(16),
        "session": session.as_str().unwrap_or(""),
        "username": "rvisor",
        "date": now(),
        "msg_type": msg_type,
        "version": PROTOCOL_VERSION,
    })
}

/// The time now, ISO 8601 with microseconds, UTC.
fn now() -> String {
    let d = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let secs = rvisor::clock::rfc3339(d.as_secs());
    // `...Z` -> `....ffffffZ`
    let base = secs.trim_end_matches('Z');
    format!("{base}.{:06}Z", d.subsec_micros())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(signer: &Signer) -> Vec<Vec<u8>> {
        let m = Message {
            ids: vec![b"client".to_vec()],
            header: header("kernel_info_request", &json!("s1")),
            parent_header: json!({}),
            metadata: json!({}),
            content: json!({}),
            buffers: vec![],
        };
        m.encode(signer)
    }

    #[test]
    fn a_signed_message_round_trips() {
        let s = Signer::new("secret");
        let m = Message::decode(request(&s), &s).unwrap();
        assert_eq!(m.msg_type(), "kernel_info_request");
        assert_eq!(m.ids, vec![b"client".to_vec()]);
        let r = m.reply("kernel_info_reply", json!({"status": "ok"}));
        assert_eq!(r.parent_header["msg_type"], "kernel_info_request");
        assert_eq!(r.header["session"], "s1");
    }

    #[test]
    fn a_wrong_key_or_a_changed_frame_is_refused() {
        let frames = request(&Signer::new("secret"));
        let other = Signer::new("another");
        assert_eq!(
            Message::decode(frames.clone(), &other).unwrap_err(),
            WireError::BadSignature
        );
        let mut changed = frames.clone();
        *changed.last_mut().unwrap() = br#"{"code": "system('id')"}"#.to_vec();
        let s = Signer::new("secret");
        assert_eq!(
            Message::decode(changed, &s).unwrap_err(),
            WireError::BadSignature
        );
        let mut junk = frames;
        junk[2] = b"zz".to_vec();
        assert_eq!(
            Message::decode(junk, &s).unwrap_err(),
            WireError::BadSignature
        );
    }

    #[test]
    fn the_signature_is_the_hmac_jupyter_client_computes() {
        // hmac.new(b"key", b"abcd", hashlib.sha256).hexdigest()
        let s = Signer::new("key");
        assert_eq!(
            s.sign(&[b"a", b"b", b"c", b"d"]),
            "2a31ec0ee8d878c9eece9fb0df79b3b90b2256240163aa5ee50d176d3d1121f8"
        );
        assert!(s.verify(
            b"2a31ec0ee8d878c9eece9fb0df79b3b90b2256240163aa5ee50d176d3d1121f8",
            &[b"a", b"b", b"c", b"d"]
        ));
    }

    #[test]
    fn garbage_is_malformed_not_a_panic() {
        let s = Signer::new("k");
        assert!(matches!(
            Message::decode(vec![b"x".to_vec()], &s),
            Err(WireError::Malformed(_))
        ));
        assert!(matches!(
            Message::decode(vec![DELIMITER.to_vec(), b"ab".to_vec()], &s),
            Err(WireError::Malformed(_))
        ));
    }
}
