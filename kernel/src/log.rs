//! Where a kernel's own messages go (a refused signature, a message it
//! ignores, a socket that failed): the standard error of the process the
//! front end started. A kernel of its own process writes them there; a
//! kernel in a kernel host sends them to its stub, which writes them on
//! its standard error (the front end's terminal or log), not into the
//! host's log, which other kernels share.
//!
//! Each of a kernel's threads has its kernel's sink ([`Log::enter`]); a
//! thread with none writes on this process's standard error.

use std::cell::RefCell;
use std::sync::Arc;

type Sink = Arc<dyn Fn(&str) + Send + Sync>;

/// A kernel's sink for its messages.
#[derive(Clone, Default)]
pub struct Log(Option<Sink>);

impl std::fmt::Debug for Log {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "Log(sink)"
        } else {
            "Log(stderr)"
        })
    }
}

thread_local! {
    static CURRENT: RefCell<Log> = RefCell::new(Log::default());
}

impl Log {
    /// Messages to `sink`, one line each (without its newline).
    pub fn to(sink: impl Fn(&str) + Send + Sync + 'static) -> Self {
        Self(Some(Arc::new(sink)))
    }

    /// The sink of this thread's kernel (standard error if none).
    pub fn current() -> Self {
        CURRENT.with(|c| c.borrow().clone())
    }

    /// Makes this the sink of the calling thread's messages.
    pub fn enter(&self) {
        CURRENT.with(|c| *c.borrow_mut() = self.clone());
    }

    /// Writes `msg` to this sink.
    pub fn say(&self, msg: &str) {
        match &self.0 {
            Some(sink) => sink(msg),
            None => eprintln!("{msg}"),
        }
    }
}

/// Writes `msg` to the calling thread's kernel's sink.
pub fn say(msg: &str) {
    Log::current().say(msg);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[test]
    fn a_thread_writes_to_the_sink_it_entered_and_others_keep_theirs() {
        let got = Arc::new(Mutex::new(Vec::new()));
        let g = got.clone();
        let log = Log::to(move |m| g.lock().unwrap().push(m.to_string()));
        let l = log.clone();
        std::thread::spawn(move || {
            l.enter();
            say("one");
            Log::current().say("two");
        })
        .join()
        .unwrap();
        // This thread entered nothing: its messages are not the sink's.
        assert!(format!("{:?}", Log::current()).contains("stderr"));
        assert_eq!(*got.lock().unwrap(), ["one", "two"]);
    }
}
