//! Gathering the world: every worker learns its rank, the world size and the ring addresses of
//! the others.
//!
//! Two ways: at the Hora server (`POST /v1/sync/{job}/join`, held until every rank has joined,
//! so workers may start in any order), or from a static list of addresses that a launcher or an
//! operator already knows (`--peers`), with the rank from the launcher. Either way the result is
//! a [`World`]; after it the server is out of the loop — workers talk to each other directly.

use std::path::Path;
use std::time::Duration;

use hora_common::tls::Identity;
use hora_common::wire::{SyncJoinRequest, SyncWorld, CLIENT_API};
use reqwest::Method;

use super::{Result, SyncError};
use crate::transport::{Connection, RetryPolicy};

/// The workers of one generation of a job, as this worker sees them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct World {
    pub rank: u32,
    pub size: u32,
    /// Ring addresses (`host:port`) by rank.
    pub peers: Vec<String>,
    /// Shared by the members of this world; checked when neighbours connect.
    pub session: String,
    pub generation: u64,
}

impl World {
    /// A world of one: every collective is local.
    pub fn single() -> World {
        World {
            rank: 0,
            size: 1,
            peers: vec![String::new()],
            session: "single".into(),
            generation: 0,
        }
    }

    /// A world from addresses known in advance (rank `rank` listens on `peers[rank]`).
    pub fn from_peers(peers: Vec<String>, rank: u32) -> Result<World> {
        let size = u32::try_from(peers.len())
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| SyncError::Config("--peers lists no address".into()))?;
        if rank >= size {
            return Err(SyncError::Config(format!(
                "rank {rank} has no address: --peers lists {size}"
            )));
        }
        // Every worker derives the same session from the same list; a worker started with a
        // different list is refused at the handshake.
        let digest = ring::digest::digest(&ring::digest::SHA256, peers.join(",").as_bytes());
        Ok(World {
            rank,
            size,
            session: hex::encode(&digest.as_ref()[..16]),
            peers,
            generation: 0,
        })
    }

    /// The rank this worker receives from.
    pub fn left(&self) -> u32 {
        (self.rank + self.size - 1) % self.size
    }

    /// The rank this worker sends to.
    pub fn right(&self) -> u32 {
        (self.rank + 1) % self.size
    }

    fn from_wire(w: SyncWorld) -> Result<World> {
        if w.world_size == 0 || w.rank >= w.world_size || w.peers.len() != w.world_size as usize {
            return Err(SyncError::Rendezvous(format!(
                "the server answered an inconsistent world (rank {} of {}, {} addresses)",
                w.rank,
                w.world_size,
                w.peers.len()
            )));
        }
        Ok(World {
            rank: w.rank,
            size: w.world_size,
            peers: w.peers,
            session: w.session,
            generation: w.generation,
        })
    }
}

/// Where and how to join at the server.
#[derive(Debug, Clone)]
pub struct ServerRendezvous<'a> {
    pub server: &'a str,
    pub ca: &'a Path,
    pub identity: Option<&'a Identity>,
    pub job: &'a str,
    /// The job's token (printed when the job was created).
    pub token: &'a str,
    /// How long to wait for the other workers.
    pub timeout: Duration,
    /// How long to keep retrying while the server cannot be reached.
    pub retry_for: Duration,
}

impl ServerRendezvous<'_> {
    /// Joins and waits until the world is complete. `address` is where this worker accepts its
    /// left neighbour; `rank` the launcher's rank, if any.
    pub fn join(&self, address: &str, rank: Option<u32>, world_size: u32) -> Result<World> {
        let retry = RetryPolicy {
            budget: self.retry_for,
            ..Default::default()
        };
        let conn = Connection::new(self.server, self.ca, self.identity, retry)
            .map_err(|e| SyncError::Rendezvous(e.to_string()))?
            .with_token(self.token.to_string());
        let request = SyncJoinRequest {
            address: address.to_string(),
            rank,
            world_size,
            timeout_s: Some(self.timeout.as_secs().clamp(1, 600) as u32),
        };
        let path = format!("{CLIENT_API}/sync/{}/join", self.job);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| SyncError::io("starting the rendezvous runtime", e))?;
        let world: SyncWorld = runtime
            .block_on(conn.json("joining the sync job", || {
                conn.request(Method::POST, &path, self.timeout)
                    .json(&request)
            }))
            .map_err(|e| SyncError::Rendezvous(e.to_string()))?;
        World::from_wire(world)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn neighbours_wrap_around() {
        let peers: Vec<String> = (0..4).map(|i| format!("127.0.0.1:{}", 9000 + i)).collect();
        let w = World::from_peers(peers.clone(), 0).unwrap();
        assert_eq!((w.left(), w.right()), (3, 1));
        let w3 = World::from_peers(peers.clone(), 3).unwrap();
        assert_eq!((w3.left(), w3.right()), (2, 0));
        assert_eq!(w.session, w3.session, "same list, same session");
        let other = World::from_peers(peers[..3].to_vec(), 0).unwrap();
        assert_ne!(w.session, other.session);
        assert!(World::from_peers(peers, 4).is_err());
        assert!(World::from_peers(vec![], 0).is_err());
        let one = World::single();
        assert_eq!((one.left(), one.right()), (0, 0));
    }
}
