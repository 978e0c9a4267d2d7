//! Many one-shot runs for a harness: jobs in, results out as they finish,
//! N at a time, each in a fresh worker of its own (a spare from the pool,
//! discarded after), so no script sees another's state.

use crate::call::CallOptions;
use crate::files::RunFiles;
use crate::supervisor::Supervisor;
use crate::tools::CallContext;
use rvisor_protocol::RunResult;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex};

/// One script of a batch.
#[derive(Debug, Clone)]
pub struct BatchJob {
    /// The harness's name for it (reported with its result).
    pub id: String,
    /// The R code.
    pub code: String,
    /// Timeout, plot size, output cap, working directory.
    pub opts: CallOptions,
    /// Variables and tables bound first, tools.
    pub ctx: CallContext,
}

/// How a batch runs.
#[derive(Debug, Clone)]
pub struct BatchOptions {
    /// Jobs run at once (at least 1).
    pub parallel: usize,
    /// R code each worker runs before its job (e.g. `set.seed(1)`); its
    /// result is not reported unless it fails.
    pub preamble: Option<String>,
    /// Files around each job: given a job's index and id, the
    /// [`RunFiles`] that places its inputs before it runs and collects
    /// what it wrote after (as `rvisor run --input/--output-dir`). `None`:
    /// no files.
    pub files: Option<BatchFiles>,
}

/// Makes each job's [`RunFiles`] ([`BatchOptions::files`]), from its
/// index and id; called on the thread that runs the job.
#[derive(Clone)]
pub struct BatchFiles(pub Arc<FilesFn>);

/// The function inside [`BatchFiles`].
pub type FilesFn = dyn Fn(usize, &str) -> Box<dyn RunFiles> + Send + Sync;

impl std::fmt::Debug for BatchFiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BatchFiles(..)")
    }
}

impl Default for BatchOptions {
    fn default() -> Self {
        Self {
            parallel: std::thread::available_parallelism().map_or(2, |n| n.get()),
            preamble: None,
            files: None,
        }
    }
}

/// A job's result.
#[derive(Debug, Clone)]
pub struct BatchDone {
    /// The job's position in the input (0-based).
    pub index: usize,
    /// The job's id.
    pub id: String,
    /// Its result.
    pub result: RunResult,
}

/// The results of a batch, in the order the jobs finish. Dropping it stops
/// taking new jobs (those running finish).
#[derive(Debug)]
pub struct Batch {
    rx: Receiver<BatchDone>,
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Iterator for Batch {
    type Item = BatchDone;

    fn next(&mut self) -> Option<BatchDone> {
        self.rx.recv().ok()
    }
}

impl Drop for Batch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

type Jobs = Mutex<Box<dyn Iterator<Item = (usize, BatchJob)> + Send>>;

impl Supervisor {
    /// Runs `jobs`, `opts.parallel` at a time, each as a one-shot run in a
    /// fresh worker; the results come out of the returned iterator as the
    /// jobs finish (`BatchDone::index` gives the input order back). A job
    /// that fails, times out or crashes its worker is a result like any
    /// other: the batch goes on.
    pub fn batch<I>(&self, jobs: I, opts: BatchOptions) -> Batch
    where
        I: IntoIterator<Item = BatchJob>,
        I::IntoIter: Send + 'static,
    {
        let jobs: Arc<Jobs> = Arc::new(Mutex::new(Box::new(jobs.into_iter().enumerate())));
        let (tx, rx) = std::sync::mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let threads = (0..opts.parallel.max(1))
            .map(|_| {
                let (sup, jobs, tx, stop) = (self.clone(), jobs.clone(), tx.clone(), stop.clone());
                let (preamble, files) = (opts.preamble.clone(), opts.files.clone());
                std::thread::spawn(move || {
                    runner(&sup, &jobs, &tx, &stop, preamble.as_deref(), files.as_ref())
                })
            })
            .collect();
        Batch { rx, stop, threads }
    }
}

fn runner(
    sup: &Supervisor,
    jobs: &Jobs,
    tx: &Sender<BatchDone>,
    stop: &AtomicBool,
    preamble: Option<&str>,
    files: Option<&BatchFiles>,
) {
    while !stop.load(Ordering::SeqCst) {
        let next = jobs.lock().unwrap_or_else(|e| e.into_inner()).next();
        let Some((index, job)) = next else { return };
        let result = match files {
            None => sup.run_once_after(
                crate::ids::execution_id(),
                &job.code,
                &job.opts,
                &job.ctx,
                None,
                None,
                preamble,
            ),
            Some(f) => {
                let mut run_files = (f.0)(index, &job.id);
                sup.run_once_after_with_files(
                    crate::ids::execution_id(),
                    &job.code,
                    (&job.opts, &job.ctx),
                    preamble,
                    run_files.as_mut(),
                )
            }
        };
        let done = BatchDone {
            index,
            id: job.id,
            result,
        };
        if tx.send(done).is_err() {
            return;
        }
    }
}
