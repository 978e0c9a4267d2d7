//! Many nodes behind one router (docs/scale-out.md): the node id a node's
//! session ids carry, and the drain state (readiness off, new work refused,
//! calls in flight counted so a shutdown can wait for them).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// The one regular expression a router matches a session id with: the
/// node id (group `node`), a dot, then the node's own `s-` id. nginx's
/// `map` in deploy/nginx/rvisor.conf uses the same pattern.
pub const SESSION_ID_PATTERN: &str =
    r"^(?P<node>[a-z0-9](?:[a-z0-9-]{0,30}[a-z0-9])?)\.s-[0-9a-f]+$";

/// A node id: 1 to 32 of `a-z`, `0-9` and `-`, starting and ending with a
/// letter or digit (a DNS label, so a pod name fits).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeId(String);

impl NodeId {
    /// Checks `s` and keeps it.
    pub fn parse(s: &str) -> Result<Self, String> {
        let b = s.as_bytes();
        let ok_char = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-';
        let edge = |c: Option<&u8>| c.is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
        if (1..=32).contains(&b.len()) && b.iter().all(ok_char) && edge(b.first()) && edge(b.last())
        {
            Ok(Self(s.to_string()))
        } else {
            Err(format!(
                "{s:?} is not a node id: use 1 to 32 lowercase letters, digits and '-', starting \
                 and ending with a letter or digit (e.g. n1)"
            ))
        }
    }

    /// `n{ordinal}` from a StatefulSet pod's host name (`rvisor-2` gives
    /// `n2`): the digits after the last `-`.
    pub fn from_hostname(host: &str) -> Result<Self, String> {
        let host = host.split('.').next().unwrap_or(host);
        match host.rsplit_once('-') {
            Some((_, n))
                if !n.is_empty() && n.len() <= 9 && n.bytes().all(|c| c.is_ascii_digit()) =>
            {
                let ordinal: u32 = n.parse().map_err(|e| format!("{n:?}: {e}"))?;
                Self::parse(&format!("n{ordinal}"))
            }
            _ => Err(format!(
                "the host name {host:?} ends in no ordinal (NAME-N, as a StatefulSet's pods \
                 are named); give --node-id explicitly"
            )),
        }
    }

    /// The id.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for NodeId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// The node id in a session id (`n1.s-...` gives `n1`), if it has one.
pub fn node_of(session_id: &str) -> Option<&str> {
    let (node, rest) = session_id.split_once('.')?;
    (rest.starts_with("s-") && NodeId::parse(node).is_ok()).then_some(node)
}

/// Whether the node is draining, and the calls in flight.
#[derive(Debug, Default)]
pub struct Drain {
    draining: AtomicBool,
    since: Mutex<Option<Instant>>,
    in_flight: Arc<InFlightCount>,
}

#[derive(Debug, Default)]
struct InFlightCount {
    /// Every call in flight.
    n: AtomicUsize,
    /// Those accepted before the drain started: the ones it waits for.
    before: AtomicUsize,
    lock: Mutex<()>,
    zero: Condvar,
}

/// One call in flight; dropping it ends the count's share.
#[derive(Debug)]
pub struct InFlight {
    count: Arc<InFlightCount>,
    before_drain: bool,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let c = &self.count;
        c.n.fetch_sub(1, Ordering::SeqCst);
        if self.before_drain && c.before.fetch_sub(1, Ordering::SeqCst) == 1 {
            let _g = c.lock.lock().unwrap_or_else(|e| e.into_inner());
            c.zero.notify_all();
        }
    }
}

impl Drain {
    /// Starts draining (idempotent); true the first time.
    pub fn start(&self) -> bool {
        let first = !self.draining.swap(true, Ordering::SeqCst);
        if first {
            *self.since.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
        }
        first
    }

    /// Whether the node is draining.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// How long it has been draining.
    pub fn draining_for(&self) -> Option<Duration> {
        self.since
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .map(|t| t.elapsed())
    }

    /// Counts a call until the guard drops.
    pub fn enter(&self) -> InFlight {
        let c = &self.in_flight;
        c.n.fetch_add(1, Ordering::SeqCst);
        // Counted as before the drain unless it had started; a call racing
        // the start is counted before (waited for), never lost.
        c.before.fetch_add(1, Ordering::SeqCst);
        let before_drain = !self.is_draining();
        if !before_drain && c.before.fetch_sub(1, Ordering::SeqCst) == 1 {
            let _g = c.lock.lock().unwrap_or_else(|e| e.into_inner());
            c.zero.notify_all();
        }
        InFlight {
            count: c.clone(),
            before_drain,
        }
    }

    /// Calls in flight now.
    pub fn in_flight(&self) -> usize {
        self.in_flight.n.load(Ordering::SeqCst)
    }

    /// Blocks until the calls accepted before the drain started have
    /// ended or `grace` has passed; true if none of them is left. (Calls
    /// that existing sessions get during the drain are not waited for: a
    /// steady stream of them would hold the drain for its whole grace.)
    pub fn wait_idle(&self, grace: Duration) -> bool {
        let until = Instant::now() + grace;
        let c = &self.in_flight;
        let mut g = c.lock.lock().unwrap_or_else(|e| e.into_inner());
        while c.before.load(Ordering::SeqCst) > 0 {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            g = c
                .zero
                .wait_timeout(g, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_ids_are_dns_labels_and_come_from_pod_ordinals() {
        for ok in ["n1", "rvisor-0", "a", "n12345"] {
            assert_eq!(NodeId::parse(ok).unwrap().as_str(), ok);
        }
        for bad in ["", "N1", "n1.", "-n1", "n1-", "n/1", "n 1", &"n".repeat(33)] {
            assert!(
                NodeId::parse(bad).unwrap_err().contains("not a node id"),
                "{bad}"
            );
        }
        assert_eq!(NodeId::from_hostname("rvisor-2").unwrap().as_str(), "n2");
        assert_eq!(NodeId::from_hostname("rvisor-0").unwrap().as_str(), "n0");
        assert_eq!(
            NodeId::from_hostname("rvisor-10.nodes.ns")
                .unwrap()
                .as_str(),
            "n10"
        );
        assert!(NodeId::from_hostname("laptop")
            .unwrap_err()
            .contains("--node-id"));
    }

    #[test]
    fn one_pattern_matches_every_node_session_id() {
        let re = regex::Regex::new(SESSION_ID_PATTERN).unwrap();
        let c = re.captures("n1.s-0123456789abcdef").unwrap();
        assert_eq!(&c["node"], "n1");
        assert_eq!(node_of("n1.s-0123456789abcdef"), Some("n1"));
        assert_eq!(&re.captures("rvisor-3.s-00ff").unwrap()["node"], "rvisor-3");
        // Ids without a node keep today's form, and do not match.
        assert!(!re.is_match("s-0123456789abcdef"));
        assert_eq!(node_of("s-0123456789abcdef"), None);
        assert_eq!(node_of("N1.s-00"), None);
    }

    #[test]
    fn a_drain_waits_for_the_calls_in_flight_within_its_grace() {
        let d = Arc::new(Drain::default());
        assert!(!d.is_draining());
        let call = d.enter();
        assert!(d.start());
        assert!(!d.start());
        assert!(d.is_draining() && d.draining_for().is_some());
        // A call that came during the drain is counted, not waited for.
        let later = d.enter();
        assert_eq!(d.in_flight(), 2);
        assert!(!d.wait_idle(Duration::from_millis(20)));
        let (tx, rx) = std::sync::mpsc::channel();
        let waiter = {
            let d = d.clone();
            std::thread::spawn(move || {
                tx.send(()).unwrap();
                d.wait_idle(Duration::from_secs(60))
            })
        };
        rx.recv().unwrap();
        drop(call);
        assert!(waiter.join().unwrap());
        assert_eq!(d.in_flight(), 1);
        drop(later);
        assert_eq!(d.in_flight(), 0);
        assert!(d.wait_idle(Duration::ZERO));
    }
}
