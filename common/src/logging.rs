//! How Hora's programs log: to standard error, filtered by `HORA_LOG` (a `tracing` filter such
//! as `info` or `warn,hora_server=debug`), as lines for people or, for a log collector, as one
//! JSON object per event (`--log-format json`, or `HORA_LOG_FORMAT=json`).

use tracing_subscriber::EnvFilter;

/// The logging flag every program takes (`#[command(flatten)]`).
#[derive(Debug, Clone, clap::Args)]
pub struct LogArgs {
    /// How logs are written to standard error: `text` for people, `json` (one object per line)
    /// for a log collector. Which events: `HORA_LOG` (for example `warn` or `info,hora=debug`).
    #[arg(
        long,
        global = true,
        value_enum,
        env = "HORA_LOG_FORMAT",
        default_value_t = LogFormat::Text
    )]
    pub log_format: LogFormat,
}

/// How log events are written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Lines for people (in colour on a terminal).
    #[default]
    Text,
    /// One JSON object per line: `timestamp`, `level`, `target`, the event's `fields` (its
    /// `message` among them), and the `span` it happened in with that span's fields.
    Json,
}

impl LogFormat {
    /// The format `HORA_LOG_FORMAT` names (`text` or `json`, any case), for programs without
    /// flags (the Python package); text when it is unset or unknown.
    pub fn from_env() -> LogFormat {
        std::env::var("HORA_LOG_FORMAT")
            .ok()
            .and_then(|v| <LogFormat as clap::ValueEnum>::from_str(&v, true).ok())
            .unwrap_or_default()
    }
}

/// Starts logging for this process as `format` says, filtered by `HORA_LOG` or else
/// `default_filter`. Once per process: later calls (a second `import` of the Python package) do
/// nothing.
pub fn init(format: LogFormat, default_filter: &str) {
    let filter =
        EnvFilter::try_from_env("HORA_LOG").unwrap_or_else(|_| EnvFilter::new(default_filter));
    let logger = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    // (An error here is a logger set already.)
    let _ = match format {
        LogFormat::Text => logger
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .try_init(),
        LogFormat::Json => logger
            .json()
            .with_current_span(true)
            .with_span_list(false)
            .try_init(),
    };
}

/// Reports the error that ends the program: `error: …` on standard error for people, or, with
/// [`LogFormat::Json`], an ERROR event whose `error` field holds it, so a log collector sees why.
pub fn fatal(format: LogFormat, error: &str) {
    match format {
        LogFormat::Text => eprintln!("error: {error}"),
        LogFormat::Json => tracing::error!(error, "stopped"),
    }
}
