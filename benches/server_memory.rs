//! Peak resident memory of the real server while 10 and while 200 clients upload to one round
//! of a 25M-parameter model (100 MB of f32). The design bound: peak RSS ≤ 3 × model bytes +
//! 100 MB, whatever the number of clients.
//!
//! `make bench` (it builds the release server first). Each client has its own TLS connection
//! and all uploads are in flight at once; their envelopes are sealed beforehand into temporary
//! files (the bench itself would otherwise need clients × 100 MB) and streamed from there.
//! `HORA_BENCH_CLIENTS=10,200` and `HORA_BENCH_MEMORY_PARAMS=25000000` change the set-up.

#[path = "../tests/support/mod.rs"]
mod support;

use std::time::Instant;

use hora_common::model::{DType, ModelSpec, TensorSpec};
use hora_common::wire::{TaskInfo, TaskState, UpdateMeta};
use reqwest::Method;
use support::*;

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let counts: Vec<usize> = std::env::var("HORA_BENCH_CLIENTS")
        .unwrap_or_else(|_| "10,200".into())
        .split(',')
        .filter_map(|v| v.trim().parse().ok())
        .collect();
    let params: usize = std::env::var("HORA_BENCH_MEMORY_PARAMS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(25_000_000);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    println!(
        "server peak RSS during one round of a {params}-parameter model ({:.0} MB of f32)",
        params as f64 * 4e-6
    );
    for n in counts {
        runtime.block_on(run(n, params));
    }
}

async fn run(clients: usize, params: usize) {
    let dir = tempfile::tempdir().expect("tempdir");
    let bodies = tempfile::tempdir().expect("tempdir");
    let server = Server::start(dir.path());
    let admin = server.api(ADMIN_TOKEN);
    let sizes = [
        params / 2,
        params / 4,
        params / 8,
        params - params / 2 - params / 4 - params / 8,
    ];
    let spec = ModelSpec::new(
        sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| TensorSpec {
                name: format!("layer{i}.weight"),
                shape: vec![n],
                dtype: DType::F32,
            })
            .collect(),
    )
    .expect("spec");
    let initial = support::ramp_model(&spec);
    let model_bytes = initial.numel() as u64 * 4;
    let digest = admin.upload_model(&initial).await;
    admin
        .create_task(&task(
            "mem",
            digest,
            1,
            clients as u32,
            clients as u32,
            3600,
        ))
        .await;

    // Enrol, join, and seal every client's delta to a file.
    let d = delta(&initial, 1);
    let plaintext = d.to_safetensors();
    drop(d);
    let mut uploads = Vec::new();
    for i in 0..clients {
        let c = admin.enrol().await;
        let offer = c.join("mem").await;
        let binding = hora_common::envelope::Binding {
            task: "mem",
            round: offer.round,
            client: &c.id,
            base_model: &offer.model,
        };
        let sealed =
            hora_common::envelope::seal(&plaintext, &offer.round_key, &binding).expect("seal");
        let path = bodies.path().join(format!("{i}.env"));
        std::fs::write(&path, &sealed).expect("write sealed body");
        uploads.push((c, offer.round, path, sealed.len() as u64));
    }
    drop(plaintext);
    let before = peak_rss(server.pid()).expect("VmHWM");

    let started = Instant::now();
    let mut handles = Vec::new();
    for (c, round, path, len) in uploads {
        // Its own connection, like a real device.
        let http = hora_server::tls::https_client(&server.ca, None).expect("client");
        let url = format!("{}/v1/tasks/mem/rounds/{round}/update", server.url);
        let token = c.api.token.clone();
        handles.push(tokio::spawn(async move {
            let file = tokio::fs::File::open(&path).await.expect("open body");
            let meta = UpdateMeta {
                num_examples: 10,
                metrics: Default::default(),
                contributors: None,
            };
            let resp = http
                .post(url)
                .bearer_auth(token)
                .header("x-hora-update", serde_json::to_string(&meta).expect("json"))
                .header("content-length", len.to_string())
                .body(reqwest::Body::wrap_stream(
                    tokio_util::io::ReaderStream::with_capacity(file, 1 << 20),
                ))
                .send()
                .await
                .expect("upload");
            assert!(
                resp.status().is_success(),
                "{}: {}",
                resp.status(),
                resp.text().await.unwrap_or_default()
            );
        }));
    }
    for h in handles {
        h.await.expect("upload task");
    }
    let elapsed = started.elapsed();
    let info: TaskInfo = admin
        .ok(admin.request(Method::GET, "/admin/v1/tasks/mem"))
        .await;
    assert_eq!(info.state, TaskState::Finished, "the round must publish");
    let peak = peak_rss(server.pid()).expect("VmHWM");
    let bound = 3 * model_bytes + 100_000_000;
    println!(
        "  {clients:>4} clients: peak RSS {:6.0} MB (before uploads {:5.0} MB); bound 3 x {:.0} MB + 100 MB = {:.0} MB -> {:.2} of the bound ({}); {:.1} s, {:.2} GB/s ingested",
        peak as f64 / 1e6,
        before as f64 / 1e6,
        model_bytes as f64 / 1e6,
        bound as f64 / 1e6,
        peak as f64 / bound as f64,
        if peak <= bound { "within" } else { "OVER" },
        elapsed.as_secs_f64(),
        clients as f64 * (model_bytes as f64) / elapsed.as_secs_f64() / 1e9,
    );
    server.kill();
}
