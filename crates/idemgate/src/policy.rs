//! Route policies: which requests take part, where their key comes from, and which responses
//! are kept. A [`RoutePolicy`] starts from a [`Preset`] and any part can be overridden.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use http::{HeaderName, Method, StatusCode, header};

pub use crate::store::UnknownOutcome;

use crate::webhook::{RouteVerifier, Verifier};

/// Default lease on an in-flight record; renewed while the upstream call runs.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);
/// The shortest lease a route takes (see [`RoutePolicy::lease`]).
pub const MIN_LEASE: Duration = Duration::from_millis(300);
/// Default cap on a buffered idempotent request body (10 MiB).
pub const DEFAULT_MAX_REQUEST_BYTES: usize = 10 * 1024 * 1024;
/// Default cap on a stored response body (10 MiB); larger responses are delivered, not kept.
pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 10 * 1024 * 1024;
/// Default `concurrent = "wait"` bound.
pub const DEFAULT_WAIT_TIMEOUT: Duration = Duration::from_secs(10);
/// Default key header (IETF draft).
pub const DEFAULT_KEY_HEADER: HeaderName = crate::headers::IDEMPOTENCY_KEY;

/// The three starting points of the route presets (docs/behaviour.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Preset {
    /// Store every status except `5xx`, `401`, `403`, `408`, `425`, `429`; unknown outcomes
    /// become ambiguous; ttl 24 h.
    #[default]
    Api,
    /// Store `2xx` only (a sender retries a failure precisely to have it run again); unknown
    /// outcomes are retried; ttl 72 h (the longest common webhook redelivery window).
    Webhook,
    /// Store every status the upstream answered, `5xx` too; unknown outcomes become
    /// ambiguous; ttl 24 h.
    Strict,
}

impl Preset {
    /// The statuses this preset stores.
    pub fn store_statuses(self) -> StatusSet {
        match self {
            Preset::Api => StatusSet::range(200, 499)
                .without(401)
                .without(403)
                .without(408)
                .without(425)
                .without(429),
            Preset::Webhook => StatusSet::range(200, 299),
            Preset::Strict => StatusSet::range(200, 599),
        }
    }

    /// What this preset does with an unknown outcome.
    pub fn unknown_outcome(self) -> UnknownOutcome {
        match self {
            Preset::Api | Preset::Strict => UnknownOutcome::Ambiguous,
            Preset::Webhook => UnknownOutcome::Retry,
        }
    }

    /// How long this preset keeps records.
    pub fn ttl(self) -> Duration {
        const HOUR: u64 = 3600;
        match self {
            Preset::Api | Preset::Strict => Duration::from_secs(24 * HOUR),
            Preset::Webhook => Duration::from_secs(72 * HOUR),
        }
    }
}

impl FromStr for Preset {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "api" => Ok(Preset::Api),
            "webhook" => Ok(Preset::Webhook),
            "strict" => Ok(Preset::Strict),
            other => Err(format!(
                "unknown preset {other:?}; expected \"api\", \"webhook\" or \"strict\""
            )),
        }
    }
}

/// A set of final status codes (200–599), checked in constant time.
#[derive(Clone, Copy, PartialEq, Eq, Default)]
pub struct StatusSet([u64; 10]);

impl StatusSet {
    /// No status.
    pub const fn empty() -> Self {
        Self([0; 10])
    }

    /// Every status from `lo` to `hi` inclusive (clamped to 0–639).
    pub fn range(lo: u16, hi: u16) -> Self {
        let mut s = Self::empty();
        for code in lo..=hi.min(639) {
            s = s.with(code);
        }
        s
    }

    /// This set plus `code`.
    #[must_use]
    pub fn with(mut self, code: u16) -> Self {
        if code < 640 {
            self.0[(code / 64) as usize] |= 1 << (code % 64);
        }
        self
    }

    /// This set minus `code`.
    #[must_use]
    pub fn without(mut self, code: u16) -> Self {
        if code < 640 {
            self.0[(code / 64) as usize] &= !(1 << (code % 64));
        }
        self
    }

    /// Whether `status` is in the set.
    pub fn contains(&self, status: StatusCode) -> bool {
        self.has(status.as_u16())
    }

    fn has(&self, code: u16) -> bool {
        code < 640 && self.0[(code / 64) as usize] & (1 << (code % 64)) != 0
    }

    /// Builds a set from config entries applied in order: `"2xx"` adds a class, `"404"` adds
    /// one code, and a leading `!` removes instead (`"!429"`, `"!5xx"`).
    ///
    /// ```
    /// use http::StatusCode;
    /// use idemgate::policy::StatusSet;
    ///
    /// let kept = StatusSet::parse(&["2xx", "4xx", "!429"]).unwrap();
    /// assert!(kept.contains(StatusCode::CREATED));
    /// assert!(!kept.contains(StatusCode::TOO_MANY_REQUESTS));
    /// assert!(StatusSet::parse(&["7xx"]).is_err());
    /// ```
    pub fn parse<S: AsRef<str>>(entries: &[S]) -> Result<Self, String> {
        let mut set = Self::empty();
        for entry in entries {
            let entry = entry.as_ref().trim();
            let (remove, body) = match entry.strip_prefix('!') {
                Some(rest) => (true, rest),
                None => (false, entry),
            };
            let (lo, hi) = parse_status_entry(body).ok_or_else(|| {
                format!(
                    "{entry:?} is not a status entry; expected a code from 200 to 599 \
                     (\"404\"), a class (\"2xx\"), or either after \"!\" to exclude it"
                )
            })?;
            for code in lo..=hi {
                set = if remove {
                    set.without(code)
                } else {
                    set.with(code)
                };
            }
        }
        Ok(set)
    }
}

fn parse_status_entry(s: &str) -> Option<(u16, u16)> {
    let b = s.as_bytes();
    if b.len() != 3 || !(b'2'..=b'5').contains(&b[0]) {
        return None;
    }
    let class = u16::from(b[0] - b'0') * 100;
    if s[1..].eq_ignore_ascii_case("xx") {
        return Some((class, class + 99));
    }
    let code: u16 = s.parse().ok()?;
    Some((code, code))
}

impl fmt::Debug for StatusSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut list = f.debug_list();
        let mut code = 0u16;
        while code < 640 {
            if self.has(code) {
                let start = code;
                while self.has(code + 1) {
                    code += 1;
                }
                if start == code {
                    list.entry(&start);
                } else {
                    list.entry(&format_args!("{start}-{code}"));
                }
            }
            code += 1;
        }
        list.finish()
    }
}

/// Where a request's idempotency key comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeySource {
    /// A header, e.g. `Idempotency-Key`, `X-GitHub-Delivery`, `webhook-id`.
    Header(HeaderName),
    /// A field of a JSON request body, by RFC 6901 pointer (e.g. `/id` for Stripe events). The
    /// field must be a string or an integer.
    JsonPointer(String),
}

impl Default for KeySource {
    fn default() -> Self {
        KeySource::Header(DEFAULT_KEY_HEADER)
    }
}

/// What a request does when another with the same key and fingerprint is in flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Concurrent {
    /// Answer `409` with `Retry-After` at once.
    #[default]
    Reject,
    /// Wait up to the given time for the first request to finish, then replay its response;
    /// `409` if it is still running. If the first one's response is not kept (its status is
    /// outside the route's `store` set), the key is free again and the waiting request runs,
    /// as a retry would.
    Wait(Duration),
}

/// What a keyed request does when the store fails or does not answer in time. Read from a
/// config file as `"reject"` or `"pass"`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnStoreError {
    /// Answer `503` with `Retry-After` and forward nothing (fail closed).
    #[default]
    Reject,
    /// Forward the request without protection; logged and counted.
    Pass,
}

/// Everything the layer needs to know about one route: start from a preset and change what
/// differs.
///
/// ```
/// use std::time::Duration;
/// use idemgate::RoutePolicy;
/// use idemgate::policy::StatusSet;
///
/// let payments = RoutePolicy::strict()
///     .name("payments")
///     .require_key(true)
///     .ttl(Duration::from_secs(24 * 3600))
///     .store_statuses(StatusSet::parse(&["2xx", "4xx", "!429"]).unwrap());
/// assert_eq!(payments.route_name(), "payments");
/// ```
#[derive(Clone, Debug)]
pub struct RoutePolicy {
    pub(crate) name: String,
    pub(crate) methods: Vec<Method>,
    pub(crate) key: KeySource,
    pub(crate) require_key: bool,
    pub(crate) scope_headers: Vec<HeaderName>,
    pub(crate) fingerprint_headers: Vec<HeaderName>,
    pub(crate) store_statuses: StatusSet,
    pub(crate) unknown_outcome: UnknownOutcome,
    pub(crate) ttl: Duration,
    pub(crate) lease: Duration,
    pub(crate) concurrent: Concurrent,
    pub(crate) max_request_bytes: usize,
    pub(crate) max_response_bytes: usize,
    pub(crate) mismatch_status: StatusCode,
    pub(crate) store_set_cookie: bool,
    pub(crate) verifier: Option<RouteVerifier>,
}

impl Default for RoutePolicy {
    fn default() -> Self {
        Self::preset(Preset::Api)
    }
}

impl RoutePolicy {
    /// A policy with every part taken from `preset` and the behaviour contract's defaults
    /// elsewhere.
    pub fn preset(preset: Preset) -> Self {
        Self {
            name: "default".to_owned(),
            methods: vec![Method::POST, Method::PATCH],
            key: KeySource::default(),
            require_key: false,
            scope_headers: vec![header::AUTHORIZATION],
            fingerprint_headers: vec![header::CONTENT_TYPE],
            store_statuses: preset.store_statuses(),
            unknown_outcome: preset.unknown_outcome(),
            ttl: preset.ttl(),
            lease: DEFAULT_LEASE,
            concurrent: Concurrent::Reject,
            max_request_bytes: DEFAULT_MAX_REQUEST_BYTES,
            max_response_bytes: DEFAULT_MAX_RESPONSE_BYTES,
            mismatch_status: StatusCode::UNPROCESSABLE_ENTITY,
            store_set_cookie: false,
            verifier: None,
        }
    }

    /// The `api` preset (the default).
    pub fn api() -> Self {
        Self::preset(Preset::Api)
    }

    /// The `webhook` preset.
    pub fn webhook() -> Self {
        Self::preset(Preset::Webhook)
    }

    /// The `strict` preset.
    pub fn strict() -> Self {
        Self::preset(Preset::Strict)
    }

    /// The route's name in logs and metrics. Also part of every record key: routes with
    /// different names never share records, while routes with the same name share them (a
    /// key sent under either finds the other's record). Every preset is named `default`, as
    /// is the layer's default route, so name each route added with
    /// [`IdempotencyLayer::route`](crate::IdempotencyLayer::route) unless sharing is wanted.
    #[must_use]
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Methods that take part (default `POST`, `PATCH`). Others pass through untouched.
    #[must_use]
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.methods = methods.into_iter().collect();
        self
    }

    /// Where the key comes from (default the `Idempotency-Key` header).
    #[must_use]
    pub fn key(mut self, source: KeySource) -> Self {
        self.key = source;
        self
    }

    /// Take the key from this header.
    #[must_use]
    pub fn key_header(self, name: HeaderName) -> Self {
        self.key(KeySource::Header(name))
    }

    /// Take the key from this JSON pointer into the body.
    #[must_use]
    pub fn key_json_pointer(self, pointer: impl Into<String>) -> Self {
        self.key(KeySource::JsonPointer(pointer.into()))
    }

    /// Answer `400` to a request of a taking-part method that carries no key.
    #[must_use]
    pub fn require_key(mut self, require: bool) -> Self {
        self.require_key = require;
        self
    }

    /// Headers whose values make the scope (default `Authorization`); empty for one shared
    /// scope.
    #[must_use]
    pub fn scope_headers(mut self, headers: impl IntoIterator<Item = HeaderName>) -> Self {
        self.scope_headers = headers.into_iter().collect();
        self
    }

    /// Headers that are part of the fingerprint (default `Content-Type`).
    #[must_use]
    pub fn fingerprint_headers(mut self, headers: impl IntoIterator<Item = HeaderName>) -> Self {
        self.fingerprint_headers = headers.into_iter().collect();
        self
    }

    /// Which response statuses are stored; others release the key.
    #[must_use]
    pub fn store_statuses(mut self, statuses: StatusSet) -> Self {
        self.store_statuses = statuses;
        self
    }

    /// What an unknown outcome becomes.
    #[must_use]
    pub fn unknown_outcome(mut self, outcome: UnknownOutcome) -> Self {
        self.unknown_outcome = outcome;
        self
    }

    /// How long records live.
    #[must_use]
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// The lease on an in-flight record (default 30 s), renewed at a third of it. At least
    /// [`MIN_LEASE`]: a shorter one is raised to it, so renewals never run in a tight loop.
    /// Keep it above 1.5 times the layer's store timeout, so that a renewal that takes the
    /// whole timeout still lands before the lease ends (the proxy refuses a configuration
    /// that does not).
    #[must_use]
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease.max(MIN_LEASE);
        self
    }

    /// What a request does while the same one is in flight.
    #[must_use]
    pub fn concurrent(mut self, concurrent: Concurrent) -> Self {
        self.concurrent = concurrent;
        self
    }

    /// Cap on a buffered idempotent request body; larger → `413`.
    #[must_use]
    pub fn max_request_bytes(mut self, bytes: usize) -> Self {
        self.max_request_bytes = bytes;
        self
    }

    /// Cap on a stored response body; larger responses are delivered but not kept.
    #[must_use]
    pub fn max_response_bytes(mut self, bytes: usize) -> Self {
        self.max_response_bytes = bytes;
        self
    }

    /// Status of the fingerprint-mismatch answer (default `422`).
    #[must_use]
    pub fn mismatch_status(mut self, status: StatusCode) -> Self {
        self.mismatch_status = status;
        self
    }

    /// Keep `Set-Cookie` in stored responses (default: removed, so one client's session is
    /// never handed to whoever replays).
    #[must_use]
    pub fn store_set_cookie(mut self, keep: bool) -> Self {
        self.store_set_cookie = keep;
        self
    }

    /// Check every request of the route's methods with `verifier` before anything else: the
    /// body is read (up to `max_request_bytes`) and checked before the key is looked at or
    /// the store is called, and a request that fails is answered `401 invalid-signature`,
    /// claiming and forwarding nothing. The [`webhook`](crate::webhook) module has the
    /// providers' schemes, and a closure is a verifier too:
    ///
    /// ```
    /// use idemgate::RoutePolicy;
    /// use idemgate::webhook::{SignatureError, SignedRequest};
    ///
    /// let policy = RoutePolicy::webhook().name("hooks").verify_with(
    ///     |request: &SignedRequest<'_>| {
    ///         request.header_str(&http::HeaderName::from_static("x-signature"))?;
    ///         Err(SignatureError::Mismatch)
    ///     },
    /// );
    /// # let _ = policy;
    /// ```
    #[must_use]
    pub fn verify_with(mut self, verifier: impl Verifier) -> Self {
        self.verifier = Some(RouteVerifier::new(verifier));
        self
    }

    /// The route's name.
    pub fn route_name(&self) -> &str {
        &self.name
    }

    /// The headers whose values make the scope, as set by
    /// [`scope_headers`](Self::scope_headers).
    ///
    /// ```
    /// use idemgate::RoutePolicy;
    ///
    /// let policy = RoutePolicy::default();
    /// assert_eq!(policy.scope_header_names(), [http::header::AUTHORIZATION]);
    /// ```
    pub fn scope_header_names(&self) -> &[HeaderName] {
        &self.scope_headers
    }

    /// The statuses whose responses the route keeps, as set by
    /// [`store_statuses`](Self::store_statuses): a response with one of them settles its key.
    ///
    /// ```
    /// use idemgate::RoutePolicy;
    ///
    /// let policy = RoutePolicy::webhook();
    /// assert!(policy.stored_statuses().contains(http::StatusCode::OK));
    /// assert!(!policy.stored_statuses().contains(http::StatusCode::INTERNAL_SERVER_ERROR));
    /// ```
    pub fn stored_statuses(&self) -> &StatusSet {
        &self.store_statuses
    }

    /// What becomes of a request whose outcome is unknown, as set by
    /// [`unknown_outcome`](Self::unknown_outcome).
    pub fn unknown_outcome_rule(&self) -> UnknownOutcome {
        self.unknown_outcome
    }

    /// The lease on an in-flight record, as set by [`lease`](Self::lease).
    pub fn lease_duration(&self) -> Duration {
        self.lease
    }

    /// Where the route reads a request's key, as set by [`key`](Self::key).
    pub fn key_source(&self) -> &KeySource {
        &self.key
    }

    /// Whether requests with `method` take part (others pass through unprotected), as set by
    /// [`methods`](Self::methods).
    ///
    /// ```
    /// use idemgate::RoutePolicy;
    ///
    /// assert!(RoutePolicy::api().takes_part(&http::Method::POST));
    /// assert!(!RoutePolicy::api().takes_part(&http::Method::GET));
    /// ```
    pub fn takes_part(&self, method: &Method) -> bool {
        self.methods.contains(method)
    }

    /// Whether the route checks a sender's signature before anything else (see
    /// [`verify_with`](Self::verify_with)).
    pub fn verifies_signatures(&self) -> bool {
        self.verifier.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(code: u16) -> StatusCode {
        StatusCode::from_u16(code).unwrap()
    }

    #[test]
    fn api_preset_matches_the_spec_table() {
        let set = Preset::Api.store_statuses();
        for code in [200, 201, 204, 301, 400, 404, 409, 422] {
            assert!(set.contains(s(code)), "{code} should be stored");
        }
        for code in [401, 403, 408, 425, 429, 500, 502, 503, 504] {
            assert!(!set.contains(s(code)), "{code} should not be stored");
        }
        assert_eq!(Preset::Api.unknown_outcome(), UnknownOutcome::Ambiguous);
        assert_eq!(Preset::Api.ttl(), Duration::from_secs(24 * 3600));
    }

    #[test]
    fn webhook_preset_stores_2xx_only() {
        let set = Preset::Webhook.store_statuses();
        assert!(set.contains(s(200)) && set.contains(s(299)));
        assert!(!set.contains(s(300)) && !set.contains(s(400)) && !set.contains(s(500)));
        assert_eq!(Preset::Webhook.unknown_outcome(), UnknownOutcome::Retry);
        assert_eq!(Preset::Webhook.ttl(), Duration::from_secs(72 * 3600));
    }

    #[test]
    fn strict_preset_stores_5xx() {
        let set = Preset::Strict.store_statuses();
        for code in [200, 201, 301, 401, 403, 408, 425, 429, 500, 502, 503, 504] {
            assert!(set.contains(s(code)), "{code} should be stored");
        }
        assert_eq!(Preset::Strict.unknown_outcome(), UnknownOutcome::Ambiguous);
        assert_eq!(Preset::Strict.ttl(), Duration::from_secs(24 * 3600));
    }

    #[test]
    fn status_entries_parse_in_order() {
        let set = StatusSet::parse(&["2xx", "4xx", "!429", "503"]).unwrap();
        assert!(set.contains(s(201)) && set.contains(s(404)) && set.contains(s(503)));
        assert!(!set.contains(s(429)) && !set.contains(s(500)));
        for bad in ["6xx", "abc", "99", "1xx", "", "!"] {
            assert!(
                StatusSet::parse(&[bad]).is_err(),
                "{bad:?} should be refused"
            );
        }
    }
}
