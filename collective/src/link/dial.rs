//! The connecting side of the handshake: this worker dials its right neighbour, answers its
//! challenge with a proof of membership, checks the neighbour's proof, and maps the shared
//! memory a same-host neighbour offers.

use std::io::{self};
use std::net::TcpStream;
use std::thread;
use std::time::{Duration, Instant};

use crate::handshake::{self, LinkTerms, Nonces, RingKey, Role, NONCE_LEN};
use crate::sealed::{Opener, Sealer};
use crate::{CollectiveError, Result};

use super::frame::{
    abort_text, read_frame_by, read_sealed_by, write_frame_by, write_sealed_by, Hello, Kind,
    CHALLENGE_LEN, MAX_HOST_FRAME,
};
use super::shm::attach_slots;
use super::tcp::Outbound;
use super::{resolve, tune, PROTOCOL_VERSION, UNSEALED_KNOB};

/// The connecting side of the handshake: this worker, to its right neighbour.
pub(super) struct Connector<'a> {
    pub(super) address: &'a str,
    /// The right neighbour's rank.
    pub(super) rank: u32,
    pub(super) terms: LinkTerms,
    pub(super) key: &'a RingKey,
    /// This host's id, offered once both sides have proved themselves.
    pub(super) host: Option<&'a str>,
    pub(super) timeout: Duration,
    pub(super) deadline: Instant,
}

/// How a connection attempt that did not end in a link ended.
pub(super) enum Attempt {
    /// The connection closed before the handshake was done (the neighbour was busy with
    /// strangers, or gave up on a slow handshake): worth another try.
    Closed(String),
    Failed(CollectiveError),
}

impl Connector<'_> {
    /// Connects, retrying until the deadline while nobody listens or the connection closes
    /// mid-handshake; a refusal or a failed proof ends it at once.
    pub(super) fn connect(&self) -> Result<Outbound> {
        let (rank, address) = (self.rank, self.address);
        let addrs = resolve(address)?;
        let mut delay = Duration::from_millis(20);
        let mut closed = None;
        loop {
            let attempt = addrs.iter().find_map(|a| {
                TcpStream::connect_timeout(a, Duration::from_secs(5).min(self.timeout)).ok()
            });
            if let Some(stream) = attempt {
                match self.handshake(stream) {
                    Ok(out) => return Ok(out),
                    Err(Attempt::Failed(e)) => return Err(e),
                    Err(Attempt::Closed(why)) => {
                        tracing::debug!(rank, "{why}; trying again");
                        closed = Some(why);
                    }
                }
            }
            if Instant::now() + delay > self.deadline {
                let what = match closed {
                    Some(why) => format!(
                        "did not complete the handshake at {address} within {} s ({why})",
                        self.timeout.as_secs()
                    ),
                    None => format!(
                        "could not be reached at {address} within {} s: it did not start, or the address is wrong",
                        self.timeout.as_secs()
                    ),
                };
                return Err(CollectiveError::PeerFailed { rank, what });
            }
            thread::sleep(delay);
            delay = (delay * 2).min(Duration::from_millis(500));
        }
    }

    /// Challenge, hello, welcome — then, proved both ways, the shared-memory offer.
    fn handshake(&self, mut stream: TcpStream) -> Result<Outbound, Attempt> {
        let (rank, address, deadline) = (self.rank, self.address, self.deadline);
        tune(&stream, self.timeout)
            .map_err(|e| Attempt::Failed(CollectiveError::io("tuning the ring socket", e)))?;
        let io_failed = |e: io::Error| match e.kind() {
            io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => {
                Attempt::Failed(CollectiveError::PeerFailed {
                    rank,
                    what: format!(
                        "did not answer the handshake at {address} within {} s: it stalled, or \
                         something other than a Hora worker listens there",
                        self.timeout.as_secs()
                    ),
                })
            }
            io::ErrorKind::InvalidData => Attempt::Failed(CollectiveError::Protocol(format!(
                "the process at {address}, where rank {rank} should be, sent {e}: is it a Hora \
                 worker of this version?"
            ))),
            _ => Attempt::Closed(format!(
                "the connection to rank {rank} at {address} closed during the handshake ({e})"
            )),
        };
        let refused = |payload: &[u8]| {
            Attempt::Failed(CollectiveError::Protocol(format!(
                "rank {rank} at {address} refused this worker: {} (every worker needs the same \
                 world: the same server job and generation, or the same --peers list and \
                 session secret)",
                abort_text(payload)
            )))
        };
        let unexpected = |kind: Kind, what: &str| {
            Attempt::Failed(CollectiveError::Protocol(format!(
                "the process at {address}, where rank {rank} should be, sent a {kind:?} frame \
                 where {what} was due: is it a Hora worker of this version?"
            )))
        };

        let (kind, challenge) =
            read_frame_by(&mut stream, MAX_HOST_FRAME, deadline).map_err(io_failed)?;
        match kind {
            Kind::Challenge if challenge.len() >= 4 => {}
            Kind::Abort => return Err(refused(&challenge)),
            kind => return Err(unexpected(kind, "a challenge")),
        }
        // The version first: another version's challenge may have another length.
        let (version, rest) = challenge.split_at(4);
        let version = u32::from_le_bytes(version.try_into().unwrap_or_default());
        if version != PROTOCOL_VERSION {
            return Err(Attempt::Failed(CollectiveError::Protocol(format!(
                "rank {rank} at {address} speaks ring protocol {version}, this worker \
                 {PROTOCOL_VERSION}: run the same Hora version on every worker"
            ))));
        }
        if challenge.len() != CHALLENGE_LEN {
            return Err(unexpected(Kind::Challenge, "a challenge of another length"));
        }
        let (their_nonce, their_sealed) = rest.split_at(NONCE_LEN);
        if their_sealed != [u8::from(self.terms.sealed)] {
            return Err(Attempt::Failed(CollectiveError::Protocol(format!(
                "rank {rank} at {address} {} its ring frames and this worker {}: give every \
                 worker the same setting (sealing is on unless a worker is started with \
                 {UNSEALED_KNOB})",
                if self.terms.sealed {
                    "does not seal"
                } else {
                    "seals"
                },
                if self.terms.sealed {
                    "does"
                } else {
                    "does not"
                },
            ))));
        }
        let nonces = Nonces {
            acceptor: their_nonce.try_into().unwrap_or_default(),
            connector: handshake::nonce().map_err(Attempt::Failed)?,
        };
        let hello = Hello {
            version: PROTOCOL_VERSION,
            generation: self.terms.generation,
            size: self.terms.size,
            rank: self.terms.from,
            sealed: self.terms.sealed,
            nonce: nonces.connector,
            proof: self.key.prove(Role::Connector, &self.terms, &nonces),
        };
        write_frame_by(&mut stream, Kind::Hello, &hello.encode(), deadline).map_err(io_failed)?;
        let (kind, welcome) =
            read_frame_by(&mut stream, MAX_HOST_FRAME, deadline).map_err(io_failed)?;
        match kind {
            Kind::Welcome => {}
            Kind::Abort => return Err(refused(&welcome)),
            kind => return Err(unexpected(kind, "a welcome")),
        }
        if !self
            .key
            .verify(Role::Acceptor, &self.terms, &nonces, &welcome)
        {
            return Err(Attempt::Failed(CollectiveError::Protocol(format!(
                "the process at {address}, where rank {rank} should be, could not prove that it \
                 belongs to this ring: a stranger, or a worker of another job or generation"
            ))));
        }

        // Proved both ways: from here on every frame is sealed, and the host id and the offer
        // are for a member only.
        let (mut seal, mut open) = if self.terms.sealed {
            let keys = self.key.frame_keys(&self.terms, &nonces);
            (
                Sealer::new(keys.to_acceptor),
                Opener::new(keys.to_connector),
            )
        } else {
            (Sealer::plain(), Opener::plain())
        };
        let host = self.host.unwrap_or_default();
        write_sealed_by(
            &mut stream,
            &mut seal,
            Kind::Host,
            host.as_bytes(),
            deadline,
        )
        .map_err(io_failed)?;
        let (kind, offer) =
            read_sealed_by(&mut stream, &mut open, MAX_HOST_FRAME, deadline).map_err(io_failed)?;
        if kind != Kind::Offer {
            return Err(unexpected(kind, "an offer"));
        }
        let mut slots = None;
        // "shm PATH SLOT_BYTES": a same-host offer of shared-memory slots.
        let offer = String::from_utf8_lossy(&offer).into_owned();
        let mut words = offer.split_whitespace();
        if let (Some("shm"), Some(path), Some(bytes)) = (words.next(), words.next(), words.next()) {
            let answer = match bytes
                .parse()
                .map_err(io::Error::other)
                .and_then(|b| attach_slots(path, b))
            {
                Ok(mapped) => {
                    slots = Some(mapped);
                    b"yes".as_slice()
                }
                Err(e) => {
                    tracing::debug!("shared memory with rank {rank} unavailable ({e}); using TCP");
                    b"no".as_slice()
                }
            };
            write_sealed_by(&mut stream, &mut seal, Kind::Attached, answer, deadline)
                .map_err(io_failed)?;
        }
        tune(&stream, self.timeout)
            .map_err(|e| Attempt::Failed(CollectiveError::io("tuning the ring socket", e)))?;
        Ok(Outbound {
            stream,
            peer: rank,
            timeout: self.timeout,
            slots,
            seal,
            open,
        })
    }
}
