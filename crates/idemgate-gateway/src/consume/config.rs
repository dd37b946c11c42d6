//! The consumer's configuration: `[[sources]]` in the config file and the `consume` flags,
//! checked into [`SourceSettings`].
//!
//! ```toml
//! [[sources]]
//! url = "redis-stream://127.0.0.1:6379/orders?group=billing"
//! key_field = "event_id"            # or "payload:/id", a JSON pointer into the field `payload`
//! upstream = "http://127.0.0.1:3000/handle"
//! ```

use std::fmt;
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;

use crate::config::{ConfigError, FileConfig, Overrides, Settings, Upstream, parse_duration};

/// Default cap on the entries of one source being delivered at once.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 64;
/// Default number of tries of an entry whose handler answers a status the route does not
/// keep, before it is dead-lettered.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 5;
/// Default wait before the second try; it doubles with each try, up to [`MAX_RETRY_BACKOFF`].
pub const DEFAULT_RETRY_BACKOFF: Duration = Duration::from_millis(500);
/// The longest wait between two tries.
pub const MAX_RETRY_BACKOFF: Duration = Duration::from_secs(30);
/// Default field holding the body sent to the handler.
pub const DEFAULT_PAYLOAD_FIELD: &str = "payload";
/// Most entries one source may have in flight.
pub const MAX_MAX_IN_FLIGHT: usize = 10_000;

/// One `[[sources]]` table as written.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceFile {
    /// `redis-stream://HOST:PORT/STREAM?group=GROUP[&consumer=NAME]`.
    pub url: Option<String>,
    /// Where each entry's key is: a field name, or `FIELD:/json/pointer`.
    pub key_field: Option<String>,
    /// Use the entry's own id when the key field is missing (off by default: a producer's
    /// retry makes a new entry, with a new id, for the same event).
    pub entry_id_fallback: Option<bool>,
    /// The field whose value is the body; without it the entry's fields go as a JSON object.
    pub payload_field: Option<String>,
    /// The handler's URL (default: the top-level `upstream`).
    pub upstream: Option<String>,
    /// Cap on entries being delivered at once.
    pub max_in_flight: Option<usize>,
    /// Tries before an entry the handler keeps refusing is dead-lettered.
    pub max_attempts: Option<u32>,
    /// Wait before the second try (doubling after).
    pub retry_backoff: Option<String>,
    /// How long an entry stays pending on a consumer before another takes it over (default:
    /// the route's lease).
    pub claim_idle: Option<String>,
    /// The stream dead letters go to (default `STREAM.dead`).
    pub dead_letter_stream: Option<String>,
}

/// Where an entry's key is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeyField {
    /// The value of a field of the entry.
    Field(String),
    /// A string or integer inside a field holding JSON, by RFC 6901 pointer.
    JsonPointer {
        /// The field holding the JSON document.
        field: String,
        /// The pointer, starting with `/`.
        pointer: String,
    },
}

impl KeyField {
    /// Reads `event_id` or `payload:/id` (a field, `:`, then a pointer starting with `/`).
    pub fn parse(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if let Some((field, pointer)) = s.split_once(":/") {
            if field.is_empty() {
                return Err(format!(
                    "{s:?} names no field before \":/\"; expected FIELD or FIELD:/json/pointer"
                ));
            }
            return Ok(KeyField::JsonPointer {
                field: field.to_owned(),
                pointer: format!("/{pointer}"),
            });
        }
        if s.is_empty() {
            return Err("empty; expected FIELD or FIELD:/json/pointer".into());
        }
        Ok(KeyField::Field(s.to_owned()))
    }
}

impl fmt::Display for KeyField {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyField::Field(field) => f.write_str(field),
            KeyField::JsonPointer { field, pointer } => write!(f, "{field}:{pointer}"),
        }
    }
}

/// A Redis stream read through a consumer group.
#[derive(Clone, PartialEq, Eq)]
pub struct StreamSpec {
    /// `redis://[:PASSWORD@]HOST:PORT` (or `rediss://`) for the client.
    pub redis_url: String,
    /// `HOST:PORT`, for logs and metrics.
    pub server: String,
    /// The stream's key.
    pub stream: String,
    /// The consumer group.
    pub group: String,
    /// This consumer's name in the group.
    pub consumer: String,
}

impl fmt::Debug for StreamSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "StreamSpec({self})")
    }
}

impl fmt::Display for StreamSpec {
    /// `redis-stream://HOST:PORT/STREAM?group=G`, never with a password.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "redis-stream://{}/{}?group={}",
            self.server, self.stream, self.group
        )
    }
}

const STREAM_FORM: &str = "redis-stream://HOST:PORT/STREAM?group=GROUP[&consumer=NAME]";

impl StreamSpec {
    /// Reads `redis-stream://[:PASSWORD@]HOST:PORT/STREAM?group=G[&consumer=NAME]`
    /// (`rediss-stream://` for TLS). Without `consumer`, the consumer is `HOSTNAME-PID`.
    pub fn parse(url: &str) -> Result<Self, String> {
        let url = url.trim();
        let (scheme, rest) = match url.split_once("://") {
            Some(("redis-stream", rest)) => ("redis", rest),
            Some(("rediss-stream", rest)) if cfg!(feature = "redis-tls") => ("rediss", rest),
            Some(("rediss-stream", _)) => {
                return Err(
                    "rediss-stream:// (TLS) needs idemgate built with the redis-tls feature".into(),
                );
            }
            _ => return Err(format!("not a source URL; expected {STREAM_FORM}")),
        };
        let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
        let (authority, stream) = rest
            .split_once('/')
            .ok_or_else(|| format!("names no stream; expected {STREAM_FORM}"))?;
        let server = authority.rsplit_once('@').map_or(authority, |(_, s)| s);
        let valid_server = server.rsplit_once(':').is_some_and(|(host, port)| {
            !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0)
        });
        if !valid_server {
            return Err(format!(
                "{server:?} is not HOST:PORT; expected {STREAM_FORM}"
            ));
        }
        if stream.is_empty() {
            return Err(format!("names no stream; expected {STREAM_FORM}"));
        }
        let (mut group, mut consumer) = (None, None);
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            match pair.split_once('=') {
                Some(("group", g)) if !g.is_empty() => group = Some(g.to_owned()),
                Some(("consumer", c)) if !c.is_empty() => consumer = Some(c.to_owned()),
                _ => {
                    return Err(format!(
                        "query {pair:?} is not understood; expected group=GROUP and, optionally, consumer=NAME"
                    ));
                }
            }
        }
        let group = group.ok_or_else(|| format!("names no group; expected {STREAM_FORM}"))?;
        Ok(Self {
            redis_url: format!("{scheme}://{authority}"),
            server: server.to_owned(),
            stream: stream.to_owned(),
            group,
            consumer: consumer.unwrap_or_else(default_consumer_name),
        })
    }
}

/// `HOSTNAME-PID`: unique among live processes, so two consumers never share a name.
fn default_consumer_name() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "idemgate".to_owned());
    format!("{host}-{}", std::process::id())
}

/// One source, checked.
#[derive(Clone, Debug)]
pub struct SourceSettings {
    /// The stream, group and consumer.
    pub stream: StreamSpec,
    /// Where each entry's key is.
    pub key_field: KeyField,
    /// Whether the entry id stands in for a missing key.
    pub entry_id_fallback: bool,
    /// The field whose value is the body.
    pub payload_field: String,
    /// The handler.
    pub upstream: Upstream,
    /// Cap on entries being delivered at once.
    pub max_in_flight: usize,
    /// Tries before an entry the handler keeps refusing is dead-lettered.
    pub max_attempts: u32,
    /// Wait before the second try.
    pub retry_backoff: Duration,
    /// Idle time after which another consumer's pending entry is taken over; `None` means
    /// the lease of the route the handler's path falls on.
    pub claim_idle: Option<Duration>,
    /// Where dead letters go.
    pub dead_letter_stream: String,
}

/// Everything `idemgate consume` runs with.
#[derive(Clone, Debug)]
pub struct ConsumeSettings {
    /// The store, routes, timeouts and admin listener, as for the proxy.
    pub gateway: Settings,
    /// The sources, at least one.
    pub sources: Vec<SourceSettings>,
}

impl ConsumeSettings {
    /// Reads `path` (when given), lays `overrides` over it, adds `flags_source` (the source
    /// the `consume` flags describe, as a table), and checks the result.
    pub fn load(
        path: Option<&Path>,
        overrides: &Overrides,
        flags_source: Option<SourceFile>,
    ) -> Result<Self, ConfigError> {
        let mut file = match path {
            Some(path) => FileConfig::read(path)?,
            None => FileConfig::default(),
        }
        .with_overrides(overrides);
        let mut tables = Vec::with_capacity(file.sources.len() + 1);
        for (i, table) in std::mem::take(&mut file.sources).into_iter().enumerate() {
            tables.push((format!("sources[{i}]"), read_table(i, table)?));
        }
        if let Some(source) = flags_source {
            tables.push(("--source".to_owned(), source));
        }
        if tables.is_empty() {
            return Err(ConfigError::invalid(
                "sources",
                "no source to consume: give --source redis-stream://HOST:PORT/STREAM?group=GROUP or a [[sources]] table",
            ));
        }
        // The top-level upstream is the sources' default; with none, the first source's own
        // stands in for it, so that a file whose sources all name theirs is complete.
        if file.upstream.is_none() {
            file.upstream = tables.iter().find_map(|(_, s)| s.upstream.clone());
        }
        let gateway = file.validate()?;
        let sources = tables
            .iter()
            .map(|(field, source)| validate_source(field, source, &gateway))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self { gateway, sources })
    }
}

/// `sources[i]` read into a [`SourceFile`], naming the field that is wrong.
fn read_table(i: usize, table: toml::Table) -> Result<SourceFile, ConfigError> {
    serde_path_to_error::deserialize(table).map_err(|error| {
        let at = error.path().to_string();
        let field = if at == "." || at.is_empty() {
            format!("sources[{i}]")
        } else {
            format!("sources[{i}].{at}")
        };
        ConfigError::invalid(field, error.into_inner().message().to_owned())
    })
}

fn validate_source(
    field: &str,
    source: &SourceFile,
    gateway: &Settings,
) -> Result<SourceSettings, ConfigError> {
    let name = |key: &str| {
        if field == "--source" {
            format!("--{}", key.replace('_', "-"))
        } else {
            format!("{field}.{key}")
        }
    };
    let url = source.url.as_deref().ok_or_else(|| {
        ConfigError::invalid(name("url"), format!("required; expected {STREAM_FORM}"))
    })?;
    let stream = StreamSpec::parse(url)
        .map_err(|m| ConfigError::invalid(field_or(field, &name("url")), m))?;
    let key_field = source.key_field.as_deref().ok_or_else(|| {
        ConfigError::invalid(
            name("key_field"),
            "required: the field holding each message's own id (e.g. event_id, or payload:/id for a JSON pointer into the field payload)",
        )
    })?;
    let key_field =
        KeyField::parse(key_field).map_err(|m| ConfigError::invalid(name("key_field"), m))?;
    let upstream = match &source.upstream {
        Some(url) => Upstream::parse(url).map_err(|m| ConfigError::invalid(name("upstream"), m))?,
        None => gateway.upstream.clone(),
    };
    let max_in_flight = source.max_in_flight.unwrap_or(DEFAULT_MAX_IN_FLIGHT);
    if !(1..=MAX_MAX_IN_FLIGHT).contains(&max_in_flight) {
        return Err(ConfigError::invalid(
            name("max_in_flight"),
            format!("{max_in_flight} is out of range; expected 1 to {MAX_MAX_IN_FLIGHT}"),
        ));
    }
    let max_attempts = source.max_attempts.unwrap_or(DEFAULT_MAX_ATTEMPTS);
    if max_attempts == 0 {
        return Err(ConfigError::invalid(
            name("max_attempts"),
            "must be at least 1",
        ));
    }
    let duration = |key: &str, value: &Option<String>| {
        value
            .as_deref()
            .map(|v| match parse_duration(v) {
                Ok(d) if !d.is_zero() => Ok(d),
                Ok(_) => Err(ConfigError::invalid(name(key), "must be longer than zero")),
                Err(m) => Err(ConfigError::invalid(name(key), m)),
            })
            .transpose()
    };
    let retry_backoff =
        duration("retry_backoff", &source.retry_backoff)?.unwrap_or(DEFAULT_RETRY_BACKOFF);
    let claim_idle = duration("claim_idle", &source.claim_idle)?;
    let dead_letter_stream = match &source.dead_letter_stream {
        Some(s) if s.is_empty() => {
            return Err(ConfigError::invalid(name("dead_letter_stream"), "empty"));
        }
        Some(s) if *s == stream.stream => {
            return Err(ConfigError::invalid(
                name("dead_letter_stream"),
                "is the stream the source reads; dead letters need a stream of their own",
            ));
        }
        Some(s) => s.clone(),
        None => format!("{}.dead", stream.stream),
    };
    Ok(SourceSettings {
        stream,
        key_field,
        entry_id_fallback: source.entry_id_fallback.unwrap_or(false),
        payload_field: source
            .payload_field
            .clone()
            .unwrap_or_else(|| DEFAULT_PAYLOAD_FIELD.to_owned()),
        upstream,
        max_in_flight,
        max_attempts,
        retry_backoff,
        claim_idle,
        dead_letter_stream,
    })
}

/// A source from the flags is named by `--source`; one from the file by its `url` field.
fn field_or(field: &str, url_field: &str) -> String {
    if field == "--source" {
        field.to_owned()
    } else {
        url_field.to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_fields_are_a_field_or_a_pointer_into_one() {
        assert_eq!(
            KeyField::parse("event_id").unwrap(),
            KeyField::Field("event_id".into())
        );
        assert_eq!(
            KeyField::parse("payload:/data/id").unwrap(),
            KeyField::JsonPointer {
                field: "payload".into(),
                pointer: "/data/id".into()
            }
        );
        assert!(KeyField::parse(":/id").is_err());
        assert!(KeyField::parse("  ").is_err());
    }

    #[test]
    fn stream_urls_name_server_stream_and_group() {
        let spec = StreamSpec::parse(
            "redis-stream://:secret@127.0.0.1:6379/orders?group=billing&consumer=c1",
        )
        .unwrap();
        assert_eq!(spec.redis_url, "redis://:secret@127.0.0.1:6379");
        assert_eq!(
            (
                spec.stream.as_str(),
                spec.group.as_str(),
                spec.consumer.as_str()
            ),
            ("orders", "billing", "c1")
        );
        assert_eq!(
            spec.to_string(),
            "redis-stream://127.0.0.1:6379/orders?group=billing"
        );
        let named = StreamSpec::parse("redis-stream://h:1/s?group=g").unwrap();
        assert!(
            named
                .consumer
                .ends_with(&format!("-{}", std::process::id()))
        );
        for (bad, says) in [
            ("redis://h:1/s?group=g", "not a source URL"),
            ("redis-stream://h:1/s", "names no group"),
            ("redis-stream://h:1/?group=g", "names no stream"),
            ("redis-stream://h/s?group=g", "is not HOST:PORT"),
            ("redis-stream://h:1/s?group=g&x=1", "not understood"),
        ] {
            let error = StreamSpec::parse(bad).unwrap_err();
            assert!(error.contains(says), "{bad}: {error}");
        }
    }

    fn load(toml: &str, flags: Option<SourceFile>) -> Result<ConsumeSettings, ConfigError> {
        let dir =
            std::env::temp_dir().join(format!("idemgate-consume-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(format!(
            "{:x}.toml",
            toml.len()
                ^ flags
                    .as_ref()
                    .and_then(|f| f.url.as_ref())
                    .map_or(0, String::len)
        ));
        std::fs::write(&path, toml).unwrap();
        let loaded = ConsumeSettings::load(Some(&path), &Overrides::default(), flags);
        let _ = std::fs::remove_file(&path);
        loaded
    }

    #[test]
    fn sources_come_from_the_file_and_the_flags() {
        let settings = load(
            r#"
            store = "memory"
            [[sources]]
            url = "redis-stream://127.0.0.1:6379/orders?group=billing"
            key_field = "payload:/id"
            upstream = "http://127.0.0.1:3000/orders"
            max_in_flight = 8
            retry_backoff = "100ms"
            "#,
            Some(SourceFile {
                url: Some("redis-stream://127.0.0.1:6379/events?group=g".into()),
                key_field: Some("event_id".into()),
                ..SourceFile::default()
            }),
        )
        .unwrap();
        let [file, flags] = settings.sources.as_slice() else {
            panic!("two sources expected: {:?}", settings.sources);
        };
        assert_eq!(file.max_in_flight, 8);
        assert_eq!(file.retry_backoff, Duration::from_millis(100));
        assert_eq!(file.dead_letter_stream, "orders.dead");
        assert_eq!(
            flags.upstream.base_path, "/orders",
            "the top-level upstream is the default"
        );
        assert_eq!(flags.max_attempts, DEFAULT_MAX_ATTEMPTS);
        assert_eq!(flags.payload_field, DEFAULT_PAYLOAD_FIELD);
    }

    #[test]
    fn the_sample_file_loads() {
        let path = Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../config/consume.toml"
        ));
        let settings = ConsumeSettings::load(Some(path), &Overrides::default(), None).unwrap();
        let [source] = settings.sources.as_slice() else {
            panic!("one source expected");
        };
        assert_eq!(source.stream.stream, "orders");
        assert_eq!(source.key_field, KeyField::Field("event_id".into()));
        assert_eq!(source.claim_idle, Some(Duration::from_secs(30)));
        assert_eq!(source.dead_letter_stream, "orders.dead");
    }

    #[test]
    fn bad_sources_are_refused_naming_the_field() {
        let base = "store = \"memory\"\nupstream = \"http://127.0.0.1:3000\"\n";
        for (source, field, says) in [
            ("key_field = \"id\"", "sources[0].url", "required"),
            (
                "url = \"redis-stream://h:1/s?group=g\"",
                "sources[0].key_field",
                "required",
            ),
            (
                "url = \"redis-stream://h:1/s\"\nkey_field = \"id\"",
                "sources[0].url",
                "group",
            ),
            (
                "url = \"redis-stream://h:1/s?group=g\"\nkey_field = \"id\"\nmax_in_flight = 0",
                "sources[0].max_in_flight",
                "out of range",
            ),
            (
                "url = \"redis-stream://h:1/s?group=g\"\nkey_field = \"id\"\nretry_backoff = \"soon\"",
                "sources[0].retry_backoff",
                "not a duration",
            ),
            (
                "url = \"redis-stream://h:1/s?group=g\"\nkey_field = \"id\"\ndead_letter_stream = \"s\"",
                "sources[0].dead_letter_stream",
                "of their own",
            ),
            (
                "url = \"redis-stream://h:1/s?group=g\"\nkey_field = \"id\"\nkey_feild = \"x\"",
                "sources[0].key_feild",
                "unknown field",
            ),
        ] {
            let error = load(&format!("{base}[[sources]]\n{source}\n"), None).unwrap_err();
            assert_eq!(error.field(), Some(field), "{source}: {error}");
            assert!(error.to_string().contains(says), "{source}: {error}");
        }
        let none = load(base, None).unwrap_err();
        assert_eq!(none.field(), Some("sources"));
    }
}
