//! What a store keeps: the record kinds, the stored response, and their compact binary
//! encoding (shared by the stores that serialise, so a record written by one gateway build
//! reads the same in another).

use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::{HeaderMap, HeaderValue, StatusCode};
use sha2::{Digest, Sha256};

/// A SHA-256 digest. Used for record keys, fingerprints and body digests.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Hash256(pub [u8; 32]);

impl Hash256 {
    /// The digest of `bytes`.
    pub fn of(bytes: &[u8]) -> Self {
        Self(Sha256::digest(bytes).into())
    }

    /// The first 8 bytes as lowercase hex: short enough for a log line, long enough to grep.
    pub fn short(&self) -> String {
        hex(&self.0[..8])
    }

    /// The full digest as lowercase hex.
    pub fn to_hex(&self) -> String {
        hex(&self.0)
    }

    /// Parses 64 hex digits.
    pub fn from_hex(s: &str) -> Option<Self> {
        let s = s.as_bytes();
        if s.len() != 64 {
            return None;
        }
        let mut out = [0u8; 32];
        for (i, pair) in s.chunks_exact(2).enumerate() {
            let hi = (pair[0] as char).to_digit(16)?;
            let lo = (pair[1] as char).to_digit(16)?;
            out[i] = (hi * 16 + lo) as u8;
        }
        Some(Self(out))
    }
}

fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[(b >> 4) as usize] as char);
        s.push(DIGITS[(b & 0xf) as usize] as char);
    }
    s
}

impl fmt::Debug for Hash256 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}…", self.short())
    }
}

/// Where a record lives in a store: SHA-256 of the route, the scope and the key. Stores never
/// see the raw key.
pub type RecordKey = Hash256;

/// SHA-256 over what makes two requests "the same request" (see [`crate::fingerprint::fingerprint`]).
pub type FingerprintHash = Hash256;

/// Identifies the gateway task that owns an in-flight record. Completing, releasing, renewing
/// or marking a record ambiguous succeeds only with the current token (fencing).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct OwnerToken(pub u128);

impl OwnerToken {
    /// A fresh token, unique across processes with overwhelming probability: 64 random bits
    /// drawn once per process, beside a per-process counter. Tokens fence one owner from
    /// another and are never shown to clients, so they need to be unique, not unguessable.
    pub fn generate() -> Self {
        use std::hash::{BuildHasher, RandomState};
        use std::sync::OnceLock;
        use std::sync::atomic::{AtomicU64, Ordering};
        // RandomState is seeded from the OS: hashing anything with a fresh one gives 64
        // random bits without a random-number dependency.
        static PROCESS: OnceLock<u64> = OnceLock::new();
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let process = *PROCESS.get_or_init(|| RandomState::new().hash_one(std::process::id()));
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        Self(((process as u128) << 64) | n as u128)
    }
}

impl fmt::Debug for OwnerToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The process's bits, shortened, and the token's number within that process.
        write!(
            f,
            "OwnerToken({:08x}…#{})",
            (self.0 >> 96) as u32,
            self.0 as u64
        )
    }
}

/// A response kept for replay: status, end-to-end headers (repeated fields in order) and the
/// body byte for byte.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredResponse {
    /// The upstream's status.
    pub status: StatusCode,
    /// End-to-end headers as the upstream sent them, hop-by-hop ones removed.
    pub headers: HeaderMap,
    /// The body exactly as received (`Content-Encoding` intact).
    pub body: Bytes,
}

/// What a completed record holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Completion {
    /// The response, replayed to every retry.
    Response(StoredResponse),
    /// The response was larger than `max_response_bytes`: it reached its client whole, but
    /// only its status and the body's digest are kept. Retries get a problem response.
    TooLarge {
        /// The status the first client received.
        status: StatusCode,
        /// SHA-256 of the body the first client received.
        body_digest: Hash256,
        /// The body's length in bytes.
        body_len: u64,
    },
}

/// A record as a store returns it from [`Store::get`](crate::store::Store::get).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Record {
    /// A gateway is running the request now.
    InFlight {
        /// The request's fingerprint.
        fingerprint: FingerprintHash,
        /// When the owner's lease ends unless renewed.
        lease_deadline: SystemTime,
    },
    /// The request ran and its outcome is kept.
    Completed {
        /// The request's fingerprint.
        fingerprint: FingerprintHash,
        /// The kept outcome.
        completion: Completion,
        /// When it was stored.
        stored_at: SystemTime,
    },
    /// The upstream was sent the request and no answer was captured.
    Ambiguous {
        /// The request's fingerprint.
        fingerprint: FingerprintHash,
        /// When the outcome became unknown.
        since: SystemTime,
    },
}

impl Record {
    /// The fingerprint every record kind carries.
    pub fn fingerprint(&self) -> FingerprintHash {
        match self {
            Record::InFlight { fingerprint, .. }
            | Record::Completed { fingerprint, .. }
            | Record::Ambiguous { fingerprint, .. } => *fingerprint,
        }
    }
}

/// Milliseconds since the Unix epoch, saturating; the unit every store keeps times in.
pub fn unix_millis(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis().min(u64::MAX as u128) as u64)
        .unwrap_or(0)
}

/// The inverse of [`unix_millis`].
pub fn from_unix_millis(ms: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms)
}

/// A record body that could not be decoded: written by a newer build, or damaged.
#[derive(Debug, thiserror::Error)]
#[error("undecodable record: {0}")]
pub struct DecodeError(pub(crate) &'static str);

impl DecodeError {
    /// An error saying what was wrong, for stores that check their own framing around the
    /// encoded completion.
    pub fn new(what: &'static str) -> Self {
        Self(what)
    }
}

const FORMAT_VERSION: u8 = 1;
const TAG_RESPONSE: u8 = 1;
const TAG_TOO_LARGE: u8 = 2;

impl Completion {
    /// Encodes to the compact binary form: version, tag, then length-prefixed fields. The body
    /// is raw bytes, never base64.
    pub fn encode(&self) -> Bytes {
        match self {
            Completion::Response(r) => {
                let header_bytes: usize = r
                    .headers
                    .iter()
                    .map(|(n, v)| 8 + n.as_str().len() + v.len())
                    .sum();
                let mut b = BytesMut::with_capacity(16 + header_bytes + r.body.len());
                b.put_u8(FORMAT_VERSION);
                b.put_u8(TAG_RESPONSE);
                b.put_u16(r.status.as_u16());
                b.put_u32(r.headers.len() as u32);
                for (name, value) in &r.headers {
                    b.put_u32(name.as_str().len() as u32);
                    b.put_slice(name.as_str().as_bytes());
                    b.put_u32(value.len() as u32);
                    b.put_slice(value.as_bytes());
                }
                b.put_u64(r.body.len() as u64);
                b.put_slice(&r.body);
                b.freeze()
            }
            Completion::TooLarge {
                status,
                body_digest,
                body_len,
            } => {
                let mut b = BytesMut::with_capacity(44);
                b.put_u8(FORMAT_VERSION);
                b.put_u8(TAG_TOO_LARGE);
                b.put_u16(status.as_u16());
                b.put_slice(&body_digest.0);
                b.put_u64(*body_len);
                b.freeze()
            }
        }
    }

    /// Decodes what [`Completion::encode`] wrote. The body shares `bytes`' allocation.
    pub fn decode(mut bytes: Bytes) -> Result<Self, DecodeError> {
        fn need(b: &Bytes, n: usize) -> Result<(), DecodeError> {
            if b.remaining() < n {
                Err(DecodeError("truncated"))
            } else {
                Ok(())
            }
        }
        need(&bytes, 4)?;
        if bytes.get_u8() != FORMAT_VERSION {
            return Err(DecodeError("unknown format version"));
        }
        let tag = bytes.get_u8();
        let status =
            StatusCode::from_u16(bytes.get_u16()).map_err(|_| DecodeError("bad status"))?;
        match tag {
            TAG_RESPONSE => {
                need(&bytes, 4)?;
                let count = bytes.get_u32() as usize;
                // One more than stored, as a replay adds `Idempotent-Replayed`, and room for
                // the client's next request, which hyper parses into this map.
                let mut headers = crate::headers::response_map(count.min(256) + 1);
                for _ in 0..count {
                    need(&bytes, 4)?;
                    let n = bytes.get_u32() as usize;
                    need(&bytes, n)?;
                    // The name is read from the bytes in place (a name is copied or matched
                    // to a standard one, never shared): no handle on them is taken.
                    let name = crate::headers::field_name(&bytes[..n])
                        .ok_or(DecodeError("bad header name"))?;
                    bytes.advance(n);
                    need(&bytes, 4)?;
                    let n = bytes.get_u32() as usize;
                    need(&bytes, n)?;
                    let value = HeaderValue::from_maybe_shared(bytes.split_to(n))
                        .map_err(|_| DecodeError("bad header value"))?;
                    // A map holds at most 32 768 fields; a damaged record may claim more.
                    headers
                        .try_append(name, value)
                        .map_err(|_| DecodeError("too many header fields"))?;
                }
                need(&bytes, 8)?;
                let n = bytes.get_u64() as usize;
                need(&bytes, n)?;
                let body = bytes.split_to(n);
                Ok(Completion::Response(StoredResponse {
                    status,
                    headers,
                    body,
                }))
            }
            TAG_TOO_LARGE => {
                need(&bytes, 40)?;
                let mut digest = [0u8; 32];
                bytes.copy_to_slice(&mut digest);
                Ok(Completion::TooLarge {
                    status,
                    body_digest: Hash256(digest),
                    body_len: bytes.get_u64(),
                })
            }
            _ => Err(DecodeError("unknown completion tag")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn response_round_trips_with_binary_body_and_repeated_headers() {
        let mut headers = HeaderMap::new();
        headers.append("set-thing", HeaderValue::from_static("a"));
        headers.append("set-thing", HeaderValue::from_static("b"));
        headers.insert(
            "content-type",
            HeaderValue::from_static("application/octet-stream"),
        );
        let original = Completion::Response(StoredResponse {
            status: StatusCode::CREATED,
            headers,
            body: Bytes::from((0..=255u8).collect::<Vec<_>>()),
        });
        let decoded = Completion::decode(original.encode()).unwrap();
        assert_eq!(decoded, original);
        let Completion::Response(r) = decoded else {
            unreachable!()
        };
        let values: Vec<_> = r.headers.get_all("set-thing").iter().collect();
        assert_eq!(values, ["a", "b"]);
    }

    #[test]
    fn too_large_round_trips() {
        let original = Completion::TooLarge {
            status: StatusCode::OK,
            body_digest: Hash256::of(b"x"),
            body_len: 12_345_678,
        };
        assert_eq!(Completion::decode(original.encode()).unwrap(), original);
    }

    #[test]
    fn a_record_with_more_fields_than_a_header_map_holds_is_an_error_not_a_panic() {
        // 40 000 fields with distinct names (a header map holds 32 768), then an empty body.
        let mut b = BytesMut::new();
        b.put_u8(FORMAT_VERSION);
        b.put_u8(TAG_RESPONSE);
        b.put_u16(200);
        b.put_u32(40_000);
        for i in 0..40_000 {
            let name = format!("x{i}");
            b.put_u32(name.len() as u32);
            b.put_slice(name.as_bytes());
            b.put_u32(0);
        }
        b.put_u64(0);
        assert!(Completion::decode(b.freeze()).is_err());
    }

    #[test]
    fn truncated_input_is_an_error_not_a_panic() {
        let full = Completion::Response(StoredResponse {
            status: StatusCode::OK,
            headers: HeaderMap::new(),
            body: Bytes::from_static(b"hello"),
        })
        .encode();
        for cut in 0..full.len() {
            assert!(
                Completion::decode(full.slice(..cut)).is_err(),
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn hex_round_trips() {
        let h = Hash256::of(b"abc");
        assert_eq!(Hash256::from_hex(&h.to_hex()), Some(h));
        assert_eq!(h.short().len(), 16);
        assert_eq!(Hash256::from_hex("zz"), None);
    }

    #[test]
    fn tokens_are_distinct() {
        let a = OwnerToken::generate();
        let b = OwnerToken::generate();
        assert_ne!(a, b);
        assert_ne!(format!("{a:?}"), format!("{b:?}"));
    }
}
