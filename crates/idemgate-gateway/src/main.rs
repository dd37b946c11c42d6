//! The `idemgate` binary: parses the command line, sets up logging, and runs the gateway
//! (all of it lives in the [`idemgate_gateway`] library).

use std::process::ExitCode;

use clap::Parser;
use idemgate_gateway::{Cli, logging, run_cli};

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
    logging::init(cli.log_format);
    run_cli(&cli)
}
