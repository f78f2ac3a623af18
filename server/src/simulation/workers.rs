//! The pool of worker processes a simulation's virtual clients train on.
//!
//! Each worker is a `hora-simulate-worker` process (or any command that speaks
//! hora-common's [`simulation`](hora_common::simulation) protocol) with a thread of ours that
//! feeds it jobs from the pool's one queue and hands back its replies. A worker that dies, or
//! answers nonsense, fails the job it held (the engine counts that client as dropped out) and
//! leaves the pool; the others carry on. Dropping the pool closes every worker's input, and the
//! workers exit; one still busy with a job (the run was cancelled) is killed.

use std::ffi::OsString;
use std::io::{BufReader, BufWriter};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use hora_common::simulation::{self, Job, Reply, Setup};
use tokio::sync::oneshot;

/// A job's outcome: the reply and its payload, or why the worker could not answer.
pub type Answer = Result<(Reply, Vec<u8>), String>;

struct Pending {
    job: Job,
    answer: oneshot::Sender<Answer>,
}

/// Worker processes, fed from one queue.
pub struct Pool {
    queue: Option<mpsc::Sender<Box<Pending>>>,
    threads: Vec<JoinHandle<()>>,
    /// Each worker's process id (0 once it is gone).
    pids: Vec<Arc<Mutex<u32>>>,
    /// Each worker's process, to kill when the pool goes with a job still running.
    children: Vec<Arc<Mutex<Child>>>,
}

impl Pool {
    /// Starts `workers` processes of `command` (program, then arguments) and sends each `setup`.
    pub fn start(command: &[OsString], workers: usize, setup: &Setup) -> Result<Pool, String> {
        let (program, args) = command.split_first().ok_or("the worker command is empty")?;
        let (queue, jobs) = mpsc::channel::<Box<Pending>>();
        let jobs = Arc::new(Mutex::new(jobs));
        let mut pool = Pool {
            queue: Some(queue),
            threads: Vec::new(),
            pids: Vec::new(),
            children: Vec::new(),
        };
        for index in 0..workers.max(1) {
            let mut child = Command::new(program)
                .args(args)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .map_err(|e| {
                    format!(
                        "starting simulation worker `{}`: {e} (build it with `cargo build -p hora-client`, or name it with --worker-command)",
                        program.to_string_lossy()
                    )
                })?;
            let pid = Arc::new(Mutex::new(child.id()));
            pool.pids.push(pid.clone());
            let pipes = (child.stdin.take(), child.stdout.take());
            let child = Arc::new(Mutex::new(child));
            pool.children.push(child.clone());
            let (jobs, setup) = (jobs.clone(), setup.clone());
            let thread = std::thread::Builder::new()
                .name(format!("hora-sim-worker-{index}"))
                .spawn(move || feed(index, &child, pipes, &setup, &jobs, &pid))
                .map_err(|e| format!("starting a worker's thread: {e}"))?;
            pool.threads.push(thread);
        }
        Ok(pool)
    }

    /// Queues `job`; the answer comes once a worker has done it.
    pub fn submit(&self, job: Job) -> oneshot::Receiver<Answer> {
        let (answer, rx) = oneshot::channel();
        let pending = Box::new(Pending { job, answer });
        let queued = match &self.queue {
            Some(queue) => queue.send(pending).map_err(|e| e.0),
            None => Err(pending),
        };
        if let Err(pending) = queued {
            let _ = pending
                .answer
                .send(Err("every simulation worker has exited".into()));
        }
        rx
    }

    /// Queues `job` and waits for its answer.
    pub async fn run(&self, job: Job) -> Answer {
        self.submit(job)
            .await
            .unwrap_or_else(|_| Err("the simulation worker went away".into()))
    }

    /// How many workers are still running.
    pub fn alive(&self) -> usize {
        self.pids.iter().filter(|p| *lock(p) != 0).count()
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // Closing the queue ends each idle thread's loop, which closes its worker's input; a
        // worker still on a job is killed (nobody waits for its answer), which ends its
        // thread's read. (A child already reaped is not signalled: std keeps its status.)
        self.queue = None;
        for child in &self.children {
            let _ = lock(child).kill();
        }
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// One worker's thread: the setup, then jobs from the queue until it closes or the worker fails.
fn feed(
    index: usize,
    child: &Mutex<Child>,
    pipes: (Option<ChildStdin>, Option<ChildStdout>),
    setup: &Setup,
    jobs: &Mutex<mpsc::Receiver<Box<Pending>>>,
    pid: &Mutex<u32>,
) {
    let (Some(stdin), Some(stdout)) = pipes else {
        return;
    };
    let (mut input, mut output) = (BufWriter::new(stdin), BufReader::new(stdout));
    let mut failed = simulation::write_frame(&mut input, setup, &[])
        .err()
        .map(|e| e.to_string());
    while failed.is_none() {
        // (The lock is held only while waiting for the next job, never across a job.)
        let next = lock(jobs).recv();
        let Ok(pending) = next else {
            break; // the pool is done
        };
        if pending.answer.is_closed() {
            continue; // nobody waits for it any more (the run ended, or moved on)
        }
        let answer = simulation::write_frame(&mut input, &pending.job, &[])
            .and_then(|()| simulation::read_frame::<Reply>(&mut output))
            .map_err(|e| e.to_string());
        if let Err(e) = &answer {
            failed = Some(e.clone());
        }
        let _ = pending.answer.send(answer);
    }
    drop(input);
    let mut child = lock(child);
    if let Some(why) = failed {
        tracing::warn!(worker = index, error = %why, "a simulation worker failed; its clients count as dropped out and the others go on");
        let _ = child.kill();
    }
    let _ = child.wait();
    *lock(pid) = 0;
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
