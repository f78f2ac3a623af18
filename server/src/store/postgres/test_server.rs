//! A throwaway PostgreSQL server for tests: a real `postgres` on a free loopback port, its data
//! directory in a temporary directory, stopped (immediately: nothing in it is kept) when the
//! [`TestServer`] drops, or by the kernel when the thread that started it dies.
//!
//! Tests run one per process (cargo-nextest), so starting must be cheap: `initdb` runs once per
//! PostgreSQL version into a template under the cache directory (`$HORA_CACHE_DIR`, else
//! `$XDG_CACHE_HOME/hora`, else `~/.cache/hora`; a lock file keeps parallel test processes from
//! making it twice), and each server starts on a copy of it (a few MB: one-MB WAL segments).
//! The server runs without fsync: a test's data has to outlive the server process, not the
//! machine.
//!
//! PostgreSQL refuses to run as root: as root, `initdb` and `postgres` run as the `postgres`
//! user that Debian's package makes (else `nobody`), with the directories given to that user.
//! No PostgreSQL installed fails the test with what to do (`make test` installs it).
//!
//! The store's unit tests use it as `store::postgres::test_server`; the server's integration
//! tests include this same file (`#[path]`), so it names nothing of the crate.

use std::fs;
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Bumped when the template's `initdb` options change, so an old template is not reused.
const TEMPLATE_LAYOUT: u32 = 1;
const SUPERUSER: &str = "hora";

pub(crate) struct TestServer {
    child: Option<Child>,
    bin: PathBuf,
    owner: Owner,
    port: u16,
    dir: tempfile::TempDir,
    /// TLS only, with this certificate and key (copies in `dir`).
    tls: Option<(PathBuf, PathBuf)>,
}

impl TestServer {
    /// Starts a server on a copy of the template (made first if there is none yet).
    pub(crate) fn start() -> TestServer {
        TestServer::start_with(None)
    }

    /// Starts a server that takes TCP connections over TLS only, with the certificate (PEM,
    /// chain) and key (PEM) given.
    pub(crate) fn start_tls(cert: &Path, key: &Path) -> TestServer {
        TestServer::start_with(Some((cert, key)))
    }

    fn start_with(tls: Option<(&Path, &Path)>) -> TestServer {
        let bin = bindir().unwrap_or_else(|| {
            panic!(
                "PostgreSQL's server programs (initdb, postgres) are not installed, and the \
                 PostgreSQL store's tests need them: run `make test` (it installs Debian's \
                 `postgresql`), or `apt-get install postgresql`, or set HORA_PG_BINDIR to the \
                 directory that holds them"
            )
        });
        let owner = Owner::for_postgres();
        let template = template(&bin, owner);
        let dir = tempfile::Builder::new()
            .prefix("hora-postgres-")
            .tempdir()
            .expect("a temporary directory");
        owner.give(dir.path());
        run(Command::new("cp")
            .arg("-a")
            .arg(&template)
            .arg(dir.path().join("data")));
        let tls = tls.map(|(cert, key)| {
            let data = dir.path().join("data");
            // Over TCP, TLS or nothing; the Unix socket (unused) as it was.
            fs::write(
                data.join("pg_hba.conf"),
                "local all all trust\nhostssl all all 127.0.0.1/32 trust\nhost all all 127.0.0.1/32 reject\n",
            )
            .expect("pg_hba.conf");
            let copies = (dir.path().join("server.crt"), dir.path().join("server.key"));
            for (from, to) in [(cert, &copies.0), (key, &copies.1)] {
                fs::copy(from, to).expect("a copy of the certificate or key");
                fs::set_permissions(to, std::os::unix::fs::PermissionsExt::from_mode(0o600))
                    .expect("chmod");
                owner.give(to);
            }
            copies
        });
        let mut server = TestServer {
            child: None,
            bin,
            owner,
            port: 0,
            dir,
            tls,
        };
        // Another process may take the free port before the server binds it: then another.
        for _ in 0..5 {
            server.port = free_port();
            match server.launch() {
                Ok(child) => {
                    server.child = Some(child);
                    return server;
                }
                Err(log) if log.contains("could not bind") => continue,
                Err(log) => panic!("PostgreSQL did not start; its log:\n{log}"),
            }
        }
        panic!("PostgreSQL found no free port to listen on");
    }

    /// `postgres://hora@127.0.0.1:PORT/postgres` (trusted: nothing else listens there).
    pub(crate) fn url(&self) -> String {
        format!("postgres://{SUPERUSER}@127.0.0.1:{}/postgres", self.port)
    }

    /// Stops the server now (immediate shutdown) and waits for it.
    pub(crate) fn stop(&mut self) {
        if let Some(child) = self.child.take() {
            quit(child);
        }
    }

    /// Starts the server again on its data and port (after [`stop`](Self::stop)).
    pub(crate) fn restart(&mut self) {
        self.stop();
        let child = self
            .launch()
            .unwrap_or_else(|log| panic!("PostgreSQL did not start again; its log:\n{log}"));
        self.child = Some(child);
    }

    /// Runs `postgres` on the data directory and port, as the owner, until it is ready; its
    /// log if it is not.
    fn launch(&self) -> Result<Child, String> {
        let data = self.dir.path().join("data");
        let log = self.dir.path().join("postgres.log");
        let mut command = Command::new(self.bin.join("postgres"));
        command
            .arg("-D")
            .arg(&data)
            .args(["-p", &self.port.to_string()])
            .args(["-c", "listen_addresses=127.0.0.1"])
            .arg("-c")
            .arg(format!(
                "unix_socket_directories={}",
                self.dir.path().display()
            ))
            // No fsync: a test's data only has to outlive the server process (an immediate
            // stop and `restart`), not the machine. Commits still write their WAL first.
            .args(["-c", "fsync=off", "-c", "full_page_writes=off"])
            .args(["-c", "shared_buffers=16MB"])
            .args(self.tls.iter().flat_map(|(cert, key)| {
                [
                    "-c".to_string(),
                    "ssl=on".to_string(),
                    "-c".to_string(),
                    format!("ssl_cert_file={}", cert.display()),
                    "-c".to_string(),
                    format!("ssl_key_file={}", key.display()),
                ]
            }))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(fs::File::create(&log).map_err(|e| e.to_string())?);
        self.owner.apply(&mut command);
        // SAFETY: prctl only sets this process's parent-death signal: when the thread that
        // started the server ends without stopping it (a test killed midway), the kernel sends
        // it SIGQUIT, PostgreSQL's immediate shutdown. It runs after the switch of user, which
        // would clear it.
        unsafe {
            command.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGQUIT) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = command.spawn().map_err(|e| format!("postgres: {e}"))?;
        match wait_ready(&mut child, &data, &log) {
            Ok(()) => Ok(child),
            Err(text) => {
                quit(child);
                Err(text)
            }
        }
    }
}

/// Stops a postmaster: SIGQUIT, PostgreSQL's immediate shutdown (nothing is kept), and waits.
fn quit(mut child: Child) {
    if let Ok(pid) = i32::try_from(child.id()) {
        // SAFETY: signals our own child, which is not reaped yet.
        unsafe {
            libc::kill(pid, libc::SIGQUIT);
        }
    }
    let _ = child.wait();
}

/// Waits until the postmaster says it is ready (its pid file's status line); its log if it
/// exits first or takes over 30 s.
fn wait_ready(child: &mut Child, data: &Path, log: &Path) -> Result<(), String> {
    let started = Instant::now();
    let log = || fs::read_to_string(log).unwrap_or_default();
    while started.elapsed() < Duration::from_secs(30) {
        let pid_file = fs::read_to_string(data.join("postmaster.pid")).unwrap_or_default();
        if pid_file.lines().nth(7).map(str::trim) == Some("ready") {
            return Ok(());
        }
        if child.try_wait().ok().flatten().is_some() {
            return Err(log());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Err(format!("(not ready after 30 s)\n{}", log()))
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Where `initdb` and `postgres` are: `$HORA_PG_BINDIR`, `pg_config --bindir`, next to an
/// `initdb` on the PATH, or the newest of Debian's `/usr/lib/postgresql/*/bin`.
fn bindir() -> Option<PathBuf> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    candidates.extend(std::env::var_os("HORA_PG_BINDIR").map(PathBuf::from));
    if let Ok(out) = Command::new("pg_config").arg("--bindir").output() {
        candidates.push(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()));
    }
    for dir in std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()) {
        if let Ok(initdb) = fs::canonicalize(dir.join("initdb")) {
            candidates.extend(initdb.parent().map(Path::to_path_buf));
        }
    }
    let mut debian: Vec<(u32, PathBuf)> = fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| Some((e.file_name().to_str()?.parse().ok()?, e.path().join("bin"))))
        .collect();
    debian.sort();
    candidates.extend(debian.into_iter().rev().map(|(_, bin)| bin));
    candidates
        .into_iter()
        .find(|dir| dir.join("initdb").is_file() && dir.join("postgres").is_file())
}

/// The user PostgreSQL runs as: this process's, or when that is root, `postgres` (else
/// `nobody`).
#[derive(Clone, Copy)]
struct Owner(Option<(libc::uid_t, libc::gid_t)>);

impl Owner {
    fn for_postgres() -> Owner {
        // SAFETY: geteuid cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            return Owner(None);
        }
        for name in [c"postgres", c"nobody"] {
            // SAFETY: getpwnam returns null or a pointer to a static record, read at once (tests
            // look users up from one thread at a time).
            let user = unsafe { libc::getpwnam(name.as_ptr()) };
            if !user.is_null() {
                // SAFETY: not null, as checked.
                let user = unsafe { &*user };
                return Owner(Some((user.pw_uid, user.pw_gid)));
            }
        }
        panic!("running as root, and neither a `postgres` nor a `nobody` user exists for PostgreSQL to run as (it refuses root)");
    }

    fn key(self) -> String {
        match self.0 {
            Some((uid, _)) => format!("u{uid}"),
            // SAFETY: getuid cannot fail.
            None => format!("u{}", unsafe { libc::getuid() }),
        }
    }

    /// Gives `path` (a directory this process made) to the user.
    fn give(self, path: &Path) {
        if let Some((uid, gid)) = self.0 {
            std::os::unix::fs::chown(path, Some(uid), Some(gid)).expect("chown");
        }
    }

    /// Makes `command` run as the user.
    fn apply(self, command: &mut Command) {
        if let Some((uid, gid)) = self.0 {
            command.uid(uid).gid(gid);
        }
    }
}

/// The template data directory for this PostgreSQL and user, made by `initdb` if missing.
fn template(bin: &Path, owner: Owner) -> PathBuf {
    let version = Command::new(bin.join("postgres"))
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    let version: String = version
        .split_whitespace()
        .nth(2)
        .unwrap_or("unknown")
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '.')
        .collect();
    let cache = cache_dir();
    fs::create_dir_all(&cache).expect("the cache directory");
    let template = cache.join(format!(
        "postgres-template-{version}-{}-v{TEMPLATE_LAYOUT}",
        owner.key()
    ));
    let lock = fs::File::create(cache.join("postgres-template.lock")).expect("a lock file");
    // SAFETY: flock on a file we hold open; released when it is closed (dropped below).
    unsafe {
        libc::flock(std::os::fd::AsRawFd::as_raw_fd(&lock), libc::LOCK_EX);
    }
    if !template.join("PG_VERSION").is_file() {
        let staging = tempfile::Builder::new()
            .prefix("hora-postgres-initdb-")
            .tempdir()
            .expect("a temporary directory");
        owner.give(staging.path());
        let data = staging.path().join("data");
        let mut initdb = Command::new(bin.join("initdb"));
        initdb
            .arg("-D")
            .arg(&data)
            .args(["-U", SUPERUSER, "--auth=trust", "--encoding=UTF8"])
            .args(["--locale=C", "--no-sync", "--wal-segsize=1"]);
        owner.apply(&mut initdb);
        run(&mut initdb);
        // What a test killed while it copied left (nobody else copies: we hold the lock).
        for entry in fs::read_dir(&cache).into_iter().flatten().flatten() {
            if entry
                .file_name()
                .to_string_lossy()
                .starts_with(".tmp-postgres-template-")
            {
                let _ = fs::remove_dir_all(entry.path());
            }
        }
        let tmp = cache.join(format!(".tmp-postgres-template-{}", std::process::id()));
        run(Command::new("cp").arg("-a").arg(&data).arg(&tmp));
        fs::rename(&tmp, &template).expect("the template in place");
    }
    drop(lock);
    template
}

/// Hora's cache directory (`HORA_CACHE_DIR`, else the user's cache), where the set-up scripts
/// install what tests start.
pub(crate) fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("HORA_CACHE_DIR") {
        return PathBuf::from(dir);
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("hora")
}

/// A loopback port nothing listens on now.
pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// Runs `command`, panicking with its output if it fails.
fn run(command: &mut Command) {
    let out = command
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("{command:?}: {e}"));
    if !out.status.success() {
        let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
        let _ = (&out.stderr[..]).read_to_string(&mut text);
        panic!("{command:?} failed ({}):\n{text}", out.status);
    }
}
