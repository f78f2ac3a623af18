//! Secure aggregation end to end.
//!
//! - The `secure` example runs a real `hora-server` and 20 `hora-client train` processes
//!   through one SecAgg+ round, some crashing after a chosen stage, then runs the same round
//!   without secure aggregation with exactly the clients the secure round summed: the two
//!   published models must agree within the quantisation bound the protocol states.
//! - Adversarial clients, driven stage by stage over real TLS against a real server: a forged
//!   advertisement, shares sent to a non-neighbour, a replayed masked vector, a late one, and a
//!   client revealing both shares of one peer are all refused, and the round still publishes
//!   exactly the FedAvg of the honest inputs. What the server stores of a masked upload is
//!   checked to look uniformly random.

use hora_common::model::Model;
use hora_common::secagg::{ClientSession, Context, Identity, Quantiser, SecAggError};
use hora_common::wire::{
    Credentials, SecAggReceipt, SecAggRoster, SecAggShareBundles, SecAggShareKind, SecAggUnmask,
    SecAggUnmaskRequest, SecureAggregationConfig,
};
use rand_chacha::rand_core::SeedableRng;
use reqwest::{Method, StatusCode};

mod support;
use support::{
    delta, free_port, run_example, small_model, task, Api, Client, Replicas, Server, ADMIN_TOKEN,
};

/// Runs the secure example and checks the secure round against plain FedAvg of its survivors;
/// returns what it printed as its result.
fn secure_round(args: &[&str], summed: u64, abandoned: u64) -> serde_json::Value {
    let (stdout, r) = run_example("secure", args);
    println!("{stdout}");
    assert_eq!(r["summed"], summed, "{stdout}");
    assert_eq!(r["abandoned"], abandoned, "{stdout}");
    assert_eq!(r["examples"], r["plain_examples"], "{stdout}");
    let (diff, bound) = (
        r["max_diff"].as_f64().unwrap(),
        r["bound"].as_f64().unwrap(),
    );
    // The stated bound, plus the f32 rounding of both published models (weights below 1).
    assert!(
        diff <= bound + 2.5e-7,
        "difference {diff} exceeds the bound {bound}:\n{stdout}"
    );
    r
}

#[test]
fn twenty_clients_without_dropouts_publish_the_fedavg_of_all() {
    secure_round(&["--clients", "20"], 20, 0);
}

/// A task that trains part of its model: the masked sums are of its trainable tensors only,
/// and the round publishes their FedAvg.
#[test]
fn clients_training_part_of_the_model_publish_the_fedavg_of_its_trainable_tensors() {
    let r = secure_round(&["--clients", "4", "--trainable", "*.bias"], 4, 0);
    let (tensors, all) = (
        r["tensors"].as_u64().unwrap(),
        r["model_tensors"].as_u64().unwrap(),
    );
    assert!(0 < tensors && tensors < all, "{r}");
}

/// Federated evaluation inside the masked inputs: round 2's clients evaluate round 1's model
/// and the server, learning only the sum, records what every client's own evaluation gives.
#[test]
fn round_twos_clients_evaluate_round_ones_model_inside_their_masked_inputs() {
    let r = secure_round(&["--clients", "4", "--evaluate"], 4, 0);
    let e = &r["evaluation"];
    assert_eq!(e["clients"], 4, "{r}");
    assert_eq!(e["examples"], e["expected_examples"], "{r}");
    let close = |got: &str, want: &str, bound: &str| {
        let (g, w, b) = (
            e[got].as_f64().unwrap(),
            e[want].as_f64().unwrap(),
            e[bound].as_f64().unwrap(),
        );
        assert!(
            (g - w).abs() <= b + 1e-6 * w.abs(),
            "{got} {g} vs {w} (bound {b}): {r}"
        );
    };
    close("accuracy", "expected_accuracy", "accuracy_bound");
    close("loss", "expected_loss", "loss_bound");
}

#[test]
fn ten_percent_dropping_at_two_stages_publish_the_fedavg_of_the_survivors() {
    secure_round(
        &["--clients", "20", "--drop", "advertise=1,share-keys=1"],
        18,
        0,
    );
}

#[test]
fn thirty_percent_dropping_at_three_stages_publish_the_fedavg_of_the_survivors() {
    // Those that vanish after uploading their masked input are in the sum: their self-masks
    // are recovered from their neighbours' shares.
    secure_round(
        &[
            "--clients",
            "20",
            "--drop",
            "advertise=2,share-keys=2,masked-input=2",
        ],
        16,
        0,
    );
}

/// The same across three replicas on one PostgreSQL database, the clients spread over them:
/// every replica takes advertisements and masked inputs, and the leader's sum of the replicas'
/// masked partial sums unmasks to the FedAvg of the survivors.
#[test]
fn thirty_percent_dropping_across_three_replicas_publish_the_fedavg_of_the_survivors() {
    let r = secure_round(
        &[
            "--clients",
            "10",
            "--replicas",
            "3",
            "--drop",
            "advertise=1,share-keys=1,masked-input=1",
        ],
        8,
        0,
    );
    for what in ["replica_advertised", "replica_masked"] {
        let taken: Vec<u64> = serde_json::from_value(r[what].clone()).unwrap();
        assert_eq!(taken.len(), 3, "{r}");
        assert!(taken.iter().all(|&n| n > 0), "{what}: {r}");
    }
    // Everyone advertised (the first to drop did so after advertising); the eight that
    // survived to upload did so once each.
    let total = |what: &str| -> u64 {
        r[what]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .sum()
    };
    assert!(total("replica_advertised") >= 10, "{r}"); // (a repeat after a lost answer counts again)
    assert_eq!(total("replica_masked"), 8, "{r}");
}

#[test]
fn a_round_where_too_many_drop_is_abandoned_and_retried() {
    // Six clients, each with all five others as neighbours and threshold 3: three vanish after
    // sharing keys, so each survivor keeps two neighbours — too few. The attempt is abandoned
    // and the retry, with the three survivors, publishes their FedAvg.
    secure_round(
        &[
            "--clients",
            "6",
            "--drop",
            "share-keys=3",
            "--stage-secs",
            "4",
        ],
        3,
        1,
    );
}

/// Enrols a client with a fresh Ed25519 identity.
async fn enrol(admin: &Api) -> (Client, Identity) {
    let token: serde_json::Value = admin
        .ok(admin
            .request(Method::POST, "/admin/v1/enrolments")
            .json(&serde_json::json!({})))
        .await;
    let (identity, _) = Identity::generate().unwrap();
    let creds: Credentials = admin
        .ok(admin
            .with_token(token["token"].as_str().unwrap())
            .request(Method::POST, "/v1/enrol")
            .json(&serde_json::json!({"identity_key": hex::encode(identity.public_key())})))
        .await;
    let client = Client {
        api: admin.with_token(&format!("{}.{}", creds.client_id, creds.secret)),
        id: creds.client_id,
    };
    (client, identity)
}

/// Fetches a stage's answer (the stage must have closed).
async fn fetch<T: serde::de::DeserializeOwned>(c: &Client, path: &str) -> T {
    c.api
        .ok(c.api.request(Method::GET, &format!("{path}?wait_ms=10000")))
        .await
}

/// Chi-square of the byte histogram against uniform (255 degrees of freedom).
fn chi_square(bytes: &[u8]) -> f64 {
    let mut counts = [0f64; 256];
    bytes.iter().for_each(|&b| counts[b as usize] += 1.0);
    let expected = bytes.len() as f64 / 256.0;
    counts
        .iter()
        .map(|c| (c - expected).powi(2) / expected)
        .sum()
}

/// One secure round driven stage by stage by in-process clients over HTTP.
struct Harness {
    clients: Vec<(Client, Identity)>,
    sessions: Vec<ClientSession>,
    rosters: Vec<SecAggRoster>,
    base: String,
    quantiser: Quantiser,
    global: Model,
    deltas: Vec<(u64, Model)>,
}

impl Harness {
    /// Creates task `sa` (one round of `n` clients with `config`), enrols, joins and advertises.
    async fn start(admin: &Api, n: usize, config: SecureAggregationConfig) -> Harness {
        let global = small_model();
        let digest = admin.upload_model(&global).await;
        let mut task = task("sa", digest, 1, 3, n as u32, 120);
        task.secure_aggregation = Some(config);
        admin.create_task(&task).await;
        let mut clients = Vec::new();
        for _ in 0..n {
            clients.push(enrol(admin).await);
        }
        let mut offers = Vec::new();
        for (c, _) in &clients {
            offers.push(c.join("sa").await);
        }
        let secure = offers[0]
            .secure_aggregation
            .clone()
            .expect("a secure round");
        let ctx = Context::new("sa", 1, secure.attempt);
        Harness {
            sessions: clients
                .iter()
                .map(|(c, _)| ClientSession::new(ctx.clone(), &c.id).unwrap())
                .collect(),
            clients,
            rosters: Vec::new(),
            base: format!("/v1/tasks/sa/secagg/1/{}", secure.attempt),
            quantiser: Quantiser {
                clip: secure.clip,
                scale: secure.scale,
                max_weight: secure.max_weight,
            },
            deltas: (0..n)
                .map(|i| (10 + 7 * i as u64, delta(&global, i as u64)))
                .collect(),
            global,
        }
    }

    async fn post<T: serde::Serialize>(&self, i: usize, stage: &str, body: &T) {
        let c = &self.clients[i].0;
        let _: SecAggReceipt = c
            .api
            .ok(c
                .api
                .request(Method::POST, &format!("{}/{stage}", self.base))
                .json(body))
            .await;
    }

    async fn advertise(&self, i: usize) {
        let (_, identity) = &self.clients[i];
        self.post(i, "advertise", &self.sessions[i].advertise(identity))
            .await;
    }

    /// Every client fetches its roster and makes its share bundles.
    async fn rosters(&mut self) -> Vec<SecAggShareBundles> {
        let mut bundles = Vec::new();
        for i in 0..self.clients.len() {
            let roster: SecAggRoster =
                fetch(&self.clients[i].0, &format!("{}/neighbours", self.base)).await;
            bundles.push(self.sessions[i].share_keys(&roster).unwrap());
            self.rosters.push(roster);
        }
        bundles
    }

    /// Client `i`'s masked input (quantised delta plus masks), as bytes.
    async fn masked(&mut self, i: usize) -> (Vec<u32>, Vec<u8>) {
        let inbox: SecAggShareBundles =
            fetch(&self.clients[i].0, &format!("{}/shares", self.base)).await;
        let mut rng = rand_chacha::ChaCha20Rng::seed_from_u64(i as u64);
        let (w, d) = &self.deltas[i];
        let input = self.quantiser.encode(d.data(), *w, &mut rng);
        let masked = self.sessions[i].masked_input(&inbox, &input).unwrap();
        (input, masked.iter().flat_map(|v| v.to_le_bytes()).collect())
    }

    async fn upload(&self, i: usize, bytes: &[u8]) {
        let c = &self.clients[i].0;
        let _: SecAggReceipt = c
            .api
            .ok(c
                .api
                .request(Method::POST, &format!("{}/masked", self.base))
                .body(bytes.to_vec()))
            .await;
    }

    async fn unmask_request(&self, i: usize) -> SecAggUnmaskRequest {
        fetch(&self.clients[i].0, &format!("{}/unmask", self.base)).await
    }

    /// Waits for round 1 and checks it is the weighted mean of every client's delta.
    async fn check_published(&self, admin: &Api) {
        let total: u64 = self.deltas.iter().map(|(w, _)| w).sum();
        let mut expected: Vec<f64> = self.global.data().iter().map(|&v| f64::from(v)).collect();
        for (w, d) in &self.deltas {
            for (e, v) in expected.iter_mut().zip(d.data()) {
                *e += *w as f64 * f64::from(*v) / total as f64;
            }
        }
        let published = loop {
            let history: Vec<hora_common::wire::RoundRecord> = admin
                .ok(admin.request(Method::GET, "/admin/v1/tasks/sa/rounds"))
                .await;
            if let Some(r) = history.first() {
                break r.clone();
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        };
        assert_eq!(
            published.outcome,
            hora_common::wire::RoundOutcome::Published
        );
        assert_eq!(published.examples, total);
        assert_eq!(published.participants.len(), self.clients.len());
        let model = admin.round_model("sa", 1).await;
        let bound = self.quantiser.error_bound(self.clients.len(), total) + 2.5e-7;
        let worst = model
            .data()
            .iter()
            .zip(&expected)
            .map(|(got, want)| (f64::from(*got) - want).abs())
            .fold(0.0, f64::max);
        assert!(worst <= bound, "{worst} > {bound}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_protocol_state_and_masked_sum_survive_a_server_restart() {
    let dir = tempfile::tempdir().unwrap();
    let listen = format!("127.0.0.1:{}", free_port());
    let server = Server::start_on(dir.path(), &listen, &[]);
    survives_a_sigkill(server, || Server::start_on(dir.path(), &listen, &[])).await;
}

/// The same across replicas on one PostgreSQL database: the leader is SIGKILLed and its standby
/// (on the same address) takes over the round.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_protocol_state_and_masked_sum_survive_a_failover_to_a_standby_replica() {
    let mut replicas = Replicas::new(&format!("127.0.0.1:{}", free_port()));
    let leader = replicas.spawn().listening();
    let standby = replicas.spawn();
    survives_a_sigkill(leader, move || standby.listening()).await;
}

/// Secure aggregation across three replicas, message by message: leader `a`, followers `b` and
/// `c`, client i talking to replica i mod 3. Every stage's messages are taken by all three; a
/// masked input taken by `b` and sent again to `c` (its answer lost) is refused there as in
/// already (and `c`, whose refused sum is that input alone, a blob of the same name as `b`'s
/// partial, leaves it be); `b` is SIGKILLed with that input acknowledged and its clients move
/// to the leader; the stage closes once all six are in, counted across replicas, and the round
/// publishes the FedAvg of all six: `b`'s durable masked partial sum is in it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_followers_masked_partial_sum_survives_its_sigkill_and_the_replicas_unmask_it_with_the_others(
) {
    let mut replicas = Replicas::new(&format!("127.0.0.1:{}", free_port()));
    let a = replicas.spawn().listening();
    let listens: Vec<String> = (0..2)
        .map(|_| format!("127.0.0.1:{}", free_port()))
        .collect();
    let b = replicas.spawn_on(&listens[0]);
    let _c = replicas.spawn_on(&listens[1]);
    let admin = a.api(ADMIN_TOKEN);
    let urls = [
        a.url.clone(),
        format!("https://{}", listens[0]),
        format!("https://{}", listens[1]),
    ];
    for url in &urls[1..] {
        // (A follower answers `/readyz` once it serves clients.)
        let ready = || async {
            let r = admin.http.get(format!("{url}/readyz")).send().await;
            r.is_ok_and(|r| r.status().is_success())
        };
        let until = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while !ready().await {
            assert!(std::time::Instant::now() < until, "{url} does not follow");
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }
    let n = 6;
    let mut h = Harness::start(&admin, n, SecureAggregationConfig::default()).await;
    for (i, (c, _)) in h.clients.iter_mut().enumerate() {
        c.api.url = urls[i % 3].clone();
    }
    for i in 0..n {
        h.advertise(i).await;
    }
    let bundles = h.rosters().await;
    for (i, b) in bundles.iter().enumerate() {
        h.post(i, "shares", b).await;
    }
    let mut uploads = Vec::new();
    for i in 0..n {
        uploads.push(h.masked(i).await.1);
    }
    h.upload(1, &uploads[1]).await;
    let retry = Api {
        url: urls[2].clone(),
        ..h.clients[1].0.api.clone()
    };
    retry
        .refused(
            retry
                .request(Method::POST, &format!("{}/masked", h.base))
                .body(uploads[1].clone()),
            StatusCode::CONFLICT,
            "already_contributed",
        )
        .await;
    drop(b); // SIGKILL
    for i in [1, 4] {
        h.clients[i].0.api.url = urls[0].clone();
    }
    for i in [0, 2, 3, 4, 5] {
        h.upload(i, &uploads[i]).await;
    }
    for i in 0..n {
        let request = h.unmask_request(i).await;
        assert!(request.dropped.is_empty(), "every neighbour survived");
        let answer = h.sessions[i].unmask(&request).unwrap();
        h.post(i, "unmask", &answer).await;
    }
    h.check_published(&admin).await;
}

/// A round of four: two masked inputs acknowledged, then `server` is SIGKILLed and `next` (on
/// the same address) has their sum, the keys and the shares, and the round carries on.
async fn survives_a_sigkill(server: Server, next: impl FnOnce() -> Server) {
    let admin = server.api(ADMIN_TOKEN);
    let mut h = Harness::start(&admin, 4, SecureAggregationConfig::default()).await;
    for i in 0..4 {
        h.advertise(i).await;
    }
    let bundles = h.rosters().await;
    for (i, b) in bundles.iter().enumerate() {
        h.post(i, "shares", b).await;
    }
    let mut uploads = Vec::new();
    for i in 0..4 {
        uploads.push(h.masked(i).await.1);
    }
    h.upload(0, &uploads[0]).await;
    h.upload(1, &uploads[1]).await;
    // SIGKILL with two masked inputs acknowledged.
    server.kill();
    let server = next();
    h.upload(2, &uploads[2]).await;
    h.upload(3, &uploads[3]).await;
    for i in 0..4 {
        let request = h.unmask_request(i).await;
        assert_eq!(request.survivors.len(), 3);
        let answer = h.sessions[i].unmask(&request).unwrap();
        h.post(i, "unmask", &answer).await;
    }
    h.check_published(&server.api(ADMIN_TOKEN)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adversarial_clients_are_refused_and_the_honest_sum_is_published() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let admin = server.api(ADMIN_TOKEN);
    let n = 5;
    // A sparse graph even at five clients: two neighbours each, both needed.
    let mut h = Harness::start(
        &admin,
        n,
        SecureAggregationConfig {
            degree: Some(2),
            threshold: Some(2),
            ..Default::default()
        },
    )
    .await;
    let base = h.base.clone();

    // Stage 0. Keys signed by someone else's identity are refused.
    let c0 = h.clients[0].0.api.clone();
    let forged = h.sessions[0].advertise(&h.clients[1].1);
    c0.refused(
        c0.request(Method::POST, &format!("{base}/advertise"))
            .json(&forged),
        StatusCode::BAD_REQUEST,
        "bad_signature",
    )
    .await;
    for i in 0..n {
        h.advertise(i).await;
    }

    // Stage 1. Shares addressed to a client that is not a neighbour are refused.
    let bundles = h.rosters().await;
    assert!(h
        .rosters
        .iter()
        .all(|r| r.neighbours.len() == 2 && r.threshold == 2));
    let outsider = h
        .clients
        .iter()
        .map(|(c, _)| c.id.clone())
        .find(|id| {
            *id != h.clients[0].0.id && h.rosters[0].neighbours.iter().all(|nb| nb.client != *id)
        })
        .expect("a non-neighbour");
    let mut misdirected = bundles[0].clone();
    misdirected.shares[0].peer = outsider;
    c0.refused(
        c0.request(Method::POST, &format!("{base}/shares"))
            .json(&misdirected),
        StatusCode::BAD_REQUEST,
        "not_a_neighbour",
    )
    .await;
    for (i, b) in bundles.iter().enumerate() {
        h.post(i, "shares", b).await;
    }

    // Stage 2.
    let mut uploads = Vec::new();
    for i in 0..n {
        let (input, bytes) = h.masked(i).await;
        h.upload(i, &bytes).await;
        if i == 0 {
            // What the server stored after one upload is that upload: it must look uniform,
            // where the plaintext input (small weighted values) is anything but.
            let stored: Vec<_> = std::fs::read_dir(dir.path().join("checkpoints"))
                .unwrap()
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "msum"))
                .collect();
            assert_eq!(stored.len(), 1, "{stored:?}");
            let on_disk = std::fs::read(&stored[0]).unwrap();
            assert_eq!(&on_disk[8..], &bytes[..]);
            let plain: Vec<u8> = input.iter().flat_map(|v| v.to_le_bytes()).collect();
            // 255 dof: P(chi2 > 400) < 1e-8 for uniform bytes.
            assert!(
                chi_square(&on_disk[8..]) < 400.0,
                "stored sum is not uniform"
            );
            assert!(chi_square(&plain) > 400.0, "the test could not tell");
            // A replay of the same masked vector is refused, and counts once.
            c0.refused(
                c0.request(Method::POST, &format!("{base}/masked"))
                    .body(bytes.clone()),
                StatusCode::CONFLICT,
                "already_contributed",
            )
            .await;
        }
        uploads.push(bytes);
    }
    // A masked vector after the stage has closed is refused.
    c0.refused(
        c0.request(Method::POST, &format!("{base}/masked"))
            .body(uploads[0].clone()),
        StatusCode::CONFLICT,
        "stage_closed",
    )
    .await;

    // Stage 3. A client revealing both shares of one peer is refused.
    let mut answers = Vec::new();
    for i in 0..n {
        let request = h.unmask_request(i).await;
        assert_eq!(request.survivors.len(), 2);
        assert!(request.dropped.is_empty());
        answers.push(h.sessions[i].unmask(&request).unwrap());
    }
    let mut both: SecAggUnmask = answers[0].clone();
    let mut extra = both.shares[0].clone();
    extra.kind = SecAggShareKind::MaskKey;
    both.shares.push(extra);
    c0.refused(
        c0.request(Method::POST, &format!("{base}/unmask"))
            .json(&both),
        StatusCode::BAD_REQUEST,
        "forged_message",
    )
    .await;
    // A session that has revealed its shares answers no second request: a server cannot get
    // the other share of a peer by asking again with that peer moved to the other list.
    let peer = h.rosters[0].neighbours[0].client.clone();
    let moved = SecAggUnmaskRequest {
        survivors: vec![],
        dropped: vec![peer],
    };
    assert!(matches!(
        h.sessions[0].unmask(&moved),
        Err(SecAggError::Stage(_))
    ));
    for (i, a) in answers.iter().enumerate() {
        h.post(i, "unmask", a).await;
    }

    // Published: the weighted mean of the honest deltas, within the quantisation bound.
    h.check_published(&admin).await;
}
