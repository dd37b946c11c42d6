//! What a verifier sees of a request.

use std::time::SystemTime;

use http::{HeaderMap, HeaderName};

use super::SignatureError;

/// The parts of a request a [`Verifier`](super::Verifier) checks: its headers, its whole
/// body as read, the part of its path after the route's prefix, its query, and the time it
/// is judged at.
///
/// ```
/// use http::HeaderMap;
/// use idemgate::webhook::SignedRequest;
///
/// let mut headers = HeaderMap::new();
/// headers.insert("x-signature", "abc".parse().unwrap());
/// let request = SignedRequest::new(&headers, b"{}")
///     .with_route_path("/sms")
///     .with_query(Some("a=1"));
/// assert_eq!(request.header_str(&http::HeaderName::from_static("x-signature")), Ok("abc"));
/// assert_eq!((request.route_path(), request.query()), ("/sms", Some("a=1")));
/// ```
#[derive(Clone, Copy, Debug)]
pub struct SignedRequest<'a> {
    headers: &'a HeaderMap,
    body: &'a [u8],
    route_path: &'a str,
    query: Option<&'a str>,
    now: SystemTime,
}

impl<'a> SignedRequest<'a> {
    /// A request with these headers and body, an empty route path, no query, judged now.
    pub fn new(headers: &'a HeaderMap, body: &'a [u8]) -> Self {
        Self {
            headers,
            body,
            route_path: "",
            query: None,
            now: SystemTime::now(),
        }
    }

    /// The part of the request's path after the route's prefix (`/sms` for `/hooks/twilio/sms`
    /// under the prefix `/hooks/twilio`; the whole path on the layer's default route).
    #[must_use]
    pub fn with_route_path(mut self, path: &'a str) -> Self {
        self.route_path = path;
        self
    }

    /// The request's query, without the `?`.
    #[must_use]
    pub fn with_query(mut self, query: Option<&'a str>) -> Self {
        self.query = query;
        self
    }

    /// Judge signed timestamps against `now` instead of the system clock.
    #[must_use]
    pub fn at(mut self, now: SystemTime) -> Self {
        self.now = now;
        self
    }

    /// The request's headers.
    pub fn headers(&self) -> &'a HeaderMap {
        self.headers
    }

    /// The request's body, exactly as received.
    pub fn body(&self) -> &'a [u8] {
        self.body
    }

    /// The part of the path after the route's prefix.
    pub fn route_path(&self) -> &'a str {
        self.route_path
    }

    /// The query, without the `?`.
    pub fn query(&self) -> Option<&'a str> {
        self.query
    }

    /// The time signed timestamps are judged against.
    pub fn now(&self) -> SystemTime {
        self.now
    }

    /// The value of header `name`, which must appear exactly once and be visible ASCII.
    pub fn header_str(&self, name: &HeaderName) -> Result<&'a str, SignatureError> {
        let mut values = self.headers.get_all(name).iter();
        let value = values
            .next()
            .ok_or_else(|| SignatureError::MissingHeader(name.clone()))?;
        if values.next().is_some() {
            return Err(malformed(name, "sent more than once"));
        }
        value
            .to_str()
            .map(str::trim)
            .map_err(|_| malformed(name, "not visible ASCII"))
    }
}

pub(crate) fn malformed(header: &HeaderName, why: &'static str) -> SignatureError {
    SignatureError::Malformed {
        header: header.clone(),
        why,
    }
}
