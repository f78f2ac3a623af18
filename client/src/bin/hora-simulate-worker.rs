//! `hora-simulate-worker`: trains virtual clients for a simulated federation with the built-in
//! trainer (`hora-server simulate` starts these and speaks to them over standard input and
//! output; see `hora_client::simulate`).
//!
//! A program of its own rather than a `hora-client` subcommand so that it links libtorch
//! without its CUDA half: a worker trains on one CPU thread, and libtorch_cuda's start-up alone
//! costs each process about 120 MB of memory (`build.rs` keeps CUDA for `hora-client` only).

use std::process::ExitCode;

fn main() -> ExitCode {
    let format = hora_common::logging::LogFormat::from_env();
    hora_common::logging::init(format, "warn");
    let served = hora_client::simulate::builtin::serve(
        std::io::stdin().lock(),
        std::io::BufWriter::new(std::io::stdout().lock()),
    );
    match served {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            hora_common::logging::fatal(format, &e.to_string());
            ExitCode::FAILURE
        }
    }
}
