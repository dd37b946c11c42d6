//! The gateway's configuration: the TOML file as written ([`FileConfig`]), the command-line
//! and environment overrides laid over it ([`Overrides`]), and the checked, typed result
//! ([`Settings`]).
//!
//! Precedence is flags, then `IDEMGATE_*` environment variables (both arrive as
//! [`Overrides`], clap resolves which of the two wins), then the file, then the `DEFAULT_*`
//! constants below.
//!
//! Values are checked in two steps. Reading the file gives each value its type: durations
//! ([`parse_duration`]), sizes ([`parse_byte_size`]) and the words of a choice (`preset`,
//! `on_store_error`, …, serde enums) are read as the file is parsed, and one of the wrong kind
//! is refused with a [`ConfigError::Value`] that names the file, its line and the field
//! (`routes[2].ttl`). [`FileConfig::validate`] then checks what needs more than one value or
//! more than a type (addresses, ranges, a lease against `store_timeout`, unique route names)
//! and refuses with a [`ConfigError::Invalid`] that names the field and says what would be
//! valid.

use std::collections::HashSet;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use http::{HeaderName, Method, StatusCode, Uri};
use serde::Deserialize;
use serde::de::{self, Deserializer, Visitor};

#[cfg(feature = "webhooks")]
use idemgate::webhook::{Secrets, SetupError};

use idemgate::policy::{
    Concurrent, DEFAULT_LEASE, DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_RESPONSE_BYTES,
    DEFAULT_WAIT_TIMEOUT, KeySource, MIN_LEASE, OnStoreError, Preset, RoutePolicy, StatusSet,
    UnknownOutcome,
};

/// Default address of the proxy listener.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8080";
/// Default address of the admin listener (health, readiness, metrics, records).
pub const DEFAULT_ADMIN_LISTEN: &str = "127.0.0.1:9090";
/// Default store: an embedded durable file, so records survive a restart.
pub const DEFAULT_STORE: &str = "redb:./data/idemgate.redb";
/// Default bound on one store call; past it the request is answered as the store being down.
pub const DEFAULT_STORE_TIMEOUT: Duration = idemgate::DEFAULT_STORE_TIMEOUT;
/// Default bound on the upstream's answer (connect, send, response head); past it → `504`.
pub const DEFAULT_UPSTREAM_TIMEOUT: Duration = idemgate::DEFAULT_UPSTREAM_TIMEOUT;
/// Default bound on opening a connection to the upstream; past it nothing was sent → `502`.
pub const DEFAULT_UPSTREAM_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Default for `upstream_idle_timeout`: idle upstream connections are closed after 2 to 4 s,
/// before the 5 s keep-alive timeout of servers such as Node.js, uvicorn and Apache.
pub const DEFAULT_UPSTREAM_IDLE_TIMEOUT: Duration = Duration::from_secs(4);
/// Shortest `upstream_idle_timeout`: the pool is checked every half of it.
pub const MIN_UPSTREAM_IDLE_TIMEOUT: Duration = Duration::from_millis(100);
/// Default time in-flight requests get to finish after SIGTERM/SIGINT.
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(30);
/// Default cap on open client connections; past it the listener stops accepting until one
/// closes.
pub const DEFAULT_MAX_CONNECTIONS: usize = 4096;
/// Default time a client gets to send a request's complete header block.
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Default time a connection that moves no bytes either way stays open.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// Default cap on header fields in one request.
pub const DEFAULT_MAX_HEADERS: usize = 64;
/// Default cap on a request's header block in bytes (checked by the front service; hyper's
/// own limits are set at twice it).
pub const DEFAULT_MAX_HEADER_BYTES: usize = 64 * 1024;
/// Largest accepted `max_connections`.
pub const MAX_MAX_CONNECTIONS: usize = 1_000_000;
/// Smallest accepted `max_header_bytes`: room for a request line and a handful of fields.
pub const MIN_MAX_HEADER_BYTES: usize = 8 * 1024;

/// A configuration value that was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid TOML.
    #[error("config file {path}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's message, with line and column.
        #[source]
        source: toml::de::Error,
    },
    /// A field of the file is unknown, or its value is not of the field's kind (not a
    /// duration, a size or one of its words, or of another TOML type).
    #[error(
        "config file {}{}: {field}: {message}",
        .path.display(),
        .line.map(|n| format!(", line {n}")).unwrap_or_default()
    )]
    Value {
        /// The file.
        path: PathBuf,
        /// The line of the value (from 1), when the parser knows it.
        line: Option<usize>,
        /// The field, as written in the file (`routes[1].ttl`).
        field: String,
        /// What is wrong and what would be valid.
        message: String,
    },
    /// A value is missing or out of range.
    #[error("{field}: {message}")]
    Invalid {
        /// The field, as written in the file (`routes[1].ttl`).
        field: String,
        /// What is wrong and what would be valid.
        message: String,
    },
}

impl ConfigError {
    pub(crate) fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Invalid {
            field: field.into(),
            message: message.into(),
        }
    }

    /// The field the error is about, when it is about one.
    pub fn field(&self) -> Option<&str> {
        match self {
            Self::Invalid { field, .. } | Self::Value { field, .. } => Some(field),
            _ => None,
        }
    }
}

/// The config file as written, each value read into its type (durations, sizes and choices
/// included); [`FileConfig::validate`] checks the rest. Every field is optional; unknown
/// fields are refused.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    /// Proxy listener address (`host:port`; port 0 picks a free one).
    pub listen: Option<String>,
    /// Admin listener address.
    pub admin_listen: Option<String>,
    /// The upstream's base URL (`http://host:port[/base/path]`).
    pub upstream: Option<String>,
    /// `memory`, `redb:PATH`, `redis://HOST:PORT[/DB]`,
    /// `redis-cluster://HOST:PORT[,HOST:PORT…]` or `postgres://USER@HOST[:PORT]/DB`.
    pub store: Option<String>,
    /// Record lifetime for every route that does not set its own (default: the preset's).
    #[serde(default, deserialize_with = "duration")]
    pub ttl: Option<Duration>,
    /// Bound on one store call.
    #[serde(default, deserialize_with = "duration")]
    pub store_timeout: Option<Duration>,
    /// Redis replicas that must hold a claim before its request is forwarded (`WAIT`); Redis
    /// and Redis Cluster stores only. Default 0.
    pub store_wait_replicas: Option<u32>,
    /// Most connections the PostgreSQL store opens to its server; PostgreSQL stores only.
    /// Default: the store's (16).
    pub store_pool_size: Option<u32>,
    /// `reject` (fail closed, `503`) or `pass` (forward unprotected) when the store is down.
    pub on_store_error: Option<OnStoreError>,
    /// Bound on the upstream's answer, and on each wait for more of its response body.
    #[serde(default, deserialize_with = "duration")]
    pub upstream_timeout: Option<Duration>,
    /// Bound on connecting to the upstream.
    #[serde(default, deserialize_with = "duration")]
    pub upstream_connect_timeout: Option<Duration>,
    /// How long an upstream connection is kept idle for the next request.
    #[serde(default, deserialize_with = "duration")]
    pub upstream_idle_timeout: Option<Duration>,
    /// Time in-flight requests get after SIGTERM.
    #[serde(default, deserialize_with = "duration")]
    pub shutdown_grace: Option<Duration>,
    /// Cap on a buffered idempotent request body, for routes that do not set their own.
    #[serde(default, deserialize_with = "byte_size")]
    pub max_request_bytes: Option<usize>,
    /// Cap on a stored response body, for routes that do not set their own.
    #[serde(default, deserialize_with = "byte_size")]
    pub max_response_bytes: Option<usize>,
    /// Bearer token for the admin record endpoints.
    pub admin_token: Option<String>,
    /// Name of an environment variable holding the admin token.
    pub admin_token_env: Option<String>,
    /// Forward request fields whose names contain `_` (dropped by default).
    pub underscores_in_headers: Option<bool>,
    /// Connection limits.
    pub limits: Option<LimitsFile>,
    /// Routes by path prefix.
    #[serde(default)]
    pub routes: Vec<RouteFile>,
    /// The queues `idemgate consume` reads, each a table that
    /// [`consume::config`](crate::consume::config) reads and checks; the proxy leaves them
    /// alone, so one file serves both commands.
    #[serde(default)]
    pub sources: Vec<toml::Table>,
}

/// `[limits]` as written.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsFile {
    /// Cap on open client connections.
    pub max_connections: Option<usize>,
    /// Time a client gets to send a complete header block.
    #[serde(default, deserialize_with = "duration")]
    pub header_read_timeout: Option<Duration>,
    /// Time a connection that moves no bytes either way stays open (an h2c one: with no request
    /// in progress).
    #[serde(default, deserialize_with = "duration")]
    pub idle_timeout: Option<Duration>,
    /// Cap on header fields per request.
    pub max_headers: Option<usize>,
    /// Cap on a request's header block in bytes.
    #[serde(default, deserialize_with = "byte_size")]
    pub max_header_bytes: Option<usize>,
}

/// One `[[routes]]` entry as written.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteFile {
    /// Path prefix the route covers; the longest matching prefix wins.
    pub prefix: Option<String>,
    /// Name in logs, metrics and the admin API; part of every record key.
    pub name: Option<String>,
    /// `api`, `webhook` or `strict`.
    pub preset: Option<Preset>,
    /// Take the key from this header.
    pub key_header: Option<String>,
    /// Take the key from this JSON pointer into the body.
    pub key_json_pointer: Option<String>,
    /// Methods that take part.
    pub methods: Option<Vec<String>>,
    /// Answer `400` when a taking-part request has no key.
    pub require_key: Option<bool>,
    /// Record lifetime.
    #[serde(default, deserialize_with = "duration")]
    pub ttl: Option<Duration>,
    /// `reject` (`409` at once) or `wait` (wait `wait_timeout` for the first request).
    pub concurrent: Option<ConcurrentMode>,
    /// Bound on `concurrent = "wait"`.
    #[serde(default, deserialize_with = "duration")]
    pub wait_timeout: Option<Duration>,
    /// Headers whose values make the scope.
    pub scope_headers: Option<Vec<String>>,
    /// Headers that are part of the fingerprint.
    pub fingerprint_headers: Option<Vec<String>>,
    /// Stored statuses, applied in order (`["2xx", "!429"]`).
    pub store_statuses: Option<Vec<String>>,
    /// `ambiguous` or `retry`.
    pub unknown_outcome: Option<UnknownOutcome>,
    /// Status of the fingerprint-mismatch answer.
    pub mismatch_status: Option<u16>,
    /// Lease on an in-flight record.
    #[serde(default, deserialize_with = "duration")]
    pub lease: Option<Duration>,
    /// Cap on a buffered request body.
    #[serde(default, deserialize_with = "byte_size")]
    pub max_request_bytes: Option<usize>,
    /// Cap on a stored response body.
    #[serde(default, deserialize_with = "byte_size")]
    pub max_response_bytes: Option<usize>,
    /// Keep `Set-Cookie` in stored responses.
    pub store_set_cookie: Option<bool>,
    /// A webhook provider (`github`, `stripe`, `shopify`, `standard-webhooks`, `slack`,
    /// `twilio`): the route starts from its setup and verifies its signatures.
    pub provider: Option<String>,
    /// The environment variables holding the provider's signing secret: one name, or several
    /// while a secret is rotated (a signature made with any of them is accepted).
    #[serde(default, deserialize_with = "names")]
    pub secret_env: Option<Vec<String>>,
    /// The public URL at which the provider reaches the route's prefix (Twilio signs it).
    pub public_url: Option<String>,
    /// How far a signed timestamp may be from the gateway's clock (Stripe, Standard Webhooks,
    /// Slack).
    #[serde(default, deserialize_with = "duration")]
    pub signature_tolerance: Option<Duration>,
}

/// A route's `concurrent` as written: the library's [`Concurrent`] without the bound on
/// waiting, which is the route's separate `wait_timeout`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ConcurrentMode {
    /// `"reject"`: [`Concurrent::Reject`].
    #[default]
    Reject,
    /// `"wait"`: [`Concurrent::Wait`] for `wait_timeout`.
    Wait,
}

/// Reads `"512"`, `"64KiB"`, `"10MiB"`, `"1GiB"` (also `KB`/`MB`/`GB` as powers of 1000).
pub fn parse_byte_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().map_err(|_| {
        format!("{s:?} is not a size; expected e.g. 1048576, \"64KiB\" or \"10MiB\"")
    })?;
    let mult: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "KB" | "kB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        other => {
            return Err(format!(
                "{s:?} has unknown unit {other:?}; expected B, KiB, MiB, GiB, KB, MB or GB"
            ));
        }
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("{s:?} is too large"))
}

/// Reads a duration as the config file and `--ttl` write it: numbers with units, the parts
/// adding up — `"500ms"`, `"30s"`, `"15m"`, `"24h"`, `"3d"`, `"1h30m"`, `"1h 30m"`, `"1.5s"`.
/// The syntax is [`humantime::parse_duration`]'s: units `ns`, `us`, `ms`, `s`, `m`
/// (minutes), `h`, `d`, `w`, `M` (months of 30.44 days), `y` (years of 365.25 days), and long
/// forms such as `sec`, `min`, `hours`, `days`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    use humantime::DurationError as Why;
    // humantime panics on a few sums that come to exactly u64::MAX seconds ("18446744073709551615s
    // 1000ms"); at most six numbers of at most ten digits can never come near that (six times
    // 10^10 years is under a tenth of it), and leave every duration anyone means.
    let numbers = s
        .split(|c: char| !c.is_ascii_digit())
        .filter(|run| !run.is_empty());
    if numbers.clone().count() > 6 || numbers.into_iter().any(|run| run.len() > 10) {
        return Err(format!(
            "{s:?} is not a duration (too large: at most six numbers of at most ten digits)"
        ));
    }
    humantime::parse_duration(s).map_err(|error| {
        let why = match error {
            Why::UnknownUnit { unit, .. } if unit.is_empty() => " (no unit)".to_owned(),
            Why::UnknownUnit { unit, .. } => format!(" (unknown unit {unit:?})"),
            Why::NumberOverflow => " (too large, or finer than a nanosecond)".to_owned(),
            Why::Empty | Why::InvalidCharacter(_) | Why::NumberExpected(_) => String::new(),
        };
        format!(
            "{s:?} is not a duration{why}; expected a number and a unit, \
             e.g. \"500ms\", \"30s\", \"15m\", \"24h\", \"3d\" or \"1h 30m\""
        )
    })
}

/// Reads a duration field of the file with [`parse_duration`].
fn duration<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    struct Text;
    impl Visitor<'_> for Text {
        type Value = Duration;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a duration such as \"30s\"")
        }
        fn visit_str<E: de::Error>(self, s: &str) -> Result<Duration, E> {
            parse_duration(s).map_err(E::custom)
        }
    }
    d.deserialize_str(Text).map(Some)
}

/// Reads a size field of the file: a number of bytes (`1048576`), or a string with a unit
/// ([`parse_byte_size`]).
fn byte_size<'de, D: Deserializer<'de>>(d: D) -> Result<Option<usize>, D::Error> {
    struct Size;
    impl Visitor<'_> for Size {
        type Value = u64;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a size such as 1048576 or \"10MiB\"")
        }
        fn visit_u64<E: de::Error>(self, n: u64) -> Result<u64, E> {
            Ok(n)
        }
        fn visit_i64<E: de::Error>(self, n: i64) -> Result<u64, E> {
            u64::try_from(n).map_err(|_| E::invalid_value(de::Unexpected::Signed(n), &self))
        }
        fn visit_str<E: de::Error>(self, s: &str) -> Result<u64, E> {
            parse_byte_size(s).map_err(E::custom)
        }
    }
    let n = d.deserialize_any(Size)?;
    usize::try_from(n)
        .map(Some)
        .map_err(|_| de::Error::custom(format!("{n} bytes is too large for this machine")))
}

/// Reads `secret_env`: one name, or a list of names.
fn names<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<String>>, D::Error> {
    struct Names;
    impl<'de> Visitor<'de> for Names {
        type Value = Vec<String>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(
                "the name of an environment variable, or a list of names such as \
                 [\"SECRET\", \"SECRET_NEXT\"]",
            )
        }
        fn visit_str<E: de::Error>(self, s: &str) -> Result<Vec<String>, E> {
            Ok(vec![s.to_owned()])
        }
        fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<String>, A::Error> {
            let mut names = Vec::new();
            while let Some(name) = seq.next_element::<String>()? {
                names.push(name);
            }
            Ok(names)
        }
    }
    d.deserialize_any(Names).map(Some)
}

/// Values from the command line or the environment, laid over the file.
#[derive(Clone, Debug, Default)]
pub struct Overrides {
    /// `--listen` / `IDEMGATE_LISTEN`.
    pub listen: Option<String>,
    /// `--admin-listen` / `IDEMGATE_ADMIN_LISTEN`.
    pub admin_listen: Option<String>,
    /// `--upstream` / `IDEMGATE_UPSTREAM`.
    pub upstream: Option<String>,
    /// `--store` / `IDEMGATE_STORE`.
    pub store: Option<String>,
    /// `--ttl` / `IDEMGATE_TTL`, read by [`parse_duration`] as the file's durations are.
    pub ttl: Option<Duration>,
    /// `--admin-token` / `IDEMGATE_ADMIN_TOKEN`.
    pub admin_token: Option<String>,
    /// `--underscores-in-headers` / `IDEMGATE_UNDERSCORES_IN_HEADERS`.
    pub underscores_in_headers: Option<bool>,
}

/// What a PostgreSQL store URL looks like, for messages that refuse one.
const POSTGRES_FORM: &str = "postgres://USER[:PASSWORD]@HOST[:PORT]/DB[?sslmode=disable|prefer|require] (or postgresql://…)";

/// Where records are kept. Shown (by `Display` and `Debug` alike) without any password a URL
/// carries.
#[derive(Clone, PartialEq, Eq)]
pub enum StoreSpec {
    /// In this process only; lost on restart.
    Memory,
    /// An embedded durable file.
    Redb(PathBuf),
    /// A Redis server shared by several gateways (`redis://` or `rediss://` URL), or a Redis
    /// Cluster (`redis-cluster://` or `rediss-cluster://`, its nodes comma-separated).
    Redis(String),
    /// A PostgreSQL database shared by several gateways (`postgres://` or `postgresql://`
    /// URL; the password from the URL or `PGPASSWORD`).
    Postgres(String),
}

impl StoreSpec {
    /// Reads `memory`, `redb:PATH`, `redis://HOST:PORT[/DB]` or
    /// `redis-cluster://HOST:PORT[,HOST:PORT…]` or `postgres://USER@HOST[:PORT]/DB`. A refusal
    /// never repeats a URL's password.
    pub fn parse(s: &str) -> Result<Self, String> {
        let s = s.trim();
        // What a refusal may repeat of `s`: the URL without its `user:password@`.
        let shown = without_credentials(s);
        if s == "memory" {
            Ok(StoreSpec::Memory)
        } else if let Some(path) = s.strip_prefix("redb:") {
            if path.is_empty() {
                return Err("redb: needs a file path, e.g. \"redb:./data/idemgate.redb\"".into());
            }
            Ok(StoreSpec::Redb(PathBuf::from(path)))
        } else if s.starts_with("rediss://") && !cfg!(feature = "redis-tls") {
            Err(format!(
                "{shown:?}: rediss:// (TLS) needs idemgate built with the redis-tls feature"
            ))
        } else if s.starts_with("redis://") || s.starts_with("rediss://") {
            let uri: Uri = s
                .parse()
                .map_err(|e| format!("{shown:?} is not a valid URL: {e}"))?;
            if uri.host().is_none_or(str::is_empty) {
                return Err(format!(
                    "{shown:?} names no host; expected redis://HOST:PORT[/DB]"
                ));
            }
            Ok(StoreSpec::Redis(s.to_owned()))
        } else if let Some(nodes) = s
            .strip_prefix("redis-cluster://")
            .or_else(|| s.strip_prefix("rediss-cluster://"))
        {
            if !cfg!(feature = "redis-cluster") {
                return Err(format!(
                    "{shown:?}: a Redis Cluster needs idemgate built with the redis-cluster feature"
                ));
            }
            if s.starts_with("rediss-cluster://") && !cfg!(feature = "redis-tls") {
                return Err(format!(
                    "{shown:?}: rediss-cluster:// (TLS) needs idemgate built with the redis-tls feature"
                ));
            }
            let nodes = nodes.rsplit_once('@').map_or(nodes, |(_, nodes)| nodes);
            let nodes = nodes.split(['/', '?']).next().unwrap_or_default();
            for node in nodes.split(',') {
                let valid = node.rsplit_once(':').is_some_and(|(host, port)| {
                    !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0)
                });
                if !valid {
                    return Err(format!(
                        "{shown:?}: {node:?} is not a node; expected redis-cluster://HOST:PORT[,HOST:PORT…]"
                    ));
                }
            }
            Ok(StoreSpec::Redis(s.to_owned()))
        } else if s.starts_with("postgres://") || s.starts_with("postgresql://") {
            parse_postgres(s)
        } else {
            Err(format!(
                "{shown:?} is not a store; expected \"memory\", \"redb:PATH\", \"redis://HOST:PORT[/DB]\", \
                 \"redis-cluster://HOST:PORT[,HOST:PORT…]\" or \"postgres://USER@HOST[:PORT]/DB\""
            ))
        }
    }
}

/// A `postgres://` or `postgresql://` store, checked as the store will read it. The URL may
/// carry a password, so a refusal says what is wrong without repeating it.
#[cfg(feature = "postgres")]
fn parse_postgres(url: &str) -> Result<StoreSpec, String> {
    match idemgate::store::PostgresStoreConfig::new(url).validate() {
        Ok(_) => Ok(StoreSpec::Postgres(url.to_owned())),
        Err(error) => {
            // The top of the chain only says the store is unavailable; its source says why.
            let why = std::error::Error::source(&error).map_or_else(
                || error.to_string(),
                |s| idemgate::ErrorChain(s).to_string(),
            );
            Err(format!("{why}; expected {POSTGRES_FORM}"))
        }
    }
}

#[cfg(not(feature = "postgres"))]
fn parse_postgres(_url: &str) -> Result<StoreSpec, String> {
    Err(format!(
        "postgres:// needs idemgate built with the postgres feature (a store of the form \
         {POSTGRES_FORM})"
    ))
}

/// `url` without the `user:password@` part of its authority, if it has one.
fn without_credentials(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    match rest[..authority_end].rfind('@') {
        Some(at) => format!("{scheme}://{}", &rest[at + 1..]),
        None => url.to_owned(),
    }
}

impl fmt::Display for StoreSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreSpec::Memory => f.write_str("memory"),
            StoreSpec::Redb(path) => write!(f, "redb:{}", path.display()),
            // The URL may carry a password; show only scheme, hosts and ports.
            StoreSpec::Redis(url) if url.contains("-cluster://") => {
                let (scheme, rest) = url.split_once("://").unwrap_or(("redis-cluster", url));
                let nodes = rest.rsplit_once('@').map_or(rest, |(_, nodes)| nodes);
                let nodes = nodes.split(['/', '?']).next().unwrap_or_default();
                write!(f, "{scheme}://{nodes}")
            }
            StoreSpec::Redis(url) => match url.parse::<Uri>() {
                Ok(uri) => write!(
                    f,
                    "{}://{}:{}",
                    uri.scheme_str().unwrap_or("redis"),
                    uri.host().unwrap_or("?"),
                    uri.port_u16().unwrap_or(6379)
                ),
                Err(_) => f.write_str("redis"),
            },
            // `user@host:port/db`, as the store names its server in logs and errors.
            #[cfg(feature = "postgres")]
            StoreSpec::Postgres(url) => {
                match idemgate::store::PostgresStoreConfig::new(url.as_str()).validate() {
                    Ok(server) => write!(f, "postgres://{server}"),
                    Err(_) => f.write_str("postgres"),
                }
            }
            #[cfg(not(feature = "postgres"))]
            StoreSpec::Postgres(_) => f.write_str("postgres"),
        }
    }
}

impl fmt::Debug for StoreSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "StoreSpec({self})")
    }
}

/// The upstream every request goes to.
#[derive(Clone, Debug)]
pub struct Upstream {
    /// The base URL as configured.
    pub uri: Uri,
    /// `host:port`.
    pub authority: http::uri::Authority,
    /// The base path without a trailing `/` (empty for the root).
    pub base_path: String,
}

impl Upstream {
    /// Reads an `http://host[:port][/base]` URL. `https` upstreams are refused: the gateway
    /// speaks plain HTTP to the service beside it. So are URLs with credentials in them.
    pub fn parse(s: &str) -> Result<Self, String> {
        let uri: Uri = s.trim().parse().map_err(|e| {
            format!("{s:?} is not a URL ({e}); expected e.g. \"http://127.0.0.1:3000\"")
        })?;
        match uri.scheme_str() {
            Some("http") => {}
            Some("https") => {
                return Err(format!(
                    "{s:?} uses https, which the gateway does not speak to its upstream; \
                     use an http:// URL to the service (run idemgate next to it)"
                ));
            }
            _ => {
                return Err(format!(
                    "{s:?} is not an http:// URL; expected e.g. \"http://127.0.0.1:3000\""
                ));
            }
        }
        let authority = uri
            .authority()
            .filter(|a| !a.host().is_empty())
            .cloned()
            .ok_or_else(|| {
                format!("{s:?} names no host; expected e.g. \"http://127.0.0.1:3000\"")
            })?;
        // The gateway never sends credentials of its own upstream: each client's own
        // `Authorization` goes through. A `user:password@` part would be ignored, and printed
        // wherever the URL is shown; it is refused instead, without echoing it.
        if authority.as_str().contains('@') {
            return Err(format!(
                "the upstream URL for {}:{} carries credentials (user:password@), which \
                 idemgate does not send upstream; remove them (clients' own Authorization \
                 headers are forwarded)",
                authority.host(),
                authority.port_u16().unwrap_or(80)
            ));
        }
        if uri.query().is_some() {
            return Err(format!(
                "{s:?} has a query; the upstream URL takes a base path only"
            ));
        }
        let base_path = uri.path().trim_end_matches('/').to_owned();
        Ok(Self {
            uri,
            authority,
            base_path,
        })
    }
}

/// Connection limits, checked.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Cap on open client connections.
    pub max_connections: usize,
    /// Time a client gets to send a complete header block.
    pub header_read_timeout: Duration,
    /// Time a connection that moves no bytes either way stays open (an h2c one: with no request
    /// in progress).
    pub idle_timeout: Duration,
    /// Cap on header fields per request.
    pub max_headers: usize,
    /// Cap on a request's header block in bytes.
    pub max_header_bytes: usize,
}

/// One route, checked.
#[derive(Clone, Debug)]
pub struct RouteSettings {
    /// The path prefix.
    pub prefix: String,
    /// The policy the layer applies.
    pub policy: RoutePolicy,
}

/// The whole configuration, checked and typed.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Proxy listener address.
    pub listen: SocketAddr,
    /// Admin listener address.
    pub admin_listen: SocketAddr,
    /// Where requests go.
    pub upstream: Upstream,
    /// Where records are kept.
    pub store: StoreSpec,
    /// Bound on one store call.
    pub store_timeout: Duration,
    /// Redis replicas that must hold a claim before its request is forwarded; 0 for none.
    pub store_wait_replicas: u32,
    /// Most connections a PostgreSQL store opens; `None` for the store's default.
    pub store_pool_size: Option<usize>,
    /// What to do when the store fails.
    pub on_store_error: OnStoreError,
    /// Bound on the upstream's answer, and on each wait for more of its response body.
    pub upstream_timeout: Duration,
    /// Bound on connecting to the upstream.
    pub upstream_connect_timeout: Duration,
    /// Idle upstream connections are closed after between half of this and all of it.
    pub upstream_idle_timeout: Duration,
    /// Time in-flight requests get after SIGTERM.
    pub shutdown_grace: Duration,
    /// Bearer token for the admin record endpoints; none disables them.
    pub admin_token: Option<String>,
    /// Connection limits.
    pub limits: Limits,
    /// Whether request fields whose names contain `_` are forwarded; by default they are
    /// dropped (see `server::drop_underscored_fields`).
    pub underscores_in_headers: bool,
    /// The policy for paths no route matches.
    pub default_route: RoutePolicy,
    /// Routes by path prefix.
    pub routes: Vec<RouteSettings>,
}

impl Settings {
    /// Reads `path` (when given), lays `overrides` over it and checks the result.
    pub fn load(path: Option<&Path>, overrides: &Overrides) -> Result<Self, ConfigError> {
        let file = match path {
            Some(path) => FileConfig::read(path)?,
            None => FileConfig::default(),
        };
        file.with_overrides(overrides).validate()
    }

    /// The names of every route, the default one first.
    pub fn route_names(&self) -> impl Iterator<Item = &str> {
        std::iter::once(self.default_route.route_name())
            .chain(self.routes.iter().map(|r| r.policy.route_name()))
    }

    /// The policy named `name`.
    pub fn route_by_name(&self, name: &str) -> Option<&RoutePolicy> {
        if self.default_route.route_name() == name {
            return Some(&self.default_route);
        }
        self.routes
            .iter()
            .map(|r| &r.policy)
            .find(|p| p.route_name() == name)
    }
}

/// Name of the policy for paths no configured route matches.
pub const DEFAULT_ROUTE_NAME: &str = "default";

impl FileConfig {
    /// Reads and parses a config file (see [`FileConfig::from_toml`]).
    pub fn read(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::from_toml(&text, path)
    }

    /// Parses the text of the config file at `path` (the path only names the file in errors).
    /// Each value is read into its type here; one of the wrong kind, and an unknown field, is
    /// a [`ConfigError::Value`] naming its line and field. What needs more than the value's
    /// type is left to [`FileConfig::validate`].
    pub fn from_toml(text: &str, path: &Path) -> Result<Self, ConfigError> {
        let parse_error = |source| ConfigError::Parse {
            path: path.to_owned(),
            source,
        };
        let document = toml::Deserializer::parse(text).map_err(parse_error)?;
        serde_path_to_error::deserialize(document).map_err(|error| {
            if error.path().iter().next().is_none() {
                return parse_error(error.into_inner());
            }
            let field = error.path().to_string();
            let error = error.into_inner();
            let line = error
                .span()
                .and_then(|span| text.get(..span.start))
                .map(|before| before.matches('\n').count() + 1);
            ConfigError::Value {
                path: path.to_owned(),
                line,
                field,
                message: error.message().to_owned(),
            }
        })
    }

    /// This file with command-line and environment values laid over it.
    #[must_use]
    pub fn with_overrides(mut self, o: &Overrides) -> Self {
        fn lay<T: Clone>(slot: &mut Option<T>, value: &Option<T>) {
            if value.is_some() {
                slot.clone_from(value);
            }
        }
        lay(&mut self.listen, &o.listen);
        lay(&mut self.admin_listen, &o.admin_listen);
        lay(&mut self.upstream, &o.upstream);
        lay(&mut self.store, &o.store);
        lay(&mut self.ttl, &o.ttl);
        if o.admin_token.is_some() {
            // A token given by flag or environment wins over the file's, in either form.
            self.admin_token_env = None;
        }
        lay(&mut self.admin_token, &o.admin_token);
        lay(&mut self.underscores_in_headers, &o.underscores_in_headers);
        self
    }

    /// Checks every value and builds the typed configuration. A provider route's secrets are
    /// read from the environment variables its `secret_env` names.
    pub fn validate(&self) -> Result<Settings, ConfigError> {
        self.validate_reading(SECRETS_FROM_ENV)
    }

    /// [`FileConfig::validate`], reading provider routes' secrets with `read_secrets`.
    fn validate_reading(&self, read_secrets: ReadSecrets) -> Result<Settings, ConfigError> {
        let (listen, admin_listen) = self.listeners()?;
        let upstream = self.upstream()?;
        let store = StoreSpec::parse(self.store.as_deref().unwrap_or(DEFAULT_STORE))
            .map_err(|m| ConfigError::invalid("store", m))?;
        let timeouts = self.timeouts()?;
        let store_wait_replicas = self.store_wait_replicas.unwrap_or(0);
        if store_wait_replicas > 0 && !matches!(store, StoreSpec::Redis(_)) {
            return Err(ConfigError::invalid(
                "store_wait_replicas",
                format!("applies to a Redis or Redis Cluster store, and the store is {store}"),
            ));
        }
        let store_pool_size = self.store_pool_size(&store)?;
        let ttl = self.ttl.map(|ttl| nonzero("ttl", ttl)).transpose()?;
        let admin_token = self.admin_token()?;
        let limits = self.limits.clone().unwrap_or_default().validate()?;
        if let Err(why) = lease_outlasts_a_renewal(DEFAULT_LEASE, timeouts.store) {
            return Err(ConfigError::invalid(
                "store_timeout",
                format!("{why} (routes without a lease of their own)"),
            ));
        }
        let defaults = RouteDefaults {
            ttl,
            store_timeout: timeouts.store,
            max_request_bytes: self.max_request_bytes.unwrap_or(DEFAULT_MAX_REQUEST_BYTES),
            max_response_bytes: self
                .max_response_bytes
                .unwrap_or(DEFAULT_MAX_RESPONSE_BYTES),
            read_secrets,
        };
        Ok(Settings {
            listen,
            admin_listen,
            upstream,
            store,
            store_timeout: timeouts.store,
            store_wait_replicas,
            store_pool_size,
            on_store_error: self.on_store_error.unwrap_or_default(),
            upstream_timeout: timeouts.upstream,
            upstream_connect_timeout: timeouts.upstream_connect,
            upstream_idle_timeout: timeouts.upstream_idle,
            shutdown_grace: self.shutdown_grace.unwrap_or(DEFAULT_SHUTDOWN_GRACE),
            admin_token,
            limits,
            underscores_in_headers: self.underscores_in_headers.unwrap_or(false),
            default_route: defaults.policy(Preset::Api).name(DEFAULT_ROUTE_NAME),
            routes: self.routes(&defaults)?,
        })
    }

    /// `listen` and `admin_listen`, which must differ.
    fn listeners(&self) -> Result<(SocketAddr, SocketAddr), ConfigError> {
        let listen = addr("listen", self.listen.as_deref().unwrap_or(DEFAULT_LISTEN))?;
        let admin_listen = addr(
            "admin_listen",
            self.admin_listen.as_deref().unwrap_or(DEFAULT_ADMIN_LISTEN),
        )?;
        if listen == admin_listen && listen.port() != 0 {
            return Err(ConfigError::invalid(
                "admin_listen",
                format!(
                    "{admin_listen} is also the proxy's listen address; give them different ports"
                ),
            ));
        }
        Ok((listen, admin_listen))
    }

    /// `upstream`, which is required.
    fn upstream(&self) -> Result<Upstream, ConfigError> {
        let upstream = self.upstream.as_deref().ok_or_else(|| {
            ConfigError::invalid(
                "upstream",
                "required: set --upstream, IDEMGATE_UPSTREAM or `upstream = \"http://HOST:PORT\"` in the config file",
            )
        })?;
        Upstream::parse(upstream).map_err(|m| ConfigError::invalid("upstream", m))
    }

    /// `store_pool_size`: at least one connection, and only for a PostgreSQL store (the
    /// others keep one multiplexed connection, or none).
    fn store_pool_size(&self, store: &StoreSpec) -> Result<Option<usize>, ConfigError> {
        let Some(size) = self.store_pool_size else {
            return Ok(None);
        };
        if !matches!(store, StoreSpec::Postgres(_)) {
            return Err(ConfigError::invalid(
                "store_pool_size",
                format!("applies to a PostgreSQL store, and the store is {store}"),
            ));
        }
        if size == 0 {
            return Err(ConfigError::invalid(
                "store_pool_size",
                "must be at least 1 connection",
            ));
        }
        Ok(Some(size as usize))
    }

    /// The store and upstream timeouts, with their defaults and bounds.
    fn timeouts(&self) -> Result<Timeouts, ConfigError> {
        let store = positive("store_timeout", self.store_timeout, DEFAULT_STORE_TIMEOUT)?;
        let upstream = positive(
            "upstream_timeout",
            self.upstream_timeout,
            DEFAULT_UPSTREAM_TIMEOUT,
        )?;
        let upstream_connect = positive(
            "upstream_connect_timeout",
            self.upstream_connect_timeout,
            DEFAULT_UPSTREAM_CONNECT_TIMEOUT.min(upstream),
        )?;
        if upstream_connect > upstream {
            return Err(ConfigError::invalid(
                "upstream_connect_timeout",
                format!(
                    "{upstream_connect:?} is longer than upstream_timeout ({upstream:?}); \
                     it must not exceed it"
                ),
            ));
        }
        let upstream_idle = positive(
            "upstream_idle_timeout",
            self.upstream_idle_timeout,
            DEFAULT_UPSTREAM_IDLE_TIMEOUT,
        )?;
        if upstream_idle < MIN_UPSTREAM_IDLE_TIMEOUT {
            return Err(ConfigError::invalid(
                "upstream_idle_timeout",
                format!(
                    "{upstream_idle:?} is shorter than {MIN_UPSTREAM_IDLE_TIMEOUT:?}, the least it may be"
                ),
            ));
        }
        Ok(Timeouts {
            store,
            upstream,
            upstream_connect,
            upstream_idle,
        })
    }

    /// Every `[[routes]]` entry, checked, with names and prefixes unique.
    fn routes(&self, defaults: &RouteDefaults) -> Result<Vec<RouteSettings>, ConfigError> {
        let mut routes = Vec::with_capacity(self.routes.len());
        let mut names = HashSet::from([DEFAULT_ROUTE_NAME.to_owned()]);
        let mut prefixes = HashSet::new();
        for (i, route) in self.routes.iter().enumerate() {
            let field = format!("routes[{i}]");
            let settings = route.validate(&field, defaults)?;
            if !names.insert(settings.policy.route_name().to_owned()) {
                return Err(ConfigError::invalid(
                    format!("{field}.name"),
                    format!(
                        "{:?} is already used by another route (or is the reserved \"{DEFAULT_ROUTE_NAME}\"); \
                         route names must be unique",
                        settings.policy.route_name()
                    ),
                ));
            }
            if !prefixes.insert(settings.prefix.clone()) {
                return Err(ConfigError::invalid(
                    format!("{field}.prefix"),
                    format!(
                        "{:?} is already the prefix of another route",
                        settings.prefix
                    ),
                ));
            }
            routes.push(settings);
        }
        Ok(routes)
    }

    fn admin_token(&self) -> Result<Option<String>, ConfigError> {
        let token = match (&self.admin_token, &self.admin_token_env) {
            (Some(_), Some(_)) => {
                return Err(ConfigError::invalid(
                    "admin_token_env",
                    "set either admin_token or admin_token_env, not both",
                ));
            }
            (Some(t), None) => t.clone(),
            (None, Some(var)) => std::env::var(var).map_err(|_| {
                ConfigError::invalid(
                    "admin_token_env",
                    format!("environment variable {var:?} is not set (or not UTF-8)"),
                )
            })?,
            (None, None) => return Ok(None),
        };
        let field = if self.admin_token.is_some() {
            "admin_token"
        } else {
            "admin_token_env"
        };
        if token.len() < 16 {
            return Err(ConfigError::invalid(
                field,
                "the admin token must be at least 16 characters",
            ));
        }
        if !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(ConfigError::invalid(
                field,
                "the admin token must be visible ASCII without spaces (it is sent as a bearer token)",
            ));
        }
        Ok(Some(token))
    }
}

/// The checked timeouts of the top level (`shutdown_grace` aside, which may be zero).
struct Timeouts {
    store: Duration,
    upstream: Duration,
    upstream_connect: Duration,
    upstream_idle: Duration,
}

impl LimitsFile {
    fn validate(self) -> Result<Limits, ConfigError> {
        let max_connections = self.max_connections.unwrap_or(DEFAULT_MAX_CONNECTIONS);
        if !(1..=MAX_MAX_CONNECTIONS).contains(&max_connections) {
            return Err(ConfigError::invalid(
                "limits.max_connections",
                format!("{max_connections} is out of range; expected 1 to {MAX_MAX_CONNECTIONS}"),
            ));
        }
        let max_headers = self.max_headers.unwrap_or(DEFAULT_MAX_HEADERS);
        if max_headers == 0 {
            return Err(ConfigError::invalid(
                "limits.max_headers",
                "must be at least 1",
            ));
        }
        let max_header_bytes = self.max_header_bytes.unwrap_or(DEFAULT_MAX_HEADER_BYTES);
        if max_header_bytes < MIN_MAX_HEADER_BYTES || u32::try_from(max_header_bytes).is_err() {
            return Err(ConfigError::invalid(
                "limits.max_header_bytes",
                format!("must be between {MIN_MAX_HEADER_BYTES} (8KiB) and 4GiB"),
            ));
        }
        Ok(Limits {
            max_connections,
            header_read_timeout: positive(
                "limits.header_read_timeout",
                self.header_read_timeout,
                DEFAULT_HEADER_READ_TIMEOUT,
            )?,
            idle_timeout: positive(
                "limits.idle_timeout",
                self.idle_timeout,
                DEFAULT_IDLE_TIMEOUT,
            )?,
            max_headers,
            max_header_bytes,
        })
    }
}

/// A lease is renewed a third of the way through, and the renewal may take up to
/// `store_timeout`: unless that fits in the remaining two thirds, one slow renewal lets a
/// live owner's lease lapse, and a retry takes over a request that is still running.
fn lease_outlasts_a_renewal(lease: Duration, store_timeout: Duration) -> Result<(), String> {
    if store_timeout.saturating_mul(3) < lease.saturating_mul(2) {
        Ok(())
    } else {
        Err(format!(
            "a lease of {lease:?} is too short for store_timeout {store_timeout:?}: it is renewed \
             at a third of its length and a renewal may take all of store_timeout, so the lease \
             must be more than 1.5 times store_timeout"
        ))
    }
}

/// Reads the secrets held by the environment variables a provider route names.
#[cfg(feature = "webhooks")]
type ReadSecrets = fn(&[String]) -> Result<Secrets, SetupError>;
/// Without the `webhooks` feature no route reads a secret.
#[cfg(not(feature = "webhooks"))]
type ReadSecrets = ();

/// Secrets from the process's environment.
#[cfg(feature = "webhooks")]
const SECRETS_FROM_ENV: ReadSecrets = |names| Secrets::from_env(names);
#[cfg(not(feature = "webhooks"))]
const SECRETS_FROM_ENV: ReadSecrets = ();

/// What every route starts from: the top-level ttl and body caps, the store timeout its
/// lease must outlast, and where a provider route's secrets are read.
struct RouteDefaults {
    ttl: Option<Duration>,
    store_timeout: Duration,
    max_request_bytes: usize,
    max_response_bytes: usize,
    #[cfg_attr(not(feature = "webhooks"), allow(dead_code))]
    read_secrets: ReadSecrets,
}

impl RouteDefaults {
    /// `preset` with the top-level values laid over it.
    fn policy(&self, preset: Preset) -> RoutePolicy {
        let policy = self.body_caps(RoutePolicy::preset(preset));
        match self.ttl {
            Some(ttl) => policy.ttl(ttl),
            None => policy,
        }
    }

    /// `policy` with the top-level body caps.
    fn body_caps(&self, policy: RoutePolicy) -> RoutePolicy {
        policy
            .max_request_bytes(self.max_request_bytes)
            .max_response_bytes(self.max_response_bytes)
    }
}

/// The keys that only a provider route takes.
const PROVIDER_KEYS: [&str; 3] = ["secret_env", "public_url", "signature_tolerance"];

impl RouteFile {
    /// Checks the route written at `field` (`routes[2]`) and builds its policy: the preset
    /// with the top-level values (or, on a `provider` route, the provider's setup, verified),
    /// then each of the route's own keys that the file sets.
    fn validate(
        &self,
        field: &str,
        defaults: &RouteDefaults,
    ) -> Result<RouteSettings, ConfigError> {
        let f = |name: &str| format!("{field}.{name}");
        let prefix = self.prefix(&f("prefix"))?;
        let (base, provider_route) = match &self.provider {
            Some(provider) => (self.provider_policy(field, provider, defaults)?, true),
            None => {
                if let Some(key) = PROVIDER_KEYS.iter().find(|key| self.sets(key)) {
                    return Err(ConfigError::invalid(
                        f(key),
                        "only applies to a webhook provider route; set provider = \"github\", \
                         \"stripe\", \"shopify\", \"standard-webhooks\", \"slack\" or \"twilio\"",
                    ));
                }
                (defaults.policy(self.preset.unwrap_or_default()), false)
            }
        };
        // A provider route is named after its provider (as the library names it), others
        // after their prefix.
        let name = match &self.name {
            Some(name) => name.clone(),
            None if provider_route => base.route_name().to_owned(),
            None => prefix.clone(),
        };
        if name.is_empty() || name.len() > 64 || !name.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(ConfigError::invalid(
                f("name"),
                format!("{name:?} is not a route name; expected 1–64 visible ASCII characters"),
            ));
        }
        let policy = self.with_own_keys(field, base.name(name), defaults, provider_route)?;
        Ok(RouteSettings { prefix, policy })
    }

    /// `policy` with each of the route's own keys that the file sets laid over it.
    fn with_own_keys(
        &self,
        field: &str,
        mut policy: RoutePolicy,
        defaults: &RouteDefaults,
        provider_route: bool,
    ) -> Result<RoutePolicy, ConfigError> {
        let f = |name: &str| format!("{field}.{name}");
        if let Some(key) = self.key_source(field)? {
            policy = policy.key(key);
        }
        if let Some(methods) = self.methods(field)? {
            policy = policy.methods(methods);
        }
        if let Some(require) = self.require_key {
            policy = policy.require_key(require);
        }
        if let Some(ttl) = self.ttl {
            policy = policy.ttl(nonzero(&f("ttl"), ttl)?);
        }
        if let Some(concurrent) = self.concurrent(field, provider_route)? {
            policy = policy.concurrent(concurrent);
        }
        if let Some(headers) = &self.scope_headers {
            policy = policy.scope_headers(header_list(&f("scope_headers"), headers)?);
        }
        if let Some(headers) = &self.fingerprint_headers {
            policy = policy.fingerprint_headers(header_list(&f("fingerprint_headers"), headers)?);
        }
        if let Some(statuses) = &self.store_statuses {
            policy = policy.store_statuses(
                StatusSet::parse(statuses)
                    .map_err(|m| ConfigError::invalid(f("store_statuses"), m))?,
            );
        }
        if let Some(outcome) = self.unknown_outcome {
            policy = policy.unknown_outcome(outcome);
        }
        if let Some(code) = self.mismatch_status {
            policy = policy.mismatch_status(mismatch_status(&f("mismatch_status"), code)?);
        }
        if let Some(lease) = self.lease(&f("lease"), defaults.store_timeout)? {
            policy = policy.lease(lease);
        }
        if let Some(bytes) = self.max_request_bytes {
            policy = policy.max_request_bytes(bytes);
        }
        if let Some(bytes) = self.max_response_bytes {
            policy = policy.max_response_bytes(bytes);
        }
        if let Some(keep) = self.store_set_cookie {
            policy = policy.store_set_cookie(keep);
        }
        Ok(policy)
    }

    /// Whether the file sets the provider key `key` on this route.
    fn sets(&self, key: &str) -> bool {
        match key {
            "secret_env" => self.secret_env.is_some(),
            "public_url" => self.public_url.is_some(),
            "signature_tolerance" => self.signature_tolerance.is_some(),
            _ => false,
        }
    }

    /// The setup of the provider named `provider`, verified with the secrets its
    /// `secret_env` names, with the top-level body caps. Its ttl is the provider's (at least
    /// its redelivery horizon) unless the route sets one: the top-level ttl does not shorten it.
    #[cfg(feature = "webhooks")]
    fn provider_policy(
        &self,
        field: &str,
        provider: &str,
        defaults: &RouteDefaults,
    ) -> Result<RoutePolicy, ConfigError> {
        use idemgate::webhook::{DEFAULT_TOLERANCE, Provider};

        let f = |name: &str| format!("{field}.{name}");
        let provider: Provider = provider
            .parse()
            .map_err(|why| ConfigError::invalid(f("provider"), why))?;
        if let Some(preset) = self.preset.filter(|p| *p != Preset::Webhook) {
            return Err(ConfigError::invalid(
                f("preset"),
                format!(
                    "a provider route is a webhook route, not {preset:?}; change what it keeps \
                     with store_statuses, unknown_outcome and ttl instead"
                ),
            ));
        }
        let names = self.secret_names(field, provider)?;
        let timestamped = matches!(
            provider,
            Provider::Stripe | Provider::StandardWebhooks | Provider::Slack
        );
        let tolerance = match self.signature_tolerance {
            Some(_) if !timestamped => {
                return Err(ConfigError::invalid(
                    f("signature_tolerance"),
                    format!(
                        "{provider} signs no timestamp, so there is no tolerance to set \
                         (only stripe, standard-webhooks and slack sign one); remove it"
                    ),
                ));
            }
            Some(tolerance) => nonzero(&f("signature_tolerance"), tolerance)?,
            None => DEFAULT_TOLERANCE,
        };
        let public_url = match (&self.public_url, provider) {
            (None, Provider::Twilio) => {
                return Err(ConfigError::invalid(
                    f("public_url"),
                    "required with provider = \"twilio\": the public URL at which Twilio reaches \
                     this route's prefix, as entered in Twilio's console (Twilio signs it), \
                     e.g. \"https://hooks.example.com/twilio\"",
                ));
            }
            (Some(_), Provider::Twilio) | (None, _) => self.public_url.as_deref(),
            (Some(_), _) => {
                return Err(ConfigError::invalid(
                    f("public_url"),
                    format!(
                        "{provider} does not sign the URL it requested (only twilio does); \
                         remove it"
                    ),
                ));
            }
        };
        let setup_error = |error: SetupError| {
            let key = match error {
                SetupError::InvalidPublicUrl { .. } => "public_url",
                _ => "secret_env",
            };
            ConfigError::invalid(f(key), error.to_string())
        };
        let secrets = (defaults.read_secrets)(&names).map_err(setup_error)?;
        let policy = provider
            .verified_policy(secrets, tolerance, public_url)
            .map_err(setup_error)?;
        Ok(defaults.body_caps(policy))
    }

    /// `secret_env`, which a provider route requires: one name or more, each a possible
    /// environment variable name.
    #[cfg(feature = "webhooks")]
    fn secret_names(
        &self,
        field: &str,
        provider: idemgate::webhook::Provider,
    ) -> Result<Vec<String>, ConfigError> {
        let f = format!("{field}.secret_env");
        let names = self.secret_env.clone().ok_or_else(|| {
            ConfigError::invalid(
                &f,
                format!(
                    "required with provider = \"{provider}\": the name of the environment \
                     variable holding the signing secret (or a list of names while rotating \
                     one); a provider route verifies every delivery, and the secret is never \
                     written in the file"
                ),
            )
        })?;
        if names.is_empty() {
            return Err(ConfigError::invalid(
                f,
                "is empty; name at least one environment variable",
            ));
        }
        for (j, name) in names.iter().enumerate() {
            if name.is_empty() || name.contains(['=', '\0']) || name.contains(char::is_whitespace) {
                return Err(ConfigError::invalid(
                    format!("{f}[{j}]"),
                    format!(
                        "{name:?} is not the name of an environment variable; expected e.g. \
                         \"STRIPE_WEBHOOK_SECRET\""
                    ),
                ));
            }
        }
        Ok(names)
    }

    /// Without the `webhooks` feature there are no provider routes.
    #[cfg(not(feature = "webhooks"))]
    fn provider_policy(
        &self,
        field: &str,
        provider: &str,
        _: &RouteDefaults,
    ) -> Result<RoutePolicy, ConfigError> {
        Err(ConfigError::invalid(
            format!("{field}.provider"),
            format!(
                "{provider:?}: this idemgate was built without the `webhooks` feature, so it \
                 cannot verify webhook signatures; build it with that feature (on by default) \
                 to use provider routes"
            ),
        ))
    }

    /// `prefix`, which is required and must be a path.
    fn prefix(&self, field: &str) -> Result<String, ConfigError> {
        let prefix = self.prefix.clone().ok_or_else(|| {
            ConfigError::invalid(
                field,
                "required: the path prefix the route covers, e.g. \"/payments\"",
            )
        })?;
        if !prefix.starts_with('/')
            || prefix.contains(['?', '#'])
            || prefix.contains(char::is_whitespace)
        {
            return Err(ConfigError::invalid(
                field,
                format!(
                    "{prefix:?} is not a path prefix; expected one starting with \"/\", e.g. \"/payments\""
                ),
            ));
        }
        Ok(prefix)
    }

    /// `key_header` or `key_json_pointer` (not both), when either is set.
    fn key_source(&self, field: &str) -> Result<Option<KeySource>, ConfigError> {
        match (&self.key_header, &self.key_json_pointer) {
            (Some(_), Some(_)) => Err(ConfigError::invalid(
                format!("{field}.key_json_pointer"),
                "set either key_header or key_json_pointer, not both",
            )),
            (Some(h), None) => Ok(Some(KeySource::Header(header_name(
                &format!("{field}.key_header"),
                h,
            )?))),
            (None, Some(p)) if !(p.starts_with('/') && p.len() > 1) => Err(ConfigError::invalid(
                format!("{field}.key_json_pointer"),
                format!(
                    "{p:?} is not a JSON pointer to a field; expected e.g. \"/id\" or \"/data/object/id\""
                ),
            )),
            (None, Some(p)) => Ok(Some(KeySource::JsonPointer(p.clone()))),
            (None, None) => Ok(None),
        }
    }

    /// `methods`, upper-cased, when set: at least one, each a valid method.
    fn methods(&self, field: &str) -> Result<Option<Vec<Method>>, ConfigError> {
        let Some(methods) = &self.methods else {
            return Ok(None);
        };
        let mut parsed = Vec::with_capacity(methods.len());
        for (j, m) in methods.iter().enumerate() {
            let upper = m.trim().to_ascii_uppercase();
            let method = Method::from_bytes(upper.as_bytes())
                .ok()
                .filter(|_| !upper.is_empty())
                .ok_or_else(|| {
                    ConfigError::invalid(
                        format!("{field}.methods[{j}]"),
                        format!("{m:?} is not an HTTP method; expected e.g. \"POST\""),
                    )
                })?;
            parsed.push(method);
        }
        if parsed.is_empty() {
            return Err(ConfigError::invalid(
                format!("{field}.methods"),
                "is empty; list at least one method, or remove the route",
            ));
        }
        Ok(Some(parsed))
    }

    /// `concurrent` with its `wait_timeout`, when the file sets either. `wait_timeout` is set
    /// only with `"wait"`, or alone on a provider route, whose setup waits already: then it
    /// bounds that wait. `concurrent = "wait"` alone on a provider route keeps the provider's
    /// bound.
    fn concurrent(
        &self,
        field: &str,
        provider_route: bool,
    ) -> Result<Option<Concurrent>, ConfigError> {
        let wait_field = format!("{field}.wait_timeout");
        let wait_timeout = self
            .wait_timeout
            .map(|w| nonzero(&wait_field, w))
            .transpose()?;
        match (self.concurrent, wait_timeout) {
            (Some(ConcurrentMode::Reject), Some(_)) | (None, Some(_)) if !provider_route => Err(
                ConfigError::invalid(wait_field, "only applies with concurrent = \"wait\""),
            ),
            (Some(ConcurrentMode::Reject), Some(_)) => Err(ConfigError::invalid(
                wait_field,
                "only applies with concurrent = \"wait\" (a provider route waits unless it \
                 sets concurrent = \"reject\")",
            )),
            (Some(ConcurrentMode::Reject), None) => Ok(Some(Concurrent::Reject)),
            (Some(ConcurrentMode::Wait) | None, Some(wait)) => Ok(Some(Concurrent::Wait(wait))),
            (Some(ConcurrentMode::Wait), None) if provider_route => Ok(None),
            (Some(ConcurrentMode::Wait), None) => Ok(Some(Concurrent::Wait(DEFAULT_WAIT_TIMEOUT))),
            (None, None) => Ok(None),
        }
    }

    /// `lease` when set, at least [`MIN_LEASE`] and long enough to outlast a renewal.
    fn lease(&self, field: &str, store_timeout: Duration) -> Result<Option<Duration>, ConfigError> {
        let Some(lease) = self.lease else {
            return Ok(None);
        };
        let lease = nonzero(field, lease)?;
        if lease < MIN_LEASE {
            return Err(ConfigError::invalid(
                field,
                format!("must be at least {MIN_LEASE:?} (it is renewed at a third of it)"),
            ));
        }
        lease_outlasts_a_renewal(lease, store_timeout)
            .map_err(|why| ConfigError::invalid(field, why))?;
        Ok(Some(lease))
    }
}

fn mismatch_status(field: &str, code: u16) -> Result<StatusCode, ConfigError> {
    StatusCode::from_u16(code)
        .ok()
        .filter(StatusCode::is_client_error)
        .ok_or_else(|| {
            ConfigError::invalid(
                field,
                format!("{code} is not a client-error status; expected 400–499, e.g. 422 or 409"),
            )
        })
}

fn addr(field: &str, s: &str) -> Result<SocketAddr, ConfigError> {
    s.trim().parse().map_err(|_| {
        ConfigError::invalid(
            field,
            format!("{s:?} is not an address; expected IP:PORT, e.g. \"127.0.0.1:8080\" or \"[::1]:8080\""),
        )
    })
}

fn nonzero(field: &str, d: Duration) -> Result<Duration, ConfigError> {
    if d.is_zero() {
        return Err(ConfigError::invalid(field, "must be longer than zero"));
    }
    Ok(d)
}

fn positive(
    field: &str,
    value: Option<Duration>,
    default: Duration,
) -> Result<Duration, ConfigError> {
    value.map_or(Ok(default), |d| nonzero(field, d))
}

fn header_name(field: &str, s: &str) -> Result<HeaderName, ConfigError> {
    HeaderName::from_bytes(s.trim().as_bytes()).map_err(|_| {
        ConfigError::invalid(
            field,
            format!("{s:?} is not a header name; expected e.g. \"Idempotency-Key\""),
        )
    })
}

fn header_list(field: &str, list: &[String]) -> Result<Vec<HeaderName>, ConfigError> {
    list.iter()
        .enumerate()
        .map(|(j, h)| header_name(&format!("{field}[{j}]"), h))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Asserts that two policies are the same in every setting. `RoutePolicy` keeps its
    /// settings to itself, so they are compared as their `Debug` forms.
    #[track_caller]
    fn assert_same_policy(parsed: &RoutePolicy, expected: RoutePolicy) {
        assert_eq!(format!("{parsed:#?}"), format!("{expected:#?}"));
    }

    /// One setting's value in a policy's `Debug` form (`name: value`, up to the next field).
    #[cfg_attr(not(feature = "webhooks"), allow(dead_code))]
    fn debug_field<'a>(debug: &'a str, name: &str) -> &'a str {
        let start = debug
            .find(&format!("{name}: "))
            .unwrap_or_else(|| panic!("no {name} in {debug}"));
        let rest = &debug[start..];
        let mut depth = 0_i32;
        let end = rest
            .char_indices()
            .find(|&(_, c)| {
                match c {
                    '(' | '[' | '{' => depth += 1,
                    ')' | ']' | '}' => depth -= 1,
                    _ => {}
                }
                depth < 0 || (depth == 0 && c == ',')
            })
            .map_or(rest.len(), |(at, _)| at);
        &rest[..end]
    }

    /// The secret every variable but the ones below holds in [`test_env`].
    #[cfg(feature = "webhooks")]
    const TEST_SECRET: &str = "s3cr3t-value-for-tests";
    /// What `STANDARD…` variables hold: a Standard Webhooks secret.
    #[cfg(feature = "webhooks")]
    const TEST_WHSEC: &str = "whsec_czNjcjN0LXZhbHVlLWZvci10ZXN0cw==";

    /// The environment the tests' provider routes read, never the test process's own: a
    /// variable named `UNSET…` is not set, `EMPTY…` is empty, `NOT_BASE64…` holds a Standard
    /// Webhooks secret that is not base64, `STANDARD…` a good one, any other [`TEST_SECRET`].
    #[cfg(feature = "webhooks")]
    fn test_env(names: &[String]) -> Result<Secrets, SetupError> {
        let values = names
            .iter()
            .map(|name| match name.as_str() {
                unset if unset.starts_with("UNSET") => Err(SetupError::MissingEnv {
                    name: unset.to_owned(),
                }),
                empty if empty.starts_with("EMPTY") => Err(SetupError::EmptySecret {
                    from: format!("from the environment variable {empty}"),
                }),
                bad if bad.starts_with("NOT_BASE64") => Ok("whsec_s3cr3t*not!base64"),
                standard if standard.starts_with("STANDARD") => Ok(TEST_WHSEC),
                _ => Ok(TEST_SECRET),
            })
            .collect::<Result<Vec<_>, _>>()?;
        Secrets::new(values)
    }

    fn parse(text: &str) -> Result<Settings, ConfigError> {
        let file = FileConfig::from_toml(text, Path::new("test.toml"))?;
        #[cfg(feature = "webhooks")]
        return file.validate_reading(test_env);
        #[cfg(not(feature = "webhooks"))]
        file.validate()
    }

    fn field_of(text: &str) -> String {
        match parse(text) {
            Ok(_) => panic!("config should have been refused:\n{text}"),
            Err(e) => e
                .field()
                .map(str::to_owned)
                .unwrap_or_else(|| e.to_string()),
        }
    }

    #[test]
    fn a_duration_too_large_to_add_up_is_refused_not_a_panic() {
        for s in [
            "18446744073709551615s 1000ms",
            "99999999999s",
            "1s 1s 1s 1s 1s 1s 1s",
        ] {
            let refused = parse_duration(s).unwrap_err();
            assert!(refused.contains("too large"), "{refused}");
        }
        assert_eq!(
            parse_duration("9999999999ms"),
            Ok(Duration::from_millis(9_999_999_999))
        );
    }

    #[test]
    fn durations_read_with_units() {
        // Every spelling in docs/proxy.md, config/*.toml, the tests and scripts/, as the parser
        // before humantime read it.
        for (text, secs, millis) in [
            ("500ms", 0, 500),
            ("1500ms", 1, 500),
            ("10ms", 0, 10),
            ("100ms", 0, 100),
            ("200ms", 0, 200),
            ("300ms", 0, 300),
            ("0s", 0, 0),
            ("1s", 1, 0),
            ("2s", 2, 0),
            ("3s", 3, 0),
            ("4s", 4, 0),
            ("5s", 5, 0),
            ("8s", 8, 0),
            ("10s", 10, 0),
            ("20s", 20, 0),
            ("30s", 30, 0),
            ("60s", 60, 0),
            ("15m", 900, 0),
            ("1h", 3600, 0),
            ("2h", 7200, 0),
            ("12h", 12 * 3600, 0),
            ("24h", 86_400, 0),
            ("72h", 3 * 86_400, 0),
            ("3d", 3 * 86_400, 0),
            ("1h30m", 5400, 0),
            (" 30s ", 30, 0),
            ("1d12h30m15s500ms", 131_415, 500),
        ] {
            let expected = Duration::from_secs(secs) + Duration::from_millis(millis);
            assert_eq!(parse_duration(text), Ok(expected), "{text:?}");
        }
        // humantime's syntax adds spaces between parts, long unit names and fractions.
        assert_eq!(parse_duration("1h 30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("2 minutes"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("1w"), Ok(Duration::from_secs(7 * 86_400)));
        for bad in [
            "",
            "30",
            "s",
            "30x",
            "30S",
            "-1s",
            "1,5s",
            "99999999999999999999d",
            "3 parsecs",
        ] {
            let error = parse_duration(bad).expect_err(bad);
            assert!(error.contains("is not a duration"), "{error}");
        }
        let error = parse_duration("3 parsecs").unwrap_err();
        assert!(error.contains("unknown unit \"parsecs\""), "{error}");
    }

    #[test]
    fn a_value_of_the_wrong_kind_names_the_file_line_and_field() {
        let text = "upstream = \"http://127.0.0.1:3000\"\n\
                    [[routes]]\nprefix = \"/a\"\n\
                    [[routes]]\nprefix = \"/b\"\nttl = \"3 parsecs\"\n";
        let error = parse(text).unwrap_err();
        assert_eq!(error.field(), Some("routes[1].ttl"));
        assert_eq!(
            error.to_string(),
            "config file test.toml, line 6: routes[1].ttl: \"3 parsecs\" is not a duration \
             (unknown unit \"parsecs\"); expected a number and a unit, e.g. \"500ms\", \"30s\", \
             \"15m\", \"24h\", \"3d\" or \"1h 30m\""
        );
        let up = "upstream = \"http://127.0.0.1:3000\"\n";
        for (text, field, hint) in [
            (
                format!("{up}on_store_error = \"ignore\""),
                "on_store_error",
                "`reject` or `pass`",
            ),
            (
                format!("{up}[[routes]]\nprefix = \"/a\"\npreset = \"fast\""),
                "routes[0].preset",
                "`api`, `webhook`, `strict`",
            ),
            (
                format!("{up}[[routes]]\nprefix = \"/a\"\nlease = 30"),
                "routes[0].lease",
                "expected a duration",
            ),
            (
                format!("{up}max_request_bytes = -1"),
                "max_request_bytes",
                "expected a size",
            ),
            (
                format!("{up}[limits]\nmax_header_bytes = \"8 parsecs\""),
                "limits.max_header_bytes",
                "unknown unit",
            ),
        ] {
            let error = parse(&text).unwrap_err();
            assert_eq!(error.field(), Some(field), "{text}");
            let told = error.to_string();
            assert!(told.starts_with("config file test.toml, line "), "{told}");
            assert!(told.contains(hint), "{told}");
        }
    }

    #[test]
    fn a_refused_redis_store_never_repeats_its_password() {
        for spec in [
            "redis://user:hunter2@:6379",
            "redis-cluster://user:hunter2@127.0.0.1:7000,127.0.0.1",
            "rediss-cluster://:hunter2@127.0.0.1:x",
            "redisx://user:hunter2@127.0.0.1:6379",
        ] {
            let refused = StoreSpec::parse(spec).expect_err(spec);
            assert!(!refused.contains("hunter2"), "{spec}: {refused}");
        }
    }

    #[test]
    fn sizes_read_with_units() {
        assert_eq!(parse_byte_size("64KiB"), Ok(65_536));
        assert_eq!(parse_byte_size("10MiB"), Ok(10 << 20));
        assert_eq!(parse_byte_size("1MB"), Ok(1_000_000));
        assert_eq!(parse_byte_size("512"), Ok(512));
        assert!(parse_byte_size("10 parsecs").is_err());
        assert!(parse_byte_size("MiB").is_err());
    }

    #[test]
    fn upstream_only_takes_http() {
        let u = Upstream::parse("http://127.0.0.1:3000/api/").unwrap();
        assert_eq!(u.base_path, "/api");
        assert_eq!(u.authority.as_str(), "127.0.0.1:3000");
        let err = Upstream::parse("http://user:secret@127.0.0.1:3000").unwrap_err();
        assert!(err.contains("credentials"), "{err}");
        assert!(!err.contains("secret"), "the password is not echoed: {err}");
        assert_eq!(
            Upstream::parse("http://localhost:3000").unwrap().base_path,
            ""
        );
        let err = Upstream::parse("https://example.test").unwrap_err();
        assert!(err.contains("https"), "{err}");
        assert!(Upstream::parse("ftp://x").is_err());
        assert!(Upstream::parse("127.0.0.1:3000").is_err());
        assert!(Upstream::parse("http://h/?q=1").is_err());
    }

    #[test]
    fn store_specs() {
        assert_eq!(StoreSpec::parse("memory"), Ok(StoreSpec::Memory));
        assert_eq!(
            StoreSpec::parse("redb:/data/x.redb"),
            Ok(StoreSpec::Redb("/data/x.redb".into()))
        );
        assert_eq!(
            StoreSpec::parse("redis://127.0.0.1:6379/2"),
            Ok(StoreSpec::Redis("redis://127.0.0.1:6379/2".into()))
        );
        for bad in [
            "redb:",
            "sqlite:x",
            "mem",
            "redis://",
            "rediss://",
            "postgres://",
        ] {
            assert!(StoreSpec::parse(bad).is_err(), "{bad:?} should be refused");
        }
        // TLS is taken only by a build that can speak it, and refused with the reason.
        let tls = StoreSpec::parse("rediss://cache:6380");
        if cfg!(feature = "redis-tls") {
            assert_eq!(tls, Ok(StoreSpec::Redis("rediss://cache:6380".into())));
        } else {
            assert!(tls.is_err_and(|why| why.contains("redis-tls")));
        }
        let shown = StoreSpec::Redis("redis://user:secret@cache:6380/1".into()).to_string();
        assert!(!shown.contains("secret"), "{shown}");

        // A cluster: its nodes, each HOST:PORT, checked at --check-config.
        let cluster = "redis-cluster://:secret@10.0.0.1:7000,10.0.0.2:7001";
        if cfg!(feature = "redis-cluster") {
            assert_eq!(
                StoreSpec::parse(cluster),
                Ok(StoreSpec::Redis(cluster.into()))
            );
            let shown = StoreSpec::parse(cluster).unwrap().to_string();
            assert_eq!(shown, "redis-cluster://10.0.0.1:7000,10.0.0.2:7001");
            for bad in [
                "redis-cluster://",
                "redis-cluster://a:7000,",
                "redis-cluster://a",
                "redis-cluster://:7000",
                "redis-cluster://a:port",
                "redis-cluster://a:0",
            ] {
                let why = StoreSpec::parse(bad).unwrap_err();
                assert!(why.contains("HOST:PORT"), "{bad:?}: {why}");
            }
        } else {
            assert!(StoreSpec::parse(cluster).is_err_and(|why| why.contains("redis-cluster")));
        }
    }

    #[test]
    fn postgres_store_specs() {
        let urls = [
            "postgres://idemgate@db.internal:5433/app",
            "postgresql://idemgate@db.internal/app?sslmode=require",
            "postgres://idemgate:s3cret@127.0.0.1:5432/app?sslmode=disable",
        ];
        for url in urls {
            let spec = StoreSpec::parse(url);
            if cfg!(feature = "postgres") {
                assert_eq!(spec, Ok(StoreSpec::Postgres(url.into())), "{url}");
            } else {
                assert!(
                    spec.is_err_and(|why| why.contains("postgres feature")),
                    "{url}"
                );
            }
        }
        if cfg!(feature = "postgres") {
            let spec = StoreSpec::parse(urls[2]).unwrap();
            for shown in [spec.to_string(), format!("{spec:?}")] {
                assert!(!shown.contains("s3cret"), "{shown}");
                assert!(shown.contains("idemgate@127.0.0.1:5432/app"), "{shown}");
            }
        }
        // Refused, naming what is wrong and what would be valid, never the password.
        for (bad, why) in [
            ("postgres://gw:s3cret@h/db?sslmode=sometimes", "sslmode"),
            ("postgres://gw:s3cret@h/db?sslmode=verify-ca", "verify-ca"),
            ("postgresql://gw:s3cret@h/db?frobnicate=1", "frobnicate"),
            ("postgres://gw:s3cret@h:notaport/db", "port"),
            ("postgres:///db", "no host"),
        ] {
            let refused = StoreSpec::parse(bad).expect_err(bad);
            assert!(!refused.contains("s3cret"), "{refused}");
            if cfg!(feature = "postgres") {
                assert!(refused.contains(why), "{bad}: {refused}");
                assert!(
                    refused.contains("expected postgres://USER"),
                    "{bad}: {refused}"
                );
            }
        }
    }

    #[test]
    fn minimal_config_takes_defaults() {
        let s = parse("upstream = \"http://127.0.0.1:3000\"").unwrap();
        assert_eq!(s.listen, DEFAULT_LISTEN.parse().unwrap());
        assert_eq!(s.admin_listen, DEFAULT_ADMIN_LISTEN.parse().unwrap());
        assert_eq!(s.store, StoreSpec::parse(DEFAULT_STORE).unwrap());
        assert_eq!(s.store_timeout, DEFAULT_STORE_TIMEOUT);
        assert_eq!(s.upstream_timeout, DEFAULT_UPSTREAM_TIMEOUT);
        assert_eq!(s.on_store_error, OnStoreError::Reject);
        assert_eq!(s.limits.max_connections, DEFAULT_MAX_CONNECTIONS);
        assert!(s.admin_token.is_none());
        assert!(s.routes.is_empty());
        assert_eq!(s.default_route.route_name(), DEFAULT_ROUTE_NAME);
    }

    #[test]
    fn overrides_win_over_the_file() {
        let file: FileConfig = toml::from_str(
            "upstream = \"http://127.0.0.1:1\"\nlisten = \"127.0.0.1:1000\"\nttl = \"1h\"",
        )
        .unwrap();
        let o = Overrides {
            listen: Some("127.0.0.1:2000".into()),
            ttl: Some(Duration::from_secs(7200)),
            ..Overrides::default()
        };
        let s = file.clone().with_overrides(&o).validate().unwrap();
        assert_eq!(s.listen.port(), 2000);
        assert_eq!(s.upstream.authority.as_str(), "127.0.0.1:1");
        let from_file = file.validate().unwrap().default_route;
        assert_same_policy(&s.default_route, from_file.ttl(Duration::from_secs(7200)));
    }

    #[test]
    fn underscored_fields_are_dropped_unless_the_file_or_an_override_keeps_them() {
        let up = "upstream = \"http://127.0.0.1:1\"\n";
        for (file, flag, kept) in [
            ("", None, false),
            ("underscores_in_headers = true", None, true),
            ("underscores_in_headers = false", Some(true), true),
            ("underscores_in_headers = true", Some(false), false),
        ] {
            let config: FileConfig = toml::from_str(&format!("{up}{file}")).unwrap();
            let o = Overrides {
                underscores_in_headers: flag,
                ..Overrides::default()
            };
            let s = config.with_overrides(&o).validate().unwrap();
            assert_eq!(s.underscores_in_headers, kept, "{file:?} {flag:?}");
        }
    }

    #[test]
    fn an_overriding_admin_token_wins_over_the_files_in_either_form() {
        let o = Overrides {
            admin_token: Some("from-the-flag-0123456789".into()),
            ..Overrides::default()
        };
        for line in [
            "admin_token = \"from-the-file-0123456789\"",
            "admin_token_env = \"IDEMGATE_TEST_UNSET_VARIABLE\"",
        ] {
            let file: FileConfig =
                toml::from_str(&format!("upstream = \"http://127.0.0.1:1\"\n{line}")).unwrap();
            let s = file.with_overrides(&o).validate().unwrap();
            assert_eq!(s.admin_token.as_deref(), Some("from-the-flag-0123456789"));
        }
        // Within one file, both forms are still a mistake.
        let both: FileConfig = toml::from_str(
            "upstream = \"http://127.0.0.1:1\"\nadmin_token = \"from-the-file-0123456789\"\nadmin_token_env = \"X\"",
        )
        .unwrap();
        let error = both.validate().unwrap_err().to_string();
        assert!(error.contains("not both"), "{error}");
    }

    #[test]
    fn routes_build_policies() {
        let s = parse(
            r#"
            upstream = "http://127.0.0.1:3000"
            ttl = "12h"
            [[routes]]
            prefix = "/webhooks/github"
            name = "github"
            preset = "webhook"
            key_header = "X-GitHub-Delivery"
            scope_headers = []
            [[routes]]
            prefix = "/payments"
            methods = ["post", "PUT"]
            require_key = true
            concurrent = "wait"
            wait_timeout = "5s"
            store_statuses = ["2xx", "4xx", "!429"]
            unknown_outcome = "retry"
            mismatch_status = 409
            ttl = "1h"
            lease = "10s"
            max_request_bytes = "1MiB"
            "#,
        )
        .unwrap();
        // The top-level ttl applies to a route that sets none.
        let github = RoutePolicy::preset(Preset::Webhook)
            .name("github")
            .key_header(HeaderName::from_static("x-github-delivery"))
            .scope_headers([])
            .ttl(Duration::from_secs(12 * 3600));
        assert_same_policy(&s.routes[0].policy, github);
        let payments = RoutePolicy::default()
            .name("/payments")
            .methods([Method::POST, Method::PUT])
            .require_key(true)
            .concurrent(Concurrent::Wait(Duration::from_secs(5)))
            .store_statuses(StatusSet::parse(&["2xx", "4xx", "!429"]).unwrap())
            .unknown_outcome(UnknownOutcome::Retry)
            .mismatch_status(StatusCode::CONFLICT)
            .ttl(Duration::from_secs(3600))
            .lease(Duration::from_secs(10))
            .max_request_bytes(1 << 20);
        assert_same_policy(&s.routes[1].policy, payments);
        assert!(s.route_by_name("github").is_some());
        assert_eq!(s.route_names().count(), 3);
    }

    #[test]
    fn waiting_for_replicas_needs_a_redis_store() {
        let up = "upstream = \"http://127.0.0.1:3000\"\nstore_wait_replicas = 1\n";
        assert_eq!(field_of(up), "store_wait_replicas");
        assert_eq!(
            field_of(&format!("{up}store = \"redb:x.redb\"")),
            "store_wait_replicas"
        );
        let redis = parse(&format!("{up}store = \"redis://127.0.0.1:6379\"")).unwrap();
        assert_eq!(redis.store_wait_replicas, 1);
        let cluster = format!("{up}store = \"redis-cluster://127.0.0.1:7000,127.0.0.1:7001\"");
        assert_eq!(parse(&cluster).unwrap().store_wait_replicas, 1);
        assert_eq!(
            parse("upstream = \"http://127.0.0.1:3000\"")
                .unwrap()
                .store_wait_replicas,
            0
        );
    }

    #[test]
    fn a_pool_size_needs_a_postgres_store_and_one_connection() {
        let up = "upstream = \"http://127.0.0.1:3000\"\n";
        let pg = format!("{up}store = \"postgres://gw@127.0.0.1/app\"\n");
        assert_eq!(
            parse(&format!("{pg}store_pool_size = 4"))
                .unwrap()
                .store_pool_size,
            Some(4)
        );
        assert_eq!(parse(&pg).unwrap().store_pool_size, None);
        assert_eq!(
            field_of(&format!("{pg}store_pool_size = 0")),
            "store_pool_size"
        );
        assert_eq!(
            field_of(&format!("{pg}store_pool_size = -1")),
            "store_pool_size"
        );
        for other in ["memory", "redb:x.redb", "redis://127.0.0.1:6379"] {
            assert_eq!(
                field_of(&format!("{up}store = \"{other}\"\nstore_pool_size = 4")),
                "store_pool_size",
                "{other}"
            );
        }
    }

    #[test]
    fn bad_values_name_their_field() {
        let up = "upstream = \"http://127.0.0.1:3000\"\n";
        assert_eq!(field_of(""), "upstream");
        assert_eq!(field_of("upstream = \"https://x\""), "upstream");
        assert_eq!(field_of(&format!("{up}listen = \"localhost\"")), "listen");
        assert_eq!(field_of(&format!("{up}store = \"sqlite:x\"")), "store");
        assert_eq!(
            field_of(&format!("{up}store_timeout = \"2 parsecs\"")),
            "store_timeout"
        );
        assert_eq!(
            field_of(&format!("{up}store_timeout = \"0s\"")),
            "store_timeout"
        );
        assert_eq!(
            field_of(&format!("{up}on_store_error = \"ignore\"")),
            "on_store_error"
        );
        assert_eq!(
            field_of(&format!("{up}admin_token = \"short\"")),
            "admin_token"
        );
        assert_eq!(
            field_of(&format!(
                "{up}upstream_timeout = \"1s\"\nupstream_connect_timeout = \"2s\""
            )),
            "upstream_connect_timeout"
        );
        for short in ["0s", "99ms"] {
            assert_eq!(
                field_of(&format!("{up}upstream_idle_timeout = \"{short}\"")),
                "upstream_idle_timeout"
            );
        }
        assert_eq!(
            field_of(&format!("{up}[limits]\nmax_connections = 0")),
            "limits.max_connections"
        );
        assert_eq!(
            field_of(&format!("{up}[limits]\nmax_header_bytes = 100")),
            "limits.max_header_bytes"
        );
        assert_eq!(
            field_of(&format!("{up}[[routes]]\nname = \"x\"")),
            "routes[0].prefix"
        );
        assert_eq!(
            field_of(&format!("{up}[[routes]]\nprefix = \"payments\"")),
            "routes[0].prefix"
        );
        assert_eq!(
            field_of(&format!(
                "{up}[[routes]]\nprefix = \"/a\"\npreset = \"fast\""
            )),
            "routes[0].preset"
        );
        assert_eq!(
            field_of(&format!(
                "{up}[[routes]]\nprefix = \"/a\"\nkey_header = \"bad header\""
            )),
            "routes[0].key_header"
        );
        assert_eq!(
            field_of(&format!(
                "{up}[[routes]]\nprefix = \"/a\"\nkey_header = \"a\"\nkey_json_pointer = \"/id\""
            )),
            "routes[0].key_json_pointer"
        );
        assert_eq!(
            field_of(&format!(
                "{up}[[routes]]\nprefix = \"/a\"\nkey_json_pointer = \"id\""
            )),
            "routes[0].key_json_pointer"
        );
        assert_eq!(
            field_of(&format!(
                "{up}[[routes]]\nprefix = \"/a\"\nmethods = [\"POST\", \"GE T\"]"
            )),
            "routes[0].methods[1]"
        );
        assert_eq!(
            field_of(&format!(
                "{up}[[routes]]\nprefix = \"/a\"\nttl = \"forever\""
            )),
            "routes[0].ttl"
        );
        assert_eq!(
            field_of(&format!(
                "{up}[[routes]]\nprefix = \"/a\"\nconcurrent = \"queue\""
            )),
            "routes[0].concurrent"
        );
        assert_eq!(
            field_of(&format!(
                "{up}[[routes]]\nprefix = \"/a\"\nwait_timeout = \"1s\""
            )),
            "routes[0].wait_timeout"
        );
        assert_eq!(
            field_of(&format!(
                "{up}[[routes]]\nprefix = \"/a\"\nstore_statuses = [\"2xx\", \"6xx\"]"
            )),
            "routes[0].store_statuses"
        );
        assert_eq!(
            field_of(&format!(
                "{up}[[routes]]\nprefix = \"/a\"\nunknown_outcome = \"maybe\""
            )),
            "routes[0].unknown_outcome"
        );
        assert_eq!(
            field_of(&format!(
                "{up}[[routes]]\nprefix = \"/a\"\nmismatch_status = 200"
            )),
            "routes[0].mismatch_status"
        );
        assert_eq!(
            field_of(&format!(
                "{up}[[routes]]\nprefix = \"/a\"\nlease = \"10ms\""
            )),
            "routes[0].lease"
        );
        // A renewal sent at a third of the lease must land before its end.
        assert_eq!(
            field_of(&format!(
                "{up}store_timeout = \"2s\"\n[[routes]]\nprefix = \"/a\"\nlease = \"3s\""
            )),
            "routes[0].lease"
        );
        assert_eq!(
            field_of(&format!("{up}store_timeout = \"20s\"")),
            "store_timeout"
        );
        assert_eq!(
            field_of(&format!(
                "{up}[[routes]]\nprefix = \"/a\"\n[[routes]]\nprefix = \"/b\"\nname = \"/a\""
            )),
            "routes[1].name"
        );
        assert_eq!(
            field_of(&format!(
                "{up}[[routes]]\nprefix = \"/a\"\nname = \"x\"\n[[routes]]\nprefix = \"/a\"\nname = \"y\""
            )),
            "routes[1].prefix"
        );
    }

    #[test]
    fn sample_configs_load_and_validate() {
        let s = parse(include_str!("../../../config/idemgate.toml")).unwrap();
        assert_eq!(s.routes.len(), 2);
        let pay = format!("{:?}", s.route_by_name("payments").unwrap());
        assert!(pay.contains("require_key: true"), "{pay}");
        assert!(pay.contains("concurrent: Wait(10s)"), "{pay}");
        let orders = format!("{:?}", s.route_by_name("orders").unwrap());
        assert!(orders.contains("mismatch_status: 409"), "{orders}");

        // Every route of the webhook sample is a provider route, verified, with its
        // provider's setup; it is loaded here so that it cannot rot.
        let text = include_str!("../../../config/webhooks.toml");
        let file = FileConfig::from_toml(text, Path::new("webhooks.toml")).unwrap();
        assert_eq!(file.routes.len(), 6);
        assert!(
            file.routes
                .iter()
                .all(|r| r.provider.is_some() && r.secret_env.is_some()),
            "every route of config/webhooks.toml is a provider route with its secret's name"
        );
        #[cfg(feature = "webhooks")]
        {
            use idemgate::webhook::Provider;
            let s = file.validate_reading(test_env).unwrap();
            for provider in Provider::ALL {
                let name = provider.as_str();
                let route = s
                    .routes
                    .iter()
                    .find(|r| r.policy.route_name() == name)
                    .unwrap_or_else(|| panic!("no {name} route in config/webhooks.toml"));
                let policy = format!("{:?}", route.policy);
                assert!(policy.contains("verifier: Some("), "{policy}");
                let preset = format!("{:?}", provider.policy());
                for setting in [
                    "key",
                    "methods",
                    "require_key",
                    "scope_headers",
                    "fingerprint_headers",
                    "store_statuses",
                    "unknown_outcome",
                    "ttl",
                    "concurrent",
                ] {
                    assert_eq!(
                        debug_field(&policy, setting),
                        debug_field(&preset, setting),
                        "{name}: {setting}"
                    );
                }
                assert!(route.prefix.starts_with("/webhooks/"), "{}", route.prefix);
            }
        }
        #[cfg(not(feature = "webhooks"))]
        assert_eq!(
            file.validate().unwrap_err().field(),
            Some("routes[0].provider")
        );
    }

    /// A provider route starts from the provider's verified setup; only the keys the file
    /// writes change it, and the top-level ttl does not shorten it.
    #[cfg(feature = "webhooks")]
    #[test]
    fn a_provider_route_is_the_providers_setup_with_only_the_written_keys_changed() {
        use idemgate::webhook::{DEFAULT_TOLERANCE, Provider};

        let verified = |provider: Provider, public_url: Option<&str>| {
            let secrets = test_env(&["ANY".to_owned()]).unwrap();
            provider
                .verified_policy(secrets, DEFAULT_TOLERANCE, public_url)
                .unwrap()
        };
        let s = parse(
            r#"
            upstream = "http://127.0.0.1:3000"
            ttl = "1h"
            max_request_bytes = "1MiB"
            [[routes]]
            prefix = "/hooks/stripe"
            provider = "stripe"
            secret_env = "STRIPE_WEBHOOK_SECRET"
            [[routes]]
            prefix = "/hooks/slack"
            provider = "slack"
            secret_env = ["SLACK_SIGNING_SECRET", "SLACK_SIGNING_SECRET_NEXT"]
            signature_tolerance = "2m"
            name = "slack-events"
            concurrent = "wait"
            [[routes]]
            prefix = "/hooks/github"
            provider = "github"
            secret_env = "GITHUB_WEBHOOK_SECRET"
            preset = "webhook"
            concurrent = "reject"
            ttl = "7d"
            fingerprint_headers = ["Content-Type"]
            [[routes]]
            prefix = "/hooks/twilio"
            provider = "twilio"
            secret_env = "TWILIO_AUTH_TOKEN"
            public_url = "https://hooks.example.com/twilio"
            wait_timeout = "3s"
            "#,
        )
        .unwrap();
        // Nothing but the top-level body cap is laid over the provider's setup: not the
        // top-level ttl (the provider's 72 h stays), not the preset's concurrent or lease.
        assert_same_policy(
            &s.routes[0].policy,
            verified(Provider::Stripe, None).max_request_bytes(1 << 20),
        );
        // concurrent = "wait" alone keeps the provider's bound (Slack's 2 s).
        assert_same_policy(
            &s.routes[1].policy,
            verified(Provider::Slack, None)
                .name("slack-events")
                .max_request_bytes(1 << 20),
        );
        assert_same_policy(
            &s.routes[2].policy,
            verified(Provider::GitHub, None)
                .max_request_bytes(1 << 20)
                .concurrent(Concurrent::Reject)
                .ttl(Duration::from_secs(7 * 86_400))
                .fingerprint_headers([http::header::CONTENT_TYPE]),
        );
        // wait_timeout alone bounds the provider's wait.
        assert_same_policy(
            &s.routes[3].policy,
            verified(Provider::Twilio, Some("https://hooks.example.com/twilio"))
                .max_request_bytes(1 << 20)
                .concurrent(Concurrent::Wait(Duration::from_secs(3))),
        );
        // Every provider's setup waits, which is what lets wait_timeout alone bound it.
        for provider in Provider::ALL {
            let policy = format!("{:?}", provider.policy());
            assert!(
                debug_field(&policy, "concurrent").starts_with("concurrent: Wait("),
                "{policy}"
            );
        }
        assert_eq!(
            s.route_names().collect::<Vec<_>>(),
            ["default", "stripe", "slack-events", "github", "twilio"]
        );
        // A route without a provider is as it was: its preset and the top-level ttl.
        let plain = parse(
            "upstream = \"http://127.0.0.1:3000\"\nttl = \"1h\"\n[[routes]]\nprefix = \"/a\"\npreset = \"webhook\"",
        )
        .unwrap();
        assert_same_policy(
            &plain.routes[0].policy,
            RoutePolicy::webhook()
                .name("/a")
                .ttl(Duration::from_secs(3600)),
        );
    }

    #[cfg(feature = "webhooks")]
    #[test]
    fn provider_mistakes_are_refused_naming_the_field_and_never_a_secret() {
        let route = |lines: &str| {
            format!("upstream = \"http://127.0.0.1:3000\"\n[[routes]]\nprefix = \"/a\"\n{lines}")
        };
        for (lines, field, hint) in [
            (
                "provider = \"gitlab\"\nsecret_env = \"S\"",
                "routes[0].provider",
                "\"github\", \"stripe\", \"shopify\", \"standard-webhooks\", \"slack\", \"twilio\"",
            ),
            (
                "provider = \"stripe\"",
                "routes[0].secret_env",
                "required with provider = \"stripe\"",
            ),
            (
                "provider = \"stripe\"\nsecret_env = []",
                "routes[0].secret_env",
                "is empty",
            ),
            (
                "provider = \"stripe\"\nsecret_env = [\"A\", \"B=C\"]",
                "routes[0].secret_env[1]",
                "not the name of an environment variable",
            ),
            (
                "provider = \"stripe\"\nsecret_env = [\"STRIPE_WEBHOOK_SECRET\", \"UNSET_NEXT\"]",
                "routes[0].secret_env",
                "the environment variable UNSET_NEXT holds no webhook secret: it is not set",
            ),
            (
                "provider = \"github\"\nsecret_env = \"EMPTY_SECRET\"",
                "routes[0].secret_env",
                "EMPTY_SECRET is empty",
            ),
            (
                "provider = \"standard-webhooks\"\nsecret_env = \"NOT_BASE64_SECRET\"",
                "routes[0].secret_env",
                "not valid base64",
            ),
            (
                "provider = \"twilio\"\nsecret_env = \"T\"",
                "routes[0].public_url",
                "required with provider = \"twilio\"",
            ),
            (
                "provider = \"twilio\"\nsecret_env = \"T\"\npublic_url = \"/twilio\"",
                "routes[0].public_url",
                "absolute",
            ),
            (
                "provider = \"github\"\nsecret_env = \"G\"\npublic_url = \"https://x.example/gh\"",
                "routes[0].public_url",
                "only twilio",
            ),
            (
                "provider = \"github\"\nsecret_env = \"G\"\nsignature_tolerance = \"1m\"",
                "routes[0].signature_tolerance",
                "signs no timestamp",
            ),
            (
                "provider = \"slack\"\nsecret_env = \"S\"\nsignature_tolerance = \"0s\"",
                "routes[0].signature_tolerance",
                "longer than zero",
            ),
            (
                "provider = \"stripe\"\nsecret_env = \"S\"\npreset = \"api\"",
                "routes[0].preset",
                "webhook route",
            ),
            (
                "provider = \"stripe\"\nsecret_env = \"S\"\nconcurrent = \"reject\"\nwait_timeout = \"1s\"",
                "routes[0].wait_timeout",
                "only applies with concurrent",
            ),
            (
                "secret_env = \"S\"",
                "routes[0].secret_env",
                "only applies to a webhook provider route",
            ),
            (
                "public_url = \"https://x.example\"",
                "routes[0].public_url",
                "only applies to a webhook provider route",
            ),
            (
                "signature_tolerance = \"1m\"",
                "routes[0].signature_tolerance",
                "only applies to a webhook provider route",
            ),
            (
                "provider = \"stripe\"\nsecret_env = 5",
                "routes[0].secret_env",
                "environment variable",
            ),
            (
                "provider = \"stripe\"\nsecret_env = \"S\"\nsignature_tolerance = \"soon\"",
                "routes[0].signature_tolerance",
                "not a duration",
            ),
        ] {
            let text = route(lines);
            let error = parse(&text).unwrap_err();
            assert_eq!(error.field(), Some(field), "{text}\n{error}");
            let told = idemgate::ErrorChain(&error).to_string();
            assert!(told.contains(hint), "{text}\n{told}");
            assert!(!told.contains("s3cr3t"), "a secret in an error: {told}");
        }
        // Two routes of one provider need names of their own.
        let twice = route(
            "provider = \"github\"\nsecret_env = \"A\"\n[[routes]]\nprefix = \"/b\"\nprovider = \"github\"\nsecret_env = \"B\"",
        );
        assert_eq!(field_of(&twice), "routes[1].name");
        // A parsed provider route prints no secret either.
        let s = parse(&route("provider = \"github\"\nsecret_env = \"G\"")).unwrap();
        let shown = format!("{s:?}");
        assert!(!shown.contains("s3cr3t"), "{shown}");
    }

    /// A gateway built without the `webhooks` feature refuses a provider route at start, and
    /// says why.
    #[cfg(not(feature = "webhooks"))]
    #[test]
    fn without_the_webhooks_feature_a_provider_route_is_refused() {
        let error = parse(
            "upstream = \"http://127.0.0.1:3000\"\n[[routes]]\nprefix = \"/a\"\nprovider = \"github\"\nsecret_env = \"G\"",
        )
        .unwrap_err();
        assert_eq!(error.field(), Some("routes[0].provider"));
        assert!(error.to_string().contains("`webhooks` feature"), "{error}");
    }

    #[test]
    fn unknown_fields_are_refused_by_name() {
        // As the gateway prints it: the error with its causes (the parser's message is the
        // cause of a file's parse error).
        let told = |err: ConfigError| idemgate::ErrorChain(&err).to_string();
        let err =
            parse("upstream = \"http://127.0.0.1:3000\"\nlisen = \"127.0.0.1:1\"").unwrap_err();
        let err = told(err);
        assert!(err.contains("lisen"), "{err}");
        let err =
            parse("upstream = \"http://127.0.0.1:3000\"\n[[routes]]\nprefix = \"/a\"\nkey = \"x\"")
                .unwrap_err();
        let err = told(err);
        assert!(err.contains("key"), "{err}");
    }
}
