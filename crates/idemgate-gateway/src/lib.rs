//! The `idemgate` reverse proxy: the layer in front of any HTTP upstream.
//!
//! ```text
//! idemgate [--config FILE] [--listen ADDR] [--upstream URL] [--store STORE] [--ttl DURATION]
//!          [--admin-listen ADDR] [--admin-token TOKEN] [--log-format text|json]
//! idemgate --check-config --config FILE
//! STORE: memory | redb:PATH | redis://HOST:PORT[/DB] | rediss://HOST:PORT[/DB]
//!        | postgres://USER[:PASSWORD]@HOST[:PORT]/DB[?sslmode=…] | postgresql://…
//! ```
//!
//! - [`config`]: the TOML file, overrides and validation.
//! - [`forward`]: the forwarder to the upstream: targets, header rules, upstream failures.
//! - [`pool`]: the keep-alive connections to the upstream.
//! - [`http1`]: the gateway's own HTTP/1.1, one codec for both directions: the loop that
//!   serves plain requests from clients, and the client of an upstream connection
//!   ([`http1::client`]).
//! - [`server`]: the listeners, connection limits, graceful shutdown.
//! - `watchdog`: closes client connections too slow to send a head, or idle too long.
//! - [`admin`]: health, readiness, metrics and the record endpoints.
//! - [`metrics`]: counters, histograms and the instrumented store.
//! - [`logging`]: the log lines on standard error, written in batches.

pub mod admin;
pub mod config;
pub mod forward;
pub mod http1;
pub mod logging;
pub mod metrics;
pub mod pool;
pub mod server;
mod watchdog;

use idemgate::ErrorChain;
use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, ValueEnum};

use self::config::{Overrides, Settings};

/// The command line. Every option can also come from an `IDEMGATE_*` environment variable;
/// a flag wins over the variable, and both win over the config file.
#[derive(Debug, Parser)]
#[command(
    name = "idemgate",
    version,
    about = "HTTP idempotency-key gateway: runs each keyed request once and replays its response to retries"
)]
pub struct Cli {
    /// TOML config file (see config/idemgate.toml).
    #[arg(long, env = "IDEMGATE_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Proxy listener address [default: 127.0.0.1:8080].
    #[arg(long, env = "IDEMGATE_LISTEN", value_name = "ADDR")]
    pub listen: Option<String>,
    /// The upstream's base URL, e.g. http://127.0.0.1:3000.
    #[arg(long, env = "IDEMGATE_UPSTREAM", value_name = "URL")]
    pub upstream: Option<String>,
    /// memory | redb:PATH | redis://HOST:PORT[/DB] | rediss://… (TLS) |
    /// postgres://USER@HOST:PORT/DB?sslmode=… or postgresql://… (password in the URL or
    /// PGPASSWORD) [default: redb:./data/idemgate.redb].
    #[arg(long, env = "IDEMGATE_STORE", value_name = "STORE")]
    pub store: Option<String>,
    /// Record lifetime for routes that do not set their own (30s, 24h, 3d, 1h 30m).
    #[arg(
        long,
        env = "IDEMGATE_TTL",
        value_name = "DURATION",
        value_parser = config::parse_duration
    )]
    pub ttl: Option<Duration>,
    /// Admin listener address [default: 127.0.0.1:9090].
    #[arg(long, env = "IDEMGATE_ADMIN_LISTEN", value_name = "ADDR")]
    pub admin_listen: Option<String>,
    /// Bearer token for the admin record endpoints (prefer the environment variable).
    #[arg(
        long,
        env = "IDEMGATE_ADMIN_TOKEN",
        value_name = "TOKEN",
        hide_env_values = true
    )]
    pub admin_token: Option<String>,
    /// Forward request header fields whose names contain `_` (`X_Api_Key`); by default they
    /// are dropped, as nginx does [default: false].
    #[arg(
        long,
        env = "IDEMGATE_UNDERSCORES_IN_HEADERS",
        value_name = "BOOL",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true"
    )]
    pub underscores_in_headers: Option<bool>,
    /// Log line format.
    #[arg(long, env = "IDEMGATE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Check the configuration, print `ok` and exit.
    #[arg(long)]
    pub check_config: bool,
}

/// How log lines are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

impl Cli {
    /// The values that override the config file.
    pub fn overrides(&self) -> Overrides {
        Overrides {
            listen: self.listen.clone(),
            admin_listen: self.admin_listen.clone(),
            upstream: self.upstream.clone(),
            store: self.store.clone(),
            ttl: self.ttl,
            admin_token: self.admin_token.clone(),
            underscores_in_headers: self.underscores_in_headers,
        }
    }
}

/// Runs the command line: checks the configuration, or runs the gateway until SIGTERM or
/// SIGINT. Errors are written to standard error and give a failing exit code.
pub fn run_cli(cli: &Cli) -> ExitCode {
    let exit = check_or_serve(cli);
    logging::STDERR.flush();
    exit
}

fn check_or_serve(cli: &Cli) -> ExitCode {
    let settings = match Settings::load(cli.config.as_deref(), &cli.overrides()) {
        Ok(settings) => settings,
        Err(error) => {
            logging::STDERR.print_line(format_args!(
                "idemgate: invalid configuration: {}",
                ErrorChain(&error)
            ));
            return ExitCode::from(2);
        }
    };
    if cli.check_config {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(
            out,
            "ok: upstream {}, store {}, {} route(s)",
            settings.upstream.uri,
            settings.store,
            settings.routes.len()
        );
        return ExitCode::SUCCESS;
    }
    // On one core (a small container, or a process pinned with taskset) a single-threaded
    // runtime serves the same load with fewer thread wake-ups: in the load benchmark it used
    // about a fifth less CPU per request than a one-worker multi-threaded runtime.
    let one_core = std::thread::available_parallelism().is_ok_and(|n| n.get() == 1);
    let mut runtime = if one_core {
        tokio::runtime::Builder::new_current_thread()
    } else {
        tokio::runtime::Builder::new_multi_thread()
    };
    // A thread out of work writes the log lines gathered so far (see `logging`).
    let runtime = runtime
        .enable_all()
        .on_thread_park(|| logging::STDERR.flush())
        .build();
    let runtime = match runtime {
        Ok(runtime) => runtime,
        Err(error) => {
            logging::STDERR.print_line(format_args!(
                "idemgate: cannot start the async runtime: {error}"
            ));
            return ExitCode::FAILURE;
        }
    };
    let served = runtime.block_on(async {
        let flusher = tokio::spawn(logging::flush_periodically(&logging::STDERR));
        let served = server::run(settings, shutdown_signal()).await;
        flusher.abort();
        served
    });
    match served {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            tracing::error!(error = %ErrorChain(&error), "idemgate could not start");
            logging::STDERR.print_line(format_args!("idemgate: {}", ErrorChain(&error)));
            ExitCode::FAILURE
        }
    }
}

/// Resolves on the first SIGTERM or SIGINT. The handlers are installed when this is called
/// (inside a Tokio runtime), not when the future is first polled, so a signal that arrives
/// while the gateway is still starting is not lost to the default action.
pub fn shutdown_signal() -> impl Future<Output = ()> + Send {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let handlers = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        );
        async move {
            match handlers {
                (Ok(mut term), Ok(mut int)) => {
                    tokio::select! {
                        _ = term.recv() => tracing::info!("SIGTERM received"),
                        _ = int.recv() => tracing::info!("SIGINT received"),
                    }
                }
                _ => {
                    tracing::warn!("cannot install signal handlers; falling back to Ctrl-C only");
                    let _ = tokio::signal::ctrl_c().await;
                }
            }
        }
    }
    #[cfg(not(unix))]
    {
        async {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ttl_flag_reads_durations_as_the_file_does() {
        let cli = Cli::try_parse_from(["idemgate", "--ttl", "1h 30m"]).unwrap();
        assert_eq!(cli.overrides().ttl, Some(Duration::from_secs(5400)));
        let error = Cli::try_parse_from(["idemgate", "--ttl", "3 parsecs"])
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("--ttl") && error.contains("\"3 parsecs\" is not a duration"),
            "{error}"
        );
    }
}
