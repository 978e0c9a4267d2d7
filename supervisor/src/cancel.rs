//! A cancel token: lets the code that asked for a call (an HTTP handler
//! whose client left, an nng pipe that closed, an MCP client whose input
//! ended) stop it from any thread, whether it is queued, starting or
//! running.

use std::sync::{Arc, Mutex, MutexGuard};

type Hook = Box<dyn FnOnce() + Send>;

#[derive(Default)]
struct State {
    cancelled: bool,
    /// What stops the call where it is now (set while it runs).
    hook: Option<Hook>,
}

/// Cancels one call. Cheap to clone; every clone cancels the same call.
#[derive(Clone, Default)]
pub struct CancelToken {
    state: Arc<Mutex<State>>,
}

impl std::fmt::Debug for CancelToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CancelToken")
            .field("cancelled", &self.is_cancelled())
            .finish()
    }
}

impl CancelToken {
    /// A token nothing has cancelled yet.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Cancels the call: a call not started yet never starts; a running
    /// one is interrupted (and its worker killed if R does not answer
    /// within the grace period); its outcome is `cancelled`. Idempotent.
    pub fn cancel(&self) {
        let hook = {
            let mut s = self.lock();
            s.cancelled = true;
            s.hook.take()
        };
        if let Some(h) = hook {
            h();
        }
    }

    /// Whether [`CancelToken::cancel`] was called.
    pub fn is_cancelled(&self) -> bool {
        self.lock().cancelled
    }

    /// Runs `hook` when the token is cancelled, or now if it already was
    /// (for the code that runs the call).
    pub fn on_cancel(&self, hook: impl FnOnce() + Send + 'static) {
        let mut s = self.lock();
        if s.cancelled {
            drop(s);
            hook();
        } else {
            s.hook = Some(Box::new(hook));
        }
    }

    /// Forgets the hook (the call ended).
    pub fn clear(&self) {
        self.lock().hook = None;
    }
}

/// Cancels its token when dropped, unless disarmed: for the async handler
/// whose future is dropped when its client leaves.
#[derive(Debug)]
pub struct CancelOnDrop(Option<CancelToken>);

impl CancelOnDrop {
    /// Arms `token`.
    pub fn new(token: CancelToken) -> Self {
        Self(Some(token))
    }

    /// The call ended normally: dropping no longer cancels.
    pub fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(t) = self.0.take() {
            t.cancel();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn a_hook_runs_once_whether_set_before_or_after_the_cancel() {
        let n = Arc::new(AtomicUsize::new(0));
        let t = CancelToken::new();
        let m = n.clone();
        t.on_cancel(move || {
            m.fetch_add(1, Ordering::SeqCst);
        });
        t.cancel();
        t.cancel();
        assert_eq!(n.load(Ordering::SeqCst), 1);
        let m = n.clone();
        t.on_cancel(move || {
            m.fetch_add(1, Ordering::SeqCst);
        });
        assert_eq!(
            n.load(Ordering::SeqCst),
            2,
            "already cancelled: runs at once"
        );
    }

    #[test]
    fn a_cleared_hook_never_runs_and_a_disarmed_guard_never_cancels() {
        let n = Arc::new(AtomicUsize::new(0));
        let t = CancelToken::new();
        let m = n.clone();
        t.on_cancel(move || {
            m.fetch_add(1, Ordering::SeqCst);
        });
        t.clear();
        CancelOnDrop::new(t.clone()).disarm();
        assert!(!t.is_cancelled());
        drop(CancelOnDrop::new(t.clone()));
        assert!(t.is_cancelled());
        assert_eq!(n.load(Ordering::SeqCst), 0);
    }
}
