//! Forming a world: bind the ring port, meet the other workers (at the server, or from a list
//! of peer addresses known in advance), connect to the ring neighbours. Used by
//! `hora-client sync` and by the Python package's `hora.sync`, which brings its own tensors.

use std::net::TcpListener;

use crate::launch::LaunchRank;
use crate::link::Links;
use hora_common::wire::{SyncJoinRequest, SyncRejoin};

use crate::rendezvous::{self, Rendezvous, World};
use crate::ring::{CommOptions, Communicator};
use crate::{CollectiveError, Result};

/// How the workers find each other.
pub enum Meeting<'a> {
    /// At a rendezvous service: the Hora server, through `hora-client`'s
    /// `sync::ServerRendezvous`.
    Server(&'a dyn Rendezvous),
    /// Ring addresses known in advance, by rank, and the operator's shared secret that every
    /// worker derives the world's session from (needed unless the world is of one).
    Peers {
        peers: Vec<String>,
        secret: Option<String>,
    },
}

/// Binds the ring port, meets the other workers and connects to the neighbours.
///
/// `listen` is the local address to accept on (`host:port`, port 0 for any); `advertise` the
/// host the others should dial (default: the listen address's host).
pub fn form_world(
    meeting: Meeting<'_>,
    launch: &LaunchRank,
    listen: &str,
    advertise: Option<&str>,
    options: CommOptions,
) -> Result<Communicator> {
    let (world, listener) = match meeting {
        Meeting::Peers { peers, secret } => {
            let rank = launch.rank.ok_or_else(|| {
                CollectiveError::Config(
                    "--peers needs this worker's rank: --rank, or a launcher's environment (mpirun, Slurm)".into(),
                )
            })?;
            if let Some(size) = launch.world_size {
                if size as usize != peers.len() {
                    return Err(CollectiveError::Config(format!(
                        "the world size is {size} but --peers lists {} addresses",
                        peers.len()
                    )));
                }
            }
            let world = World::from_peers(peers, rank, secret.as_deref())?;
            let own = &world.peers[rank as usize];
            let port = own.rsplit_once(':').map(|(_, p)| p).unwrap_or_default();
            // Accept on our listed port on every interface: the listed host may be a name.
            let listener = if world.size > 1 {
                Some(Links::listen(own).or_else(|_| Links::listen(&format!("0.0.0.0:{port}")))?)
            } else {
                None
            };
            (world, listener)
        }
        Meeting::Server(service) => {
            let size = launch.world_size.ok_or_else(|| {
                CollectiveError::Config(
                    "the world size is unknown: give --world-size, or start the workers with mpirun or srun".into(),
                )
            })?;
            let (listener, address) = bind(listen, advertise)?;
            tracing::info!(%address, rank = ?launch.rank, size, "joining the job");
            let request = SyncJoinRequest {
                address,
                rank: launch.rank,
                world_size: size,
                timeout_s: Some(service.timeout().as_secs().clamp(1, 600) as u32),
                rejoin: None,
                elastic: false,
            };
            (rendezvous::join(service, &request)?, Some(listener))
        }
    };
    connect(world, listener, options)
}

/// Binds the ring port on `listen` and returns it with the address the other workers should
/// dial: `advertise`'s host (default: the bound address, which must then not be a wildcard)
/// with the bound port.
pub fn bind(listen: &str, advertise: Option<&str>) -> Result<(TcpListener, String)> {
    let listener = Links::listen(listen)?;
    let local = listener
        .local_addr()
        .map_err(|e| CollectiveError::io("reading the ring address", e))?;
    let host = match advertise {
        Some(h) => h.to_string(),
        None if local.ip().is_unspecified() => {
            return Err(CollectiveError::Config(format!(
                "listening on {local}: give --advertise HOST, the name or address the other workers can reach this one at"
            )))
        }
        None => local.ip().to_string(),
    };
    let address = if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{}", local.port())
    } else {
        format!("{host}:{}", local.port())
    };
    Ok((listener, address))
}

/// Connects to the ring neighbours of `world`, accepting the left one on `listener` (bound
/// before the world was known, by a caller that learned the peers' addresses its own way, such
/// as a Spark barrier's all-gather; `None` for a world of one).
pub fn connect(
    world: World,
    listener: Option<TcpListener>,
    options: CommOptions,
) -> Result<Communicator> {
    tracing::info!(
        rank = world.rank,
        size = world.size,
        generation = world.generation,
        "world formed"
    );
    let links = match listener {
        Some(listener) if world.size > 1 => {
            Some(Links::connect(&world, listener, &options.links())?)
        }
        _ => None,
    };
    Communicator::new(world, links, options)
}

/// How many worlds in a row may fail while their rings connect before a worker gives up.
const MEET_ATTEMPTS: u32 = 5;

/// How an elastic job's worker (a job created with `--min-world-size`) meets each of its worlds:
/// at the server, which forms a world from whoever joined, the newest commit at rank 0.
pub struct ElasticMeeting<'a> {
    pub service: &'a dyn Rendezvous,
    pub listen: &'a str,
    pub advertise: Option<&'a str>,
    /// The job's largest world (its `world_size`).
    pub max_world_size: u32,
    pub options: CommOptions,
}

impl ElasticMeeting<'_> {
    /// Joins the next world: as a survivor of the world and rank `rejoin` names (with the step
    /// of its last commit), or as a newcomer. A world whose member dies while the ring connects
    /// is given up and the next one joined (a few times in a row at most); a rendezvous
    /// refusal, such as a world below the minimum, is the caller's error.
    pub fn meet(&self, mut rejoin: Option<SyncRejoin>) -> Result<Communicator> {
        let mut attempt = 1;
        loop {
            let (listener, address) = bind(self.listen, self.advertise)?;
            tracing::info!(%address, ?rejoin, "joining the elastic job");
            // A survivor waits its timeout for the others to come back; a new worker waits as
            // long as the server holds a join (10 minutes) for the running world's next commit.
            let wait = match rejoin {
                Some(_) => self.options.timeout.as_secs().clamp(1, 600),
                None => 600,
            };
            let request = SyncJoinRequest {
                address,
                rank: None,
                world_size: self.max_world_size,
                timeout_s: Some(wait as u32),
                rejoin,
                elastic: true,
            };
            let world = rendezvous::join(self.service, &request)?;
            let (generation, rank) = (world.generation, world.rank);
            match connect(world, Some(listener), self.options.clone()) {
                Err(e) if e.survivable() && attempt < MEET_ATTEMPTS => {
                    tracing::warn!(error = %e, attempt, "a worker was lost while the world formed: joining the next one");
                    // Still a member of the world that formed, with the same state.
                    rejoin = rejoin.map(|r| SyncRejoin {
                        generation,
                        rank,
                        ..r
                    });
                    attempt += 1;
                }
                formed => return formed,
            }
        }
    }
}
