//! [`PostgresStoreConfig`], and how it becomes a connection configuration and a TLS connector.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tokio_postgres::config::{Host, SslMode};
use tokio_postgres_rustls::MakeRustlsConnect;

use super::BACKEND;
use crate::store::StoreError;

/// Settings for a [`PostgresStore`](super::PostgresStore).
///
/// ```
/// use std::time::Duration;
/// use idemgate::store::PostgresStoreConfig;
///
/// let mut config = PostgresStoreConfig::new("postgres://idemgate@db.internal:5432/app?sslmode=require");
/// config.pool_size = 32;
/// config.timeout = Duration::from_millis(500);
/// ```
#[derive(Clone)]
#[non_exhaustive]
pub struct PostgresStoreConfig {
    /// Where PostgreSQL is: `postgres://[user[:password]@]host[:port][/dbname][?param=value&…]`
    /// (or `postgresql://…`), with libpq's parameters as `tokio-postgres` reads them
    /// (`sslmode`, `options`, `application_name`, `connect_timeout`, `host=/socket/dir`, …).
    ///
    /// `sslmode` is `disable`, `prefer` (the default: TLS when the server offers it) or
    /// `require`; `verify-full` is taken as `require`. Every TLS connection checks the
    /// server's certificate and name against the system's trusted roots (or those in
    /// `SSL_CERT_FILE` / `SSL_CERT_DIR` when set), as libpq's `verify-full` does, so
    /// `verify-ca` (which skips the name) is refused. Never logged with its password.
    pub url: String,
    /// The password, used when the URL carries none. [`new`](Self::new) takes it from
    /// `PGPASSWORD`, as libpq does. Never logged.
    pub password: Option<String>,
    /// Most connections the store keeps open at once; with two or more, one of them carries
    /// the reads every call shares. Default [`DEFAULT_POOL_SIZE`](Self::DEFAULT_POOL_SIZE).
    pub pool_size: usize,
    /// How long one store call may take, waiting for a pooled connection and connecting
    /// included, before it fails with [`StoreError::Timeout`]. Also each connection's
    /// `statement_timeout`, so the server gives up on a statement the store gave up on.
    /// Default [`DEFAULT_TIMEOUT`](Self::DEFAULT_TIMEOUT).
    pub timeout: Duration,
    /// Pause between two runs of the background deletion of expired records. Default
    /// [`DEFAULT_SWEEP_INTERVAL`](Self::DEFAULT_SWEEP_INTERVAL).
    pub sweep_interval: Duration,
    /// Most expired records one deletion removes (one short transaction); a run deletes such
    /// batches one after another while they come back full. Default
    /// [`DEFAULT_SWEEP_BATCH`](Self::DEFAULT_SWEEP_BATCH).
    pub sweep_batch: u32,
}

impl PostgresStoreConfig {
    /// The default [`pool_size`](Self::pool_size): enough for a busy gateway's concurrent
    /// store calls, each a single short statement.
    pub const DEFAULT_POOL_SIZE: usize = 16;
    /// The default [`timeout`](Self::timeout), as for Redis: a round trip under load fits,
    /// and a client waiting behind a dead server gets its `503` quickly.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1);
    /// The default [`sweep_interval`](Self::sweep_interval).
    pub const DEFAULT_SWEEP_INTERVAL: Duration = Duration::from_secs(1);
    /// The default [`sweep_batch`](Self::sweep_batch).
    pub const DEFAULT_SWEEP_BATCH: u32 = 1_000;

    /// Settings for the PostgreSQL at `url`, the password from `PGPASSWORD` if it is set,
    /// everything else at its default.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            password: std::env::var("PGPASSWORD").ok(),
            pool_size: Self::DEFAULT_POOL_SIZE,
            timeout: Self::DEFAULT_TIMEOUT,
            sweep_interval: Self::DEFAULT_SWEEP_INTERVAL,
            sweep_batch: Self::DEFAULT_SWEEP_BATCH,
        }
    }

    /// Checks the URL as [`PostgresStore::connect`](super::PostgresStore::connect) reads it
    /// (its scheme, its syntax, a host, its `sslmode`), without contacting the server, and
    /// returns the server it names as logs and errors show it: `user@host:port/dbname`,
    /// never the password.
    ///
    /// A URL that is refused gets a [`StoreError::Unavailable`] whose source says what is
    /// wrong, without the URL (which may carry a password).
    ///
    /// ```
    /// use idemgate::store::PostgresStoreConfig;
    ///
    /// let config = PostgresStoreConfig::new("postgresql://gw:s3cret@db.internal:5433/app?sslmode=require");
    /// assert_eq!(config.validate().unwrap(), "gw@db.internal:5433/app");
    /// assert!(PostgresStoreConfig::new("postgres://db/app?sslmode=sometimes").validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<String, StoreError> {
        connection_config(self).map(|pg| display_target(&pg))
    }
}

impl fmt::Debug for PostgresStoreConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let server = match connection_config(self) {
            Ok(config) => display_target(&config),
            Err(_) => "(invalid url)".to_owned(),
        };
        f.debug_struct("PostgresStoreConfig")
            .field("server", &server)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .field("pool_size", &self.pool_size)
            .field("timeout", &self.timeout)
            .field("sweep_interval", &self.sweep_interval)
            .field("sweep_batch", &self.sweep_batch)
            .finish()
    }
}

/// What went wrong with the server (or the settings for it): the source of every
/// [`StoreError::Unavailable`] the store returns, naming the server without its password.
#[derive(Debug, thiserror::Error)]
#[error("postgres at {server}: {what}")]
pub(super) struct ServerError {
    pub(super) server: String,
    pub(super) what: String,
    #[source]
    pub(super) source: Option<crate::store::BoxError>,
}

pub(super) fn server_error(
    server: &str,
    what: impl Into<String>,
    source: Option<crate::store::BoxError>,
) -> StoreError {
    StoreError::Unavailable {
        backend: BACKEND,
        source: Box::new(ServerError {
            server: server.to_owned(),
            what: what.into(),
            source,
        }),
    }
}

/// A URL that cannot be used, said without the URL itself (it may carry a password).
#[derive(Debug, thiserror::Error)]
#[error("invalid postgres url: {what}")]
struct InvalidUrl {
    what: &'static str,
    #[source]
    source: Option<crate::store::BoxError>,
}

/// The connection settings `config` describes, with the store's own additions: the password
/// from [`PostgresStoreConfig::password`] when the URL has none, the store timeout as the
/// connect timeout and as every session's `statement_timeout`, `enable_seqscan = off`, and
/// `application_name` `idemgate` unless the URL names one.
pub(super) fn connection_config(
    config: &PostgresStoreConfig,
) -> Result<tokio_postgres::Config, StoreError> {
    let invalid = |what, source| StoreError::Unavailable {
        backend: BACKEND,
        source: Box::new(InvalidUrl { what, source }),
    };
    let url = config.url.as_str();
    if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
        return Err(invalid(
            "it must start with postgres:// or postgresql://",
            None,
        ));
    }
    let url = normalise_sslmode(url).map_err(|what| invalid(what, None))?;
    let mut pg: tokio_postgres::Config = url
        .parse()
        .map_err(|e: tokio_postgres::Error| invalid("cannot be read", Some(Box::new(e))))?;
    if pg.get_hosts().is_empty() && pg.get_hostaddrs().is_empty() {
        return Err(invalid("it names no host", None));
    }
    if pg.get_password().is_none()
        && let Some(password) = &config.password
    {
        pg.password(password.as_str());
    }
    if pg.get_connect_timeout().is_none() {
        pg.connect_timeout(config.timeout);
    }
    if pg.get_application_name().is_none() {
        pg.application_name("idemgate");
    }
    // A session keeps its statements' plans for its whole life, and autovacuum empties and
    // analyzes the table whenever traffic stops: plans made then would read the whole table
    // once it has grown again. Every statement of the store has an index to use.
    let ours = format!(
        "-c statement_timeout={} -c enable_seqscan=off",
        config.timeout.as_millis().clamp(1, i32::MAX as u128)
    );
    let options = match pg.get_options() {
        Some(theirs) if !theirs.trim().is_empty() => format!("{theirs} {ours}"),
        _ => ours,
    };
    pg.options(options);
    Ok(pg)
}

/// Checks that a new session runs with the settings [`connection_config`] asks for: a pooler
/// between the store and PostgreSQL (PgBouncer with `ignore_startup_parameters = options`)
/// drops them without a word, and its sessions would then run without `statement_timeout`
/// and with plans that read the whole table. Such a session is refused, naming the cause.
pub(super) async fn check_session(
    client: &mut deadpool_postgres::ClientWrapper,
) -> Result<(), deadpool_postgres::HookError> {
    // The simple protocol: a pooler in transaction mode may run a prepared statement's
    // execution on another server connection than its preparation.
    let answer = client
        .simple_query("SHOW enable_seqscan")
        .await
        .map_err(deadpool_postgres::HookError::Backend)?;
    let enable_seqscan = answer.iter().find_map(|message| match message {
        tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0),
        _ => None,
    });
    if enable_seqscan == Some("off") {
        return Ok(());
    }
    Err(deadpool_postgres::HookError::message(
        "the session runs without the options the store connected with \
         (-c statement_timeout=… -c enable_seqscan=off): a pooler between the gateway and \
         PostgreSQL dropped them (PgBouncer's ignore_startup_parameters = options?); connect \
         to PostgreSQL directly",
    ))
}

/// `sslmode=verify-full` becomes `require` (every TLS connection here is verified as
/// `verify-full` asks); `verify-ca` is refused, as its weaker check cannot be had.
fn normalise_sslmode(url: &str) -> Result<std::borrow::Cow<'_, str>, &'static str> {
    let Some((base, query)) = url.split_once('?') else {
        return Ok(url.into());
    };
    let mut changed = false;
    let mut params = Vec::new();
    for param in query.split('&') {
        match param {
            "sslmode=verify-full" => {
                changed = true;
                params.push("sslmode=require");
            }
            "sslmode=verify-ca" => {
                return Err(
                    "sslmode=verify-ca is not supported: TLS connections always check the \
                     server's name too; use sslmode=verify-full (or require, the same here)",
                );
            }
            other => params.push(other),
        }
    }
    if !changed {
        return Ok(url.into());
    }
    Ok(format!("{base}?{}", params.join("&")).into())
}

/// `user@host:port/dbname` for logs and errors: what the URL names, never its password.
pub(super) fn display_target(config: &tokio_postgres::Config) -> String {
    let hosts: Vec<String> = config
        .get_hosts()
        .iter()
        .enumerate()
        .map(|(i, host)| {
            let name = match host {
                Host::Tcp(name) => name.clone(),
                Host::Unix(path) => path.display().to_string(),
            };
            match config.get_ports().get(i).or(config.get_ports().first()) {
                Some(port) => format!("{name}:{port}"),
                None => name,
            }
        })
        .collect();
    let mut out = String::new();
    if let Some(user) = config.get_user() {
        out.push_str(user);
        out.push('@');
    }
    out.push_str(&hosts.join(","));
    if let Some(db) = config.get_dbname() {
        out.push('/');
        out.push_str(db);
    }
    out
}

/// The TLS connector for `sslmode=prefer` and `require`: rustls with ring's cryptography,
/// trusting the system's roots (`SSL_CERT_FILE` and `SSL_CERT_DIR` apply). Built even for
/// `disable`, where it is never used, so the pool has one connector type.
pub(super) fn tls_connector(server: &str, mode: SslMode) -> Result<MakeRustlsConnect, StoreError> {
    let mut roots = rustls::RootCertStore::empty();
    if mode != SslMode::Disable {
        let found = rustls_native_certs::load_native_certs();
        for error in &found.errors {
            tracing::debug!(postgres = %server, %error, "a trusted root could not be loaded");
        }
        let (added, _ignored) = roots.add_parsable_certificates(found.certs);
        if added == 0 {
            tracing::warn!(
                postgres = %server,
                "no trusted root certificates found: TLS connections to postgres will fail \
                 (install ca-certificates, or set SSL_CERT_FILE)",
            );
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| server_error(server, "cannot set up TLS", Some(Box::new(e))))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(MakeRustlsConnect::new(tls))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(url: &str) -> PostgresStoreConfig {
        let mut config = PostgresStoreConfig::new(url);
        config.password = None;
        config
    }

    #[test]
    fn both_schemes_parse_and_others_are_refused() {
        for url in ["postgres://u@h:5433/db", "postgresql://u@h:5433/db"] {
            let pg = connection_config(&config(url)).expect(url);
            assert_eq!(display_target(&pg), "u@h:5433/db");
        }
        for url in [
            "redis://h",
            "host=h user=u",
            "postgres//h",
            "postgres://",
            "postgres:///db",
        ] {
            assert!(connection_config(&config(url)).is_err(), "{url}");
        }
    }

    #[test]
    fn the_urls_password_wins_over_the_configured_one() {
        let mut c = config("postgres://u:from-url@h/db");
        c.password = Some("from-env".to_owned());
        let pg = connection_config(&c).unwrap();
        assert_eq!(pg.get_password(), Some(&b"from-url"[..]));

        let mut c = config("postgres://u@h/db");
        c.password = Some("from-env".to_owned());
        let pg = connection_config(&c).unwrap();
        assert_eq!(pg.get_password(), Some(&b"from-env"[..]));
    }

    #[test]
    fn the_timeout_bounds_statements_on_the_server_too() {
        let mut c = config("postgres://u@h/db?options=-c%20search_path%3Dgw");
        c.timeout = Duration::from_millis(750);
        let pg = connection_config(&c).unwrap();
        assert_eq!(
            pg.get_options(),
            Some("-c search_path=gw -c statement_timeout=750 -c enable_seqscan=off")
        );
        assert_eq!(pg.get_connect_timeout(), Some(&Duration::from_millis(750)));
        assert_eq!(pg.get_application_name(), Some("idemgate"));
    }

    #[test]
    fn sslmodes_are_read_as_documented() {
        let mode = |url: &str| connection_config(&config(url)).map(|pg| pg.get_ssl_mode());
        assert_eq!(mode("postgres://h/db").ok(), Some(SslMode::Prefer));
        assert_eq!(
            mode("postgres://h/db?sslmode=disable").ok(),
            Some(SslMode::Disable)
        );
        assert_eq!(
            mode("postgres://h/db?application_name=x&sslmode=verify-full").ok(),
            Some(SslMode::Require)
        );
        assert!(mode("postgres://h/db?sslmode=verify-ca").is_err());
        assert!(mode("postgres://h/db?sslmode=sometimes").is_err());
    }

    #[test]
    fn passwords_never_reach_debug_output() {
        let mut c = config("postgres://u:s3cret@h/db");
        c.password = Some("hunter2".to_owned());
        let shown = format!("{c:?}");
        assert!(
            !shown.contains("s3cret") && !shown.contains("hunter2"),
            "{shown}"
        );
        assert!(shown.contains("u@h:5432/db"), "{shown}");
    }
}
