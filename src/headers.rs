//! Header rules shared by the layer and the proxy.

use http::HeaderMap;
use http::header::{CONNECTION, HeaderName, TE, TRAILER, TRANSFER_ENCODING, UPGRADE};

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

/// Room for fields in the header map of a response the gateway makes or relays. hyper keeps the
/// map of each response it writes and parses the connection's next request into it, growing it
/// (two allocations and a rehash) if that request has more fields than the map has room for;
/// requests commonly carry 10 to 20, often more than the response they follow.
pub(crate) const RESPONSE_FIELDS_ROOM: usize = 16;

/// An empty header map for a response of `fields` fields, with at least
/// [`RESPONSE_FIELDS_ROOM`].
pub(crate) fn response_map(fields: usize) -> HeaderMap {
    HeaderMap::with_capacity(fields.max(RESPONSE_FIELDS_ROOM))
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
pub(crate) fn remove(headers: &mut HeaderMap, name: &HeaderName) {
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
