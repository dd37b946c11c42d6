//! The `idemgate` binary: parses the command line, sets up logging, and runs the gateway
//! (all of it lives in [`idemgate::proxy`]).

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::Parser;
use idemgate::proxy::{Cli, LogFormat, run_cli};
use tracing_subscriber::EnvFilter;

// A gateway allocates and frees a few dozen small objects per request while the memory store
// holds records freed seconds later; glibc's allocator spent a sixth of the CPU of a new-key
// request in its slow path under that mix (see BENCHMARKS.md). mimalloc keeps per-size free
// lists without that cost. Its 2.x line (the `v2` feature): Rust asks for every allocation
// with its alignment, and 3.x answers those that miss its fast path (a refill, anything over
// 1 KiB) by over-allocating unless the size is a power of two, about 5 times per request
// here; 2.x serves alignments up to 16 bytes from the plain size class.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    // IDEMGATE_LOG takes the usual filter syntax (`info`, `idemgate=debug,hyper=warn`).
    let filter = EnvFilter::try_from_env("IDEMGATE_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    match cli.log_format {
        LogFormat::Text => logs.init(),
        LogFormat::Json => logs.json().init(),
    }
    run_cli(&cli)
}
