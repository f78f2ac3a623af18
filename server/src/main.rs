//! `hora-server`: serve, make development certificates, administer a running server, or migrate
//! a PostgreSQL store's schema.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{ArgMatches, CommandFactory, FromArgMatches, Parser, Subcommand};
use hora_common::{config as layers, logging};
use hora_server::store::StoreLocation;
use hora_server::{admin_cli, config, tls};

#[derive(Parser)]
#[command(
    name = "hora-server",
    version = concat!(env!("CARGO_PKG_VERSION"), " (commit ", env!("HORA_COMMIT"), ")"),
    about = "Hora federated-learning aggregation server"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    #[command(flatten)]
    logging: logging::LogArgs,
}

// Parsed once, on main's stack: the size of its largest variant costs nothing.
// No Debug: it holds secrets (the admin token, a store URL's password).
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Run the server (HTTPS always; development certificates are made when none are given).
    Serve(config::ServeArgs),
    /// Make development certificates: a CA, a server certificate, and client certificates.
    Certs {
        #[arg(long, default_value = "certs")]
        dir: PathBuf,
        /// Extra host names or IPs for the server certificate.
        #[arg(long = "host")]
        hosts: Vec<String>,
        /// Client certificates to make, for mutual TLS.
        #[arg(long = "client")]
        clients: Vec<String>,
    },
    /// Drive a running server through its admin API.
    Admin(admin_cli::AdminArgs),
    /// Check a configuration before running with it.
    Config {
        #[command(subcommand)]
        command: ConfigCommand,
    },
    #[command(flatten)]
    Docs(layers::DocsCommand),
    /// Bring a PostgreSQL store's schema up to this hora-server's (`serve` does it too, at
    /// start); prints the migrations it applied.
    Migrate {
        /// The database: postgres://user:password@host:port/database.
        #[arg(long, env = "HORA_STORE", hide_env_values = true)]
        store: String,
    },
    /// Simulate a federation of virtual clients in this process: the round engine of `serve`
    /// over an in-process store, the clients trained by `hora-client` worker processes, on a
    /// simulated clock; prints one row per round.
    Simulate(hora_server::simulation::cli::SimulateArgs),
    /// Show the replicas that share a PostgreSQL store: which one leads (its lease, epoch and
    /// last renewal), which stand by, each one's last heartbeat, and the tasks.
    Status {
        /// The database: postgres://user:password@host:port/database.
        #[arg(long, env = "HORA_STORE", hide_env_values = true)]
        store: String,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
}

#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum ConfigCommand {
    /// Print every option `serve` would run with (given the same flags, environment and
    /// --config file), its value and where it came from (flag, environment, file or default),
    /// secrets masked; fails, saying why, on a configuration `serve` would refuse.
    Check {
        /// Print JSON instead of text: {"key": {"value": …, "source": "flag", "from": "--listen"}}.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        serve: config::ServeArgs,
    },
}

/// The PostgreSQL database `--store` names (the embedded store has no replicas or schema).
fn postgres_target(store: &str, what: &str) -> Result<hora_server::store::postgres::Target> {
    match store.parse().map_err(|e| anyhow::anyhow!("--store: {e}"))? {
        StoreLocation::Postgres(target) => Ok(*target),
        StoreLocation::Sled => anyhow::bail!("--store sled: {what}"),
    }
}

/// Environment variables renamed for one naming scheme across Hora's programs: (old, new).
const RENAMED_ENV: [(&str, &str); 1] = [("HORA_URL", "HORA_SERVER")];

fn main() -> std::process::ExitCode {
    let renamed = layers::rename_env(&RENAMED_ENV);
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    // (A simulation's table is its output: the engine's per-round log lines would bury it.)
    let level = match cli.command {
        Command::Simulate(_) => "warn",
        _ => "info",
    };
    logging::init(cli.logging.log_format, level);
    layers::warn_renamed(&renamed);
    match run(cli.command, &matches) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            logging::fatal(cli.logging.log_format, &format!("{e:#}"));
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(command: Command, all: &ArgMatches) -> Result<()> {
    let runtime = tokio::runtime::Runtime::new()?;
    let matches = layers::leaf(all);
    match command {
        Command::Serve(args) => runtime.block_on(hora_server::serve(config::ServeConfig::resolve(
            &args, matches,
        )?)),
        Command::Docs(docs) => docs.run(Cli::command()).map_err(anyhow::Error::msg),
        Command::Config {
            command: ConfigCommand::Check { json, serve },
        } => {
            let layered = config::ServeConfig::layered(&serve, matches)?;
            let mut report = layered.report();
            let resolved = config::ServeConfig::from_layered(layered)?;
            for setting in &mut report {
                if setting.key == "store" {
                    // The database without its password.
                    setting.value = match &resolved.store {
                        StoreLocation::Sled => "sled".into(),
                        StoreLocation::Postgres(target) => format!("postgres://{target}").into(),
                    };
                }
            }
            println!("{}", layers::render(&report, json)?);
            Ok(())
        }
        Command::Certs {
            dir,
            hosts,
            clients,
        } => {
            let server = tls::make_dev_certs(&dir, &hosts)?;
            println!("CA:     {}", dir.join(tls::CA_CERT).display());
            println!(
                "server: {} (key {})",
                server.cert.display(),
                server.key.display()
            );
            for name in clients {
                let c = tls::make_client_cert(&dir, &name)?;
                println!("client: {} (key {})", c.cert.display(), c.key.display());
            }
            Ok(())
        }
        Command::Admin(args) => {
            let admin = all.subcommand_matches("admin").unwrap_or(matches);
            runtime.block_on(admin_cli::run(args, admin))
        }
        Command::Status { store, json } => {
            let target = postgres_target(
                &store,
                "the embedded store belongs to one server; ask it (GET /readyz, the admin API)",
            )?;
            let status = hora_server::store::postgres::status(&target).with_context(|| {
                format!("reading the replicas of the PostgreSQL store at {target}")
            })?;
            if json {
                println!("{}", serde_json::to_string_pretty(&status)?);
            } else {
                print_status(&status);
            }
            Ok(())
        }
        Command::Simulate(args) => runtime.block_on(hora_server::simulation::cli::run(args)),
        Command::Migrate { store } => {
            let target = postgres_target(
                &store,
                "the embedded store has no schema to migrate (it upgrades itself when it opens)",
            )?;
            let applied = hora_server::store::postgres::migrate(&target)
                .with_context(|| format!("migrating the PostgreSQL store at {target}"))?;
            if applied.is_empty() {
                println!("{target}: the schema is up to date");
            }
            for name in applied {
                println!("{target}: applied {name}");
            }
            Ok(())
        }
    }
}

/// `hora-server status` as text.
fn print_status(status: &hora_server::store::postgres::Status) {
    println!("database {}", status.database);
    match &status.lease {
        None => println!("lease: never taken (no replica has served on this database yet)"),
        Some(l) if l.expires_in_secs > 0.0 => println!(
            "lease: held by {} ({}), epoch {}, renewed {:.1} s ago, expires in {:.1} s",
            l.holder, l.address, l.epoch, l.renewed_secs_ago, l.expires_in_secs
        ),
        Some(l) => println!(
            "lease: LAPSED {:.1} s ago (last holder {}, epoch {}): no replica leads; a standby takes it at its next poll",
            -l.expires_in_secs, l.holder, l.epoch
        ),
    }
    println!("replicas: {}", status.replicas.len());
    for r in &status.replicas {
        println!(
            "  {:<8} {}  at {}  version {}  last heartbeat {:.1} s ago",
            r.role, r.id, r.address, r.version, r.seen_secs_ago
        );
    }
    println!(
        "tasks: {} ({} with a round open)",
        status.tasks, status.open_rounds
    );
}
