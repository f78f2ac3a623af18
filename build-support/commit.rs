//! The commit a binary was built from, for `--version`: `HORA_COMMIT` at compile time. From
//! `HORA_BUILD_COMMIT` when set (a build from a source tarball, which has no repository), else
//! from git, else "unknown".

use std::path::PathBuf;
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

pub fn emit() {
    println!("cargo:rerun-if-env-changed=HORA_BUILD_COMMIT");
    let commit = match std::env::var("HORA_BUILD_COMMIT") {
        Ok(commit) if !commit.trim().is_empty() => commit.trim().to_string(),
        _ => {
            // Built again when HEAD moves: HEAD itself, and the branch it names (its loose ref,
            // else the packed refs). Only files that exist: cargo counts a missing one as
            // changed, which would build this crate again every time.
            let mut watched = vec!["HEAD".to_string()];
            if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
                watched.push(branch);
                watched.push("packed-refs".into());
            }
            for what in watched {
                if let Some(path) = git(&["rev-parse", "--git-path", &what]).map(PathBuf::from) {
                    if path.exists() {
                        println!("cargo:rerun-if-changed={}", path.display());
                        if what != "HEAD" {
                            break; // the loose ref, or failing that the packed refs
                        }
                    }
                }
            }
            git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_else(|| "unknown".into())
        }
    };
    println!("cargo:rustc-env=HORA_COMMIT={commit}");
}
