//! The ring's connections: each worker sends to its right neighbour and receives from its left,
//! over one TCP connection each (for two workers, two connections between the same pair).
//!
//! Frames are a 16-byte header — kind, an auxiliary word, payload length — and the payload.
//! After the handshake every frame is sealed (AES-256-GCM, a key per connection and direction
//! derived from the session over the handshake's transcript, a counter nonce; see `sealed`):
//! its header and its payload are two records, each with its tag, so a frame that was altered,
//! dropped, replayed or injected on the way stops the ring with an error naming the rank it
//! came from, and nothing a worker sends can be read on the way.
//!
//! **Who gets in.** The ring port is open to anyone who can reach it, so a connection is a
//! stranger until it proves otherwise. The accepting side speaks first with a `Challenge` (the
//! protocol version and a fresh random nonce); the connecting side answers `Hello` with its own
//! nonce and a proof that it knows the world's session (an HMAC over both nonces, the version,
//! the generation, the world size and both ranks — see `handshake`); the accepting side checks it
//! and only then answers `Welcome` with its own proof, which the connecting side checks in turn.
//! So a worker of another job, generation or version is refused instead of corrupting a
//! reduction, and neither side sends anything secret, or derived from a secret other than the
//! proofs. A refused connection is told "not a member of this ring" and nothing else; the
//! refusing worker logs the details. Every accepted connection is challenged at once and has a
//! few seconds (never past the ring's deadline) to answer; only one whose answer has arrived and
//! starts as a hello should is given a thread to check it, and addresses whose connections stayed
//! silent, sent garbage or proved nothing are suspect for a backoff that doubles (see
//! `accept_left`): strangers cannot hold up the real neighbour, however many there are and
//! however often they reconnect.
//!
//! Failure is loud and fast. Reads and writes have a timeout (`--timeout`, 30 s by default); a
//! closed connection or a timeout is turned into an error naming the rank at the other end; and
//! the worker that notices first sends an `Abort` frame naming the failed rank to its right
//! neighbour, which forwards it, so every survivor stops and names the same rank. Payload lengths
//! are checked against what the receiver expects before anything is read into memory.
//!
//! **Shared memory between neighbours on one host.** When both ends run on the same machine
//! (same kernel boot id, exchanged only once both sides have proved themselves), the receiving
//! side offers a ring of slots in a shared-memory file (`/dev/shm`, mode 0600, unlinked as soon
//! as both have mapped it): the sender writes a piece straight into a free slot and sends only a
//! 16-byte header over TCP, and the receiver reduces straight out of the slot and hands it back
//! with a credit frame. One copy per byte instead of two through the kernel, and no payload
//! system calls — what NCCL and MPI do within a node. The sender maps only a regular file of
//! its own user with mode 0600, opened without following links. The TCP connection stays: it
//! carries the headers, credits, aborts and timeouts, so failure detection is the same either
//! way. `HORA_RING_SHM=0` turns it off. Pieces go in and out of slots with
//! [`hora_common::kernel::copy`], whose speed does not depend on where the caller's buffer
//! starts (`HORA_RING_PLAIN_COPY=1` uses memcpy instead, for the benchmark's comparison). The
//! slots' contents are not sealed: shared memory is reachable only by this user on this host (a
//! file of mode 0600 that is unlinked at once), who can read and write both processes' memory
//! anyway; the headers, credits and aborts that cross the socket are sealed like every other
//! frame.
//!
//! **Where each concern lives.** `frame`: the frame format, the handshake's messages, deadlines
//! and what a failed read says about the neighbour; `dial`: the connecting side of the
//! handshake; `accept`: the accepting side, strangers kept out; `shm`: the shared-memory slots
//! and their checks (every `unsafe` of the slot memory is there) and the links' shared-memory
//! path; `tcp`: the two ends of a link once connected ([`Outbound`], [`Inbound`]), which the
//! ring drives, and their TCP stream path.

mod accept;
mod dial;
mod frame;
mod shm;
mod tcp;
#[cfg(test)]
mod tests;

use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::thread;
use std::time::{Duration, Instant};

use crate::handshake::{LinkTerms, RingKey};
use crate::rendezvous::World;
use crate::{CollectiveError, Result};

use accept::{accept_left, Gate};
use dial::Connector;
pub(crate) use frame::MAX_CONTROL;
pub use frame::{Header, Kind};
use shm::{host_id, MAX_SLOT_BYTES};
pub use tcp::{Inbound, Incoming, Outbound};

/// Bumped whenever frames or the handshake change: workers of different versions refuse each
/// other. Version 2: the challenge-response handshake (version 1 sent the session in the clear);
/// version 3: frames sealed after the handshake.
const PROTOCOL_VERSION: u32 = 3;
/// The most one accepted connection is given to send its hello and prove itself (less when the
/// ring's deadline is nearer, or its address is suspect). A real neighbour needs milliseconds.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Handshakes in progress at once, each for a connection whose hello is in; another waits for
/// one of them to end (which takes microseconds: the proof is checked at once).
const MAX_HANDSHAKES: usize = 32;
/// How a worker is told to leave its frames unsealed, for error messages.
const UNSEALED_KNOB: &str = "--ring-unsealed (seal_frames=False in Python)";
/// All a refused connection is told.
pub(crate) const REFUSAL: &str = "not a member of this ring";
/// Kernel socket buffers: a few pipelined sub-chunks in flight each way.
const SOCKET_BUFFER: usize = 8 << 20;

/// How a worker's links are made.
#[derive(Debug, Clone, Copy)]
pub struct LinkOptions {
    /// The ring's deadline to connect, and its read and write timeout afterwards.
    pub timeout: Duration,
    /// Shared-memory slots of this many bytes offered to a same-host left neighbour (`None`:
    /// TCP only).
    pub slot_bytes: Option<usize>,
    /// Seal every frame after the handshake (see `sealed`); every worker of a world must agree.
    pub seal_frames: bool,
}

/// Both ends of one worker's place in the ring (none in a world of one).
pub struct Links {
    pub inbound: Inbound,
    pub outbound: Outbound,
}

fn tune(stream: &TcpStream, timeout: Duration) -> io::Result<()> {
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    let socket = socket2::SockRef::from(stream);
    socket.set_send_buffer_size(SOCKET_BUFFER)?;
    socket.set_recv_buffer_size(SOCKET_BUFFER)?;
    Ok(())
}

impl Links {
    /// Binds the address this worker will accept its left neighbour on (before the rendezvous,
    /// so the address it announces is already listening).
    pub fn listen(address: &str) -> Result<TcpListener> {
        TcpListener::bind(address).map_err(|e| {
            CollectiveError::io(
                format!("listening for the ring on {address} (choose another with --ring-listen)"),
                e,
            )
        })
    }

    /// Connects to the right neighbour and accepts the left one, both within `options.timeout`,
    /// each proving to the other that it is a member of `world`.
    pub fn connect(world: &World, listener: TcpListener, options: &LinkOptions) -> Result<Links> {
        let LinkOptions {
            timeout,
            slot_bytes,
            seal_frames,
        } = *options;
        if world.size < 2 {
            return Err(CollectiveError::Config(
                "a world of one has no ring to connect".into(),
            ));
        }
        let deadline = Instant::now() + timeout;
        let key = RingKey::derive(&world.session);
        let host = host_id();
        let terms = |from, to| LinkTerms {
            version: PROTOCOL_VERSION,
            generation: world.generation,
            size: world.size,
            from,
            to,
            sealed: seal_frames,
        };
        let right = world.right();
        let connector = Connector {
            address: &world.peers[right as usize],
            rank: right,
            terms: terms(world.rank, right),
            key: &key,
            host: host.as_deref(),
            timeout,
            deadline,
        };
        let gate = Gate {
            key: key.clone(),
            terms: terms(world.left(), world.rank),
            timeout,
            offer: host
                .clone()
                .zip(slot_bytes.map(|b| b.clamp(64, MAX_SLOT_BYTES).div_ceil(64) * 64)),
        };
        let own_address = &world.peers[world.rank as usize];
        let (inbound, outbound) = thread::scope(|s| {
            let out = s.spawn(|| connector.connect());
            let inbound = accept_left(gate, &listener, deadline, own_address);
            let outbound = out
                .join()
                .map_err(|_| CollectiveError::Config("the connecting thread panicked".into()))?;
            match (inbound, outbound) {
                // A refusal by the right neighbour (another session: other --peers, another
                // job) explains a left neighbour that never came better than the wait does.
                (Err(_), Err(refused @ CollectiveError::Protocol(_))) => Err(refused),
                (inbound, outbound) => Ok::<_, CollectiveError>((inbound?, outbound?)),
            }
        })?;
        Ok(Links { inbound, outbound })
    }
}

fn resolve(address: &str) -> Result<Vec<SocketAddr>> {
    address
        .to_socket_addrs()
        .map(|a| a.collect())
        .map_err(|e| CollectiveError::io(format!("resolving the ring address {address}"), e))
}
