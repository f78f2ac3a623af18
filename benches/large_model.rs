//! The largest model this machine federates: one round of a model of `HORA_LARGE_MODEL_MB` MiB
//! of float32 (2,200 by default: past 2 GiB, the size no single HTTP/2 or gRPC message may have)
//! in 16 tensors, with `HORA_LARGE_MODEL_CLIENTS` clients (4), against the real release server.
//!
//! What it prints:
//! - the admin's model upload (streamed to disk) and each client's download and upload, in MB/s,
//!   next to the loopback TLS limit measured in the same run (one rustls stream from this
//!   process to itself, both ends on this machine's cores, as a transfer to the server is);
//! - the round's wall time, from the first client's join to the published model;
//! - the server's peak RSS (its own `process_resident_memory_peak_bytes`) against the design
//!   bound of 3 × model bytes + 100 MB (the bench fails when the peak exceeds it: it is the
//!   test that a model past 2 GB makes a round within the server's memory bound, too large for
//!   `make test`), and the clients' (this process's peak while they run, one after another,
//!   each holding the model it downloaded and its update);
//! - a download and an upload each cut at half by a relay and resumed: the bytes that went
//!   through the relay against those of the same transfer unbroken (every client goes through a
//!   counting relay on loopback, so the throughputs include its hop).
//!
//! The clients go one after another (four at once would need four times a client's memory,
//! which this 24 GB machine does not have beside the server's); each runs the SDK's own
//! download (resumed with `Range`) and upload (chunked, resumed from the chunk the server
//! expects next). Disk: about 5 × the model (the server's blobs and spool, a client's cache).
//!
//! `cargo build --release -p hora-server --bins && cargo bench -p hora --bench large_model`
//! (`make bench-large`).

#[path = "../tests/support/mod.rs"]
mod support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hora_client::{Client, ClientConfig};
use hora_common::model::{DType, ModelDigest, ModelSpec, TensorSpec};
use hora_common::wire::{Metrics, TaskInfo, TaskState, UpdateMeta};
use reqwest::Method;
use support::*;

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let env = |name: &str, default: u64| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let mib = env("HORA_LARGE_MODEL_MB", 2200);
    let clients = env("HORA_LARGE_MODEL_CLIENTS", 4).max(2);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(run(mib, clients));
}

/// Starts this process's peak RSS ([`peak_rss`]) again from its current RSS (Linux: `clear_refs` 5).
fn reset_peak() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

fn mb_per_s(bytes: u64, took: Duration) -> f64 {
    bytes as f64 / 1e6 / took.as_secs_f64()
}

async fn run(mib: u64, clients: u64) {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(&dir.path().join("server"));
    let admin = server.api(ADMIN_TOKEN);
    let numel = (mib << 20) / 4;
    let tensors = 16;
    let spec = ModelSpec::new(
        (0..tensors)
            .map(|i| TensorSpec {
                name: format!("block{i}.weight"),
                shape: vec![(numel / tensors + u64::from(i < numel % tensors)) as usize],
                dtype: DType::F32,
            })
            .collect(),
    )
    .expect("spec");
    let model_bytes = numel * 4;
    println!(
        "large-model benchmark: one round of a {mib} MiB float32 model ({numel} parameters in {tensors} tensors), {clients} clients one after another, release hora-server on loopback TLS"
    );

    // The loopback TLS limit: one stream of the model's size through rustls, here to here.
    let tls = loopback_tls(&server, model_bytes).await;
    println!("  loopback TLS limit (one rustls stream): {tls:8.0} MB/s");

    // The admin's upload, streamed to the server's disk (from a file here too: one body of
    // gigabytes in a single buffer is more than an HTTP/2 stream's flow control takes at once).
    let digest = {
        let file = dir.path().join("initial.safetensors");
        std::fs::write(&file, support::ramp_model(&spec).to_safetensors())
            .expect("write the model");
        let length = std::fs::metadata(&file).expect("the model's file").len();
        let body = reqwest::Body::wrap_stream(tokio_util::io::ReaderStream::with_capacity(
            tokio::fs::File::open(&file).await.expect("open the model"),
            1 << 20,
        ));
        let started = Instant::now();
        let uploaded: serde_json::Value = admin
            .ok(admin
                .request(Method::POST, "/admin/v1/models")
                .header("content-type", "application/octet-stream")
                .header("content-length", length.to_string())
                .body(body))
            .await;
        let took = started.elapsed();
        let _ = std::fs::remove_file(&file);
        println!(
            "  admin upload of the model:            {:8.0} MB/s ({:.1} s; the server's peak RSS after it: {:.0} MB)",
            mb_per_s(length, took),
            took.as_secs_f64(),
            admin.metric("process_resident_memory_peak_bytes").await / 1e6
        );
        ModelDigest::from_hex(uploaded["digest"].as_str().expect("the digest")).expect("a digest")
    };
    admin
        .create_task(&task(
            "large",
            digest,
            1,
            clients as u32,
            clients as u32,
            3600,
        ))
        .await;

    let upstream: std::net::SocketAddr = server
        .url
        .trim_start_matches("https://")
        .parse()
        .expect("the server's address");
    let meta = UpdateMeta {
        num_examples: 10,
        metrics: Metrics::default(),
        contributors: None,
    };
    let mut client_peak = 0u64;
    let mut chunk = 0;
    let (mut downloads, mut uploads) = (Vec::new(), Vec::new());
    let mut resent = Vec::new();
    let round_started = Instant::now();
    // Bytes through each client's relay, the way it counts: (cut?, download?, bytes).
    let mut passed = Vec::new();
    for i in 0..clients {
        // Every client goes through a relay that counts: client 0's download and client 1's
        // upload are cut at half; client 2's download and client 3's upload (and the rest) pass
        // whole, the same transfers unbroken.
        let cut = match i {
            0 => Cut::Back(model_bytes / 2),
            1 => Cut::Forth(model_bytes / 2),
            2 => Cut::Back(u64::MAX),
            _ => Cut::Forth(u64::MAX),
        };
        let (port, through) = cutting_relay(upstream, cut).await;
        let state = dir.path().join(format!("client{i}"));
        let sdk = Client::connect(
            ClientConfig::new(format!("https://127.0.0.1:{port}"), &server.ca, &state),
            Some(&admin.enrolment_token().await),
        )
        .await
        .expect("enrol");
        reset_peak();
        let offer = sdk
            .join("large")
            .await
            .expect("join")
            .offer
            .expect("selected");
        chunk = offer.upload_chunk_bytes.unwrap_or(0);
        let started = Instant::now();
        let global = sdk.model("large", &offer.model).await.expect("the model");
        let downloaded = started.elapsed();
        // The update, in the downloaded model's place: a client holds two models at most.
        let mut update = global;
        update
            .data_mut()
            .iter_mut()
            .enumerate()
            .for_each(|(j, v)| *v = ((j as u64 * 7 + i) % 13) as f32 * 1e-4);
        let before = admin.metric("hora_upload_bytes_total").await;
        let started = Instant::now();
        let receipt = sdk
            .upload("large", &offer, &update, &meta)
            .await
            .expect("the upload");
        let uploaded = started.elapsed();
        assert!(receipt.is_some(), "client {i}: no receipt");
        // What the server took: the update and its chunks' envelopes.
        let size = (admin.metric("hora_upload_bytes_total").await - before) as u64;
        drop(update);
        client_peak = client_peak.max(peak_rss(std::process::id()).unwrap_or(0));
        let is_cut = i < 2;
        let down = matches!(cut, Cut::Back(_));
        passed.push((is_cut, down, through.load(Ordering::SeqCst)));
        println!(
            "  client {i}: download {:.1} s{}, upload {:.1} s{}",
            downloaded.as_secs_f64(),
            if i == 0 {
                " (cut at half, resumed)"
            } else {
                ""
            },
            uploaded.as_secs_f64(),
            match i {
                1 => " (cut at half, resumed)",
                _ if i + 1 == clients =>
                    " (the last: its acknowledgement waits for the round's close)",
                _ => "",
            }
        );
        // Rates of the transfers neither cut nor waiting for the close.
        if i != 0 {
            downloads.push(mb_per_s(model_bytes, downloaded));
        }
        if i != 1 && i + 1 != clients {
            uploads.push(mb_per_s(size, uploaded));
        }
        // (Its model cache goes: disk for the next client.)
        let _ = std::fs::remove_dir_all(&state);
    }
    for (what, down) in [("download", true), ("upload", false)] {
        let bytes = |cut: bool| {
            passed
                .iter()
                .find(|&&(c, d, _)| c == cut && d == down)
                .map(|&(_, _, n)| n)
        };
        if let (Some(cut), Some(whole)) = (bytes(true), bytes(false)) {
            resent.push(format!(
                "  {what} cut at half and resumed: {cut} bytes through the relay, {whole} unbroken: {} more ({:.3}% of the model; one chunk is {} bytes)",
                cut.saturating_sub(whole),
                cut.saturating_sub(whole) as f64 * 100.0 / model_bytes as f64,
                chunk
            ));
        }
    }
    // Published once the last update is folded and the model written.
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let info: TaskInfo = admin
            .ok(admin.request(Method::GET, "/admin/v1/tasks/large"))
            .await;
        if info.state == TaskState::Finished {
            break;
        }
        assert!(Instant::now() < deadline, "the round did not publish");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let round = round_started.elapsed();
    let server_peak = admin.metric("process_resident_memory_peak_bytes").await as u64;
    let bound = 3 * model_bytes + 100_000_000;
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    println!(
        "  client download (resumable; through a relay): {:8.0} MB/s ({:.2} of the TLS limit)",
        mean(&downloads),
        mean(&downloads) / tls
    );
    println!(
        "  client upload (chunked; through a relay): {:8.0} MB/s ({:.2} of the TLS limit; sealing and the fold included)",
        mean(&uploads),
        mean(&uploads) / tls
    );
    println!(
        "  round wall time: {:.1} s ({clients} clients one after another: join, download, upload; then the publication)",
        round.as_secs_f64()
    );
    println!(
        "  server peak RSS: {:.0} MB = {:.2} x the model; bound 3 x {:.0} MB + 100 MB = {:.0} MB -> {}",
        server_peak as f64 / 1e6,
        server_peak as f64 / model_bytes as f64,
        model_bytes as f64 / 1e6,
        bound as f64 / 1e6,
        if server_peak <= bound { "within" } else { "OVER" }
    );
    println!(
        "  client peak RSS (one client at a time, this process): {:.0} MB = {:.2} x the model",
        client_peak as f64 / 1e6,
        client_peak as f64 / model_bytes as f64
    );
    for line in resent {
        println!("{line}");
    }
    server.kill();
    // What the bench also checks: the server's memory stays within its bound for a model this
    // large (the command fails when it does not).
    assert!(
        server_peak <= bound,
        "the server's peak RSS {server_peak} exceeds the bound of 3 x the model + 100 MB ({bound})"
    );
}

/// MB/s of one TLS stream of `bytes` from this process to a rustls listener in it, with the
/// server's development certificate: the most a transfer to the server can hope for here.
async fn loopback_tls(server: &Server, bytes: u64) -> f64 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let certs = server.ca.parent().expect("the certificates' directory");
    let config = hora_server::tls::server_config(
        &hora_server::tls::CertPaths {
            cert: certs.join("server.pem"),
            key: certs.join("server-key.pem"),
        },
        None,
    )
    .expect("a TLS configuration");
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("address");
    let received = Arc::new(AtomicU64::new(0));
    let counted = received.clone();
    let sink = tokio::spawn(async move {
        let (tcp, _) = listener.accept().await.expect("accept");
        let mut tls = acceptor.accept(tcp).await.expect("handshake");
        let mut buf = vec![0u8; 1 << 20];
        loop {
            match tls.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    counted.fetch_add(n as u64, Ordering::Relaxed);
                }
            }
        }
    });
    let client = hora_common::tls::client_config(&server.ca, None).expect("client TLS");
    let connector = tokio_rustls::TlsConnector::from(Arc::new(client));
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let name = rustls_pki_types::ServerName::try_from("localhost").expect("a name");
    let mut tls = connector.connect(name, tcp).await.expect("handshake");
    let buf = vec![7u8; 1 << 20];
    let started = Instant::now();
    let mut sent = 0;
    while sent < bytes {
        let n = buf.len().min((bytes - sent) as usize);
        tls.write_all(&buf[..n]).await.expect("write");
        sent += n as u64;
    }
    tls.shutdown().await.expect("close");
    sink.await.expect("the sink");
    assert_eq!(received.load(Ordering::SeqCst), bytes);
    mb_per_s(bytes, started.elapsed())
}
