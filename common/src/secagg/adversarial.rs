//! Attacks on one round attempt, each of which must be refused with the error that names it: a
//! server (or a neighbour through it) feeding a client forged keys, misrouted or misaddressed
//! shares and greedy unmask requests; clients feeding the server's unmasking wrong, repeated or
//! inconsistent shares.

use ring::rand::SystemRandom;
use x25519_dalek::PublicKey;

use super::keys::{advert_message, new_secret, put_str, seal_to};
use super::shamir::{self, Share, SHARE_LEN};
use super::unmask::Participant;
use super::{graph, hex_array, ClientSession, Context, Identity, SecAggError, Unmasker};
use crate::wire::{
    SecAggAdvertise, SecAggNeighbour, SecAggRoster, SecAggSealedShares, SecAggShareBundles,
    SecAggShareKind, SecAggUnmask, SecAggUnmaskRequest,
};

const M: usize = 64;

fn ctx() -> Context {
    Context::new("task", 7, 0)
}

fn add(sum: &mut [u32], v: &[u32]) {
    sum.iter_mut()
        .zip(v)
        .for_each(|(s, x)| *s = s.wrapping_add(*x));
}

/// One attempt driven by hand, with every message in reach of the test.
struct Round {
    ids: Vec<String>,
    identities: Vec<Identity>,
    sessions: Vec<ClientSession>,
    adverts: Vec<SecAggAdvertise>,
    graph: Vec<Vec<usize>>,
    t: usize,
    /// Each client's bundles as it sent them (addressed to the peer), once keys are shared.
    outgoing: Vec<SecAggShareBundles>,
}

impl Round {
    /// `n` clients (`c0`, `c1`, …) with `k` neighbours each and `t`-of-`k` sharing, advertised.
    fn new(n: usize, k: usize, t: usize) -> Round {
        let ids: Vec<String> = (0..n).map(|i| format!("c{i}")).collect();
        let identities: Vec<Identity> = (0..n).map(|_| Identity::generate().unwrap().0).collect();
        let sessions: Vec<ClientSession> = ids
            .iter()
            .map(|id| ClientSession::new(ctx(), id).unwrap())
            .collect();
        let adverts = sessions
            .iter()
            .zip(&identities)
            .map(|(s, i)| s.advertise(i))
            .collect();
        Round {
            ids,
            identities,
            sessions,
            adverts,
            graph: graph::neighbours(n, k, &[7; 32]),
            t,
            outgoing: Vec::new(),
        }
    }

    fn roster(&self, i: usize) -> SecAggRoster {
        SecAggRoster {
            index: i as u32 + 1,
            threshold: self.t as u32,
            input_deadline_unix_ms: 0,
            neighbours: self.graph[i]
                .iter()
                .map(|&j| SecAggNeighbour {
                    client: self.ids[j].clone(),
                    index: j as u32 + 1,
                    identity_key: hex::encode(self.identities[j].public_key()),
                    keys: self.adverts[j].clone(),
                })
                .collect(),
        }
    }

    /// A new session for client `i`, not yet past advertising.
    fn fresh(&self, i: usize) -> ClientSession {
        ClientSession::new(ctx(), &self.ids[i]).unwrap()
    }

    /// Every client shares keys.
    fn share_keys(&mut self) {
        self.outgoing = (0..self.ids.len())
            .map(|i| {
                let roster = self.roster(i);
                self.sessions[i].share_keys(&roster).unwrap()
            })
            .collect();
    }

    /// The bundle `from` sealed for `to`, labelled with its sender as the server delivers it.
    fn bundle(&self, from: usize, to: usize) -> SecAggSealedShares {
        let sealed = self.outgoing[from]
            .shares
            .iter()
            .find(|s| s.peer == self.ids[to])
            .expect("neighbours");
        SecAggSealedShares {
            peer: self.ids[from].clone(),
            ciphertext: sealed.ciphertext.clone(),
        }
    }

    /// What an honest server delivers to `to`: each neighbour's bundle for it.
    fn inbox(&self, to: usize) -> SecAggShareBundles {
        SecAggShareBundles {
            shares: self.graph[to]
                .iter()
                .map(|&from| self.bundle(from, to))
                .collect(),
        }
    }

    /// `to`'s honest inbox with `from`'s bundle replaced by `with`.
    fn inbox_with(&self, to: usize, from: usize, with: SecAggSealedShares) -> SecAggShareBundles {
        let mut inbox = self.inbox(to);
        let slot = inbox
            .shares
            .iter()
            .position(|s| s.peer == self.ids[from])
            .unwrap();
        inbox.shares[slot] = with;
        inbox
    }

    fn input(i: usize) -> Vec<u32> {
        (0..M).map(|j| (i * 1000 + j) as u32).collect()
    }

    /// Keys shared by all; everyone but `dropped` uploads its masked input. Returns the round,
    /// the sum of the uploads and the sum of the survivors' inputs.
    fn masked(n: usize, k: usize, t: usize, dropped: &[usize]) -> (Round, Vec<u32>, Vec<u32>) {
        let mut r = Round::new(n, k, t);
        r.share_keys();
        let (mut sum, mut expected) = (vec![0u32; M], vec![0u32; M]);
        for i in (0..n).filter(|i| !dropped.contains(i)) {
            let inbox = r.inbox(i);
            let y = r.sessions[i]
                .masked_input(&inbox, &Round::input(i))
                .unwrap();
            add(&mut sum, &y);
            add(&mut expected, &Round::input(i));
        }
        (r, sum, expected)
    }

    fn participants(&self) -> Vec<Participant> {
        (0..self.ids.len())
            .map(|i| Participant {
                id: self.ids[i].clone(),
                index: i as u32 + 1,
                mask_key: hex_array("mask_key", &self.adverts[i].mask_key).unwrap(),
                neighbours: self.graph[i].clone(),
            })
            .collect()
    }

    fn signed_advert(&self, i: usize, c: &[u8; 32], s: &[u8; 32]) -> SecAggAdvertise {
        SecAggAdvertise {
            mask_key: hex::encode(c),
            share_key: hex::encode(s),
            signature: hex::encode(self.identities[i].sign(&advert_message(
                &ctx(),
                &self.ids[i],
                c,
                s,
            ))),
        }
    }
}

fn request(survivors: &[&str], dropped: &[&str]) -> SecAggUnmaskRequest {
    SecAggUnmaskRequest {
        survivors: survivors.iter().map(|s| s.to_string()).collect(),
        dropped: dropped.iter().map(|s| s.to_string()).collect(),
    }
}

fn keys_of(advert: &SecAggAdvertise) -> ([u8; 32], [u8; 32]) {
    (
        hex_array("mask_key", &advert.mask_key).unwrap(),
        hex_array("share_key", &advert.share_key).unwrap(),
    )
}

/// A change the server makes to a neighbour's entry in a roster.
type Edit<'a> = dyn Fn(&mut SecAggNeighbour) + 'a;

#[test]
fn forged_advertisements_make_share_keys_fail() {
    let r = Round::new(5, 4, 3);
    let attempt = |edit: &Edit| {
        let mut roster = r.roster(0);
        assert_eq!(roster.neighbours[0].client, "c1");
        edit(&mut roster.neighbours[0]);
        r.fresh(0).share_keys(&roster).map(|_| ())
    };
    let (c1, s1) = keys_of(&r.adverts[1]);
    let another_attempt = {
        let s = ClientSession::new(Context::new("task", 7, 1), "c1").unwrap();
        s.advertise(&r.identities[1])
    };
    let cases: Vec<(&str, Box<Edit>)> = vec![
        (
            "c1's keys signed by c2's identity",
            Box::new(|n| {
                n.keys.signature =
                    hex::encode(r.identities[2].sign(&advert_message(&ctx(), "c1", &c1, &s1)))
            }),
        ),
        (
            "c1's mask key swapped for c2's after signing",
            Box::new(|n| n.keys.mask_key = r.adverts[2].mask_key.clone()),
        ),
        (
            "c1's share key swapped for c2's after signing",
            Box::new(|n| n.keys.share_key = r.adverts[2].share_key.clone()),
        ),
        (
            "c1's two keys exchanged",
            Box::new(|n| {
                std::mem::swap(&mut n.keys.mask_key, &mut n.keys.share_key);
            }),
        ),
        (
            "c2's advertisement presented as c1's",
            Box::new(|n| n.keys = r.adverts[2].clone()),
        ),
        (
            "c1 under another identity key",
            Box::new(|n| n.identity_key = hex::encode(r.identities[2].public_key())),
        ),
        (
            "c1's advertisement of another attempt",
            Box::new(|n| n.keys = another_attempt.clone()),
        ),
    ];
    for (what, edit) in &cases {
        match attempt(edit.as_ref()) {
            Err(SecAggError::Forged(_)) => {}
            other => panic!("{what}: {other:?}"),
        }
    }
    // The untouched roster goes through.
    attempt(&|_: &mut SecAggNeighbour| {}).unwrap();
}

#[test]
fn low_order_keys_are_refused_even_when_signed() {
    let r = Round::new(5, 4, 3);
    let mut order8 = [0u8; 32];
    hex::decode_to_slice(
        "e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b800",
        &mut order8,
    )
    .unwrap();
    let mut one = [0u8; 32];
    one[0] = 1;
    // 2^255 − 19: zero, not reduced.
    let mut p = [0xffu8; 32];
    p[0] = 0xed;
    p[31] = 0x7f;
    let (c1, s1) = keys_of(&r.adverts[1]);
    for low in [[0u8; 32], one, order8, p] {
        for (c, s) in [(low, s1), (c1, low)] {
            let mut roster = r.roster(0);
            // c1 itself signs the bad key: the signature is not what saves us here.
            roster.neighbours[0].keys = r.signed_advert(1, &c, &s);
            match r.fresh(0).share_keys(&roster) {
                Err(SecAggError::LowOrderKey) => {}
                other => panic!("{}: {other:?}", hex::encode(low)),
            }
        }
    }
}

#[test]
fn shares_routed_to_the_wrong_client_are_refused() {
    let mut r = Round::new(5, 4, 3);
    r.share_keys();
    let forged = |e: Result<Vec<u32>, SecAggError>, what: &str| match e {
        Err(SecAggError::Forged(_)) => {}
        other => panic!("{what}: {other:?}"),
    };
    let input = Round::input(0);
    // The server hands c2 the bundle c0 sealed for c1, as c0's bundle for c2.
    let inbox = r.inbox_with(2, 0, r.bundle(0, 1));
    forged(
        r.sessions[2].masked_input(&inbox, &input),
        "c0→c1 given to c2",
    );
    // c0's bundle for c3, relabelled as coming from c1.
    let mut relabelled = r.bundle(0, 3);
    relabelled.peer = "c1".into();
    let inbox = r.inbox_with(3, 1, relabelled);
    forged(
        r.sessions[3].masked_input(&inbox, &input),
        "sender relabelled",
    );
    // One neighbour's bundle twice.
    let mut inbox = r.inbox(4);
    inbox.shares.push(inbox.shares[0].clone());
    forged(r.sessions[4].masked_input(&inbox, &input), "a bundle twice");
    // A ciphertext altered in transit.
    let mut altered = r.bundle(2, 1);
    let flipped = if altered.ciphertext.starts_with('0') {
        "1"
    } else {
        "0"
    };
    altered.ciphertext.replace_range(0..1, flipped);
    let inbox = r.inbox_with(1, 2, altered);
    forged(
        r.sessions[1].masked_input(&inbox, &input),
        "altered ciphertext",
    );
    // The honest inbox goes through.
    let inbox = r.inbox(0);
    assert_eq!(r.sessions[0].masked_input(&inbox, &input).unwrap().len(), M);
}

#[test]
fn shares_addressed_inside_to_someone_else_are_refused() {
    // c0 is malicious and holds its own secrets: it seals to c2, under the key only the two of
    // them share, shares whose inner addressing says they are for c1 (say, a replay of c1's).
    let mut r = Round::new(5, 4, 3);
    let rng = SystemRandom::new();
    let (c, s) = (new_secret(&rng).unwrap(), new_secret(&rng).unwrap());
    let (pc, ps) = (
        PublicKey::from(&c).to_bytes(),
        PublicKey::from(&s).to_bytes(),
    );
    r.adverts[0] = r.signed_advert(0, &pc, &ps);
    for (from, to) in [("c0", "c1"), ("c3", "c2")] {
        let mut victim = r.fresh(2);
        let (_, victim_key) = keys_of(&victim.advertise(&r.identities[2]));
        victim.share_keys(&r.roster(2)).unwrap();
        let mut plain = Vec::new();
        put_str(&mut plain, from);
        put_str(&mut plain, to);
        plain.extend_from_slice(&[0u8; 2 * SHARE_LEN]);
        let sealed = seal_to(&s, &victim_key, &ctx(), "c0", "c2", &plain).unwrap();
        let inbox = SecAggShareBundles {
            shares: vec![SecAggSealedShares {
                peer: "c0".into(),
                ciphertext: hex::encode(sealed),
            }],
        };
        match victim.masked_input(&inbox, &Round::input(2)) {
            Err(SecAggError::Forged(m)) => assert!(m.contains("not addressed"), "{m}"),
            other => panic!("{from}→{to} inside: {other:?}"),
        }
    }
}

#[test]
fn shares_from_a_non_neighbour_are_refused() {
    let mut r = Round::new(8, 4, 3);
    r.share_keys();
    let stranger = (1..8).find(|j| !r.graph[0].contains(j)).unwrap();
    let their_neighbour = r.graph[stranger][0];
    let mut inbox = r.inbox(0);
    inbox.shares.insert(0, r.bundle(stranger, their_neighbour));
    match r.sessions[0].masked_input(&inbox, &Round::input(0)) {
        Err(SecAggError::Forged(m)) => assert!(m.contains("not a neighbour"), "{m}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn stages_only_move_forward() {
    let mut r = Round::new(5, 4, 3);
    let stage = |e: SecAggError| assert!(matches!(e, SecAggError::Stage(_)), "{e}");
    let nothing = SecAggShareBundles { shares: Vec::new() };
    stage(r.fresh(0).masked_input(&nothing, &[1]).unwrap_err());
    stage(r.fresh(1).unmask(&request(&[], &[])).unwrap_err());
    r.share_keys();
    let roster = r.roster(0);
    stage(r.sessions[0].share_keys(&roster).unwrap_err());
    let inbox = r.inbox(0);
    r.sessions[0]
        .masked_input(&inbox, &Round::input(0))
        .unwrap();
    stage(
        r.sessions[0]
            .masked_input(&inbox, &Round::input(0))
            .unwrap_err(),
    );
}

#[test]
fn greedy_unmask_requests_are_refused() {
    let (mut r, ..) = Round::masked(5, 4, 3, &[]);
    let all_but =
        |me: &str| -> Vec<String> { r.ids.iter().filter(|id| *id != me).cloned().collect() };
    // c1 named both a survivor and dropped: that would hand over both its secrets.
    match r.sessions[0].unmask(&request(&["c1", "c2", "c3", "c4"], &["c1"])) {
        Err(SecAggError::Forged(m)) => assert!(m.contains("both"), "{m}"),
        other => panic!("{other:?}"),
    }
    // …and a refused request is not followed by another chance.
    match r.sessions[0].unmask(&request(&["c1", "c2", "c3", "c4"], &[])) {
        Err(SecAggError::Stage(_)) => {}
        other => panic!("{other:?}"),
    }
    // Asking twice, the second time with c0 "dropped", is refused.
    let survivors = all_but("c1");
    let survivors: Vec<&str> = survivors.iter().map(String::as_str).collect();
    let answer = r.sessions[1].unmask(&request(&survivors, &[])).unwrap();
    assert_eq!(answer.shares.len(), 4);
    assert!(answer
        .shares
        .iter()
        .all(|s| s.kind == SecAggShareKind::SelfMask));
    match r.sessions[1].unmask(&request(&["c2", "c3", "c4"], &["c0"])) {
        Err(SecAggError::Stage(_)) => {}
        other => panic!("{other:?}"),
    }
    // A peer listed twice, a neighbour left out for a stranger, too few survivors.
    for (i, req, what) in [
        (
            2,
            request(&["c0", "c0", "c1", "c3", "c4"], &[]),
            "listed twice",
        ),
        (3, request(&["c0", "c1", "c2", "c9"], &[]), "stranger"),
        (4, request(&["c0"], &["c1", "c2", "c3"]), "below threshold"),
    ] {
        match (what, r.sessions[i].unmask(&req)) {
            ("below threshold", Err(SecAggError::Threshold(_))) => {}
            ("listed twice" | "stranger", Err(SecAggError::Forged(_))) => {}
            (_, other) => panic!("{what}: {other:?}"),
        }
    }
}

/// A round of 6 (complete graph, 3-of-5) where `dropped` vanished after sharing keys, with the
/// survivors' honest answers to the server's requests.
fn answered(dropped: &[usize]) -> (Round, Vec<Participant>, Vec<u32>, Vec<u32>) {
    let (r, sum, expected) = Round::masked(6, 5, 3, dropped);
    let participants = r.participants();
    (r, participants, sum, expected)
}

fn unmasker<'a>(participants: &'a [Participant], dropped: &[usize]) -> Unmasker<'a> {
    let n = participants.len();
    Unmasker::new(
        ctx(),
        participants,
        3,
        (0..n).collect(),
        (0..n).filter(|i| !dropped.contains(i)).collect(),
    )
}

fn answers_to(r: &mut Round, u: &Unmasker<'_>, dropped: &[usize]) -> Vec<Option<SecAggUnmask>> {
    (0..r.ids.len())
        .map(|i| (!dropped.contains(&i)).then(|| r.sessions[i].unmask(&u.request_for(i)).unwrap()))
        .collect()
}

#[test]
fn the_server_refuses_wrong_repeated_and_unasked_answers() {
    let dropped = [5];
    let (mut r, participants, sum, expected) = answered(&dropped);
    let mut u = unmasker(&participants, &dropped);
    let answers = answers_to(&mut r, &u, &dropped);
    let honest = answers[0].clone().unwrap();
    let at = |peer: &str| honest.shares.iter().position(|s| s.peer == peer).unwrap();
    let edited = |edit: &dyn Fn(&mut SecAggUnmask)| {
        let mut a = honest.clone();
        edit(&mut a);
        a
    };
    let cases: Vec<(&str, SecAggUnmask)> = vec![
        (
            "the self-mask share of dropped c5",
            edited(&|a| a.shares[at("c5")].kind = SecAggShareKind::SelfMask),
        ),
        (
            "the mask-key share of survivor c1",
            edited(&|a| a.shares[at("c1")].kind = SecAggShareKind::MaskKey),
        ),
        (
            "two shares for c1",
            edited(&|a| a.shares.push(a.shares[at("c1")].clone())),
        ),
        (
            "both shares of c1",
            edited(&|a| {
                let mut other = a.shares[at("c1")].clone();
                other.kind = SecAggShareKind::MaskKey;
                a.shares.push(other);
            }),
        ),
        (
            "a share of its own secret",
            edited(&|a| {
                let mut own = a.shares[0].clone();
                own.peer = "c0".into();
                a.shares.push(own);
            }),
        ),
        (
            "a share for a stranger",
            edited(&|a| a.shares[at("c2")].peer = "c9".into()),
        ),
    ];
    for (what, answer) in &cases {
        match u.accept(0, answer) {
            Err(SecAggError::Forged(_)) => {}
            other => panic!("{what}: {other:?}"),
        }
    }
    for (what, answer) in [
        (
            "a share missing",
            edited(&|a| {
                a.shares.pop();
            }),
        ),
        (
            "a share that is not hex",
            edited(&|a| a.shares[0].share = "zz".into()),
        ),
    ] {
        match u.accept(0, &answer) {
            Err(SecAggError::Malformed(_)) => {}
            other => panic!("{what}: {other:?}"),
        }
    }
    // From a client that uploaded nothing.
    match u.accept(5, &honest) {
        Err(SecAggError::Stage(_)) => {}
        other => panic!("{other:?}"),
    }
    // Refused answers left nothing behind: the honest one is taken, and only once.
    u.accept(0, &honest).unwrap();
    match u.accept(0, &honest) {
        Err(SecAggError::Stage(_)) => {}
        other => panic!("{other:?}"),
    }
    for (i, a) in answers.iter().enumerate().skip(1) {
        if let Some(a) = a {
            u.accept(i, a).unwrap();
        }
    }
    assert!(u.complete());
    let mut sum = sum;
    u.finish(&mut sum).unwrap();
    assert_eq!(sum, expected);
}

/// `answer`'s share for `peer`, with `f` applied to its value.
fn tamper(answer: &mut SecAggUnmask, x: u32, peer: &str, f: impl Fn(&mut Share)) {
    let s = answer.shares.iter_mut().find(|s| s.peer == peer).unwrap();
    let mut share = Share::from_bytes(x, &hex::decode(&s.share).unwrap()).unwrap();
    f(&mut share);
    s.share = hex::encode(share.to_bytes());
}

#[test]
fn a_tampered_share_is_caught_when_spare_shares_exist() {
    // No dropouts: each survivor's seed comes back in 5 shares, 3 needed.
    let (mut r, participants, sum, expected) = answered(&[]);
    let u = unmasker(&participants, &[]);
    let honest = answers_to(&mut r, &u, &[]);
    let finish = |answers: &[Option<SecAggUnmask>]| {
        let mut u = unmasker(&participants, &[]);
        for (i, a) in answers.iter().enumerate() {
            u.accept(i, a.as_ref().unwrap()).unwrap();
        }
        let mut sum = sum.clone();
        u.finish(&mut sum).map(|()| sum)
    };
    assert_eq!(finish(&honest).unwrap(), expected);
    // c1 lies about its share of c0's seed.
    let mut lying = honest.clone();
    tamper(lying[1].as_mut().unwrap(), 2, "c0", |s| {
        s.y[0] = (s.y[0] + 1) % shamir::P
    });
    match finish(&lying) {
        Err(SecAggError::Inconsistent(_)) => {}
        other => panic!("{other:?}"),
    }
}

#[test]
fn shares_that_do_not_give_the_advertised_mask_key_are_caught() {
    // c5 dropped after sharing keys; the survivors' shares of its mask key come back.
    let dropped = [5];
    let (mut r, participants, sum, expected) = answered(&dropped);
    let u = unmasker(&participants, &dropped);
    let honest = answers_to(&mut r, &u, &dropped);
    let finish = |answers: &[Option<SecAggUnmask>]| {
        let mut u = unmasker(&participants, &dropped);
        for (i, a) in answers.iter().enumerate() {
            if let Some(a) = a {
                u.accept(i, a).unwrap();
            }
        }
        let mut sum = sum.clone();
        u.finish(&mut sum).map(|()| sum)
    };
    assert_eq!(finish(&honest).unwrap(), expected);
    // Consistent shares of another key (c5 shared a key it did not advertise): they agree with
    // each other, so only the check against the advertised public key can catch them.
    let rng = SystemRandom::new();
    let points: Vec<u32> = (1..=5).collect();
    let other = shamir::split(&[0x42; 32], 3, &points, &rng).unwrap();
    let mut swapped = honest.clone();
    for (i, a) in swapped.iter_mut().enumerate().take(5) {
        tamper(a.as_mut().unwrap(), i as u32 + 1, "c5", |s| {
            s.y = other[i].y
        });
    }
    match finish(&swapped) {
        Err(SecAggError::Inconsistent(m)) => assert!(m.contains("mask key it advertised"), "{m}"),
        other => panic!("{other:?}"),
    }
    // One survivor lying about its share of c5's key is caught too.
    let mut lying = honest.clone();
    tamper(lying[3].as_mut().unwrap(), 4, "c5", |s| {
        s.y[2] = (s.y[2] + 1) % shamir::P
    });
    match finish(&lying) {
        Err(SecAggError::Inconsistent(_)) => {}
        other => panic!("{other:?}"),
    }
}
