//! Session history (docs/console.md, "History"): every session keeps a
//! bounded ring of what happened in it, each call (code, console, typed
//! segments, displays, plots, files changed, outcome, times) and each
//! reset and restore as an entry of its own, so a person (the web
//! console) or a client that joins later can read what an agent did.
//!
//! Bounds: [`HistoryLimits`] (default 100 entries and 4 MiB per session,
//! whichever is reached first; the oldest entries leave first). One entry
//! is at most [`HistoryLimits::max_entry_bytes`] (default 1 MiB): a larger
//! one is cut (plots and rich displays first, then console text) and says
//! so in its `truncated` field. With a store, the history is written
//! beside the session's checkpoint each time one is stored (`durable.rs`,
//! [`crate::durable::HistorySource`]), so it goes with the state it
//! describes through hibernation, a restart and a move to another node;
//! a node that dies loses the entries since the last checkpoint, as the
//! session loses their effects.

use super::{lock, ErrorCode, Service, ServiceError};
use rvisor::RunResult;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::HashMap;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

/// Default of [`HistoryLimits::max_entries`].
pub const DEFAULT_HISTORY_ENTRIES: usize = 100;
/// Default of [`HistoryLimits::max_bytes`]: 4 MiB.
pub const DEFAULT_HISTORY_BYTES: usize = 4 << 20;
/// Default of [`HistoryLimits::max_entry_bytes`]: 1 MiB.
pub const DEFAULT_HISTORY_ENTRY_BYTES: usize = 1 << 20;
/// Most entries one page of history holds.
pub const MAX_HISTORY_PAGE: usize = 100;
/// Entries of a page when the client does not say.
pub const DEFAULT_HISTORY_PAGE: usize = 20;

/// How much history one session keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HistoryLimits {
    /// Entries kept; one more pushes the oldest out.
    pub max_entries: usize,
    /// Bytes of all entries (as JSON) together; past it the oldest go.
    pub max_bytes: usize,
    /// Bytes of one entry (as JSON); a larger one is cut, and says so.
    pub max_entry_bytes: usize,
}

impl Default for HistoryLimits {
    fn default() -> Self {
        Self {
            max_entries: DEFAULT_HISTORY_ENTRIES,
            max_bytes: DEFAULT_HISTORY_BYTES,
            max_entry_bytes: DEFAULT_HISTORY_ENTRY_BYTES,
        }
    }
}

/// What an entry records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum EntryKind {
    /// A call: its code and what it gave.
    Call,
    /// The session's worker was replaced and its state lost (asked for,
    /// or after a timeout, crash, kill).
    Reset,
    /// The session's state was loaded from its checkpoint (after
    /// hibernation or a lost worker, or rolled back on request).
    Restore,
}

/// One entry of a session's history.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct HistoryEntry {
    /// 1, 2, 3... within the session, never reused: the paging cursor.
    pub seq: u64,
    /// What it records.
    pub kind: EntryKind,
    /// The call's execution id (calls only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub execution_id: Option<String>,
    /// The code as run (calls only).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub code: String,
    /// The call's outcome as its RunResult says (`complete`, `error`,
    /// `interrupted`, `timed_out`, `cancelled`...); for a reset or a
    /// restore, `reset` or `restore`.
    pub outcome: String,
    /// Whether the call succeeded (a reset or restore: true).
    pub success: bool,
    /// Why (resets and restores: `reset`, `timeout`, `crash`,
    /// `hibernated`, `restore`...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Console text, as the RunResult's `console`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub console: String,
    /// The RunResult's typed `segments`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schema(value_type = Vec<Object>)]
    pub segments: Vec<Value>,
    /// The RunResult's `displays` (MIME bundles).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schema(value_type = Vec<Object>)]
    pub displays: Vec<Value>,
    /// The RunResult's `plots` (PNG as base64).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schema(value_type = Vec<Object>)]
    pub plots: Vec<Value>,
    /// Files the call changed (the RunResult's `artifacts`: name, size,
    /// `uri` to download).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schema(value_type = Vec<Object>)]
    pub files: Vec<Value>,
    /// The call's error, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub error: Option<Value>,
    /// When it started (RFC 3339, UTC).
    pub started_at: String,
    /// When it ended (RFC 3339, UTC).
    pub ended_at: String,
    /// When it ended, milliseconds since the Unix epoch.
    pub ended_unix_ms: u64,
    /// Wall time from the request to the result, milliseconds.
    pub duration_ms: f64,
    /// Set when the entry was over the size of one entry and was cut:
    /// what was left out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub truncated: Option<String>,
}

/// One page of a session's history, newest first.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct HistoryPage {
    /// The session.
    pub session_id: String,
    /// Entries, newest first.
    pub entries: Vec<HistoryEntry>,
    /// The cursor of the next (older) page: pass it as `before`; null
    /// when there are no older entries.
    pub next: Option<u64>,
    /// Entries the session keeps now.
    pub total: usize,
    /// Entries that left the ring (oldest first) since the session began.
    pub dropped: u64,
    /// The bounds: entries, bytes, bytes of one entry.
    pub max_entries: usize,
    /// Bytes of all entries together.
    pub max_bytes: usize,
    /// Bytes of one entry.
    pub max_entry_bytes: usize,
}

/// The histories of the sessions this node holds, by session id, for
/// the store to write beside checkpoints. Weak: a session's history lives
/// as long as its entry (and a session being released keeps its entry
/// until its last checkpoint is written).
pub(super) type Histories = Arc<Mutex<HashMap<String, Weak<SessionHistory>>>>;

/// The history of one session.
pub struct SessionHistory {
    limits: HistoryLimits,
    ring: Mutex<Ring>,
}

impl std::fmt::Debug for SessionHistory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionHistory")
            .field("limits", &self.limits)
            .field("entries", &lock(&self.ring).entries.len())
            .finish()
    }
}

#[derive(Debug, Default)]
struct Ring {
    /// Each entry with its size as JSON.
    entries: VecDeque<(HistoryEntry, usize)>,
    bytes: usize,
    next_seq: u64,
    dropped: u64,
}

/// The stored form.
#[derive(Serialize, Deserialize)]
struct Stored {
    version: u32,
    next_seq: u64,
    dropped: u64,
    entries: Vec<HistoryEntry>,
}

fn size_of(e: &HistoryEntry) -> usize {
    serde_json::to_vec(e).map_or(0, |v| v.len())
}

impl SessionHistory {
    /// An empty history within `limits`.
    pub fn new(limits: HistoryLimits) -> Self {
        Self {
            limits,
            ring: Mutex::new(Ring {
                next_seq: 1,
                ..Ring::default()
            }),
        }
    }

    /// The history stored as `bytes` ([`SessionHistory::to_bytes`]),
    /// within `limits` (tighter limits than it was written with drop the
    /// oldest entries); an unreadable one is empty, with a warning.
    pub fn load(limits: HistoryLimits, bytes: &[u8]) -> Self {
        let h = Self::new(limits);
        match serde_json::from_slice::<Stored>(bytes) {
            Ok(s) => {
                let mut ring = lock(&h.ring);
                ring.next_seq = s.next_seq.max(1);
                ring.dropped = s.dropped;
                for e in s.entries {
                    ring.next_seq = ring.next_seq.max(e.seq + 1);
                    let size = size_of(&e);
                    ring.bytes += size;
                    ring.entries.push_back((e, size));
                }
                Self::trim(&mut ring, &limits);
            }
            Err(e) => tracing::warn!(
                target: "rvisor::sessions",
                "a session's stored history could not be read and starts empty: {e}"
            ),
        }
        h
    }

    fn trim(ring: &mut Ring, limits: &HistoryLimits) {
        while ring.entries.len() > limits.max_entries
            || (ring.bytes > limits.max_bytes && ring.entries.len() > 1)
        {
            if let Some((_, size)) = ring.entries.pop_front() {
                ring.bytes -= size;
                ring.dropped += 1;
            }
        }
    }

    /// The stored form of the history now.
    pub fn to_bytes(&self) -> Vec<u8> {
        let ring = lock(&self.ring);
        Self::encode(&ring)
    }

    fn encode(ring: &Ring) -> Vec<u8> {
        let s = Stored {
            version: 1,
            next_seq: ring.next_seq,
            dropped: ring.dropped,
            entries: ring.entries.iter().map(|(e, _)| e.clone()).collect(),
        };
        serde_json::to_vec(&s).unwrap_or_default()
    }

    /// Adds `e` (its `seq` is set here), cut to the size of one entry,
    /// dropping the oldest entries past the bounds.
    pub fn push(&self, mut e: HistoryEntry) {
        let mut ring = lock(&self.ring);
        e.seq = ring.next_seq;
        ring.next_seq += 1;
        let max_one = self.limits.max_entry_bytes.min(self.limits.max_bytes);
        let size = fit(&mut e, max_one);
        ring.bytes += size;
        ring.entries.push_back((e, size));
        Self::trim(&mut ring, &self.limits);
    }

    /// Up to `limit` entries older than `before` (a `seq`; `None`: from
    /// the newest), newest first, and the cursor of the next page.
    pub fn page(&self, limit: usize, before: Option<u64>) -> (Vec<HistoryEntry>, Option<u64>) {
        let ring = lock(&self.ring);
        let older = ring
            .entries
            .iter()
            .rev()
            .filter(|(e, _)| before.is_none_or(|b| e.seq < b));
        let mut out: Vec<HistoryEntry> = Vec::new();
        let mut more = false;
        for (e, _) in older {
            if out.len() == limit {
                more = true;
                break;
            }
            out.push(e.clone());
        }
        let next = if more {
            out.last().map(|e| e.seq)
        } else {
            None
        };
        (out, next)
    }

    /// Entries kept, entries dropped since the start, bytes kept.
    pub fn counts(&self) -> (usize, u64, usize) {
        let ring = lock(&self.ring);
        (ring.entries.len(), ring.dropped, ring.bytes)
    }

    /// The newest call entry, if any.
    pub fn last_call(&self) -> Option<HistoryEntry> {
        lock(&self.ring)
            .entries
            .iter()
            .rev()
            .find(|(e, _)| e.kind == EntryKind::Call)
            .map(|(e, _)| e.clone())
    }

    /// The bounds.
    pub fn limits(&self) -> HistoryLimits {
        self.limits
    }
}

/// Cuts `e` to at most `max` bytes as JSON, saying what it left out in
/// `truncated`; returns its size after.
fn fit(e: &mut HistoryEntry, max: usize) -> usize {
    let size = size_of(e);
    if size <= max {
        return size;
    }
    let mut left_out = Vec::new();
    // Images and rich displays first: a link to them is all a reader of
    // an old entry loses; text is what a person reads.
    if !e.plots.is_empty() {
        left_out.push(format!("{} plots", e.plots.len()));
        e.plots.clear();
    }
    let mut cut_displays = 0;
    for d in &mut e.displays {
        if let Some(data) = d.get_mut("data").and_then(Value::as_object_mut) {
            let before = data.len();
            data.retain(|k, _| k == "text/plain");
            if data.len() != before {
                cut_displays += 1;
            }
        }
    }
    if cut_displays > 0 {
        left_out.push(format!(
            "all but the text of {cut_displays} displays (their HTML, images and tables)"
        ));
    }
    if size_of(e) > max {
        // Text last: the console is kept in `console`, the segments go
        // (they hold the same text again).
        if !e.segments.is_empty() {
            e.segments.clear();
            left_out.push("the typed segments".into());
        }
        let room = max.saturating_sub(8 * 1024) / 2;
        for (field, text) in [("console", &mut e.console), ("code", &mut e.code)] {
            let (kept, cut) = rvisor_protocol::bounds::cut(text, room);
            if cut {
                left_out.push(format!(
                    "the {field} after its first {} bytes (of {})",
                    kept.len(),
                    text.len()
                ));
                *text = kept.to_string();
            }
        }
        e.displays.clear();
        e.files.truncate(100);
    }
    e.truncated = Some(format!(
        "this entry was {size} bytes, over the {max} bytes one history entry may hold: left out {}",
        left_out.join(", ")
    ));
    size_of(e)
}

fn ms_rfc3339(ms: u64) -> String {
    rvisor::clock::rfc3339(ms / 1000)
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The entry of a call that gave `r` after `took`.
pub fn call_entry(r: &RunResult, took: Duration) -> HistoryEntry {
    let ended = now_ms();
    let started = ended.saturating_sub(took.as_millis() as u64);
    HistoryEntry {
        seq: 0,
        kind: EntryKind::Call,
        execution_id: Some(r.execution_id.clone()),
        code: r.code.clone(),
        outcome: r.outcome.to_string(),
        success: r.success,
        reason: None,
        console: r.console.clone(),
        segments: values(&r.segments),
        displays: values(&r.displays),
        plots: values(&r.plots),
        files: values(&r.artifacts),
        error: r.error.as_ref().and_then(|e| serde_json::to_value(e).ok()),
        started_at: ms_rfc3339(started),
        ended_at: ms_rfc3339(ended),
        ended_unix_ms: ended,
        duration_ms: took.as_secs_f64() * 1000.0,
        truncated: None,
    }
}

/// Each of `v` as a JSON value.
fn values<T: Serialize>(v: &[T]) -> Vec<Value> {
    v.iter()
        .filter_map(|x| serde_json::to_value(x).ok())
        .collect()
}

/// The entry of a reset or restore (`kind`), `why`.
pub fn event_entry(kind: EntryKind, why: &str) -> HistoryEntry {
    let now = now_ms();
    HistoryEntry {
        seq: 0,
        kind,
        execution_id: None,
        code: String::new(),
        outcome: match kind {
            EntryKind::Reset => "reset",
            EntryKind::Restore => "restore",
            EntryKind::Call => "complete",
        }
        .to_string(),
        success: true,
        reason: Some(why.to_string()),
        console: String::new(),
        segments: Vec::new(),
        displays: Vec::new(),
        plots: Vec::new(),
        files: Vec::new(),
        error: None,
        started_at: ms_rfc3339(now),
        ended_at: ms_rfc3339(now),
        ended_unix_ms: now,
        duration_ms: 0.0,
        truncated: None,
    }
}

/// The entries a call's result `r` adds before the call itself: a restore
/// the result reports (after hibernation or a lost worker), else a reset
/// of its worker the session did not ask for (a timeout, crash or kill;
/// resets and restores asked for are entered when asked).
pub fn entries_before(r: &RunResult) -> Vec<HistoryEntry> {
    if let Some(rest) = r
        .session
        .restored
        .as_ref()
        .filter(|x| x.reason != "restore")
    {
        return vec![event_entry(EntryKind::Restore, &rest.reason)];
    }
    match r.session.reset_reason.as_deref() {
        Some(why) if r.session.fresh && why != "reset" => {
            vec![event_entry(EntryKind::Reset, why)]
        }
        _ => Vec::new(),
    }
}

impl Service {
    /// The history of `tenant`'s session `id`: up to `limit` entries
    /// (1..=[`MAX_HISTORY_PAGE`], default [`DEFAULT_HISTORY_PAGE`]) older
    /// than the cursor `before`, newest first. Another tenant's session
    /// answers `not_found`, like an unknown one.
    pub fn history(
        &self,
        tenant: &str,
        id: &str,
        limit: Option<usize>,
        before: Option<u64>,
    ) -> Result<HistoryPage, ServiceError> {
        let limit = limit.unwrap_or(DEFAULT_HISTORY_PAGE);
        if !(1..=MAX_HISTORY_PAGE).contains(&limit) {
            return Err(ServiceError::new(
                ErrorCode::Invalid,
                format!("limit is {limit}; ask for 1 to {MAX_HISTORY_PAGE} entries a page"),
            ));
        }
        self.find(tenant, id)?;
        let h = self
            .history_of(id)
            .ok_or_else(|| ServiceError::not_found("session"))?;
        let (entries, next) = h.page(limit, before);
        let (total, dropped, _) = h.counts();
        let l = h.limits();
        Ok(HistoryPage {
            session_id: id.to_string(),
            entries,
            next,
            total,
            dropped,
            max_entries: l.max_entries,
            max_bytes: l.max_bytes,
            max_entry_bytes: l.max_entry_bytes,
        })
    }

    /// The history of session `id` as this node holds it.
    pub(super) fn history_of(&self, id: &str) -> Option<Arc<SessionHistory>> {
        lock(&self.inner.sessions)
            .get(id)
            .map(|e| e.history.clone())
    }

    /// Enters call result `r` in its session's history, with the files it
    /// changed since `files_before` (the session's files when it was
    /// queued; `None`: not known, e.g. it woke from hibernation).
    pub(super) fn record_call(
        &self,
        session_id: &str,
        r: &RunResult,
        took: Duration,
        changed: Option<&[rvisor::files::FileInfo]>,
    ) {
        // A call refused before it ran (never queued) is not history.
        if matches!(r.outcome, rvisor::Outcome::Rejected) {
            return;
        }
        let Some(h) = self.history_of(session_id) else {
            return;
        };
        for e in entries_before(r) {
            h.push(e);
        }
        let mut e = call_entry(r, took);
        // A session call's files: those it changed, as the session's.
        if let Some(changed) = changed {
            e.files = changed
                .iter()
                .map(|f| {
                    serde_json::json!({
                        "uri": format!("/v1/sessions/{session_id}/files/{}", f.name),
                        "name": f.name,
                        "size": f.size,
                        "media_type": f.media_type,
                        "modified": f.modified,
                    })
                })
                .collect();
        }
        h.push(e);
    }

    /// Enters a reset or restore of session `id`, asked for by a client.
    pub(super) fn record_event(&self, id: &str, kind: EntryKind, why: &str) {
        if let Some(h) = self.history_of(id) {
            h.push(event_entry(kind, why));
        }
    }

    /// A history for a session of `tenant` being entered in the service:
    /// with a store, the one kept there beside its checkpoint (a session
    /// resumed after a restart, or moved here), registered so that the
    /// store writes it beside the session's next checkpoints.
    pub(super) fn open_history(&self, tenant: &str, id: &str) -> Arc<SessionHistory> {
        let limits = self.inner.cfg.history;
        let Some(d) = self.inner.cfg.durable.clone() else {
            return Arc::new(SessionHistory::new(limits));
        };
        let h = Arc::new(match d.get_history(tenant, id) {
            Ok(Some(bytes)) => SessionHistory::load(limits, &bytes),
            Ok(None) => SessionHistory::new(limits),
            Err(e) => {
                tracing::warn!(target: "rvisor::sessions", session = %id,
                    "the session's history could not be read from the store, it starts empty: {e}");
                SessionHistory::new(limits)
            }
        });
        let mut all = lock(&self.inner.histories);
        all.retain(|_, w| w.strong_count() > 0);
        all.insert(id.to_string(), Arc::downgrade(&h));
        h
    }
}

/// What the store writes beside a session's checkpoint: its history as
/// this node holds it.
pub(super) fn history_source(all: Histories) -> crate::durable::HistorySource {
    Arc::new(move |id: &str| {
        let h = lock(&all).get(id).and_then(Weak::upgrade)?;
        Some(h.to_bytes())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(code: &str, console: &str) -> HistoryEntry {
        let mut e = event_entry(EntryKind::Call, "x");
        e.reason = None;
        e.code = code.into();
        e.console = console.into();
        e
    }

    #[test]
    fn the_oldest_leave_first_by_count() {
        let h = SessionHistory::new(HistoryLimits {
            max_entries: 3,
            ..HistoryLimits::default()
        });
        for i in 0..5 {
            h.push(call(&format!("x <- {i}"), ""));
        }
        let (page, next) = h.page(10, None);
        let seqs: Vec<u64> = page.iter().map(|e| e.seq).collect();
        assert_eq!(seqs, vec![5, 4, 3]);
        assert_eq!(next, None);
        assert_eq!(h.counts().1, 2);
    }

    #[test]
    fn the_oldest_leave_first_by_bytes_and_an_oversized_entry_is_cut() {
        let limits = HistoryLimits {
            max_entries: 100,
            max_bytes: 20_000,
            max_entry_bytes: 10_000,
        };
        let h = SessionHistory::new(limits);
        for _ in 0..10 {
            h.push(call("print(1)", &"a".repeat(3_000)));
        }
        let (kept, _, bytes) = h.counts();
        assert!(bytes <= 20_000, "{bytes}");
        assert!((5..10).contains(&kept), "{kept}");
        h.push(call("big()", &"b".repeat(50_000)));
        let (page, _) = h.page(1, None);
        let e = &page[0];
        assert!(e.console.len() < 10_000);
        let why = e.truncated.as_deref().unwrap_or("");
        assert!(why.contains("console"), "{why}");
        assert!(size_of(e) <= 10_000);
    }

    #[test]
    fn pages_go_newest_first_with_a_cursor() {
        let h = SessionHistory::new(HistoryLimits::default());
        for i in 0..7 {
            h.push(call(&format!("{i}"), ""));
        }
        let (p1, n1) = h.page(3, None);
        assert_eq!(p1.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![7, 6, 5]);
        assert_eq!(n1, Some(5));
        let (p2, n2) = h.page(3, n1);
        assert_eq!(p2.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![4, 3, 2]);
        let (p3, n3) = h.page(3, n2);
        assert_eq!(p3.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![1]);
        assert_eq!(n3, None);
    }

    #[test]
    fn a_stored_history_loads_with_its_numbering() {
        let h = SessionHistory::new(HistoryLimits::default());
        h.push(call("a", "1"));
        h.push(event_entry(EntryKind::Reset, "timeout"));
        let bytes = h.to_bytes();
        let back = SessionHistory::load(HistoryLimits::default(), &bytes);
        let (page, _) = back.page(10, None);
        assert_eq!(page.len(), 2);
        assert_eq!(page[0].kind, EntryKind::Reset);
        back.push(call("b", ""));
        assert_eq!(back.page(1, None).0[0].seq, 3);
        // Garbage loads as an empty history.
        let bad = SessionHistory::load(HistoryLimits::default(), b"{not json");
        assert_eq!(bad.counts().0, 0);
        // Tighter limits on load drop the oldest.
        let tight = SessionHistory::load(
            HistoryLimits {
                max_entries: 1,
                ..HistoryLimits::default()
            },
            &bytes,
        );
        assert_eq!(tight.page(10, None).0[0].kind, EntryKind::Reset);
        assert_eq!(tight.counts().1, 1);
    }

    #[test]
    fn the_source_gives_the_histories_of_live_sessions_only() {
        let all: Histories = Arc::default();
        let h = Arc::new(SessionHistory::new(HistoryLimits::default()));
        h.push(call("x", ""));
        lock(&all).insert("s-1".into(), Arc::downgrade(&h));
        let source = history_source(all.clone());
        assert!(source("s-1").is_some());
        assert!(source("s-2").is_none());
        drop(h);
        assert!(source("s-1").is_none());
    }
}
