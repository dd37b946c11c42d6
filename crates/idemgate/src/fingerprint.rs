//! Hashing requests: the fingerprint that says whether a retry is the same request, and the
//! record key that says where its record lives. Every field is length-prefixed, so no two
//! different inputs hash alike by shifting bytes between fields.

use http::{HeaderMap, HeaderName, Method, Uri};
use sha2::{Digest, Sha256};

use crate::record::{FingerprintHash, RecordKey};

/// A SHA-256 fed with length-prefixed fields.
struct Fields(Sha256);

impl Fields {
    fn new(domain: &[u8]) -> Self {
        let mut f = Self(Sha256::new());
        f.field(domain);
        f
    }

    fn field(&mut self, bytes: &[u8]) {
        self.0.update((bytes.len() as u64).to_be_bytes());
        self.0.update(bytes);
    }

    /// A header's values in order, prefixed by their count; an absent header is count 0, an
    /// empty value is count 1 with length 0.
    fn header(&mut self, headers: &HeaderMap, name: &HeaderName) {
        let values = headers.get_all(name);
        self.0.update((values.iter().count() as u64).to_be_bytes());
        for value in values {
            self.field(value.as_bytes());
        }
    }

    /// The named headers in order, prefixed by their count: each name, then its values.
    fn headers(&mut self, headers: &HeaderMap, names: &[HeaderName]) {
        self.0.update((names.len() as u64).to_be_bytes());
        for name in names {
            self.field(name.as_str().as_bytes());
            self.header(headers, name);
        }
    }

    fn finish(self) -> [u8; 32] {
        self.0.finalize().into()
    }
}

/// The fingerprint of a request: method, path and query, the values of `fingerprint_headers`
/// (in order), and the body.
pub fn fingerprint(
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    fingerprint_headers: &[HeaderName],
    body: &[u8],
) -> FingerprintHash {
    let mut f = Fields::new(b"idemgate/fingerprint/v1");
    f.field(method.as_str().as_bytes());
    f.field(
        uri.path_and_query()
            .map_or("/", |pq| pq.as_str())
            .as_bytes(),
    );
    f.headers(headers, fingerprint_headers);
    f.field(body);
    FingerprintHash(f.finish())
}

/// Where the record of `key` lives: a hash of the route's name, the scope (the values of
/// `scope_headers`, by default `Authorization`) and the key. Stores only ever see this hash.
pub fn record_key(
    route: &str,
    scope_headers: &[HeaderName],
    headers: &HeaderMap,
    key: &str,
) -> RecordKey {
    let mut f = Fields::new(b"idemgate/record/v1");
    f.field(route.as_bytes());
    f.headers(headers, scope_headers);
    f.field(key.as_bytes());
    RecordKey(f.finish())
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;
    use http::header::{AUTHORIZATION, CONTENT_TYPE};

    fn fp(method: Method, uri: &str, ct: Option<&str>, body: &[u8]) -> FingerprintHash {
        let mut h = HeaderMap::new();
        if let Some(ct) = ct {
            h.insert(CONTENT_TYPE, HeaderValue::from_str(ct).unwrap());
        }
        fingerprint(&method, &uri.parse().unwrap(), &h, &[CONTENT_TYPE], body)
    }

    /// The hashes are stored in durable records, so their bytes must never change: these
    /// values were computed by the first implementation (and again, independently, from the
    /// encoding described at the top of this file).
    #[test]
    fn hashes_are_stable_across_versions() {
        // Bodies past, near and within a few hash blocks.
        let (big, mid) = (vec![7u8; 1000], vec![9u8; 250]);
        let cases = [
            fp(Method::POST, "/v1/pay?x=1", Some("application/json"), b"{}"),
            fp(Method::PUT, "/", None, &big),
            fp(Method::PUT, "/", None, &mid),
        ];
        let mut h = HeaderMap::new();
        h.insert(AUTHORIZATION, HeaderValue::from_static("Bearer a"));
        h.append(AUTHORIZATION, HeaderValue::from_static(""));
        let key = record_key("payments", &[AUTHORIZATION, CONTENT_TYPE], &h, "order-1001");
        let mut hex: Vec<String> = cases.iter().map(FingerprintHash::to_hex).collect();
        hex.push(key.to_hex());
        assert_eq!(
            hex,
            [
                "4e0f64a1502fb012dfedd3e34cd30b35c4e3c89ad8a9a75d00dca084985fb7d3",
                "16695253cbe363305b643687cbbbd2ad92c3b57a03a7981b35c3078ca5245d11",
                "a12ddf734ab8c5578afdf5d928607f40f97cbf795603c687f5815a2838fa91ba",
                "987e4760c5a4de791c32352640e5038abb9bdc8cf19d105ebcb11352abc485d4",
            ]
        );
    }

    #[test]
    fn each_part_changes_the_fingerprint() {
        let base = fp(Method::POST, "/a?x=1", Some("application/json"), b"{}");
        assert_eq!(
            base,
            fp(Method::POST, "/a?x=1", Some("application/json"), b"{}")
        );
        assert_ne!(
            base,
            fp(Method::PATCH, "/a?x=1", Some("application/json"), b"{}")
        );
        assert_ne!(
            base,
            fp(Method::POST, "/a?x=2", Some("application/json"), b"{}")
        );
        assert_ne!(
            base,
            fp(Method::POST, "/a", Some("application/json"), b"{}")
        );
        assert_ne!(base, fp(Method::POST, "/a?x=1", Some("text/plain"), b"{}"));
        assert_ne!(base, fp(Method::POST, "/a?x=1", None, b"{}"));
        assert_ne!(
            base,
            fp(Method::POST, "/a?x=1", Some("application/json"), b"{ }")
        );
    }

    #[test]
    fn absent_and_empty_header_differ() {
        assert_ne!(
            fp(Method::POST, "/", None, b""),
            fp(Method::POST, "/", Some(""), b"")
        );
    }

    #[test]
    fn fields_do_not_run_into_each_other() {
        // Moving bytes from the query into the body must not give the same hash.
        assert_ne!(
            fp(Method::POST, "/a?b", None, b"c"),
            fp(Method::POST, "/a?", None, b"bc")
        );
    }

    #[test]
    fn scope_separates_callers_and_routes() {
        let mut alice = HeaderMap::new();
        alice.insert(AUTHORIZATION, HeaderValue::from_static("Bearer alice"));
        let mut bob = HeaderMap::new();
        bob.insert(AUTHORIZATION, HeaderValue::from_static("Bearer bob"));
        let scope = [AUTHORIZATION];
        let a = record_key("api", &scope, &alice, "k1");
        assert_eq!(a, record_key("api", &scope, &alice, "k1"));
        assert_ne!(a, record_key("api", &scope, &bob, "k1"));
        assert_ne!(a, record_key("api", &scope, &HeaderMap::new(), "k1"));
        assert_ne!(a, record_key("other", &scope, &alice, "k1"));
        assert_ne!(a, record_key("api", &scope, &alice, "k2"));
        // With no scope headers every caller shares one namespace.
        assert_eq!(
            record_key("api", &[], &alice, "k1"),
            record_key("api", &[], &bob, "k1")
        );
    }
}
