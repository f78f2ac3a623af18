//! Gathering the world: every worker learns its rank, the world size and the ring addresses of
//! the others.
//!
//! Two ways: at the Hora server (`POST /v1/sync/{job}/join`, held until every rank has joined,
//! so workers may start in any order), or from a static list of addresses that a launcher or an
//! operator already knows (`--peers`), with the rank from the launcher. Either way the result is
//! a [`World`]; after it the server is out of the loop — workers talk to each other directly.
//!
//! Either way the world's session is a secret its members share and prove to each other when
//! they connect (see `handshake`): the server makes a random one for every world and hands it only
//! to holders of the job's token; with `--peers` every worker derives it from the operator's
//! shared secret (`HORA_SYNC_SECRET`) and the peer list. Before the handshake had proofs, the
//! `--peers` session was a hash of the peer list alone — anyone who knew the addresses could
//! compute it, so a secret is now required there.

use std::time::Duration;

use hora_common::wire::{SyncJoinRequest, SyncStatus, SyncWorld};

use crate::{CollectiveError, Result};

/// The shortest `--peers` secret accepted (a 128-bit random value in hex is 32 characters).
pub const MIN_SECRET_LEN: usize = 16;

/// The workers of one generation of a job, as this worker sees them.
#[derive(Clone, PartialEq, Eq)]
pub struct World {
    pub rank: u32,
    pub size: u32,
    /// Ring addresses (`host:port`) by rank.
    pub peers: Vec<String>,
    /// Shared by the members of this world and secret to them: neighbours prove they know it
    /// when they connect. Never logged, never sent.
    pub session: String,
    pub generation: u64,
}

/// Everything but the session.
impl std::fmt::Debug for World {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("World")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("peers", &self.peers)
            .field("session", &"<secret>")
            .field("generation", &self.generation)
            .finish()
    }
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

    /// A world from addresses known in advance (rank `rank` listens on `peers[rank]`), its
    /// session derived from `secret`, which every worker must be given (a world of one, which
    /// has no ring, needs none).
    pub fn from_peers(peers: Vec<String>, rank: u32, secret: Option<&str>) -> Result<World> {
        let size = u32::try_from(peers.len())
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| CollectiveError::Config("--peers lists no address".into()))?;
        if rank >= size {
            return Err(CollectiveError::Config(format!(
                "rank {rank} has no address: --peers lists {size}"
            )));
        }
        let secret =
            match secret {
                Some(s) if s.len() >= MIN_SECRET_LEN => s,
                _ if size == 1 => "",
                Some(_) => {
                    return Err(CollectiveError::Config(format!(
                    "the shared secret for --peers is shorter than {MIN_SECRET_LEN} characters: \
                     use a long random one, e.g. `openssl rand -hex 16`"
                )))
                }
                None => return Err(CollectiveError::Config(
                    "--peers needs a shared secret, the same on every worker, so that only the \
                     job's workers can join its ring: set HORA_SYNC_SECRET (e.g. to the output \
                     of `openssl rand -hex 16`; mpirun -x and srun pass it on) or \
                     --session-secret"
                        .into(),
                )),
            };
        // Every worker derives the same session from the same secret and list; a worker given
        // another secret or another list cannot prove it at the handshake.
        let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret.as_bytes());
        let mut message = b"hora sync peers session v2\0".to_vec();
        message.extend_from_slice(peers.join(",").as_bytes());
        let session = hex::encode(ring::hmac::sign(&key, &message).as_ref());
        Ok(World {
            rank,
            size,
            session,
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

    /// The world a rendezvous service answered, checked for consistency.
    pub fn from_wire(w: SyncWorld) -> Result<World> {
        if w.world_size == 0 || w.rank >= w.world_size || w.peers.len() != w.world_size as usize {
            return Err(CollectiveError::Rendezvous(format!(
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

/// A rendezvous service that gathers a job's workers into a world: the Hora server's
/// `POST /v1/sync/{job}/join`, or anything that answers the same way. The crate holds the
/// protocol (what a worker asks, what a well-formed answer is); how the request travels is the
/// implementor's (`hora-client` sends it over its HTTPS transport, with its retries and TLS), so
/// the collective stack carries no HTTP client of its own.
pub trait Rendezvous {
    /// Sends `request` and waits until the world is complete (the service holds the request
    /// until every rank has joined, or until `request.timeout_s`). Errors are
    /// [`CollectiveError::Rendezvous`] in the service's words, or
    /// [`CollectiveError::JobFinished`] when the job's training finished (`job_finished`).
    fn send(&self, request: &SyncJoinRequest) -> Result<SyncWorld>;

    /// How long this worker waits for the others.
    fn timeout(&self) -> Duration;

    /// An elastic job's generation and the workers waiting to join it (`GET
    /// /v1/sync/{job}/status`), asked by a running world's rank 0 at its commits.
    fn status(&self) -> std::result::Result<SyncStatus, String>;

    /// Says the job's training finished (`POST /v1/sync/{job}/finish`), once every rank is
    /// done: an elastic job's workers that join later, or are retried by their launcher, learn
    /// that there is nothing to do instead of waiting for a world.
    fn finish(&self) -> std::result::Result<(), String>;
}

/// Joins at `service` with `request` and waits until the world is complete.
pub fn join(service: &dyn Rendezvous, request: &SyncJoinRequest) -> Result<World> {
    let world = service.send(request)?;
    World::from_wire(world)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: Option<&str> = Some("a secret of the operator's");

    #[test]
    fn neighbours_wrap_around() {
        let peers: Vec<String> = (0..4).map(|i| format!("127.0.0.1:{}", 9000 + i)).collect();
        let w = World::from_peers(peers.clone(), 0, SECRET).unwrap();
        assert_eq!((w.left(), w.right()), (3, 1));
        let w3 = World::from_peers(peers.clone(), 3, SECRET).unwrap();
        assert_eq!((w3.left(), w3.right()), (2, 0));
        assert_eq!(w.session, w3.session, "same list, same session");
        let other = World::from_peers(peers[..3].to_vec(), 0, SECRET).unwrap();
        assert_ne!(w.session, other.session);
        assert!(World::from_peers(peers, 4, SECRET).is_err());
        assert!(World::from_peers(vec![], 0, SECRET).is_err());
        let one = World::single();
        assert_eq!((one.left(), one.right()), (0, 0));
    }

    #[test]
    fn a_peers_session_takes_a_secret_that_the_addresses_alone_do_not_give() {
        let peers: Vec<String> = (0..2).map(|i| format!("127.0.0.1:{}", 9000 + i)).collect();
        let err = World::from_peers(peers.clone(), 0, None).unwrap_err();
        assert!(err.to_string().contains("HORA_SYNC_SECRET"), "{err}");
        let err = World::from_peers(peers.clone(), 0, Some("short")).unwrap_err();
        assert!(err.to_string().contains("shorter than 16"), "{err}");
        let a = World::from_peers(peers.clone(), 0, SECRET).unwrap();
        let b = World::from_peers(peers.clone(), 0, Some("another secret, also long")).unwrap();
        assert_ne!(a.session, b.session);
        // What the session used to be: a hash of the list, which anyone could compute.
        let digest = ring::digest::digest(&ring::digest::SHA256, peers.join(",").as_bytes());
        assert!(!a.session.contains(&hex::encode(&digest.as_ref()[..16])));
        assert!(!a.session.contains("secret"));
        // Never in a log line.
        let shown = format!("{a:?}");
        assert!(
            !shown.contains(&a.session) && shown.contains("<secret>"),
            "{shown}"
        );
        // A world of one has no ring and needs no secret.
        assert!(World::from_peers(peers[..1].to_vec(), 0, None).is_ok());
    }
}
