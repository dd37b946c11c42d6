//! The `idemgate` reverse proxy: the layer in front of any HTTP upstream.
//!
//! ```text
//! idemgate [--config FILE] [--listen ADDR] [--upstream URL] [--store STORE] [--ttl DURATION]
//!          [--admin-listen ADDR] [--admin-token TOKEN] [--log-format text|json]
//! idemgate --check-config --config FILE
//! idemgate consume --source redis-stream://HOST:PORT/STREAM?group=G --key-field FIELD
//!          --upstream URL [--store STORE] [--config FILE] [--admin-listen ADDR] [...]
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
//! - [`consume`]: `idemgate consume`, the idempotent consumer of a queue.
//! - `watchdog`: closes client connections too slow to send a head, or idle too long.
//! - [`admin`]: health, readiness, metrics and the record endpoints.
//! - [`metrics`]: counters, histograms and the instrumented store.
//! - [`logging`]: the log lines on standard error, written in batches.

pub mod admin;
pub mod config;
pub mod consume;
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
    #[arg(long, env = "IDEMGATE_CONFIG", value_name = "FILE", global = true)]
    pub config: Option<PathBuf>,
    /// Proxy listener address [default: 127.0.0.1:8080].
    #[arg(long, env = "IDEMGATE_LISTEN", value_name = "ADDR")]
    pub listen: Option<String>,
    /// The upstream's base URL, e.g. http://127.0.0.1:3000.
    #[arg(long, env = "IDEMGATE_UPSTREAM", value_name = "URL", global = true)]
    pub upstream: Option<String>,
    /// memory | redb:PATH | redis://HOST:PORT[/DB] | rediss://… (TLS) |
    /// postgres://USER@HOST:PORT/DB?sslmode=… or postgresql://… (password in the URL or
    /// PGPASSWORD) [default: redb:./data/idemgate.redb].
    #[arg(long, env = "IDEMGATE_STORE", value_name = "STORE", global = true)]
    pub store: Option<String>,
    /// Record lifetime for routes that do not set their own (30s, 24h, 3d, 1h 30m).
    #[arg(
        long,
        env = "IDEMGATE_TTL",
        value_name = "DURATION",
        global = true,
        value_parser = config::parse_duration
    )]
    pub ttl: Option<Duration>,
    /// Admin listener address [default: 127.0.0.1:9090].
    #[arg(
        long,
        env = "IDEMGATE_ADMIN_LISTEN",
        value_name = "ADDR",
        global = true
    )]
    pub admin_listen: Option<String>,
    /// Bearer token for the admin record endpoints (prefer the environment variable).
    #[arg(
        long,
        env = "IDEMGATE_ADMIN_TOKEN",
        value_name = "TOKEN",
        global = true,
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
    #[arg(long, env = "IDEMGATE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    pub log_format: LogFormat,
    /// Check the configuration, print `ok` and exit.
    #[arg(long, global = true)]
    pub check_config: bool,
    /// Run the proxy (no command), or consume a queue.
    #[command(subcommand)]
    pub command: Option<Command>,
}

/// What the binary runs besides the proxy.
#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Deliver each message of a queue (a Redis stream) to an HTTP handler once, through the
    /// same layer and store as the proxy (see docs/consume.md).
    Consume(ConsumeArgs),
}

/// `idemgate consume`: one source from the flags, beside the config file's `[[sources]]`.
/// `--upstream` is the handler's URL, path included. The source's other flags describe only
/// the `--source` beside them, so each needs it: without it, one would seem to apply to the
/// file's sources and would not.
#[derive(Debug, clap::Args)]
pub struct ConsumeArgs {
    /// redis-stream://HOST:PORT/STREAM?group=GROUP[&consumer=NAME] [default consumer:
    /// HOSTNAME-PID].
    #[arg(long, value_name = "URL")]
    pub source: Option<String>,
    /// The field holding each message's own id, or FIELD:/json/pointer into a JSON field
    /// (payload:/id).
    #[arg(long, value_name = "FIELD", requires = "source")]
    pub key_field: Option<String>,
    /// Use the stream entry id as the key when the key field is missing [default: false].
    #[arg(long, requires = "source")]
    pub entry_id_fallback: bool,
    /// The field sent as the body; without it, the entry's fields as a JSON object
    /// [default: payload].
    #[arg(long, value_name = "FIELD", requires = "source")]
    pub payload_field: Option<String>,
    /// Messages delivered at once [default: 64].
    #[arg(long, value_name = "N", requires = "source")]
    pub max_in_flight: Option<usize>,
    /// Tries of a message the handler refuses before it is dead-lettered [default: 5].
    #[arg(long, value_name = "N", requires = "source")]
    pub max_attempts: Option<u32>,
    /// Wait before the second try, doubling after [default: 500ms].
    #[arg(long, value_name = "DURATION", requires = "source")]
    pub retry_backoff: Option<String>,
    /// Idle time after which a dead consumer's pending message is taken over [default: the
    /// route's lease].
    #[arg(long, value_name = "DURATION", requires = "source")]
    pub claim_idle: Option<String>,
    /// Where dead letters go [default: STREAM.dead].
    #[arg(long, value_name = "STREAM", requires = "source")]
    pub dead_letter_stream: Option<String>,
}

impl ConsumeArgs {
    /// The source the flags describe, as a `[[sources]]` table beside the file's; `None`
    /// without `--source` (clap refuses the other source flags without it).
    fn source_table(&self) -> Option<consume::config::SourceFile> {
        Some(consume::config::SourceFile {
            url: Some(self.source.clone()?),
            key_field: self.key_field.clone(),
            entry_id_fallback: Some(self.entry_id_fallback),
            payload_field: self.payload_field.clone(),
            upstream: None,
            max_in_flight: self.max_in_flight,
            max_attempts: self.max_attempts,
            retry_backoff: self.retry_backoff.clone(),
            claim_idle: self.claim_idle.clone(),
            dead_letter_stream: self.dead_letter_stream.clone(),
        })
    }
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
    if let Some(Command::Consume(args)) = &cli.command {
        return check_or_consume(cli, args);
    }
    let settings = match Settings::load(cli.config.as_deref(), &cli.overrides()) {
        Ok(settings) => settings,
        Err(error) => return invalid_configuration(&error),
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
    run_until_signal(|shutdown| server::run(settings, shutdown))
}

fn check_or_consume(cli: &Cli, args: &ConsumeArgs) -> ExitCode {
    let loaded = consume::config::ConsumeSettings::load(
        cli.config.as_deref(),
        &cli.overrides(),
        args.source_table(),
    );
    let settings = match loaded {
        Ok(settings) => settings,
        Err(error) => return invalid_configuration(&error),
    };
    if cli.check_config {
        let mut out = std::io::stdout().lock();
        for source in &settings.sources {
            let _ = writeln!(
                out,
                "ok: source {} key {} -> {}{}, store {}",
                source.stream,
                source.key_field,
                source.upstream.authority,
                source.upstream.base_path,
                settings.gateway.store
            );
        }
        return ExitCode::SUCCESS;
    }
    run_until_signal(|shutdown| consume::run(settings, shutdown))
}

fn invalid_configuration(error: &config::ConfigError) -> ExitCode {
    logging::STDERR.print_line(format_args!(
        "idemgate: invalid configuration: {}",
        ErrorChain(error)
    ));
    ExitCode::from(2)
}

/// Runs `serve` on the async runtime until SIGTERM or SIGINT (the future it is handed).
fn run_until_signal<F, E>(
    serve: impl FnOnce(std::pin::Pin<Box<dyn Future<Output = ()> + Send>>) -> F,
) -> ExitCode
where
    F: Future<Output = Result<(), E>>,
    E: std::error::Error + 'static,
{
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
        let served = serve(Box::pin(shutdown_signal())).await;
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
