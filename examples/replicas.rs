//! Running more than one server, on one machine: a PostgreSQL server of its own (initdb and
//! `postgres` in a temporary directory, on a free loopback port), three `hora-server` replicas on
//! it with their blobs in one shared directory, and a federation of `hora-client` processes that
//! are given all three URLs, each starting at another, so they spread over the replicas. The
//! first replica leads (it holds the database's lease), the others follow: all three take the
//! clients' joins and uploads, each into a partial sum the leader merges. After round 2 the
//! leader is SIGKILLed: a follower takes the lease once it lapses, the leader's clients fail over,
//! and the federation finishes, every acknowledged update kept. It prints `hora-server status`
//! before and after, the failover time and each round.
//!
//! This is `make replicas` (`cargo run --release --example replicas`; `--replicas`,
//! `--clients`, `--rounds`, `--kill-after` and `--lease-secs` change it). Nothing is left
//! running when it ends.

#[path = "support/federation.rs"]
mod federation;

/// The throwaway PostgreSQL server the store's tests start, this same file.
#[allow(dead_code)]
#[path = "../server/src/store/postgres/test_server.rs"]
mod test_server;

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Parser;
use hora_client::data::synthetic::{self, SyntheticConfig};
use hora_client::data::Dataset;
use hora_client::network::{Architecture, Network};
use hora_client::supervised::{evaluate, DeviceData};
use hora_common::wire::{CreateTask, TrainingConfig};
use tch::Device;

use federation::{binary, Federation};

#[derive(Parser)]
struct Args {
    #[arg(long, default_value_t = 3)]
    replicas: usize,
    #[arg(long, default_value_t = 6)]
    clients: usize,
    #[arg(long, default_value_t = 6)]
    rounds: u64,
    /// SIGKILL the leader once this round is published (0: never).
    #[arg(long, default_value_t = 2)]
    kill_after: u64,
    /// The replicas' lease, in seconds: a dead leader is replaced within it and a second.
    #[arg(long, default_value_t = 3)]
    lease_secs: u64,
}

/// `hora-server status` of the database, as it prints it.
fn status(store: &str) -> Result<String> {
    let out = std::process::Command::new(binary("hora-server")?)
        .args(["status", "--store", store])
        .output()
        .context("running hora-server status")?;
    anyhow::ensure!(
        out.status.success(),
        "hora-server status: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    anyhow::ensure!(
        args.replicas >= 2,
        "give at least 2 replicas: one leads, one takes over"
    );
    tch::set_num_threads(1);
    let postgres = test_server::TestServer::start();
    let store = postgres.url();
    let mut fed = Federation::start_replicas(args.replicas, &store, args.lease_secs)?;
    println!(
        "PostgreSQL at {store}; {} replicas at {} (blobs in {}), lease {} s",
        args.replicas,
        fed.urls.join(", "),
        fed.dir.path().join("blobs").display(),
        args.lease_secs
    );

    let config = SyntheticConfig::non_iid(1.0, 1.0, args.clients, 0);
    let shards = synthetic::shards(&config)?;
    let pooled_test = Dataset::concat(&shards.iter().map(|s| &s.test).collect::<Vec<_>>())?;
    let test = DeviceData::new(&pooled_test, Device::Cpu)?;
    let arch = Architecture::Logreg {
        inputs: config.dim,
        classes: config.classes,
    };
    tch::manual_seed(0);
    let initial = Network::builtin(&arch, Device::Cpu)?.weights()?;
    let digest = fed.upload_model(&initial).await?;
    let task = "replicated";
    fed.create_task(&CreateTask {
        parent: None,
        trainable: None,
        evaluation: None,
        compression: None,
        id: task.into(),
        initial_model: digest,
        model: arch.to_kind(),
        strategy: Default::default(),
        rounds: args.rounds,
        min_clients: args.clients as u32,
        target_clients: args.clients as u32,
        over_selection: 0.0,
        round_deadline_secs: 300,
        training: TrainingConfig::default(),
        secure_aggregation: None,
        update_bounds: Default::default(),
        differential_privacy: None,
        asynchronous: None,
    })
    .await?;
    // (Once every replica serves: a client given a standby first moves on to the leader.)
    fed.wait_serving(Duration::from_secs(60)).await?;
    fed.spawn_clients(task, &config.to_string(), args.clients, &["--seed", "{k}"])
        .await?;
    // (Once each replica that does not lead has said in a heartbeat that it follows: a second
    // at most.)
    let mut shown = status(&store)?;
    for _ in 0..25 {
        if !shown.contains("  standby ") {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        shown = status(&store)?;
    }
    print!("{shown}");

    println!(
        "{:>5}  {:>7}  {:>8}  {:>13}  {:>7}",
        "round", "clients", "examples", "test accuracy", "leader"
    );
    let (mut leader, mut failover) = (0, None);
    for round in 1..=args.rounds {
        let record = fed
            .wait_round(task, round, Duration::from_secs(600))
            .await?;
        let model = fed.round_model(task, round).await?;
        let mut net = Network::builtin(&arch, Device::Cpu)?;
        net.set_weights(&model)?;
        let accuracy = evaluate(&mut net, &test, 4096)?.accuracy;
        println!(
            "{:>5}  {:>7}  {:>8}  {:>13.4}  {:>7}",
            round,
            record.participants.len(),
            record.examples,
            accuracy,
            format!("#{leader}")
        );
        if round == args.kill_after && round < args.rounds {
            fed.kill_server(leader);
            let killed = Instant::now();
            leader = fed.wait_leader(Duration::from_secs(args.lease_secs + 60))?;
            let took = killed.elapsed();
            println!(
                "SIGKILLed the leader; replica #{leader} leads {:.2} s later (lease {} s)",
                took.as_secs_f64(),
                args.lease_secs
            );
            failover = Some(took);
        }
    }
    fed.wait_clients(Duration::from_secs(120))?;
    print!("{}", status(&store)?);
    match failover {
        Some(took) => println!(
            "the federation finished on replica #{leader} after a failover of {:.2} s",
            took.as_secs_f64()
        ),
        None => println!("the federation finished on replica #{leader}"),
    }
    Ok(())
}
