//! Secure aggregation (SecAgg+ and the original complete-graph SecAgg) against the plain
//! sealed-envelope upload path, measured in the same run.
//!
//! `cargo bench -p hora-common --bench secagg`. `HORA_BENCH_QUICK=1` runs only n = 100 (a smoke
//! run); `HORA_BENCH_SECAGG_PARAMS` sets m (default 100,000) and `HORA_BENCH_SECAGG_SAMPLE` the
//! number of clients timed (default 5).
//!
//! Every configuration runs the whole protocol for real: all n clients make keys, check their
//! roster and share keys; the dropped ones (10%: every tenth client) vanish right after sharing
//! keys, so the server must reconstruct their mask keys and strip their pairwise masks from the
//! sum — the expensive case. Every survivor masks a quantised f32 delta of m values and answers
//! the unmask request, the server folds all the uploads, accepts every answer and unmasks, and
//! the result is checked against the sum computed in the clear.
//!
//! - **what is sampled**: where masking every survivor's full vector would take too long here
//!   (the complete graph at n = 500 makes n² keystreams of m words), the survivors outside the
//!   timed sample mask only the first 1024 words of their input; their key agreements, share
//!   openings and unmask answers are still the real ones, the server still unmasks a full-length
//!   sum (its timed fold stands a sampled full-length upload in for each prefix-only one: the
//!   cost is the same), and the unmasked sum is checked on that prefix. The output says where
//!   this happened.
//! - **client time**: a sample of survivors, one after the other, each on a one-thread rayon pool
//!   (a client is one device): key generation + advertise, share_keys, quantising the delta with
//!   `Quantiser::encode` + masked_input, unmask. The other clients run untimed on all threads.
//! - **server time**: folding every survivor's upload (little-endian bytes, as received) into the
//!   sum, building the unmask requests, `Unmasker::accept` of every answer and `Unmasker::finish`
//!   (which expands the masks on all threads). Building rosters and routing shares (bookkeeping)
//!   is not counted.
//! - **bytes**: sent = the advertisement, the share bundles and the unmask answer as serde_json
//!   serialises them, plus 4·(m+1) bytes of masked vector; received = the roster, the inbox of
//!   bundles and the unmask request as JSON. Means over the sampled clients.
//! - **plain**: this project's upload path for the same m: the client writes its delta as
//!   safetensors and seals it with `envelope::seal`; the server opens it in place, parses and
//!   checks it and folds it with `WeightedSum::add_view`, for as many uploads as there are
//!   survivors.

use std::collections::BTreeSet;
use std::hint::black_box;
use std::time::{Duration, Instant};

use hora_common::envelope::{self, Binding, RoundSecretKey};
use hora_common::kernel::WeightedSum;
use hora_common::model::{DType, Model, ModelDigest, ModelSpec, ModelView, TensorSpec};
use hora_common::secagg::unmask::Participant;
use hora_common::secagg::{
    graph, hex_array, ClientSession, Context, Identity, Quantiser, Unmasker,
};
use hora_common::wire::{
    SecAggAdvertise, SecAggNeighbour, SecAggRoster, SecAggSealedShares, SecAggShareBundles,
    SecAggUnmask, SecAggUnmaskRequest,
};
use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha20Rng;
use rayon::prelude::*;
use rayon::ThreadPool;

/// Above this many keystream words (survivors × masks × vector length), the untimed clients
/// mask only a prefix of their input (see stage 2 of [`run_secure`]).
const FULL_MASKING_WORDS: usize = 5_000_000_000;
const PREFIX: usize = 1024;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

fn json_len<T: serde::Serialize>(value: &T) -> usize {
    serde_json::to_vec(value).expect("serialisable").len()
}

/// Client `c`'s training delta: small values, different for every client.
fn delta(c: usize, m: usize) -> Vec<f32> {
    let mut rng = ChaCha20Rng::seed_from_u64(c as u64);
    (0..m)
        .map(|_| (rng.next_u32() as f32 / u32::MAX as f32 - 0.5) * 0.02)
        .collect()
}

fn examples(c: usize) -> u64 {
    10 + (c as u64 * 7) % 90
}

#[derive(Clone, Copy, PartialEq)]
enum Graph {
    SecAggPlus,
    Complete,
}

impl Graph {
    fn name(self) -> &'static str {
        match self {
            Graph::SecAggPlus => "secagg+",
            Graph::Complete => "complete",
        }
    }

    fn degree_threshold(self, n: usize) -> (usize, usize) {
        match self {
            Graph::SecAggPlus => {
                let k = graph::default_degree(n);
                (k, graph::default_threshold(k))
            }
            Graph::Complete => (n - 1, (n - 1) / 2 + 1),
        }
    }
}

/// Per-client stage times (summed over the sample) and message sizes.
#[derive(Default)]
struct ClientCost {
    advertise: Duration,
    share_keys: Duration,
    masked_input: Duration,
    unmask: Duration,
    sent: usize,
    received: usize,
}

impl ClientCost {
    fn total(&self) -> Duration {
        self.advertise + self.share_keys + self.masked_input + self.unmask
    }
}

struct SecureResult {
    k: usize,
    t: usize,
    survivors: usize,
    sample: usize,
    /// `Some(words)` when the untimed survivors masked only that prefix of their input.
    prefix: Option<usize>,
    /// Means over the sample.
    client: ClientCost,
    fold: Duration,
    accept: Duration,
    finish: Duration,
    /// Protocol wall time of the whole simulated round (all clients), for the record.
    wall: Duration,
}

impl SecureResult {
    fn server(&self) -> Duration {
        self.fold + self.accept + self.finish
    }
}

/// Runs `f` on the one-thread pool (one client device) and times it.
fn timed<T: Send>(one: &ThreadPool, f: impl FnOnce() -> T + Send) -> (T, Duration) {
    one.install(|| {
        let t = Instant::now();
        let out = f();
        (out, t.elapsed())
    })
}

fn run_secure(
    n: usize,
    dropped: &BTreeSet<usize>,
    graph_kind: Graph,
    m: usize,
    sampled: &[usize],
    one: &ThreadPool,
) -> SecureResult {
    let wall = Instant::now();
    let (k, t) = graph_kind.degree_threshold(n);
    let ctx = Context::new("bench", 1, 0);
    let quantiser = Quantiser::for_round(1.0, 100, n).expect("quantiser");
    let ids: Vec<String> = (0..n).map(|i| format!("client-{i:04}")).collect();
    let is_sampled = |i: usize| sampled.contains(&i);
    // Enrolment happens once per client, not per round: not timed.
    let identities: Vec<Identity> = (0..n)
        .into_par_iter()
        .map(|_| Identity::generate().expect("identity").0)
        .collect();
    let mut cost = ClientCost::default();

    // Stage 0: round keys and the signed advertisement.
    let mut sessions: Vec<Option<ClientSession>> = (0..n).map(|_| None).collect();
    let mut adverts: Vec<Option<SecAggAdvertise>> = vec![None; n];
    for &i in sampled {
        let ((s, a), d) = timed(one, || {
            let s = ClientSession::new(ctx.clone(), &ids[i]).expect("session");
            let a = s.advertise(&identities[i]);
            (s, a)
        });
        cost.advertise += d;
        cost.sent += json_len(&a);
        sessions[i] = Some(s);
        adverts[i] = Some(a);
    }
    sessions
        .par_iter_mut()
        .zip(adverts.par_iter_mut())
        .enumerate()
        .filter(|(i, _)| !is_sampled(*i))
        .for_each(|(i, (s, a))| {
            let session = ClientSession::new(ctx.clone(), &ids[i]).expect("session");
            *a = Some(session.advertise(&identities[i]));
            *s = Some(session);
        });
    let mut sessions: Vec<ClientSession> = sessions.into_iter().map(Option::unwrap).collect();
    let adverts: Vec<SecAggAdvertise> = adverts.into_iter().map(Option::unwrap).collect();

    // The server fixes the graph and the participants.
    let neighbours = graph::neighbours(n, k, &[42; 32]);
    let participants: Vec<Participant> = (0..n)
        .map(|i| Participant {
            id: ids[i].clone(),
            index: i as u32 + 1,
            mask_key: hex_array("mask_key", &adverts[i].mask_key).expect("hex"),
            neighbours: neighbours[i].clone(),
        })
        .collect();
    let roster = |i: usize| SecAggRoster {
        index: i as u32 + 1,
        threshold: t as u32,
        input_deadline_unix_ms: 0,
        neighbours: neighbours[i]
            .iter()
            .map(|&j| SecAggNeighbour {
                client: ids[j].clone(),
                index: j as u32 + 1,
                identity_key: hex::encode(identities[j].public_key()),
                keys: adverts[j].clone(),
            })
            .collect(),
    };

    // Stage 1: every client shares keys (the dropped ones too: they vanish only afterwards).
    let mut outgoing: Vec<Option<SecAggShareBundles>> = vec![None; n];
    for &i in sampled {
        let r = roster(i);
        cost.received += json_len(&r);
        let (bundles, d) = timed(one, || sessions[i].share_keys(&r).expect("share_keys"));
        cost.share_keys += d;
        cost.sent += json_len(&bundles);
        outgoing[i] = Some(bundles);
    }
    sessions
        .par_iter_mut()
        .zip(outgoing.par_iter_mut())
        .enumerate()
        .filter(|(i, _)| !is_sampled(*i))
        .for_each(|(i, (s, out))| *out = Some(s.share_keys(&roster(i)).expect("share_keys")));
    let mut inboxes: Vec<Vec<SecAggSealedShares>> = vec![Vec::new(); n];
    for (from, bundles) in outgoing.into_iter().enumerate() {
        for b in bundles.expect("every client shared").shares {
            let to = ids.binary_search(&b.peer).expect("a participant");
            inboxes[to].push(SecAggSealedShares {
                peer: ids[from].clone(),
                ciphertext: b.ciphertext,
            });
        }
    }
    let inboxes: Vec<SecAggShareBundles> = inboxes
        .into_iter()
        .map(|shares| SecAggShareBundles { shares })
        .collect();
    let shared: BTreeSet<usize> = (0..n).collect();
    let survivors: BTreeSet<usize> = (0..n).filter(|i| !dropped.contains(i)).collect();

    // Stage 2: every survivor quantises its delta and masks it; the dropped clients are gone.
    // Where masking every survivor's full vector would take too long here (the complete graph
    // at n = 500: n² keystreams of m words), the untimed survivors mask only a prefix of their
    // input. Their key agreements, share openings and later unmask answers are the real ones,
    // and a mask's prefix is the prefix of the full mask, so the unmasked sum is still checked
    // on that prefix; the server's work does not depend on the clients' vector lengths.
    let len = m + 1;
    let full = survivors.len() * (k + 1) * len <= FULL_MASKING_WORDS;
    let prefix = if full { len } else { PREFIX.min(len) };
    let mask_one = |s: &mut ClientSession, i: usize, d: &[f32], upto: usize| {
        let mut rng = ChaCha20Rng::seed_from_u64(1000 + i as u64);
        let input = quantiser.encode(d, examples(i), &mut rng);
        let masked = s
            .masked_input(&inboxes[i], &input[..upto])
            .expect("masked_input");
        (input, masked)
    };
    let mut uploads: Vec<Option<(Vec<u32>, Vec<u32>)>> = vec![None; n];
    for &i in sampled {
        cost.received += json_len(&inboxes[i]);
        let d = delta(i, m);
        let (out, dur) = timed(one, || mask_one(&mut sessions[i], i, &d, len));
        cost.masked_input += dur;
        cost.sent += 4 * out.1.len();
        uploads[i] = Some(out);
    }
    sessions
        .par_iter_mut()
        .zip(uploads.par_iter_mut())
        .enumerate()
        .filter(|(i, _)| !is_sampled(*i) && survivors.contains(i))
        .for_each(|(i, (s, out))| *out = Some(mask_one(s, i, &delta(i, m), prefix)));
    let mut expected = vec![0u32; len];
    let mut received: Vec<Vec<u8>> = Vec::with_capacity(survivors.len());
    for (input, masked) in uploads.into_iter().flatten() {
        expected
            .iter_mut()
            .zip(&input)
            .for_each(|(e, v)| *e = e.wrapping_add(*v));
        received.push(masked.iter().flat_map(|v| v.to_le_bytes()).collect());
    }
    assert_eq!(received.len(), survivors.len());
    let fold_into = |sum: &mut [u32], bytes: &[u8]| {
        sum.iter_mut()
            .zip(bytes.chunks_exact(4))
            .for_each(|(s, b)| *s = s.wrapping_add(u32::from_le_bytes([b[0], b[1], b[2], b[3]])))
    };

    // The server folds the uploads as they arrive (m + 1 words each: a prefix-only upload is
    // stood in for by a full one of the sample, which costs the same).
    let whole: Vec<&Vec<u8>> = received.iter().filter(|b| b.len() == 4 * len).collect();
    let start = Instant::now();
    let mut sum = vec![0u32; len];
    for (j, bytes) in received.iter().enumerate() {
        let bytes = if bytes.len() == 4 * len {
            bytes
        } else {
            whole[j % whole.len()]
        };
        fold_into(&mut sum, bytes);
    }
    let fold = start.elapsed();
    if !full {
        // The real sum of what was uploaded (not timed).
        sum.fill(0);
        for bytes in &received {
            fold_into(&mut sum, bytes);
        }
    }
    drop(received);

    // Stage 3: unmask.
    let start = Instant::now();
    let unmasker = Unmasker::new(
        ctx.clone(),
        &participants,
        t,
        shared.clone(),
        survivors.clone(),
    );
    let requests: Vec<Option<SecAggUnmaskRequest>> = (0..n)
        .map(|i| survivors.contains(&i).then(|| unmasker.request_for(i)))
        .collect();
    let mut accept = start.elapsed();
    let mut answers: Vec<Option<SecAggUnmask>> = vec![None; n];
    for &i in sampled {
        let request = requests[i].as_ref().expect("a survivor");
        cost.received += json_len(request);
        let (answer, d) = timed(one, || sessions[i].unmask(request).expect("unmask"));
        cost.unmask += d;
        cost.sent += json_len(&answer);
        answers[i] = Some(answer);
    }
    sessions
        .par_iter_mut()
        .zip(answers.par_iter_mut())
        .enumerate()
        .filter(|(i, _)| !is_sampled(*i) && survivors.contains(i))
        .for_each(|(i, (s, a))| {
            *a = Some(s.unmask(requests[i].as_ref().unwrap()).expect("unmask"))
        });
    let mut unmasker = unmasker;
    let start = Instant::now();
    for (i, answer) in answers.iter().enumerate() {
        if let Some(answer) = answer {
            unmasker.accept(i, answer).expect("accept");
        }
    }
    assert!(unmasker.complete());
    accept += start.elapsed();
    let start = Instant::now();
    unmasker.finish(&mut sum).expect("finish");
    let finish = start.elapsed();
    assert!(
        sum[..prefix] == expected[..prefix],
        "the unmasked sum differs from the sum of the survivors' inputs"
    );

    let s = sampled.len() as u32;
    let mean = |d: Duration| d / s;
    SecureResult {
        k,
        t,
        survivors: survivors.len(),
        sample: sampled.len(),
        prefix: (!full).then_some(prefix),
        client: ClientCost {
            advertise: mean(cost.advertise),
            share_keys: mean(cost.share_keys),
            masked_input: mean(cost.masked_input),
            unmask: mean(cost.unmask),
            sent: cost.sent / sampled.len(),
            received: cost.received / sampled.len(),
        },
        fold,
        accept,
        finish,
        wall: wall.elapsed(),
    }
}

struct PlainResult {
    client: Duration,
    server: Duration,
    sent: usize,
}

/// The plain path: safetensors + envelope on the client, open + parse + check + fold on the
/// server, for `uploads` clients.
fn run_plain(m: usize, uploads: usize, sampled: &[usize], one: &ThreadPool) -> PlainResult {
    let spec = ModelSpec::new(vec![TensorSpec {
        name: "delta".into(),
        shape: vec![m],
        dtype: DType::F32,
    }])
    .expect("spec");
    let key = RoundSecretKey::generate().expect("rng");
    let public = key.public_key();
    let digest = ModelDigest([7; 32]);
    let ids: Vec<String> = (0..uploads).map(|i| format!("client-{i:04}")).collect();
    let binding = |i: usize| Binding {
        task: "bench",
        round: 1,
        client: &ids[i],
        base_model: &digest,
    };
    let seal = |i: usize, d: Vec<f32>| {
        let model = Model::from_flat(&spec, d).expect("model");
        envelope::seal(&model.to_safetensors(), &public, &binding(i)).expect("seal")
    };
    black_box(seal(0, delta(0, m))); // warm-up
    let (mut client, mut sent) = (Duration::ZERO, 0);
    for &i in sampled {
        let d = delta(i, m);
        let (sealed, dur) = timed(one, || seal(i, d));
        client += dur;
        sent += sealed.len();
    }
    let mut sum = WeightedSum::new(spec.clone());
    let mut server = Duration::ZERO;
    for i in 0..uploads {
        let mut body = seal(i, delta(i, m)); // what arrives; not timed
        let start = Instant::now();
        let plaintext = envelope::open(&mut body, &key, &binding(i)).expect("open");
        let view = ModelView::parse(plaintext, &spec.limits()).expect("parse");
        spec.check_spec(&view.spec()).expect("spec");
        view.check_finite().expect("finite");
        sum.add_view(examples(i) as f64, &view).expect("fold");
        server += start.elapsed();
    }
    black_box(sum.sum());
    PlainResult {
        client: client / sampled.len() as u32,
        server,
        sent: sent / sampled.len(),
    }
}

/// Figures of the CCS 2017 paper (complete graph, n = 500, m = 100,000), for comparison.
fn paper(n: usize, drop_pct: usize, graph_kind: Graph) -> Option<(f64, f64)> {
    match (n, drop_pct, graph_kind) {
        (500, 0, Graph::Complete) => Some((0.85, 2.0)),
        (500, 10, Graph::Complete) => Some((0.85, 62.0)),
        _ => None,
    }
}

fn main() {
    // Only under `cargo bench` (which passes `--bench`); under the test runners this is a no-op.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let quick = std::env::var("HORA_BENCH_QUICK").is_ok_and(|v| v == "1");
    let m = env_usize("HORA_BENCH_SECAGG_PARAMS", 100_000);
    let sample = env_usize("HORA_BENCH_SECAGG_SAMPLE", 5).max(1);
    let sizes: &[usize] = if quick { &[100] } else { &[100, 500] };
    let one = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .expect("pool");
    println!(
        "secure aggregation: m = {m} parameters, client times on 1 thread (mean of {sample} sampled \
         survivors), server on a pool of {} threads; dropped clients vanish after sharing keys",
        rayon::current_num_threads()
    );
    println!();
    let mut rows = Vec::new();
    let started = Instant::now();
    for &n in sizes {
        for drop_pct in [0, 10] {
            let dropped: BTreeSet<usize> = if drop_pct == 0 {
                BTreeSet::new()
            } else {
                (0..n).filter(|i| i % 10 == 9).collect()
            };
            let sampled: Vec<usize> = (0..n)
                .filter(|i| !dropped.contains(i))
                .take(sample)
                .collect();
            let plain = run_plain(m, n - dropped.len(), &sampled, &one);
            for graph_kind in [Graph::SecAggPlus, Graph::Complete] {
                let r = run_secure(n, &dropped, graph_kind, m, &sampled, &one);
                eprintln!(
                    "  done n={n} drop={drop_pct}% graph={} in {:.1} s",
                    graph_kind.name(),
                    secs(r.wall)
                );
                rows.push((
                    n,
                    drop_pct,
                    graph_kind,
                    r,
                    plain.client,
                    plain.server,
                    plain.sent,
                ));
            }
        }
    }

    println!(
        "{:<9} {:>4} {:>5} {:>4} {:>4} {:>5} | {:>9} {:>9} {:>7} | {:>9} {:>9} {:>7} | {:>10} {:>10} {:>7} | {:>9} {:>9}",
        "graph", "n", "drop", "k", "t", "surv",
        "client s", "plain s", "ratio",
        "server s", "plain s", "ratio",
        "sent B", "plain B", "ratio",
        "recv B", "paper c/s"
    );
    for (n, drop_pct, g, r, pc, ps, pb) in &rows {
        let paper_col = paper(*n, *drop_pct, *g)
            .map(|(c, s)| format!("{c:.2}/{s:.0}"))
            .unwrap_or_else(|| "-".into());
        println!(
            "{:<9} {:>4} {:>4}% {:>4} {:>4} {:>5} | {:>9.4} {:>9.4} {:>7.1} | {:>9.3} {:>9.3} {:>7.1} | {:>10} {:>10} {:>7.2} | {:>9} {:>9}",
            g.name(), n, drop_pct, r.k, r.t, r.survivors,
            secs(r.client.total()), secs(*pc), secs(r.client.total()) / secs(*pc),
            secs(r.server()), secs(*ps), secs(r.server()) / secs(*ps),
            r.client.sent, pb, r.client.sent as f64 / *pb as f64,
            r.client.received, paper_col
        );
    }
    println!();
    println!("breakdown (client: advertise / share_keys / encode+masked_input / unmask; server: fold / requests+accept / finish), seconds:");
    for (n, drop_pct, g, r, ..) in &rows {
        println!(
            "  {:<9} n={:<4} drop={:>2}%  client {:.4} / {:.4} / {:.4} / {:.4}   server {:.3} / {:.3} / {:.3}   (whole simulated round {:.1} s, {} clients timed{})",
            g.name(), n, drop_pct,
            secs(r.client.advertise), secs(r.client.share_keys), secs(r.client.masked_input), secs(r.client.unmask),
            secs(r.fold), secs(r.accept), secs(r.finish),
            secs(r.wall), r.sample,
            match r.prefix {
                None => String::from(", all survivors masked their full vector, sum checked in full"),
                Some(p) => format!(
                    "; the other {} survivors masked only their first {p} words (real keys, shares and answers), sum checked on those",
                    r.survivors - r.sample
                ),
            }
        );
    }
    println!();
    println!(
        "paper c/s: Bonawitz et al., CCS 2017, complete graph, n = 500, m = 100,000: client s per client / \
         server s (0% and 10% dropouts), as quoted for comparison (different hardware and implementation)"
    );
    println!();
    for (n, drop_pct, g, r, pc, ps, pb) in &rows {
        println!(
            "RESULT secagg n={n} drop={drop_pct}% graph={} client_s={:.4} server_s={:.3} sent_bytes={} recv_bytes={} plain_client_s={:.4} plain_server_s={:.3} plain_sent_bytes={}",
            g.name(),
            secs(r.client.total()),
            secs(r.server()),
            r.client.sent,
            r.client.received,
            secs(*pc),
            secs(*ps),
            pb
        );
    }
    eprintln!("total {:.1} s", secs(started.elapsed()));
}
