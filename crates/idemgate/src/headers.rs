//! Header rules shared by the layer and the proxy.

use http::HeaderMap;
use http::header::{CONNECTION, HeaderName, TE, TRAILER, TRANSFER_ENCODING, UPGRADE};

/// The IETF draft's `Idempotency-Key` field, the default key header.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The hop-by-hop fields of RFC 9110 §7.6.1, plus the legacy ones still seen in the wild.
pub const HOP_BY_HOP: [HeaderName; 9] = [
    CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    http::header::PROXY_AUTHENTICATE,
    http::header::PROXY_AUTHORIZATION,
    TE,
    TRAILER,
    TRANSFER_ENCODING,
    UPGRADE,
];

/// Room for fields in the header map of a response the layer makes. hyper keeps the
/// map of each response it writes and parses the connection's next request into it, growing it
/// (two allocations and a rehash) if that request has more fields than the map has room for;
/// requests commonly carry 10 to 20, often more than the response they follow.
pub(crate) const RESPONSE_FIELDS_ROOM: usize = 16;

/// An empty header map for a response of `fields` fields, with at least
/// [`RESPONSE_FIELDS_ROOM`].
pub(crate) fn response_map(fields: usize) -> HeaderMap {
    HeaderMap::with_capacity(fields.max(RESPONSE_FIELDS_ROOM))
}

/// A field name as received or stored, as a header name; `None` if it is not a valid one.
/// The names requests and responses most often carry, spelled in lowercase (as HTTP/2, hyper
/// and the stored records write them) or capitalised (as most HTTP/1.1 clients and servers
/// do), are matched byte for byte to http's constants, which is several times cheaper than
/// parsing them (and, for `Idempotency-Key`, than copying it): every replay decodes its
/// record's names, every upstream response head has its names read, and so does every
/// request the proxy's own HTTP/1.1 loop reads. Any other spelling or name is parsed.
///
/// ```
/// use idemgate::headers::field_name;
///
/// assert_eq!(field_name(b"Content-Type"), Some(http::header::CONTENT_TYPE));
/// assert_eq!(field_name(b"x-request-id").unwrap().as_str(), "x-request-id");
/// assert_eq!(field_name(b"bad name"), None);
/// ```
pub fn field_name(bytes: &[u8]) -> Option<HeaderName> {
    use http::header;
    let known = match bytes.len() {
        4 => match bytes {
            b"host" | b"Host" => Some(header::HOST),
            b"date" | b"Date" => Some(header::DATE),
            b"etag" | b"ETag" | b"Etag" => Some(header::ETAG),
            b"vary" | b"Vary" => Some(header::VARY),
            _ => None,
        },
        6 => match bytes {
            b"accept" | b"Accept" => Some(header::ACCEPT),
            b"server" | b"Server" => Some(header::SERVER),
            _ => None,
        },
        8 => matches!(bytes, b"location" | b"Location").then_some(header::LOCATION),
        10 => match bytes {
            b"connection" | b"Connection" => Some(header::CONNECTION),
            b"set-cookie" | b"Set-Cookie" => Some(header::SET_COOKIE),
            b"user-agent" | b"User-Agent" => Some(header::USER_AGENT),
            _ => None,
        },
        12 => matches!(bytes, b"content-type" | b"Content-Type").then_some(header::CONTENT_TYPE),
        13 => match bytes {
            b"authorization" | b"Authorization" => Some(header::AUTHORIZATION),
            b"cache-control" | b"Cache-Control" => Some(header::CACHE_CONTROL),
            b"last-modified" | b"Last-Modified" => Some(header::LAST_MODIFIED),
            _ => None,
        },
        14 => {
            matches!(bytes, b"content-length" | b"Content-Length").then_some(header::CONTENT_LENGTH)
        }
        15 => match bytes {
            b"idempotency-key" | b"Idempotency-Key" => Some(IDEMPOTENCY_KEY),
            b"accept-encoding" | b"Accept-Encoding" => Some(header::ACCEPT_ENCODING),
            _ => None,
        },
        16 => matches!(bytes, b"content-encoding" | b"Content-Encoding")
            .then_some(header::CONTENT_ENCODING),
        17 => matches!(bytes, b"transfer-encoding" | b"Transfer-Encoding")
            .then_some(header::TRANSFER_ENCODING),
        _ => None,
    };
    known.or_else(|| HeaderName::from_bytes(bytes).ok())
}

/// Removes hop-by-hop fields: the fixed list and every field named in `Connection`.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Most messages carry none of them; finding that out in one pass over the message's few
    // names is cheaper than hashing each listed name to find it absent.
    if !headers.keys().any(is_hop_by_hop) {
        return;
    }
    if headers.contains_key(CONNECTION) {
        let named: Vec<HeaderName> = headers
            .get_all(CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
            .collect();
        for name in named {
            headers.remove(name);
        }
    }
    // Only messages that have one get here.
    for name in HOP_BY_HOP {
        headers.remove(name);
    }
}

/// Whether `name` is one of [`HOP_BY_HOP`]: one match on the name's text instead of nine
/// comparisons.
fn is_hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
    )
}

/// Removes the field `name` (every value of it). A lookup that finds nothing, the usual case
/// for the fields this is used for, costs a pass over the names instead of a hash.
///
/// ```
/// use http::{HeaderMap, HeaderValue};
/// use idemgate::headers::remove;
/// use idemgate::response::IDEMPOTENT_REPLAYED;
///
/// let mut headers = HeaderMap::new();
/// headers.insert(&IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
/// remove(&mut headers, &IDEMPOTENT_REPLAYED);
/// assert!(headers.is_empty());
/// ```
pub fn remove(headers: &mut HeaderMap, name: &HeaderName) {
    if contains(headers, name) {
        headers.remove(name);
    }
}

/// Whether the message has a field `name`. Like [`remove`], a pass over the names instead of
/// a hash: cheaper for a field most messages lack.
pub(crate) fn contains(headers: &HeaderMap, name: &HeaderName) -> bool {
    headers.keys().any(|present| present == name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn the_match_names_exactly_the_listed_fields() {
        for name in &HOP_BY_HOP {
            assert!(is_hop_by_hop(name), "{name}");
        }
        for name in [
            "content-length",
            "x-connection",
            "tee",
            "upgrade-insecure-requests",
        ] {
            assert!(!is_hop_by_hop(&HeaderName::from_static(name)), "{name}");
        }
    }

    #[test]
    fn field_names_read_as_parsing_them_would() {
        let names: [&[u8]; 41] = [
            b"host",
            b"Host",
            b"accept",
            b"Accept",
            b"user-agent",
            b"User-Agent",
            b"authorization",
            b"Authorization",
            b"idempotency-key",
            b"Idempotency-Key",
            b"IDEMPOTENCY-KEY",
            b"accept-encoding",
            b"Accept-Encoding",
            b"hosts",
            b"date",
            b"etag",
            b"vary",
            b"server",
            b"location",
            b"connection",
            b"set-cookie",
            b"content-type",
            b"cache-control",
            b"last-modified",
            b"content-length",
            b"content-encoding",
            b"transfer-encoding",
            b"Content-Type",
            b"Content-Length",
            b"Transfer-Encoding",
            b"ETag",
            b"Etag",
            b"Set-Cookie",
            b"CONTENT-LENGTH",
            b"Date",
            b"x-request-id",
            b"X-Request-Id",
            b"dat\xc3",
            b"content type",
            b"bad name",
            b"",
        ];
        for name in names {
            assert_eq!(
                field_name(name),
                HeaderName::from_bytes(name).ok(),
                "{}",
                String::from_utf8_lossy(name)
            );
        }
        assert_eq!(
            field_name(b"Content-Type"),
            Some(http::header::CONTENT_TYPE)
        );
    }

    #[test]
    fn strips_fixed_and_connection_named_fields() {
        let mut h = HeaderMap::new();
        h.insert(CONNECTION, HeaderValue::from_static("keep-alive, X-Secret"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert(TRANSFER_ENCODING, HeaderValue::from_static("chunked"));
        h.insert("x-kept", HeaderValue::from_static("1"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1);
        assert!(h.contains_key("x-kept"));
    }

    #[test]
    fn leaves_end_to_end_fields_alone() {
        let mut h = HeaderMap::new();
        h.insert("x-kept", HeaderValue::from_static("1"));
        h.append("x-kept", HeaderValue::from_static("2"));
        h.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain"),
        );
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 3);
        remove(&mut h, &HeaderName::from_static("x-absent"));
        assert_eq!(h.len(), 3);
        remove(&mut h, &HeaderName::from_static("x-kept"));
        assert_eq!(h.len(), 1);
        assert!(h.contains_key(http::header::CONTENT_TYPE));
    }
}
