//! `hora-server`: serve, make development certificates, or administer a running server.

use std::path::PathBuf;

use anyhow::Result;
use clap::{Parser, Subcommand};
use hora_server::{admin_cli, config, tls};

#[derive(Debug, Parser)]
#[command(
    name = "hora-server",
    version,
    about = "Hora federated-learning aggregation server"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

// Parsed once at start: the size of the largest variant costs nothing worth boxing it for.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
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
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("HORA_LOG")
                .unwrap_or_else(|_| "info,hora_server=info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let runtime = tokio::runtime::Runtime::new()?;
    match cli.command {
        Command::Serve(args) => {
            runtime.block_on(hora_server::serve(config::ServeConfig::resolve(args)?))
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
        Command::Admin(args) => runtime.block_on(admin_cli::run(args)),
    }
}
