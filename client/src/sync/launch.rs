//! Where a worker's rank comes from: explicit flags, or the environment that a launcher already
//! sets (Open MPI's `mpirun`, Slurm's `srun`, MPICH/Intel MPI's PMI), so existing cluster
//! managers can start Hora workers unchanged. Without any of them the server assigns ranks in
//! the order workers join.

use super::{Result, SyncError};

/// Rank and world size as the launcher gave them (either may be unknown).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchRank {
    pub rank: Option<u32>,
    pub world_size: Option<u32>,
    /// The rank among the workers of this host (picks the GPU: `cuda:{local_rank}`).
    pub local_rank: Option<u32>,
    /// Where the values came from, for the log: `flags`, `mpirun`, `slurm`, `pmi` or `none`.
    pub source: &'static str,
}

/// Launchers in the order they are consulted: (name, rank, world size, local rank).
const LAUNCHERS: [(&str, &str, &str, &str); 3] = [
    (
        "mpirun",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
    ),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
    ("pmi", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
];

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
                    SyncError::Config(format!(
                        "{name}={v:?} is not a non-negative integer (set by your launcher?)"
                    ))
                }),
            }
        };
        let found = if flag_rank.is_some() || flag_world_size.is_some() {
            LaunchRank {
                rank: flag_rank,
                world_size: flag_world_size,
                local_rank: None,
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
            return Err(SyncError::Config(format!(
                "world size 0 (from {}): a job needs at least one worker",
                found.source
            )));
        }
        if let (Some(rank), Some(size)) = (found.rank, found.world_size) {
            if rank >= size {
                return Err(SyncError::Config(format!(
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
