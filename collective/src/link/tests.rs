use std::io::{Read, Write};
use std::net::Shutdown;
use std::sync::atomic::Ordering;

use super::accept::ACCEPT_ROUNDS;
use super::frame::{
    encode_header, read_frame_by, write_frame_by, Hello, CHALLENGE_LEN, HEADER_LEN, HELLO_LEN,
    MAGIC,
};
use super::shm::{attach_slots, attach_slots_of, create_slots, SLOTS};
use super::*;
use crate::handshake::{Nonces, Role, NONCE_LEN, PROOF_LEN};
use crate::sealed::{Opener, Sealer};

const SECRET: &str = "the operator's shared secret";

/// Rank `rank` of a world of two on loopback, with `listener`'s address as rank 0's.
fn world(listener: &TcpListener, rank: u32, secret: &str) -> World {
    let peers = vec![
        listener.local_addr().unwrap().to_string(),
        "127.0.0.1:9".to_string(),
    ];
    World::from_peers(peers, rank, Some(secret)).unwrap()
}

/// What rank 0 of `world` checks its left neighbour (rank 1) against.
fn gate(world: &World) -> Gate {
    Gate {
        key: RingKey::derive(&world.session),
        terms: terms(world, 1, 0),
        timeout: Duration::from_secs(5),
        offer: None,
    }
}

fn terms(world: &World, from: u32, to: u32) -> LinkTerms {
    LinkTerms {
        version: PROTOCOL_VERSION,
        generation: world.generation,
        size: world.size,
        from,
        to,
        sealed: true,
    }
}

/// Rank 1 of `world` connecting to rank 0, by `deadline`.
fn connect_as_rank_1(world: &World, deadline: Instant) -> Result<Outbound> {
    let key = RingKey::derive(&world.session);
    Connector {
        address: &world.peers[0],
        rank: 0,
        terms: terms(world, 1, 0),
        key: &key,
        host: None,
        timeout: Duration::from_secs(5),
        deadline,
    }
    .connect()
}

/// Everything the other end sends until it closes (or 10 s pass).
fn read_all(stream: &mut TcpStream) -> Vec<u8> {
    let _ = stream.set_read_timeout(Some(Duration::from_millis(200)));
    let (mut got, mut buf, end) = (
        Vec::new(),
        [0u8; 4096],
        Instant::now() + Duration::from_secs(10),
    );
    while Instant::now() < end {
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) => {}
            Err(_) => break,
        }
    }
    got
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

#[test]
fn a_peer_of_another_session_is_refused_and_learns_nothing_of_ours() {
    let listener = Links::listen("127.0.0.1:0").unwrap();
    let ours = world(&listener, 0, SECRET);
    let theirs = world(&listener, 1, "another job's secret, just as long");
    let deadline = Instant::now() + Duration::from_secs(20);
    thread::scope(|s| {
        let accepting = s.spawn(|| accept_left(gate(&ours), &listener, deadline, "here"));
        // A stranger that guessed a session: a well-formed hello with a proof under its key.
        let mut stranger = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (kind, challenge) = read_frame_by(&mut stranger, 64, deadline).unwrap();
        assert_eq!((kind, challenge.len()), (Kind::Challenge, CHALLENGE_LEN));
        let nonces = Nonces {
            acceptor: challenge[4..4 + NONCE_LEN].try_into().unwrap(),
            connector: [7; NONCE_LEN],
        };
        let hello = Hello {
            version: PROTOCOL_VERSION,
            generation: 0,
            size: 2,
            rank: 1,
            sealed: true,
            nonce: nonces.connector,
            proof: RingKey::derive(&theirs.session).prove(
                Role::Connector,
                &terms(&theirs, 1, 0),
                &nonces,
            ),
        };
        write_frame_by(&mut stranger, Kind::Hello, &hello.encode(), deadline).unwrap();
        let mut told = challenge.clone();
        told.extend(read_all(&mut stranger));
        assert!(contains(&told, REFUSAL.as_bytes()), "{told:?}");
        let raw_session = hex::decode(&ours.session).unwrap();
        let our_proof =
            RingKey::derive(&ours.session).prove(Role::Acceptor, &terms(&ours, 1, 0), &nonces);
        let secrets: [&[u8]; 4] = [
            ours.session.as_bytes(),
            &raw_session,
            SECRET.as_bytes(),
            &our_proof,
        ];
        for secret in secrets {
            assert!(!contains(&told, secret), "the stranger was told {told:?}");
        }
        // An honest worker of another world: refused, and told why it might be.
        let e = connect_as_rank_1(&theirs, deadline)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("refused this worker: not a member of this ring")
                && !e.contains(&ours.session),
            "{e}"
        );
        // The real neighbour still gets in.
        let out = connect_as_rank_1(&world(&listener, 1, SECRET), deadline).unwrap();
        let inbound = accepting.join().unwrap().unwrap();
        assert_eq!((inbound.peer, out.peer), (1, 0));
    });
}

#[test]
fn silent_strangers_do_not_hold_up_the_real_neighbour() {
    let listener = Links::listen("127.0.0.1:0").unwrap();
    let ours = world(&listener, 0, SECRET);
    let start = Instant::now();
    let deadline = start + Duration::from_secs(20);
    let at = listener.local_addr().unwrap();
    // Silent, one that stops mid-header, one that sends garbage.
    let mut strangers: Vec<TcpStream> = (0..6).map(|_| TcpStream::connect(at).unwrap()).collect();
    strangers[4].write_all(&[MAGIC, 1, 0]).unwrap();
    strangers[5].write_all(&[0xff; 64]).unwrap();
    thread::scope(|s| {
        let accepting = s.spawn(|| accept_left(gate(&ours), &listener, deadline, "here"));
        thread::sleep(Duration::from_millis(200));
        let out = connect_as_rank_1(&world(&listener, 1, SECRET), deadline).unwrap();
        let inbound = accepting.join().unwrap().unwrap();
        assert_eq!((inbound.peer, out.peer), (1, 0));
    });
    assert!(
        start.elapsed() < HANDSHAKE_TIMEOUT,
        "the real neighbour waited {:?} behind silent strangers",
        start.elapsed()
    );
    // The strangers are let go too, told nothing but the challenge and the refusal.
    for mut s in strangers {
        let told = read_all(&mut s);
        assert!(!contains(&told, ours.session.as_bytes()));
    }
}

#[test]
fn the_deadline_holds_however_many_strangers_connect() {
    let listener = Links::listen("127.0.0.1:0").unwrap();
    let ours = world(&listener, 0, SECRET);
    let at = listener.local_addr().unwrap();
    // More strangers than handshakes run at once, all silent.
    let strangers: Vec<TcpStream> = (0..MAX_HANDSHAKES * 2)
        .map(|_| TcpStream::connect(at).unwrap())
        .collect();
    let start = Instant::now();
    let e = accept_left(
        gate(&ours),
        &listener,
        start + Duration::from_secs(2),
        "here",
    )
    .err()
    .unwrap()
    .to_string();
    assert!(
        start.elapsed() < Duration::from_millis(2500),
        "returned after {:?}",
        start.elapsed()
    );
    assert!(
        e.starts_with("rank 1 did not connect within") && e.contains("connections came"),
        "{e}"
    );
    drop(strangers);

    // With the handshakes full of strangers, the real neighbour gets in once they time out.
    let strangers: Vec<TcpStream> = (0..MAX_HANDSHAKES * 2)
        .map(|_| TcpStream::connect(at).unwrap())
        .collect();
    let start = Instant::now();
    let deadline = start + Duration::from_secs(20);
    thread::scope(|s| {
        let accepting = s.spawn(|| accept_left(gate(&ours), &listener, deadline, "here"));
        let out = connect_as_rank_1(&world(&listener, 1, SECRET), deadline).unwrap();
        accepting.join().unwrap().unwrap();
        assert_eq!(out.peer, 0);
    });
    assert!(
        start.elapsed() < HANDSHAKE_TIMEOUT + Duration::from_secs(3),
        "{:?}",
        start.elapsed()
    );
    drop(strangers);
}

#[test]
fn strangers_that_stop_after_the_first_byte_do_not_make_the_accept_loop_spin() {
    let listener = Links::listen("127.0.0.1:0").unwrap();
    let ours = world(&listener, 0, SECRET);
    let at = listener.local_addr().unwrap();
    let start = Instant::now();
    let deadline = start + Duration::from_secs(20);
    // Each sends the first byte of a hello's header, and then nothing.
    let strangers: Vec<TcpStream> = (0..4)
        .map(|_| {
            let mut c = TcpStream::connect(at).unwrap();
            c.write_all(&[MAGIC]).unwrap();
            c
        })
        .collect();
    let wait = Duration::from_secs(1);
    thread::scope(|s| {
        let accepting = s.spawn(|| {
            let inbound = accept_left(gate(&ours), &listener, deadline, "here");
            (inbound, ACCEPT_ROUNDS.with(|n| n.get()))
        });
        thread::sleep(wait);
        let out = connect_as_rank_1(&world(&listener, 1, SECRET), deadline).unwrap();
        let (inbound, rounds) = accepting.join().unwrap();
        assert_eq!((inbound.unwrap().peer, out.peer), (1, 0));
        // It wakes every 10 ms to look for a handshake's outcome, and for each knock and
        // byte: about 100 rounds a second; allowed ten times that. Spinning on an unread
        // byte goes round hundreds of thousands of times a second.
        let bound = start.elapsed().as_millis() as u64 + 200;
        assert!(
            rounds < bound,
            "the accept loop went round {rounds} times in {:?}",
            start.elapsed()
        );
    });
    drop(strangers);
}

/// A stranger at `at` until `stop`: it connects, does what `kind` says (0: nothing, 1:
/// garbage, 2: a hello-shaped answer with a wrong proof), waits until it is closed, and
/// connects again at once.
fn stranger(at: SocketAddr, kind: usize, stop: &std::sync::atomic::AtomicBool) {
    while !stop.load(Ordering::Relaxed) {
        let Ok(mut c) = TcpStream::connect(at) else {
            thread::sleep(Duration::from_millis(1));
            continue;
        };
        let _ = c.set_read_timeout(Some(Duration::from_millis(100)));
        match kind {
            1 => drop(c.write_all(&[0x5a; 64])),
            2 => {
                let mut frame = encode_header(Kind::Hello, 0, HELLO_LEN as u64).to_vec();
                frame.extend_from_slice(&[3; HELLO_LEN]);
                frame[HEADER_LEN..HEADER_LEN + 4].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
                frame[HEADER_LEN + 20] = 1; // sealed
                let _ = c.write_all(&frame);
            }
            _ => {}
        }
        let mut buf = [0u8; 256];
        while !stop.load(Ordering::Relaxed) {
            match c.read(&mut buf) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) => {}
                Err(_) => break,
            }
        }
    }
}

#[test]
fn strangers_that_reconnect_in_a_loop_do_not_keep_the_neighbour_out() {
    let listener = Links::listen("127.0.0.1:0").unwrap();
    let ours = world(&listener, 0, SECRET);
    let at = listener.local_addr().unwrap();
    let stop = std::sync::atomic::AtomicBool::new(false);
    let start = Instant::now();
    let deadline = start + Duration::from_secs(10);
    thread::scope(|s| {
        // More silent strangers than handshakes may run at once, and others that send
        // garbage or a wrong proof; each reconnects the moment it is closed.
        for i in 0..MAX_HANDSHAKES + 24 {
            let kind = if i < MAX_HANDSHAKES + 8 { 0 } else { 1 + i % 2 };
            let stop = &stop;
            s.spawn(move || stranger(at, kind, stop));
        }
        let accepting = s.spawn(|| accept_left(gate(&ours), &listener, deadline, "here"));
        // Let them take whatever they can first.
        thread::sleep(Duration::from_millis(500));
        let out = connect_as_rank_1(&world(&listener, 1, SECRET), deadline);
        let inbound = accepting.join().unwrap();
        stop.store(true, Ordering::Relaxed);
        let (out, inbound) = (out.unwrap(), inbound.unwrap());
        assert_eq!((inbound.peer, out.peer), (1, 0));
    });
    assert!(
        start.elapsed() < Duration::from_millis(500) + HANDSHAKE_TIMEOUT,
        "the real neighbour got in after {:?}",
        start.elapsed()
    );
}

/// Links a world of two on loopback, each rank with `options(rank)`: each rank's outcome.
fn connect_two(options: impl Fn(u32) -> LinkOptions + Sync) -> Vec<Result<Links>> {
    let listeners: Vec<TcpListener> = (0..2)
        .map(|_| Links::listen("127.0.0.1:0").unwrap())
        .collect();
    let peers: Vec<String> = listeners
        .iter()
        .map(|l| l.local_addr().unwrap().to_string())
        .collect();
    let options = &options;
    thread::scope(|s| {
        let handles: Vec<_> = listeners
            .into_iter()
            .enumerate()
            .map(|(rank, listener)| {
                let world = World::from_peers(peers.clone(), rank as u32, Some(SECRET)).unwrap();
                s.spawn(move || Links::connect(&world, listener, &options(rank as u32)))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn workers_that_disagree_on_sealing_refuse_each_other_and_say_why() {
    let errors: Vec<String> = connect_two(|rank| LinkOptions {
        timeout: Duration::from_secs(5),
        slot_bytes: None,
        seal_frames: rank == 0,
    })
    .into_iter()
    .map(|l| l.err().unwrap().to_string())
    .collect();
    assert!(
        errors[0].contains("does not seal its ring frames and this worker does"),
        "{}",
        errors[0]
    );
    assert!(
        errors[1].contains("seals its ring frames and this worker does not"),
        "{}",
        errors[1]
    );
}

/// A world of two whose rank 1 reaches rank 0 through a proxy that records what rank 1
/// sends and, at byte `flip`, flips a bit of it. Every rank allreduces a buffer of its own
/// (rank r: all r + 1234.5); returns each rank's outcome and what the proxy saw.
fn through_a_proxy(seal_frames: bool, flip: Option<usize>) -> (Vec<Result<()>>, Vec<u8>) {
    let listeners: Vec<TcpListener> = (0..2)
        .map(|_| Links::listen("127.0.0.1:0").unwrap())
        .collect();
    let proxy = TcpListener::bind("127.0.0.1:0").unwrap();
    let peers = vec![
        proxy.local_addr().unwrap().to_string(),
        listeners[1].local_addr().unwrap().to_string(),
    ];
    let rank_0 = listeners[0].local_addr().unwrap();
    let seen = std::sync::Mutex::new(Vec::new());
    let outcomes = thread::scope(|s| {
        let seen = &seen;
        s.spawn(move || {
            let (from_1, _) = proxy.accept().unwrap();
            let to_0 = TcpStream::connect(rank_0).unwrap();
            let (mut back_from, mut back_to) =
                (to_0.try_clone().unwrap(), from_1.try_clone().unwrap());
            thread::spawn(move || io::copy(&mut back_from, &mut back_to));
            let (mut from_1, mut to_0) = (from_1, to_0);
            let mut buf = [0u8; 4096];
            let mut at = 0;
            while let Ok(n @ 1..) = from_1.read(&mut buf) {
                if let Some(i) = flip.filter(|&i| (at..at + n).contains(&i)) {
                    buf[i - at] ^= 0x10;
                }
                seen.lock().unwrap().extend_from_slice(&buf[..n]);
                at += n;
                if to_0.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            let _ = to_0.shutdown(Shutdown::Both);
        });
        let handles: Vec<_> = listeners
            .into_iter()
            .enumerate()
            .map(|(rank, listener)| {
                let world = World::from_peers(peers.clone(), rank as u32, Some(SECRET)).unwrap();
                s.spawn(move || {
                    let options = crate::ring::CommOptions {
                        timeout: Duration::from_secs(5),
                        shared_memory: false,
                        seal_frames,
                        ..Default::default()
                    };
                    let links = Links::connect(&world, listener, &options.links())?;
                    let mut comm = crate::ring::Communicator::new(world, Some(links), options)?;
                    let mut buf = vec![rank as f32 + 1234.5; 100_000];
                    comm.allreduce(&mut buf[..], crate::ring::Reduce::Sum, 0)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    (outcomes, seen.into_inner().unwrap())
}

#[test]
fn sealed_frames_cannot_be_read_or_altered_on_the_way() {
    // Rank 1's values as they would cross the wire in the clear.
    let clear: Vec<u8> = [1235.5f32; 8]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    // Unsealed (the test's own check): the values cross in the clear.
    let (outcomes, seen) = through_a_proxy(false, None);
    assert!(outcomes.iter().all(|o| o.is_ok()), "{outcomes:?}");
    assert!(contains(&seen, &clear));
    // Sealed: nothing readable, and the reduction is right.
    let (outcomes, seen) = through_a_proxy(true, None);
    assert!(outcomes.iter().all(|o| o.is_ok()), "{outcomes:?}");
    assert!(seen.len() > 200_000 && !contains(&seen, &clear));
    // One bit flipped in a data frame: rank 0 stops and names rank 1, the sender.
    let (outcomes, _) = through_a_proxy(true, Some(50_000));
    let e = outcomes[0].as_ref().err().unwrap().to_string();
    assert!(
        e.starts_with("rank 1 sent a frame that failed authentication"),
        "{e}"
    );
    assert!(outcomes[1].is_err());
}

#[test]
fn an_impostor_at_the_neighbours_address_is_not_trusted() {
    let impostor = TcpListener::bind("127.0.0.1:0").unwrap();
    let ours = world(&impostor, 1, SECRET);
    let deadline = Instant::now() + Duration::from_secs(20);
    thread::scope(|s| {
        let connecting = s.spawn(|| connect_as_rank_1(&ours, deadline));
        let (mut stream, _) = impostor.accept().unwrap();
        let mut challenge = PROTOCOL_VERSION.to_le_bytes().to_vec();
        challenge.extend_from_slice(&[1; NONCE_LEN]);
        challenge.push(1);
        write_frame_by(&mut stream, Kind::Challenge, &challenge, deadline).unwrap();
        let (kind, hello) = read_frame_by(&mut stream, HELLO_LEN, deadline).unwrap();
        assert_eq!(kind, Kind::Hello);
        assert!(!contains(&hello, ours.session.as_bytes()));
        write_frame_by(&mut stream, Kind::Welcome, &[0; PROOF_LEN], deadline).unwrap();
        let e = connecting.join().unwrap().err().unwrap().to_string();
        assert!(
            e.contains("could not prove that it belongs to this ring"),
            "{e}"
        );
        // No host id, nothing else: the connection just closed.
        assert!(read_all(&mut stream).is_empty());
    });
}

/// A ring file of `bytes` bytes with `mode`, and its path.
struct RingFile(String);

impl RingFile {
    fn new(tag: &str, bytes: usize, mode: u32) -> RingFile {
        use std::os::unix::fs::PermissionsExt;
        let path = format!("/dev/shm/hora-ring-test-{}-{tag}", std::process::id());
        let file = std::fs::File::create(&path).unwrap();
        file.set_len(bytes as u64).unwrap();
        file.set_permissions(std::fs::Permissions::from_mode(mode))
            .unwrap();
        RingFile(path)
    }
}

impl Drop for RingFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[test]
fn ring_files_of_another_user_or_mode_or_behind_a_link_are_not_attached() {
    let bytes = 64;
    let own = RingFile::new("own", bytes * SLOTS as usize, 0o600);
    assert!(attach_slots(&own.0, bytes).is_ok());
    // SAFETY: no preconditions.
    let user = unsafe { libc::geteuid() };
    let e = attach_slots_of(&own.0, bytes, user.wrapping_add(1))
        .err()
        .unwrap();
    assert!(e.to_string().contains("belongs to user"), "{e}");
    for mode in [0o644, 0o660, 0o400, 0o4600] {
        let other = RingFile::new(&format!("mode{mode:o}"), bytes * SLOTS as usize, mode);
        let e = attach_slots(&other.0, bytes).err().unwrap();
        assert!(e.to_string().contains("has mode"), "{mode:o}: {e}");
    }
    let link = RingFile(format!(
        "/dev/shm/hora-ring-test-{}-link",
        std::process::id()
    ));
    std::os::unix::fs::symlink(&own.0, &link.0).unwrap();
    let e = attach_slots(&link.0, bytes).err().unwrap();
    assert_eq!(e.raw_os_error(), Some(libc::ELOOP), "{e}");
    // And what this side creates is what the other side accepts.
    let (path, _slots) = create_slots(0, bytes).unwrap();
    let made = RingFile(path.display().to_string());
    assert!(attach_slots(&made.0, bytes).is_ok());
}

#[test]
fn proved_neighbours_on_one_host_share_memory() {
    if host_id().is_none() {
        return; // No /dev/shm here, or HORA_RING_SHM=0: nothing to offer.
    }
    let links: Vec<Links> = connect_two(|_| LinkOptions {
        timeout: Duration::from_secs(10),
        slot_bytes: Some(4096),
        seal_frames: true,
    })
    .into_iter()
    .map(|l| l.unwrap())
    .collect();
    for (rank, l) in links.iter().enumerate() {
        assert!(
            l.inbound.slots.is_some() && l.outbound.slots.is_some(),
            "rank {rank}"
        );
    }
}

#[test]
fn hellos_round_trip_and_only_at_their_length() {
    let hello = Hello {
        version: PROTOCOL_VERSION,
        generation: 3,
        size: 4,
        rank: 2,
        sealed: false,
        nonce: [5; NONCE_LEN],
        proof: [6; PROOF_LEN],
    };
    let bytes = hello.encode();
    assert_eq!(bytes.len(), HELLO_LEN);
    assert_eq!(Hello::decode(&bytes), Some(hello));
    assert_eq!(Hello::decode(&bytes[1..]), None);
}

#[test]
fn only_hora_ring_files_of_sane_size_are_attached() {
    for (path, bytes) in [
        ("/etc/passwd", 64),
        ("/dev/shm/hora-ring-../../etc/passwd", 64),
        ("/dev/shm/other", 64),
        ("/dev/shm/hora-ring-x", usize::MAX),
        ("/dev/shm/hora-ring-x", 0),
    ] {
        assert!(attach_slots(path, bytes).is_err(), "{path} {bytes}");
    }
}

/// One connection's frame keys (to the acceptor, to the connector), as both ends derive them.
fn frame_keys() -> (crate::sealed::DirectionKey, crate::sealed::DirectionKey) {
    let nonces = Nonces {
        acceptor: [1; NONCE_LEN],
        connector: [2; NONCE_LEN],
    };
    let keys = RingKey::derive("a session").frame_keys(
        &LinkTerms {
            version: PROTOCOL_VERSION,
            generation: 0,
            size: 2,
            from: 1,
            to: 0,
            sealed: true,
        },
        &nonces,
    );
    (keys.to_acceptor, keys.to_connector)
}

#[test]
fn abort_frames_name_the_failed_rank_once() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let timeout = Duration::from_secs(5);
    let (to_acceptor, to_connector) = frame_keys();
    let sender = thread::spawn(move || {
        let stream = TcpStream::connect(addr).unwrap();
        let mut out = Outbound {
            stream,
            peer: 1,
            timeout,
            slots: None,
            seal: Sealer::new(to_acceptor),
            open: Opener::new(to_connector),
        };
        out.abort(Some(7), "closed its connection");
    });
    let (stream, _) = listener.accept().unwrap();
    let (to_acceptor, to_connector) = frame_keys();
    let mut inbound = Inbound {
        stream,
        peer: 3,
        timeout,
        slots: None,
        open: Opener::new(to_acceptor),
        seal: Sealer::new(to_connector),
    };
    let e = inbound.header().unwrap_err().to_string();
    assert_eq!(
        e,
        "rank 7 closed its connection (reported around the ring by rank 3)"
    );
    sender.join().unwrap();
}
