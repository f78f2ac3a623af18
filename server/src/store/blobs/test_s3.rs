//! A throwaway S3-compatible server for tests: `s3s-fs` (a real S3 server over a directory, from
//! crates.io; `scripts/setup-s3.sh` installs it, cached outside the checkout) on a free
//! loopback port, its data in a temporary directory, killed (by its pid) when the [`TestS3`]
//! drops, or by the kernel when the thread that started it dies.
//!
//! The server is found at `$HORA_S3_SERVER`, else where the setup script puts it; none there
//! fails the test with what to do. The store's unit tests use it as `store::blobs::test_s3`;
//! the server's integration tests include this same file (`#[path]`), so it names nothing of the
//! crate.

use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use crate::store::postgres::test_server::{cache_dir, free_port};

pub(crate) const BUCKET: &str = "hora-test";
pub(crate) const ACCESS_KEY: &str = "hora-test-access";
pub(crate) const SECRET_KEY: &str = "hora-test-secret";
/// The version `scripts/setup-s3.sh` installs.
const VERSION: &str = "0.14.1";

pub(crate) struct TestS3 {
    child: Child,
    port: u16,
    dir: tempfile::TempDir,
}

impl TestS3 {
    /// Starts a server with one empty bucket, [`BUCKET`], that takes [`ACCESS_KEY`] and
    /// [`SECRET_KEY`].
    pub(crate) fn start() -> TestS3 {
        let bin = binary().unwrap_or_else(|| {
            panic!(
                "the S3-compatible test server (s3s-fs {VERSION}) is not installed, and the \
                 tests of blobs on S3 need it: run `make test` or scripts/setup-s3.sh (it \
                 installs it from crates.io under the cache directory), or set HORA_S3_SERVER \
                 to an s3s-fs binary"
            )
        });
        let dir = tempfile::Builder::new()
            .prefix("hora-s3-")
            .tempdir()
            .expect("a temporary directory");
        let root = dir.path().join("root");
        std::fs::create_dir_all(root.join(BUCKET)).expect("the bucket's directory");
        // Another process may take the free port before the server binds it: then another.
        for _ in 0..5 {
            let port = free_port();
            let mut command = Command::new(&bin);
            command
                .args(["--host", "127.0.0.1", "--port", &port.to_string()])
                .args(["--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY])
                .arg(&root)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            // SAFETY: prctl only sets this process's parent-death signal: when the thread that
            // started the server ends without stopping it (a test killed midway), the kernel
            // kills it.
            unsafe {
                command.pre_exec(|| {
                    if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
            let mut child = command
                .spawn()
                .unwrap_or_else(|e| panic!("starting {}: {e}", bin.display()));
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                if TcpStream::connect(("127.0.0.1", port)).is_ok() {
                    return TestS3 { child, port, dir };
                }
                if child.try_wait().ok().flatten().is_some() || Instant::now() > deadline {
                    let _ = child.kill();
                    let _ = child.wait();
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        panic!("the S3 test server ({}) did not start", bin.display());
    }

    /// `http://127.0.0.1:PORT`.
    pub(crate) fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Where the server keeps object `key` of [`BUCKET`] (s3s-fs: a file per object).
    pub(crate) fn object_file(&self, key: &str) -> PathBuf {
        self.dir.path().join("root").join(BUCKET).join(key)
    }
}

impl Drop for TestS3 {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Sets a file's modification time `age` ago (what the server reports as an object's age).
pub(crate) fn backdate(path: &Path, age: Duration) {
    std::fs::File::options()
        .write(true)
        .open(path)
        .and_then(|f| f.set_modified(SystemTime::now() - age))
        .unwrap_or_else(|e| panic!("backdating {}: {e}", path.display()));
}

fn binary() -> Option<PathBuf> {
    if let Some(bin) = std::env::var_os("HORA_S3_SERVER") {
        return Some(PathBuf::from(bin));
    }
    let bin = cache_dir()
        .join(format!("s3s-fs-{VERSION}"))
        .join("bin/s3s-fs");
    bin.is_file().then_some(bin)
}
