//! `hora-run`: starts the workers of a synchronous job, horovodrun's way. Its own small crate:
//! it links neither libtorch nor the client.
//!
//! `hora-run -np 4 -- python train.py` starts four local processes; `-H host1:2,host2:2` places
//! them on several hosts, the remote ones over `ssh` (keys set up beforehand, as for mpirun).
//! Each worker gets what it needs to form the ring without a server: its rank, the world size,
//! its rank on its host, every worker's ring address (`HORA_PEERS`: rank r listens at its host,
//! port `--port + 1 + r`) and a secret made for this job (`HORA_SYNC_SECRET`, sent to remote
//! workers on ssh's standard input, never on a command line), in Hora's names and in torchrun's
//! (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`), so
//! `hora.sync.init()`, `hora-client sync` and `torch.distributed` read them alike.
//!
//! Each line a worker prints comes out prefixed with its rank (`[2] …`). When a worker fails,
//! the others are given `--grace` seconds to stop by themselves (the ring names the lost rank
//! and stops them within its timeout), then terminated (SIGTERM, SIGKILL 5 s later): a local
//! worker with every process it started (it runs in a process group of its own), a remote one
//! by closing its ssh input, which its remote script watches; `hora-run` exits with the first
//! failing rank's exit code (128 + the signal for one killed by a signal). Ctrl-C, SIGTERM or
//! SIGHUP stops every worker the same way (exit 130).

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;

#[derive(Parser, Debug)]
#[command(
    name = "hora-run",
    version,
    about = "Start the workers of a synchronous Hora job (horovodrun's shape)",
    after_help = "Example: hora-run -np 4 -- python train.py\n         hora-run -np 4 -H node1:2,node2:2 -- hora-client sync --model mlp --data mnist:/data"
)]
struct Args {
    /// Number of workers.
    #[arg(short = 'n', long = "np", alias = "num-proc")]
    np: u32,
    /// Hosts and their slots, `host:slots,host:slots,…` (default: this host, `np` slots).
    /// Workers fill each host's slots in order; `localhost` and `127.0.0.1` run here.
    #[arg(short = 'H', long)]
    hosts: Option<String>,
    /// Port base: rank r's ring listens at its host's port + 1 + r (torchrun's MASTER_PORT).
    #[arg(short = 'p', long, default_value_t = 29500)]
    port: u16,
    /// Seconds the other workers are given to stop by themselves after one fails.
    #[arg(long, default_value_t = 10)]
    grace: u64,
    /// The command that reaches a remote host.
    #[arg(long, default_value = "ssh")]
    ssh: String,
    /// Do not prefix workers' lines with their rank.
    #[arg(long)]
    no_tag: bool,
    /// The worker's command and its arguments (after `--`).
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    command: Vec<String>,
}

/// One worker of the job: where it runs and what it is told.
#[derive(Debug, Clone, PartialEq)]
struct Placement {
    rank: u32,
    host: String,
    local_rank: u32,
    local_size: u32,
}

/// The hosts of `-H` (or this one), filled with `np` workers in order.
fn place(np: u32, hosts: Option<&str>) -> Result<Vec<Placement>> {
    if np == 0 {
        bail!("-np must be at least 1");
    }
    let slots: Vec<(String, u32)> = match hosts {
        None => vec![("localhost".into(), np)],
        Some(list) => list
            .split(',')
            .filter(|h| !h.trim().is_empty())
            .map(|h| {
                let (host, slots) = match h.trim().rsplit_once(':') {
                    Some((host, n)) => (
                        host,
                        n.parse::<u32>().with_context(|| {
                            format!("`{h}`: the slots after `:` must be a number")
                        })?,
                    ),
                    None => (h.trim(), 1),
                };
                if host.is_empty() || slots == 0 {
                    bail!("`{h}` is not host:slots with at least one slot");
                }
                if host.starts_with('-') {
                    bail!("`{host}` is not a host name (it would reach ssh as an option)");
                }
                Ok((host.to_string(), slots))
            })
            .collect::<Result<_>>()?,
    };
    // Workers on other hosts must reach this one's: by a name they can resolve, not loopback.
    if slots.iter().any(|(h, _)| is_local(h)) && slots.iter().any(|(h, _)| !is_local(h)) {
        bail!("-H mixes this host as `localhost` with other hosts, which could not reach it there: name this host as the others know it");
    }
    let total: u64 = slots.iter().map(|(_, n)| u64::from(*n)).sum();
    if total < u64::from(np) {
        bail!("-np {np} needs {np} slots, and the hosts have {total}: give more hosts or slots (-H host:slots,…)");
    }
    let mut placed = Vec::new();
    for (host, n) in slots {
        let here = n.min(np - placed.len() as u32);
        for local_rank in 0..here {
            placed.push(Placement {
                rank: placed.len() as u32,
                host: host.clone(),
                local_rank,
                local_size: here,
            });
        }
        if placed.len() as u32 == np {
            break;
        }
    }
    Ok(placed)
}

fn is_local(host: &str) -> bool {
    matches!(host, "localhost" | "127.0.0.1" | "::1")
}

/// A host as it goes in front of `:port`.
fn bracketed(host: &str) -> String {
    let host = if is_local(host) { "127.0.0.1" } else { host };
    match host.contains(':') && !host.starts_with('[') {
        true => format!("[{host}]"),
        false => host.to_string(),
    }
}

/// What every worker is told (but the secret), by name.
fn environment(placed: &[Placement], p: &Placement, port: u16) -> Result<Vec<(String, String)>> {
    let size = placed.len() as u32;
    if u32::from(port) + size > u32::from(u16::MAX) {
        bail!("--port {port} leaves no room for {size} ring ports above it: give a lower --port");
    }
    let peers: Vec<String> = placed
        .iter()
        .map(|w| format!("{}:{}", bracketed(&w.host), u32::from(port) + 1 + w.rank))
        .collect();
    let master = match is_local(&placed[0].host) {
        true => "127.0.0.1".to_string(),
        false => placed[0].host.clone(),
    };
    let (rank, size) = (p.rank.to_string(), size.to_string());
    Ok(vec![
        ("HORA_PEERS".into(), peers.join(",")),
        ("HORA_RANK".into(), rank.clone()),
        ("HORA_WORLD_SIZE".into(), size.clone()),
        ("HORA_LOCAL_RANK".into(), p.local_rank.to_string()),
        ("RANK".into(), rank),
        ("WORLD_SIZE".into(), size),
        ("LOCAL_RANK".into(), p.local_rank.to_string()),
        ("LOCAL_WORLD_SIZE".into(), p.local_size.to_string()),
        ("MASTER_ADDR".into(), master),
        ("MASTER_PORT".into(), port.to_string()),
    ])
}

/// A shell word: `'…'`, with `'` written `'\''`.
fn quoted(word: &str) -> String {
    format!("'{}'", word.replace('\'', r"'\''"))
}

/// What the remote host runs (through `sh -c`, whatever the login shell): the job's secret
/// read from standard input (never on a command line), then the worker in the launcher's
/// directory with its environment (assignments in front of the quoted command, whose words
/// are never taken for assignments), stopped when standard input ends (the launcher closes
/// it to stop the job, or went away) with everything it started (under `setsid`, where the
/// host has it, the worker leads a process group of its own), its exit code the script's. (A background job's input is
/// /dev/null unless redirected: the watcher reads the script's input through fd 3.)
fn remote_command(env: &[(String, String)], command: &[String], dir: &str) -> String {
    let assignments: Vec<String> = env
        .iter()
        .map(|(k, v)| format!("{k}={}", quoted(v)))
        .collect();
    let words: Vec<String> = command.iter().map(|w| quoted(w)).collect();
    let script = format!(
        "cd {} || exit 127; IFS= read -r HORA_SYNC_SECRET || exit 127; export HORA_SYNC_SECRET; \
         exec 3<&0; s=; command -v setsid >/dev/null 2>&1 && s=setsid; \
         {} $s {} </dev/null 3<&- & w=$!; \
         (while IFS= read -r _; do :; done <&3; kill -TERM -$w 2>/dev/null || kill -TERM $w) & r=$!; \
         exec 3<&-; wait $w; c=$?; kill $r 2>/dev/null; exit $c",
        quoted(dir),
        assignments.join(" "),
        words.join(" ")
    );
    format!("sh -c {}", quoted(&script))
}

/// A fresh secret for the job's ring (32 hex digits).
fn job_secret() -> Result<String> {
    let mut bytes = [0u8; 16];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut bytes)
        .map_err(|_| anyhow::anyhow!("the system random number generator failed"))?;
    Ok(hex::encode(bytes))
}

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn stop(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

/// Prints each line `from` yields, tagged with `rank` unless `tag` is off.
fn relay(
    from: impl std::io::Read + Send + 'static,
    rank: u32,
    tag: bool,
    to_stderr: bool,
) -> std::thread::JoinHandle<()> {
    static OUT: Mutex<()> = Mutex::new(());
    std::thread::spawn(move || {
        for line in BufReader::new(from).split(b'\n').map_while(|l| l.ok()) {
            let _one_at_a_time = OUT.lock().unwrap_or_else(|e| e.into_inner());
            let mut text = Vec::with_capacity(line.len() + 8);
            if tag {
                text.extend_from_slice(format!("[{rank}] ").as_bytes());
            }
            text.extend_from_slice(&line);
            text.push(b'\n');
            let _ = match to_stderr {
                true => std::io::stderr().write_all(&text),
                false => std::io::stdout().write_all(&text),
            };
        }
    })
}

/// The exit code a worker's status stands for (128 + the signal that ended it).
fn code_of(status: std::process::ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => c.clamp(0, 255) as u8,
        (None, Some(s)) => (128 + s).clamp(0, 255) as u8,
        _ => 1,
    }
}

/// A worker the launcher started: a local process group of its own, or an ssh client whose
/// remote side stops the worker when `stdin` closes.
struct Worker {
    rank: u32,
    child: Child,
    local: bool,
    stdin: Option<std::process::ChildStdin>,
    relays: Vec<std::thread::JoinHandle<()>>,
    status: Option<std::process::ExitStatus>,
}

impl Worker {
    /// Signals the worker and what it started: a local worker's whole process group; a remote
    /// one's ssh client, its input closed first (the remote script then stops the worker).
    fn signal(&mut self, signal: libc::c_int) {
        if self.status.is_some() {
            return;
        }
        self.stdin = None;
        let pid = self.child.id() as libc::pid_t;
        // SAFETY: kill(2) on the process (group) of a child this process started and has not
        // reaped: its id cannot have been reused.
        unsafe {
            match self.local {
                true => libc::kill(-pid, signal),
                false => libc::kill(pid, signal),
            };
        }
    }
}

/// Stops every worker still running: SIGTERM, then SIGKILL after `patience`; waits for them.
fn stop_all(workers: &mut [Worker], patience: Duration) {
    for w in workers.iter_mut() {
        w.signal(libc::SIGTERM);
    }
    let started = Instant::now();
    loop {
        let mut running = false;
        for w in workers.iter_mut() {
            if w.status.is_none() {
                w.status = w.child.try_wait().ok().flatten();
                running |= w.status.is_none();
            }
        }
        if !running {
            return;
        }
        if started.elapsed() >= patience {
            for w in workers.iter_mut() {
                w.signal(libc::SIGKILL);
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The options of `hora-run` that take a value (the `-np` rewrite skips their values).
const WITH_VALUES: [&str; 9] = [
    "-n", "--np", "-H", "--hosts", "-p", "--port", "--grace", "--ssh", "-np",
];

/// The command line with horovodrun's `-np` (which a parser of one-letter options reads as
/// `-n p`) spelt `--np`, among hora-run's own options only: up to `--` or the worker's
/// command, whose own `-np` is left alone.
fn horovod_spelling(args: impl Iterator<Item = String>) -> Vec<String> {
    let mut out = Vec::new();
    let (mut ours, mut value_next) = (true, false);
    for (i, a) in args.enumerate() {
        if i > 0 && ours {
            if value_next {
                value_next = false;
            } else if a == "--" || !a.starts_with('-') {
                ours = false;
            } else {
                value_next = WITH_VALUES.contains(&a.as_str());
            }
        }
        match (ours, a.as_str()) {
            (true, "-np") => out.push("--np".to_string()),
            _ => out.push(a),
        }
    }
    out
}

fn main() -> ExitCode {
    match run(Args::parse_from(horovod_spelling(std::env::args()))) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("hora-run: {e:#}");
            ExitCode::from(2)
        }
    }
}

/// How long workers are given between SIGTERM and SIGKILL.
const PATIENCE: Duration = Duration::from_secs(5);

fn run(args: Args) -> Result<u8> {
    use std::os::unix::process::CommandExt;
    let placed = place(args.np, args.hosts.as_deref())?;
    let secret = job_secret()?;
    let dir = std::env::current_dir().context("the current directory")?;
    // SAFETY: installing a handler that only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, stop as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, stop as *const () as libc::sighandler_t);
        libc::signal(libc::SIGHUP, stop as *const () as libc::sighandler_t);
    }
    let mut workers: Vec<Worker> = Vec::new();
    for p in &placed {
        let env = environment(&placed, p, args.port)?;
        let local = is_local(&p.host);
        let mut cmd = match local {
            true => {
                let mut cmd = Command::new(&args.command[0]);
                cmd.args(&args.command[1..])
                    .envs(env.iter().map(|(k, v)| (k, v)))
                    .env("HORA_SYNC_SECRET", &secret)
                    .stdin(Stdio::null())
                    // Its own group: stopping it stops what it started too.
                    .process_group(0);
                cmd
            }
            false => {
                let mut cmd = Command::new(&args.ssh);
                // -T: no terminal, which would echo the secret back.
                cmd.args(["-T", "-o", "BatchMode=yes", &p.host])
                    .arg(remote_command(
                        &env,
                        &args.command,
                        &dir.display().to_string(),
                    ))
                    .stdin(Stdio::piped());
                cmd
            }
        };
        let spawned = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| {
                format!(
                    "starting rank {} ({}) on {}",
                    p.rank, args.command[0], p.host
                )
            });
        let mut child = match spawned {
            Ok(child) => child,
            Err(e) => {
                stop_all(&mut workers, PATIENCE);
                return Err(e);
            }
        };
        let mut stdin = child.stdin.take();
        if let Some(input) = stdin.as_mut() {
            // (A remote shell that cannot read it fails, and so does its rank.)
            let _ = writeln!(input, "{secret}").and_then(|()| input.flush());
        }
        let mut relays = Vec::new();
        if let Some(out) = child.stdout.take() {
            relays.push(relay(out, p.rank, !args.no_tag, false));
        }
        if let Some(err) = child.stderr.take() {
            relays.push(relay(err, p.rank, !args.no_tag, true));
        }
        workers.push(Worker {
            rank: p.rank,
            child,
            local,
            stdin,
            relays,
            status: None,
        });
    }

    let mut failed: Option<(u32, u8, Instant)> = None;
    let mut interrupted = false;
    let mut terminating: Option<Instant> = None;
    loop {
        if STOP.load(Ordering::SeqCst) && !interrupted {
            eprintln!("hora-run: interrupted; stopping every worker");
            interrupted = true;
            for w in workers.iter_mut() {
                w.signal(libc::SIGTERM);
            }
            terminating = Some(Instant::now());
        }
        let mut running = 0;
        for w in workers.iter_mut() {
            if w.status.is_some() {
                continue;
            }
            match w.child.try_wait() {
                Ok(Some(status)) => {
                    w.status = Some(status);
                    w.stdin = None;
                    if !status.success() && failed.is_none() && !interrupted {
                        eprintln!(
                            "hora-run: rank {} exited with {status}; stopping the others",
                            w.rank
                        );
                        failed = Some((w.rank, code_of(status), Instant::now()));
                    }
                }
                _ => running += 1,
            }
        }
        if running == 0 {
            break;
        }
        if let Some((_, _, at)) = failed {
            if terminating.is_none() && at.elapsed() >= Duration::from_secs(args.grace) {
                for w in workers.iter_mut() {
                    w.signal(libc::SIGTERM);
                }
                terminating = Some(Instant::now());
            }
        }
        if terminating.is_some_and(|t| t.elapsed() >= PATIENCE) {
            for w in workers.iter_mut() {
                w.signal(libc::SIGKILL);
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // What the workers wrote last, printed before the verdict (a grandchild still holding a
    // pipe is not waited for long).
    let deadline = Instant::now() + Duration::from_secs(2);
    for relay in workers.iter_mut().flat_map(|w| w.relays.drain(..)) {
        while !relay.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        if relay.is_finished() {
            let _ = relay.join();
        }
    }
    Ok(match (failed, interrupted) {
        (Some((_, code, _)), _) => code.max(1),
        (None, true) => 130,
        (None, false) => 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn horovods_np_is_read_as_ours_and_the_workers_command_is_left_alone() {
        for line in [
            "hora-run -np 4 -- prog -np 2",
            "hora-run -H a:4 -np 4 prog -np 2",
        ] {
            let args = Args::parse_from(horovod_spelling(line.split(' ').map(String::from)));
            let want: Vec<String> = vec!["prog".into(), "-np".into(), "2".into()];
            assert_eq!((args.np, args.command), (4, want), "{line}");
        }
    }

    #[test]
    fn workers_fill_the_hosts_slots_in_order() {
        let placed = place(5, Some("a:2,b:2,c:4")).unwrap();
        let at: Vec<(u32, &str, u32, u32)> = placed
            .iter()
            .map(|p| (p.rank, p.host.as_str(), p.local_rank, p.local_size))
            .collect();
        assert_eq!(
            at,
            [
                (0, "a", 0, 2),
                (1, "a", 1, 2),
                (2, "b", 0, 2),
                (3, "b", 1, 2),
                (4, "c", 0, 1)
            ]
        );
        assert_eq!(place(3, None).unwrap().len(), 3);
        assert!(place(5, Some("a:2,b:2"))
            .unwrap_err()
            .to_string()
            .contains("needs 5 slots"));
        assert!(place(1, Some("a:x")).is_err());
        assert!(place(0, None).is_err());
    }

    #[test]
    fn every_worker_is_told_the_ring_in_hora_and_torchrun_names() {
        let placed = place(3, Some("n1:2,n2:1")).unwrap();
        let env: std::collections::HashMap<String, String> =
            environment(&placed, &placed[2], 40000)
                .unwrap()
                .into_iter()
                .collect();
        assert_eq!(env["HORA_PEERS"], "n1:40001,n1:40002,n2:40003");
        assert_eq!(
            (env["RANK"].as_str(), env["WORLD_SIZE"].as_str()),
            ("2", "3")
        );
        assert_eq!(
            (env["LOCAL_RANK"].as_str(), env["LOCAL_WORLD_SIZE"].as_str()),
            ("0", "1")
        );
        assert_eq!(
            (env["MASTER_ADDR"].as_str(), env["MASTER_PORT"].as_str()),
            ("n1", "40000")
        );
        assert!(environment(&placed, &placed[0], 65534).is_err());
        let local = place(2, None).unwrap();
        let env = environment(&local, &local[1], 29500).unwrap();
        assert!(env.contains(&(
            "HORA_PEERS".into(),
            "127.0.0.1:29501,127.0.0.1:29502".into()
        )));
    }

    #[test]
    fn a_remote_worker_reads_the_secret_from_its_input_and_its_words_stay_whole() {
        let env = vec![("RANK".to_string(), "1".to_string())];
        let command = vec!["python".to_string(), "it's here.py".to_string()];
        let remote = remote_command(&env, &command, "/job dir");
        // What the remote shell gets: `sh -c` and the script, quoted once more.
        let script = remote
            .strip_prefix("sh -c '")
            .and_then(|r| r.strip_suffix('\''))
            .expect("sh -c 'script'")
            .replace(r"'\''", "'");
        assert!(script.starts_with("cd '/job dir' || exit 127; IFS= read -r HORA_SYNC_SECRET"));
        assert!(
            script.contains(r"RANK='1' $s 'python' 'it'\''s here.py' </dev/null 3<&- & w=$!"),
            "{script}"
        );
        assert!(script.ends_with("wait $w; c=$?; kill $r 2>/dev/null; exit $c"));
        assert!(!remote.contains("SECRET="), "never on the command line");
    }

    #[test]
    fn hosts_that_would_be_options_or_unreachable_loopback_are_refused() {
        assert!(place(1, Some("-oProxyCommand=x:1"))
            .unwrap_err()
            .to_string()
            .contains("option"));
        assert!(place(2, Some("localhost:1,b:1"))
            .unwrap_err()
            .to_string()
            .contains("mixes"));
    }
}
