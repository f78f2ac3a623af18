//! The accepting side of the handshake: this worker waits for its left neighbour among whoever
//! connects to its ring port, challenges every connection, admits only the one that proves it is
//! the left neighbour, and keeps strangers from holding it up (a bounded queue of pending
//! connections, a backoff for suspect addresses).

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::{Duration, Instant};

use crate::handshake::{self, LinkTerms, Nonces, RingKey, Role, NONCE_LEN};
use crate::sealed::{Opener, Sealer};
use crate::{CollectiveError, Result};

use super::frame::{
    encode_header, read_sealed_by, write_frame_by, write_sealed_by, Hello, Kind, CHALLENGE_LEN,
    HEADER_LEN, HELLO_LEN, MAX_HOST_FRAME,
};
use super::shm::{create_slots, ReceiverSlots};
use super::tcp::Inbound;
use super::{tune, HANDSHAKE_TIMEOUT, MAX_HANDSHAKES, PROTOCOL_VERSION, REFUSAL, UNSEALED_KNOB};

/// What the accepting side checks each connection against; shared with the handshake threads.
pub(super) struct Gate {
    pub(super) key: RingKey,
    /// `from` is the left neighbour's rank, `to` this worker's.
    pub(super) terms: LinkTerms,
    /// The ring's read and write timeout, for the admitted connection.
    pub(super) timeout: Duration,
    /// This host's id and the slot size offered to a same-host neighbour.
    pub(super) offer: Option<(String, usize)>,
}

/// Why a connection was not admitted: logged by this worker, never sent. (The silent, and
/// those that send what is not a hello, are closed by the accept loop before any handshake.)
pub(super) enum Refused {
    /// It spoke the protocol and proved nothing: another job, generation, version or secret.
    Unproven(String),
    /// It proved itself, and then its handshake failed.
    Failed(String),
}

/// Counts a handshake in progress for as long as it lives.
pub(super) struct Running(Arc<AtomicUsize>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Connections waiting to show their first bytes, at most; past it the oldest (of a suspect
/// address first) is closed to make room.
pub(super) const MAX_PENDING: usize = 256;
/// How long a connection from a suspect address is given to send its hello (others are given
/// [`HANDSHAKE_TIMEOUT`]). A real neighbour needs milliseconds.
pub(super) const SUSPECT_SILENCE: Duration = Duration::from_secs(1);
/// The first backoff of an address whose connection failed; it doubles with each failure.
pub(super) const FIRST_BACKOFF: Duration = Duration::from_millis(100);
pub(super) const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// Addresses remembered at most.
pub(super) const MAX_SUSPECTS: usize = 4096;

/// Addresses whose connections stayed silent, sent what is not a hello, or did not prove
/// themselves: each is suspect for a backoff that doubles with every failure. A suspect's
/// connections are still accepted (a real neighbour may share its address: a NAT, a host
/// running several workers), but they get [`SUSPECT_SILENCE`] to speak and are the first closed
/// when the pending connections are at their limit.
#[derive(Default)]
pub(super) struct Backoff {
    /// Failures in a row and until when the address is suspect.
    addresses: std::collections::HashMap<std::net::IpAddr, (u32, Instant)>,
}

impl Backoff {
    fn strike(&mut self, ip: std::net::IpAddr, now: Instant) {
        if self.addresses.len() >= MAX_SUSPECTS {
            self.addresses.retain(|_, (_, until)| *until > now);
            if self.addresses.len() >= MAX_SUSPECTS {
                return;
            }
        }
        let (strikes, until) = self.addresses.entry(ip).or_insert((0, now));
        // A failure long after the last backoff ended starts over.
        if now > *until + MAX_BACKOFF {
            *strikes = 0;
        }
        let backoff = FIRST_BACKOFF
            .saturating_mul(1 << (*strikes).min(16))
            .min(MAX_BACKOFF);
        *strikes = strikes.saturating_add(1);
        *until = now + backoff;
    }

    fn suspect(&self, ip: std::net::IpAddr, now: Instant) -> bool {
        self.addresses
            .get(&ip)
            .is_some_and(|&(_, until)| until > now)
    }
}

/// An accepted connection that has been challenged and has not yet sent a whole hello.
pub(super) struct Pending {
    stream: TcpStream,
    from: SocketAddr,
    /// The nonce of the challenge it was sent.
    nonce: [u8; NONCE_LEN],
    accepted: Instant,
    /// When it must have sent its hello.
    speak_by: Instant,
    suspect: bool,
    /// Its hello is in; it waits for a handshake thread.
    ready: bool,
    /// What it has sent so far (the first `got` bytes), taken off the socket: bytes left unread
    /// would wake `poll(2)` again at once, and the accept loop would spin until `speak_by`.
    first: [u8; HEADER_LEN + HELLO_LEN],
    got: usize,
}

/// What a pending connection has sent so far.
#[derive(Clone, Copy)]
pub(super) enum FirstBytes {
    /// A whole hello's worth, under a hello's header: worth a handshake.
    Hello,
    /// Nothing yet, or the start of a hello.
    Waiting,
    /// A hello's header with another length: a worker of another Hora version.
    OtherVersion,
    /// Something that is not a hello, or it hung up.
    Wrong(&'static str),
}

impl Pending {
    /// Takes what has arrived (up to a hello's worth) and judges all it has sent so far.
    fn first_bytes(&mut self) -> FirstBytes {
        let expected = encode_header(Kind::Hello, 0, HELLO_LEN as u64);
        while self.got < self.first.len() {
            match (&self.stream).read(&mut self.first[self.got..]) {
                Ok(0) => return FirstBytes::Wrong("it hung up before its hello"),
                Ok(n) => self.got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(_) => return FirstBytes::Wrong("its connection failed"),
            }
        }
        let (n, got) = (self.got, &self.first);
        if n >= HEADER_LEN && got[..8] == expected[..8] && got[8..16] != expected[8..16] {
            FirstBytes::OtherVersion
        } else if got[..n.min(HEADER_LEN)] != expected[..n.min(HEADER_LEN)] {
            FirstBytes::Wrong("it sent what is not a hello")
        } else if n == got.len() {
            FirstBytes::Hello
        } else {
            FirstBytes::Waiting
        }
    }

    /// The body of its hello, once [`Pending::first_bytes`] has found it whole.
    fn hello(&self) -> [u8; HELLO_LEN] {
        let mut hello = [0u8; HELLO_LEN];
        hello.copy_from_slice(&self.first[HEADER_LEN..]);
        hello
    }

    /// Tells it, as far as the socket takes it at once, that it is not a member; and closes it.
    fn refuse(self) {
        let mut frame = encode_header(Kind::Abort, 0, (4 + REFUSAL.len()) as u64).to_vec();
        frame.extend_from_slice(&u32::MAX.to_le_bytes());
        frame.extend_from_slice(REFUSAL.as_bytes());
        let _ = (&self.stream).write(&frame);
        let _ = self.stream.shutdown(Shutdown::Both);
    }
}

/// What a handshake thread reports.
pub(super) enum Outcome {
    Admitted(Box<Inbound>),
    /// The connection from this address was refused: it did not prove itself.
    Refused(std::net::IpAddr),
}

#[cfg(test)]
thread_local! {
    /// How many times the accept loop has gone round on this thread.
    pub(super) static ACCEPT_ROUNDS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Accepts connections until one proves to be the left neighbour, or until `deadline`.
///
/// Strangers must not be able to keep the real neighbour out, however many there are and however
/// often they reconnect. So a connection costs a thread only once it has shown the expected first
/// bytes: every accepted connection is sent its challenge at once and waits, in a pool of at
/// most [`MAX_PENDING`] watched with `poll(2)`, until a whole hello has arrived under a hello's
/// header (what it sends is read as it comes, so a partial hello does not keep `poll` awake) —
/// then its handshake runs on a short-lived thread ([`MAX_HANDSHAKES`] at most), which
/// checks the proof in microseconds. A connection that sends anything else is closed at once; one
/// that stays silent is closed after [`HANDSHAKE_TIMEOUT`]; and their addresses are suspect for a
/// while ([`Backoff`]). The real neighbour answers its challenge within a round trip, so it is
/// through before silent strangers can matter.
pub(super) fn accept_left(
    gate: Gate,
    listener: &TcpListener,
    deadline: Instant,
    own_address: &str,
) -> Result<Inbound> {
    use std::os::fd::AsRawFd;

    let left = gate.terms.from;
    let timeout = gate.timeout;
    let gate = Arc::new(gate);
    let (report, outcomes) = mpsc::channel::<Outcome>();
    let running = Arc::new(AtomicUsize::new(0));
    let mut pending: Vec<Pending> = Vec::new();
    let mut backoff = Backoff::default();
    let mut came = 0u64;
    listener
        .set_nonblocking(true)
        .map_err(|e| CollectiveError::io("configuring the ring listener", e))?;
    loop {
        #[cfg(test)]
        ACCEPT_ROUNDS.with(|n| n.set(n.get() + 1));
        let now = Instant::now();
        while let Ok(outcome) = outcomes.try_recv() {
            match outcome {
                Outcome::Admitted(inbound) => return Ok(*inbound),
                Outcome::Refused(ip) => backoff.strike(ip, now),
            }
        }
        if now >= deadline {
            let others = match came {
                0 => String::new(),
                n => format!(" ({n} connections came and none proved to be rank {left})"),
            };
            return Err(CollectiveError::PeerFailed {
                rank: left,
                what: format!(
                    "did not connect within {} s: it did not start, or it cannot reach this worker's address {own_address}{others}",
                    timeout.as_secs(),
                ),
            });
        }

        // Everyone who knocked: challenged at once, then pending.
        loop {
            match listener.accept() {
                Ok((stream, from)) => {
                    came += 1;
                    let nonce = match challenge(&stream, gate.terms.sealed) {
                        Ok(nonce) => nonce,
                        Err(e) => {
                            tracing::debug!(%from, "challenging a ring connection: {e}");
                            continue;
                        }
                    };
                    if pending.len() >= MAX_PENDING {
                        // Make room: the oldest of a suspect address, else the oldest.
                        let victim = (0..pending.len())
                            .min_by_key(|&i| (!pending[i].suspect, pending[i].accepted))
                            .unwrap_or(0);
                        let evicted = pending.swap_remove(victim);
                        tracing::debug!(from = %evicted.from, "{MAX_PENDING} ring connections pending: closed the oldest");
                        evicted.refuse();
                    }
                    let suspect = backoff.suspect(from.ip(), now);
                    let allowance = if suspect {
                        SUSPECT_SILENCE
                    } else {
                        HANDSHAKE_TIMEOUT
                    };
                    pending.push(Pending {
                        stream,
                        from,
                        nonce,
                        accepted: now,
                        speak_by: deadline.min(now + allowance),
                        suspect,
                        ready: false,
                        first: [0; HEADER_LEN + HELLO_LEN],
                        got: 0,
                    });
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                // What one connection did (it reset before it was accepted), or too many open
                // files for a moment: the listener is fine.
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::ConnectionAborted
                            | io::ErrorKind::ConnectionReset
                            | io::ErrorKind::Interrupted
                    ) || matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) =>
                {
                    tracing::debug!("accepting on the ring port: {e}");
                    break;
                }
                Err(e) => return Err(CollectiveError::io("accepting the left neighbour", e)),
            }
        }

        // Those that have shown a hello go to a handshake; the wrong and the silent go.
        let mut i = 0;
        while i < pending.len() {
            let verdict = pending[i].first_bytes();
            match verdict {
                FirstBytes::Hello if running.load(Ordering::Acquire) < MAX_HANDSHAKES => {
                    let p = pending.swap_remove(i);
                    handshake_thread(&gate, p, deadline, &running, &report);
                    continue;
                }
                FirstBytes::Hello => pending[i].ready = true,
                FirstBytes::Waiting if now < pending[i].speak_by => {}
                FirstBytes::Waiting | FirstBytes::Wrong(_) | FirstBytes::OtherVersion => {
                    let p = pending.swap_remove(i);
                    match verdict {
                        FirstBytes::OtherVersion => tracing::warn!(
                            from = %p.from,
                            "refused a ring connection: it sent a hello of another length (a \
                             worker of another Hora version? run the same version everywhere)"
                        ),
                        FirstBytes::Wrong(why) => {
                            tracing::debug!(from = %p.from, "closed a ring connection: {why}")
                        }
                        _ => tracing::debug!(
                            from = %p.from,
                            "closed a ring connection: it said nothing in time"
                        ),
                    }
                    backoff.strike(p.from.ip(), now);
                    p.refuse();
                    continue;
                }
            }
            i += 1;
        }

        // Wait for a knock, more first bytes, or (every 10 ms) a handshake's outcome. What came
        // has been read, so `poll` sleeps until something new does. A connection whose hello is
        // in waits for a thread, not for bytes: it is not watched.
        let mut fds = vec![libc::pollfd {
            fd: listener.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        }];
        for p in &pending {
            if !p.ready {
                fds.push(libc::pollfd {
                    fd: p.stream.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                });
            }
        }
        let wait = deadline
            .saturating_duration_since(Instant::now())
            .min(Duration::from_millis(10));
        // SAFETY: `fds` is a live array of `fds.len()` pollfd structs whose descriptors stay
        // open for the call (the listener and the pending streams are borrowed meanwhile).
        let _ = unsafe {
            libc::poll(
                fds.as_mut_ptr(),
                fds.len() as libc::nfds_t,
                wait.as_millis() as libc::c_int,
            )
        };
    }
}

/// Sends an accepted connection its challenge (the version, a fresh nonce, whether this world
/// seals its frames) without waiting, and returns the nonce.
pub(super) fn challenge(stream: &TcpStream, sealed: bool) -> io::Result<[u8; NONCE_LEN]> {
    stream.set_nonblocking(true)?;
    let nonce = handshake::nonce().map_err(|e| io::Error::other(e.to_string()))?;
    let mut frame = encode_header(Kind::Challenge, 0, CHALLENGE_LEN as u64).to_vec();
    frame.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    frame.extend_from_slice(&nonce);
    frame.push(u8::from(sealed));
    // A fresh socket's buffer takes these few bytes at once.
    match (&*stream).write(&frame)? {
        n if n == frame.len() => Ok(nonce),
        _ => Err(io::Error::other("the challenge did not fit the socket")),
    }
}

/// Runs the rest of `p`'s handshake on a short-lived thread, which reports its outcome.
pub(super) fn handshake_thread(
    gate: &Arc<Gate>,
    p: Pending,
    deadline: Instant,
    running: &Arc<AtomicUsize>,
    report: &mpsc::Sender<Outcome>,
) {
    running.fetch_add(1, Ordering::AcqRel);
    let counted = Running(Arc::clone(running));
    let (gate, report) = (Arc::clone(gate), report.clone());
    let from = p.from;
    let spawned = thread::Builder::new()
        .name("hora-ring-handshake".into())
        .stack_size(256 << 10)
        .spawn(move || {
            let _counted = counted;
            let hello = p.hello();
            let outcome = match admit(&gate, p.stream, p.from, p.nonce, &hello, deadline) {
                Ok(inbound) => Outcome::Admitted(Box::new(inbound)),
                Err(Some(ip)) => Outcome::Refused(ip),
                Err(None) => return,
            };
            // Nobody listens any more if the deadline passed meanwhile.
            let _ = report.send(outcome);
        });
    if let Err(e) = spawned {
        tracing::warn!(%from, "no thread for a ring handshake ({e}): closed the connection");
    }
}

/// Runs the rest of one challenged connection's handshake: the left neighbour, proved; or the
/// connection told only that it is not a member, closed, the reason logged, and its address if
/// it failed to prove itself (`None`: it did, and failed afterwards). Its `hello` (the body, its
/// proof in it) has been read already; once proved, it has until the ring's `deadline` to finish.
pub(super) fn admit(
    gate: &Gate,
    mut stream: TcpStream,
    from: SocketAddr,
    ours: [u8; NONCE_LEN],
    hello: &[u8; HELLO_LEN],
    deadline: Instant,
) -> Result<Inbound, Option<std::net::IpAddr>> {
    match handshake_left(gate, &mut stream, ours, hello, deadline) {
        Ok(Admitted { slots, open, seal }) => {
            if let Err(e) = tune(&stream, gate.timeout) {
                tracing::warn!(%from, "tuning the left neighbour's socket: {e}");
                return Err(None);
            }
            Ok(Inbound {
                stream,
                peer: gate.terms.from,
                timeout: gate.timeout,
                slots,
                open,
                seal,
            })
        }
        Err(refused) => {
            let tell = match refused {
                Refused::Unproven(why) => {
                    tracing::warn!(%from, "refused a ring connection: {why}");
                    true
                }
                Refused::Failed(why) => {
                    tracing::warn!(%from, "the left neighbour's handshake failed: {why}");
                    false
                }
            };
            if tell {
                let mut payload = u32::MAX.to_le_bytes().to_vec();
                payload.extend_from_slice(REFUSAL.as_bytes());
                let soon = Instant::now() + Duration::from_secs(1);
                let _ = write_frame_by(&mut stream, Kind::Abort, &payload, soon);
            }
            let _ = stream.shutdown(Shutdown::Both);
            Err(tell.then_some(from.ip()))
        }
    }
}

/// What the accepting side's handshake settled.
pub(super) struct Admitted {
    /// The slots mapped, if the neighbour took them.
    slots: Option<ReceiverSlots>,
    open: Opener,
    seal: Sealer,
}

/// The accepting side of the handshake after its challenge (nonce `ours`) and the `hello` that
/// answered it (read by the accept loop): welcome — then, proved both ways and sealed, the
/// shared-memory offer.
pub(super) fn handshake_left(
    gate: &Gate,
    stream: &mut TcpStream,
    ours: [u8; NONCE_LEN],
    hello: &[u8; HELLO_LEN],
    deadline: Instant,
) -> Result<Admitted, Refused> {
    let terms = &gate.terms;
    let failed = |e: io::Error| Refused::Failed(e.to_string());

    stream
        .set_nonblocking(false)
        .and_then(|()| tune(stream, HANDSHAKE_TIMEOUT))
        .map_err(failed)?;
    let hello = Hello::decode(hello)
        .ok_or_else(|| Refused::Unproven(format!("a hello is {HELLO_LEN} bytes")))?;
    if hello.version != PROTOCOL_VERSION {
        return Err(Refused::Unproven(format!(
            "it speaks ring protocol {}, this worker {PROTOCOL_VERSION}: run the same Hora \
             version on every worker",
            hello.version
        )));
    }
    if hello.sealed != terms.sealed {
        return Err(Refused::Unproven(format!(
            "it says it is rank {} and {} its frames, and this worker {}: give every worker the \
             same setting (sealing is on unless a worker is started with {UNSEALED_KNOB})",
            hello.rank,
            if hello.sealed {
                "seals"
            } else {
                "does not seal"
            },
            if terms.sealed { "does" } else { "does not" },
        )));
    }
    let nonces = Nonces {
        acceptor: ours,
        connector: hello.nonce,
    };
    if !gate
        .key
        .verify(Role::Connector, terms, &nonces, &hello.proof)
    {
        return Err(Refused::Unproven(format!(
            "it did not prove that it knows this world's session; it says it is rank {} of {} \
             in generation {}, and this worker waits for rank {} of {} in generation {} (a \
             worker of another job or generation, one given another --peers list or session \
             secret, or a stranger)",
            hello.rank, hello.size, hello.generation, terms.from, terms.size, terms.generation
        )));
    }
    let proof = gate.key.prove(Role::Acceptor, terms, &nonces);
    write_frame_by(stream, Kind::Welcome, &proof, deadline).map_err(failed)?;

    // Proved both ways: from here on every frame is sealed, and the host id and the offer are
    // for a member only, which is given until the ring's deadline (not cut off mid-way by the
    // strangers' short one).
    let (mut open, mut seal) = if terms.sealed {
        let keys = gate.key.frame_keys(terms, &nonces);
        (
            Opener::new(keys.to_acceptor),
            Sealer::new(keys.to_connector),
        )
    } else {
        (Opener::plain(), Sealer::plain())
    };
    let (kind, host) =
        read_sealed_by(stream, &mut open, MAX_HOST_FRAME, deadline).map_err(failed)?;
    if kind != Kind::Host {
        return Err(Refused::Failed(format!(
            "it sent a {kind:?} frame where its host id was due"
        )));
    }
    let created = gate
        .offer
        .as_ref()
        .filter(|(own, _)| !host.is_empty() && host == own.as_bytes())
        .and_then(|&(_, slot_bytes)| {
            create_slots(terms.to, slot_bytes)
                .map_err(|e| tracing::debug!("no shared memory for the ring ({e}); using TCP"))
                .ok()
                .map(|(path, slots)| (path, slots, slot_bytes))
        });
    let Some((path, slots, slot_bytes)) = created else {
        write_sealed_by(stream, &mut seal, Kind::Offer, b"", deadline).map_err(failed)?;
        return Ok(Admitted {
            slots: None,
            open,
            seal,
        });
    };
    let offer = format!("shm {} {slot_bytes}", path.display());
    let answer = write_sealed_by(stream, &mut seal, Kind::Offer, offer.as_bytes(), deadline)
        .and_then(|()| read_sealed_by(stream, &mut open, 16, deadline));
    // Both sides have it mapped (or never will): the name can go.
    let _ = std::fs::remove_file(&path);
    let slots = match answer.map_err(failed)? {
        (Kind::Attached, yes) if yes == b"yes" => Some(slots),
        (Kind::Attached, _) => None,
        (kind, _) => {
            return Err(Refused::Failed(format!(
                "it sent a {kind:?} frame where its answer to the shared-memory offer was due"
            )))
        }
    };
    Ok(Admitted { slots, open, seal })
}
