//! The connection file a Jupyter front end writes for a kernel it starts:
//! where the five sockets listen and the key that signs every message.

use crate::error::KernelError;
use serde::Deserialize;
use std::path::Path;

/// Largest connection file read (they are a few hundred bytes).
const MAX_CONNECTION_FILE_BYTES: u64 = 64 * 1024;

/// The fields of a connection file this kernel uses (others are ignored).
#[derive(Debug, Clone, Deserialize)]
pub struct ConnectionInfo {
    /// `tcp` or `ipc`.
    #[serde(default = "tcp")]
    pub transport: String,
    /// The address (tcp) or path prefix (ipc).
    pub ip: String,
    /// Shell requests (ROUTER).
    pub shell_port: u16,
    /// Control requests (ROUTER).
    pub control_port: u16,
    /// Input requests to the front end (ROUTER).
    pub stdin_port: u16,
    /// Broadcast of outputs and status (PUB).
    pub iopub_port: u16,
    /// Heartbeat echo (REP).
    pub hb_port: u16,
    /// The HMAC key; empty: messages are not signed.
    #[serde(default)]
    pub key: String,
    /// `hmac-sha256` (the only scheme supported).
    #[serde(default = "sha256")]
    pub signature_scheme: String,
}

fn tcp() -> String {
    "tcp".to_string()
}

fn sha256() -> String {
    "hmac-sha256".to_string()
}

impl ConnectionInfo {
    /// Reads and checks the connection file at `path`.
    pub fn read(path: &Path) -> Result<Self, KernelError> {
        let bad = |why: String| KernelError::ConnectionFile {
            path: path.display().to_string(),
            why,
        };
        let meta = std::fs::metadata(path).map_err(|e| bad(e.to_string()))?;
        if meta.len() > MAX_CONNECTION_FILE_BYTES {
            return Err(bad(format!(
                "it holds {} bytes, more than a connection file's {MAX_CONNECTION_FILE_BYTES}",
                meta.len()
            )));
        }
        let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
        Self::parse(&text).map_err(bad)
    }

    /// Parses and checks a connection file's text.
    pub fn parse(text: &str) -> Result<Self, String> {
        let c: Self =
            serde_json::from_str(text).map_err(|e| format!("not a connection file: {e}"))?;
        if c.signature_scheme != "hmac-sha256" {
            return Err(format!(
                "signature_scheme {:?} is not supported; use \"hmac-sha256\"",
                c.signature_scheme
            ));
        }
        if c.transport != "tcp" && c.transport != "ipc" {
            return Err(format!(
                "transport {:?} is not supported; use \"tcp\" or \"ipc\"",
                c.transport
            ));
        }
        Ok(c)
    }

    /// The ZeroMQ endpoint of `port`.
    pub fn endpoint(&self, port: u16) -> String {
        match self.transport.as_str() {
            "ipc" => format!("ipc://{}-{port}", self.ip),
            _ => format!("tcp://{}:{port}", self.ip),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_jupyter_client_file_and_refuses_other_schemes() {
        let text = r#"{"shell_port": 1, "iopub_port": 2, "stdin_port": 3, "control_port": 4,
            "hb_port": 5, "ip": "127.0.0.1", "key": "k", "transport": "tcp",
            "signature_scheme": "hmac-sha256", "kernel_name": "rvisor"}"#;
        let c = ConnectionInfo::parse(text).unwrap();
        assert_eq!(c.endpoint(c.hb_port), "tcp://127.0.0.1:5");
        let md5 = text.replace("hmac-sha256", "hmac-md5");
        assert!(ConnectionInfo::parse(&md5)
            .unwrap_err()
            .contains("hmac-md5"));
    }
}
