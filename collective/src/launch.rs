//! Where a worker's rank comes from: explicit flags, or the environment that a launcher already
//! sets (Open MPI's `mpirun`, Slurm's `srun`, MPICH/Intel MPI's PMI, PyTorch's `torchrun`), so
//! existing cluster managers can start Hora workers unchanged. Without any of them the server
//! assigns ranks in the order workers join.

use crate::{CollectiveError, Result};

/// Rank and world size as the launcher gave them (either may be unknown).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchRank {
    pub rank: Option<u32>,
    pub world_size: Option<u32>,
    /// The rank among the workers of this host (picks the GPU: `cuda:{local_rank}`).
    pub local_rank: Option<u32>,
    /// Where the values came from, for the log: `flags`, `mpirun`, `slurm`, `pmi`, `torchrun`
    /// or `none`.
    pub source: &'static str,
}

/// Launchers in the order they are consulted: (name, rank, world size, local rank).
const LAUNCHERS: [(&str, &str, &str, &str); 4] = [
    (
        "mpirun",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
    ),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
    ("pmi", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    // Last: its names are the plainest, and an MPI launcher's own win.
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
];

/// The ring addresses of a job that `torchrun` started on one host: rank r listens on
/// `MASTER_ADDR:MASTER_PORT + 1 + r` (torchrun's own store holds `MASTER_PORT`). None when
/// torchrun did not start this process (it always sets `TORCHELASTIC_RUN_ID`) or started one
/// worker; an error when it started the job on several hosts, whose addresses it does not tell
/// its workers.
pub fn torchrun_peers(env: impl Fn(&str) -> Option<String>) -> Result<Option<Vec<String>>> {
    let (Some(_), Some(addr), Some(port), Some(size)) = (
        env("TORCHELASTIC_RUN_ID"),
        env("MASTER_ADDR"),
        env("MASTER_PORT"),
        env("WORLD_SIZE"),
    ) else {
        return Ok(None);
    };
    let bad = |name: &str, v: &str| {
        CollectiveError::Config(format!(
            "{name}={v:?} is not what torchrun sets (a port, a number of workers)"
        ))
    };
    let port: u16 = port.trim().parse().map_err(|_| bad("MASTER_PORT", &port))?;
    let size: u32 = size.trim().parse().map_err(|_| bad("WORLD_SIZE", &size))?;
    if size <= 1 {
        return Ok(None);
    }
    let local = env("LOCAL_WORLD_SIZE").and_then(|v| v.trim().parse::<u32>().ok());
    if local != Some(size) {
        return Err(CollectiveError::Config(format!(
            "torchrun started this job's {size} workers on more than one host, and does not tell \
             them each other's addresses: meet at a Hora server (--server / HORA_SERVER, with a \
             sync job) or list the ring's addresses (--peers / HORA_PEERS)"
        )));
    }
    let last = u32::from(port) + size;
    if last > u32::from(u16::MAX) {
        return Err(CollectiveError::Config(format!(
            "MASTER_PORT {port} leaves no room for {size} ring ports above it: give torchrun a \
             lower --master-port, or HORA_PEERS"
        )));
    }
    let host = if addr.contains(':') && !addr.starts_with('[') {
        format!("[{addr}]")
    } else {
        addr
    };
    Ok(Some(
        (1..=size)
            .map(|i| format!("{host}:{}", u32::from(port) + i))
            .collect(),
    ))
}

impl LaunchRank {
    /// Flags win; then the first launcher whose variables are set; then nothing (the server
    /// assigns ranks). A rank without a world size is allowed: `--peers` gives the size. `env` looks a variable up (`std::env::var` in the binary, a map in tests).
    pub fn detect(
        flag_rank: Option<u32>,
        flag_world_size: Option<u32>,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<LaunchRank> {
        let number = |name: &str| -> Result<Option<u32>> {
            match env(name) {
                None => Ok(None),
                Some(v) => v.trim().parse().map(Some).map_err(|_| {
                    CollectiveError::Config(format!(
                        "{name}={v:?} is not a non-negative integer (set by your launcher?)"
                    ))
                }),
            }
        };
        // torchrun's variables have the plainest names: they count only under torchrun.
        let torchrun = env("TORCHELASTIC_RUN_ID").is_some();
        let found = if flag_rank.is_some() || flag_world_size.is_some() {
            LaunchRank {
                rank: flag_rank,
                world_size: flag_world_size,
                // (hora-run sets it beside HORA_RANK.)
                local_rank: number("HORA_LOCAL_RANK")?,
                source: "flags",
            }
        } else {
            let mut found = LaunchRank {
                rank: None,
                world_size: None,
                local_rank: None,
                source: "none",
            };
            for (name, rank, size, local) in LAUNCHERS {
                if name == "torchrun" && !torchrun {
                    continue;
                }
                let (rank, size) = (number(rank)?, number(size)?);
                if rank.is_some() || size.is_some() {
                    found = LaunchRank {
                        rank,
                        world_size: size,
                        local_rank: number(local)?,
                        source: name,
                    };
                    break;
                }
            }
            found
        };
        if let Some(0) = found.world_size {
            return Err(CollectiveError::Config(format!(
                "world size 0 (from {}): a job needs at least one worker",
                found.source
            )));
        }
        if let (Some(rank), Some(size)) = (found.rank, found.world_size) {
            if rank >= size {
                return Err(CollectiveError::Config(format!(
                    "rank {rank} is not below the world size {size} (from {})",
                    found.source
                )));
            }
        }
        Ok(found)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn launchers_and_flags() {
        let mpi = LaunchRank::detect(
            None,
            None,
            env(&[
                ("OMPI_COMM_WORLD_RANK", "2"),
                ("OMPI_COMM_WORLD_SIZE", "4"),
                ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
                ("SLURM_PROCID", "3"),
                ("SLURM_NTASKS", "8"),
            ]),
        )
        .unwrap();
        assert_eq!(
            (mpi.rank, mpi.world_size, mpi.local_rank, mpi.source),
            (Some(2), Some(4), Some(0), "mpirun")
        );
        let slurm = LaunchRank::detect(
            None,
            None,
            env(&[
                ("SLURM_PROCID", "3"),
                ("SLURM_NTASKS", "8"),
                ("SLURM_LOCALID", "1"),
            ]),
        )
        .unwrap();
        assert_eq!(
            (slurm.rank, slurm.world_size, slurm.local_rank, slurm.source),
            (Some(3), Some(8), Some(1), "slurm")
        );
        let flags = LaunchRank::detect(Some(1), Some(2), env(&[("SLURM_PROCID", "3")])).unwrap();
        assert_eq!(
            (flags.rank, flags.world_size, flags.source),
            (Some(1), Some(2), "flags")
        );
        let none = LaunchRank::detect(None, None, env(&[])).unwrap();
        assert_eq!(
            (none.rank, none.world_size, none.source),
            (None, None, "none")
        );
    }

    #[test]
    fn torchrun_gives_ranks_and_on_one_host_the_ring_addresses() {
        let one_host = env(&[
            ("TORCHELASTIC_RUN_ID", "none"),
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
        ]);
        let found = LaunchRank::detect(None, None, &one_host).unwrap();
        assert_eq!(
            (found.rank, found.world_size, found.local_rank, found.source),
            (Some(1), Some(2), Some(1), "torchrun")
        );
        assert_eq!(
            torchrun_peers(&one_host).unwrap().unwrap(),
            ["127.0.0.1:29501", "127.0.0.1:29502"]
        );
        let v6 = env(&[
            ("TORCHELASTIC_RUN_ID", "none"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "::1"),
            ("MASTER_PORT", "29500"),
        ]);
        assert_eq!(
            torchrun_peers(v6).unwrap().unwrap(),
            ["[::1]:29501", "[::1]:29502"]
        );
        // Not torchrun (a hand-written script's variables), or a world of one: nothing to find.
        let by_hand = [
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
            ("WORLD_SIZE", "4"),
            ("RANK", "x"),
        ];
        assert_eq!(torchrun_peers(env(&by_hand)).unwrap(), None);
        assert_eq!(
            LaunchRank::detect(None, None, env(&by_hand))
                .unwrap()
                .source,
            "none"
        );
        let alone = [
            ("TORCHELASTIC_RUN_ID", "none"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
            ("WORLD_SIZE", "1"),
        ];
        assert_eq!(torchrun_peers(env(&alone)).unwrap(), None);
        for (vars, needle) in [
            (
                vec![("LOCAL_WORLD_SIZE", "2"), ("WORLD_SIZE", "4")],
                "more than one host",
            ),
            (
                vec![
                    ("LOCAL_WORLD_SIZE", "4"),
                    ("WORLD_SIZE", "4"),
                    ("MASTER_PORT", "65533"),
                ],
                "no room",
            ),
            (vec![("MASTER_PORT", "x")], "MASTER_PORT"),
        ] {
            let mut vars = vars;
            for (k, v) in [
                ("TORCHELASTIC_RUN_ID", "none"),
                ("MASTER_ADDR", "127.0.0.1"),
                ("MASTER_PORT", "29500"),
                ("WORLD_SIZE", "2"),
            ] {
                if !vars.iter().any(|(name, _)| *name == k) {
                    vars.push((k, v));
                }
            }
            let err = torchrun_peers(env(&vars)).unwrap_err().to_string();
            assert!(err.contains(needle), "{err}");
        }
    }

    #[test]
    fn bad_launcher_values_are_explained() {
        for (vars, needle) in [
            (
                vec![("SLURM_PROCID", "x"), ("SLURM_NTASKS", "2")],
                "SLURM_PROCID",
            ),
            (
                vec![("SLURM_PROCID", "2"), ("SLURM_NTASKS", "2")],
                "not below",
            ),
            (vec![("PMI_RANK", "0"), ("PMI_SIZE", "0")], "world size 0"),
        ] {
            let err = LaunchRank::detect(None, None, env(&vars))
                .unwrap_err()
                .to_string();
            assert!(err.contains(needle), "{err}");
        }
    }
}
