//! What a store keeps: the record kinds, the stored response, and their compact binary
//! encoding (shared by the stores that serialise, so a record written by one gateway build
//! reads the same in another).

use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::{HeaderMap, HeaderValue, StatusCode};
use sha2::{Digest, Sha256};

/// A SHA-256 digest, such as a kept body's. Record keys and fingerprints are digests too, each
/// of its own type: [`RecordKey`], [`FingerprintHash`].
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

/// Defines a SHA-256 digest with its own meaning: the same bytes, formats and `Debug` as a
/// [`Hash256`], but a type of its own, so one kind of digest is never passed for another.
macro_rules! digest_type {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(pub [u8; 32]);

        impl $name {
            /// The SHA-256 digest of `bytes`, for tests and tools that need a value of this
            /// type; the gateway derives its own from requests (see [`crate::fingerprint`]).
            pub fn of(bytes: &[u8]) -> Self {
                Self(Hash256::of(bytes).0)
            }

            /// The first 8 bytes as lowercase hex: short enough for a log line, long enough
            /// to grep.
            pub fn short(&self) -> String {
                hex(&self.0[..8])
            }

            /// The full digest as lowercase hex.
            pub fn to_hex(&self) -> String {
                hex(&self.0)
            }

            /// Parses 64 hex digits.
            pub fn from_hex(s: &str) -> Option<Self> {
                Hash256::from_hex(s).map(|h| Self(h.0))
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}…", self.short())
            }
        }
    };
}

digest_type! {
    /// Where a record lives in a store: SHA-256 of the route, the scope and the key (see
    /// [`crate::fingerprint::record_key`]). Stores never see the raw key.
    ///
    /// Its own type, not a [`Hash256`] nor a [`FingerprintHash`], so that a record key and a
    /// fingerprint cannot be passed in each other's place. Stores keep its 32 bytes as they
    /// are.
    RecordKey
}

digest_type! {
    /// SHA-256 over what makes two requests "the same request" (see
    /// [`crate::fingerprint::fingerprint`]).
    ///
    /// Its own type, not a [`Hash256`] nor a [`RecordKey`], so that a fingerprint and a
    /// record key cannot be passed in each other's place. Stores keep its 32 bytes as they
    /// are.
    FingerprintHash
}

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

    /// A record key and a fingerprint are the same digest as a `Hash256` of the same bytes,
    /// shown and parsed the same way: only their types differ.
    #[test]
    fn keys_and_fingerprints_are_digests_of_their_own_type() {
        let h = Hash256::of(b"abc");
        let key = RecordKey::of(b"abc");
        let fingerprint = FingerprintHash::of(b"abc");
        assert_eq!((key.0, fingerprint.0), (h.0, h.0));
        for (hex, short, debug) in [
            (key.to_hex(), key.short(), format!("{key:?}")),
            (
                fingerprint.to_hex(),
                fingerprint.short(),
                format!("{fingerprint:?}"),
            ),
        ] {
            assert_eq!(
                (hex, short, debug),
                (h.to_hex(), h.short(), format!("{h:?}"))
            );
        }
        assert_eq!(RecordKey::from_hex(&h.to_hex()), Some(key));
        assert_eq!(FingerprintHash::from_hex(&h.to_hex()), Some(fingerprint));
        assert_eq!(RecordKey::from_hex("zz"), None);
        assert_eq!(FingerprintHash::from_hex("zz"), None);
    }

    #[test]
    fn tokens_are_distinct() {
        let a = OwnerToken::generate();
        let b = OwnerToken::generate();
        assert_ne!(a, b);
        assert_ne!(format!("{a:?}"), format!("{b:?}"));
    }
}

/// Properties of the record codec over generated and damaged input: what a store reads back
/// may be anything a disk, a network or another build left there.
#[cfg(test)]
pub(crate) mod proptests {
    use super::*;
    use proptest::prelude::*;
    use proptest::sample::Index;

    /// 256 cases, drawn with XorShift: ChaCha, the default generator, runs unoptimised in a
    /// debug build and was most of these properties' run time.
    pub(crate) fn config() -> ProptestConfig {
        ProptestConfig {
            rng_algorithm: proptest::test_runner::RngAlgorithm::XorShift,
            ..ProptestConfig::with_cases(256)
        }
    }

    /// Names the decoder matches to http's constants, plus a few others, so that generated
    /// header lists repeat names often.
    const COMMON_NAMES: [&str; 10] = [
        "set-cookie",
        "content-type",
        "etag",
        "vary",
        "location",
        "content-encoding",
        "cache-control",
        "idempotency-key",
        "x-request-id",
        "link",
    ];

    fn status() -> impl Strategy<Value = StatusCode> {
        (100u16..=999).prop_map(|s| StatusCode::from_u16(s).unwrap())
    }

    fn header_name() -> impl Strategy<Value = http::HeaderName> {
        prop_oneof![
            proptest::sample::select(COMMON_NAMES.to_vec()).prop_map(http::HeaderName::from_static),
            "[a-z0-9!#$%&'*+.^_`|~-]{1,40}"
                .prop_map(|n| http::HeaderName::from_bytes(n.as_bytes()).unwrap()),
        ]
    }

    /// Any valid field value: visible ASCII, space, tab and obs-text, empty included.
    fn header_value() -> impl Strategy<Value = HeaderValue> {
        proptest::collection::vec(
            prop_oneof![Just(b'\t'), 0x20u8..=0x7e, 0x80u8..=0xff],
            0..48,
        )
        .prop_map(|v| HeaderValue::from_bytes(&v).unwrap())
    }

    fn headers() -> impl Strategy<Value = HeaderMap> {
        proptest::collection::vec((header_name(), header_value()), 0..16).prop_map(|fields| {
            let mut map = HeaderMap::new();
            for (name, value) in fields {
                map.append(name, value);
            }
            map
        })
    }

    /// Bodies: empty, small, or large (up to 300 kB). The bytes come from a seeded generator,
    /// which keeps a large body cheap to make: the codec cares for the length, not the bytes.
    fn body() -> impl Strategy<Value = Bytes> {
        let len = prop_oneof![4 => 0usize..512, 1 => 0usize..300_000];
        (any::<u64>(), len).prop_map(|(mut seed, len)| {
            let mut body = Vec::with_capacity(len + 8);
            while body.len() < len {
                // splitmix64
                seed = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
                let mut z = seed;
                z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
                body.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
            }
            body.truncate(len);
            Bytes::from(body)
        })
    }

    pub(crate) fn completion() -> impl Strategy<Value = Completion> {
        prop_oneof![
            3 => (status(), headers(), body()).prop_map(|(status, headers, body)| {
                Completion::Response(StoredResponse {
                    status,
                    headers,
                    body,
                })
            }),
            1 => (status(), any::<[u8; 32]>(), any::<u64>()).prop_map(
                |(status, digest, body_len)| Completion::TooLarge {
                    status,
                    body_digest: Hash256(digest),
                    body_len,
                }
            ),
        ]
    }

    /// The fields in the order a header map yields them: a decoded map must yield the stored
    /// order, repeated names' values included.
    fn fields(c: &Completion) -> Vec<(String, Vec<u8>)> {
        match c {
            Completion::Response(r) => r
                .headers
                .iter()
                .map(|(n, v)| (n.as_str().to_owned(), v.as_bytes().to_vec()))
                .collect(),
            Completion::TooLarge { .. } => Vec::new(),
        }
    }

    /// What any decode that succeeds must satisfy: the value re-encodes to bytes that decode
    /// to the same value, and re-encoding is stable from then on.
    fn assert_decoded_is_stable(decoded: &Completion) -> Result<(), TestCaseError> {
        let encoded = decoded.encode();
        let again = Completion::decode(encoded.clone())
            .map_err(|e| TestCaseError::fail(format!("re-encoding does not decode: {e}")))?;
        prop_assert_eq!(&again, decoded);
        prop_assert_eq!(fields(&again), fields(decoded));
        prop_assert_eq!(again.encode(), encoded);
        Ok(())
    }

    /// One way of damaging an encoding.
    #[derive(Clone, Debug)]
    pub(crate) enum Mutation {
        Flip(Index, u8),
        Set(Index, u8),
        Truncate(Index),
        Extend(Vec<u8>),
        Insert(Index, Vec<u8>),
        Remove(Index, usize),
    }

    pub(crate) fn mutation() -> impl Strategy<Value = Mutation> {
        prop_oneof![
            (any::<Index>(), 1u8..=255).prop_map(|(i, m)| Mutation::Flip(i, m)),
            (any::<Index>(), any::<u8>()).prop_map(|(i, b)| Mutation::Set(i, b)),
            any::<Index>().prop_map(Mutation::Truncate),
            proptest::collection::vec(any::<u8>(), 1..32).prop_map(Mutation::Extend),
            (
                any::<Index>(),
                proptest::collection::vec(any::<u8>(), 1..16)
            )
                .prop_map(|(i, b)| Mutation::Insert(i, b)),
            (any::<Index>(), 1usize..16).prop_map(|(i, n)| Mutation::Remove(i, n)),
        ]
    }

    pub(crate) fn apply(bytes: &mut Vec<u8>, m: &Mutation) {
        match m {
            Mutation::Flip(i, mask) if !bytes.is_empty() => {
                let i = i.index(bytes.len());
                bytes[i] ^= mask;
            }
            Mutation::Set(i, b) if !bytes.is_empty() => {
                let i = i.index(bytes.len());
                bytes[i] = *b;
            }
            Mutation::Truncate(i) if !bytes.is_empty() => {
                let i = i.index(bytes.len());
                bytes.truncate(i);
            }
            Mutation::Extend(tail) => bytes.extend_from_slice(tail),
            Mutation::Insert(i, b) => {
                let i = i.index(bytes.len() + 1);
                bytes.splice(i..i, b.iter().copied());
            }
            Mutation::Remove(i, n) if !bytes.is_empty() => {
                let i = i.index(bytes.len());
                let end = (i + n).min(bytes.len());
                bytes.drain(i..end);
            }
            _ => {}
        }
    }

    /// Encodings of generated completions, most of them damaged by up to three mutations.
    pub(crate) fn damaged_encoding() -> impl Strategy<Value = Vec<u8>> {
        (completion(), proptest::collection::vec(mutation(), 0..4)).prop_map(
            |(original, mutations)| {
                let mut bytes = original.encode().to_vec();
                for m in &mutations {
                    apply(&mut bytes, m);
                }
                bytes
            },
        )
    }

    /// What records are made of, to be put together in any order: small big-endian lengths
    /// and counts, runs of token characters, runs of any bytes.
    fn piece() -> impl Strategy<Value = Vec<u8>> {
        prop_oneof![
            (0u32..12).prop_map(|n| n.to_be_bytes().to_vec()),
            (0u64..12).prop_map(|n| n.to_be_bytes().to_vec()),
            "[a-z-]{0,11}".prop_map(String::into_bytes),
            proptest::collection::vec(any::<u8>(), 0..12),
        ]
    }

    /// Input that gets past the version byte often: a valid version, a valid or random tag
    /// and a status (mostly in range), then random bytes or random pieces; or bytes with no
    /// structure at all.
    fn raw_record() -> impl Strategy<Value = Vec<u8>> {
        let tail = prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..128),
            proptest::collection::vec(piece(), 0..12).prop_map(|pieces| pieces.concat()),
        ];
        prop_oneof![
            1 => proptest::collection::vec(any::<u8>(), 0..128),
            4 => (
                prop_oneof![Just(TAG_RESPONSE), Just(TAG_TOO_LARGE), any::<u8>()],
                prop_oneof![3 => 100u16..=999, 1 => any::<u16>()],
                tail,
            )
                .prop_map(|(tag, status, tail)| {
                    let mut b = vec![FORMAT_VERSION, tag];
                    b.extend_from_slice(&status.to_be_bytes());
                    b.extend_from_slice(&tail);
                    b
                }),
        ]
    }

    proptest! {
        #![proptest_config(config())]

        #[test]
        fn decode_inverts_encode(original in completion()) {
            let encoded = original.encode();
            let decoded = Completion::decode(encoded.clone())
                .map_err(|e| TestCaseError::fail(format!("own encoding does not decode: {e}")))?;
            prop_assert_eq!(&decoded, &original);
            // Equality of header maps ignores the order of distinct names; the stored order
            // is kept too, so a replay sends the fields as the upstream did.
            prop_assert_eq!(fields(&decoded), fields(&original));
            prop_assert_eq!(decoded.encode(), encoded);
        }

        #[test]
        fn every_strict_prefix_of_an_encoding_is_refused(
            original in completion(),
            cut in any::<Index>(),
        ) {
            let encoded = original.encode();
            let cut = cut.index(encoded.len());
            prop_assert!(Completion::decode(encoded.slice(..cut)).is_err(), "cut at {}", cut);
        }

        #[test]
        fn arbitrary_bytes_decode_to_an_error_or_a_stable_value(raw in raw_record()) {
            if let Ok(decoded) = Completion::decode(Bytes::from(raw)) {
                assert_decoded_is_stable(&decoded)?;
            }
        }

        #[test]
        fn damaged_encodings_decode_to_an_error_or_a_stable_value(
            original in completion(),
            mutations in proptest::collection::vec(mutation(), 1..4),
        ) {
            let mut bytes = original.encode().to_vec();
            for m in &mutations {
                apply(&mut bytes, m);
            }
            if let Ok(decoded) = Completion::decode(Bytes::from(bytes)) {
                assert_decoded_is_stable(&decoded)?;
            }
        }

        #[test]
        fn hex_digests_round_trip_in_either_case(digest in any::<[u8; 32]>()) {
            let h = Hash256(digest);
            let hex = h.to_hex();
            prop_assert_eq!(hex.len(), 64);
            prop_assert!(hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')));
            prop_assert_eq!(Hash256::from_hex(&hex), Some(h));
            prop_assert_eq!(Hash256::from_hex(&hex.to_ascii_uppercase()), Some(h));
            prop_assert!(hex.starts_with(&h.short()));
        }

        #[test]
        fn from_hex_accepts_exactly_64_hex_digits(
            s in prop_oneof![
                any::<String>(),
                "[0-9a-fA-F]{60,68}",
                // 64 characters, one of which may be anything (a multi-byte one included).
                ("[0-9a-fA-F]{63}", any::<char>(), any::<Index>()).prop_map(|(s, c, i)| {
                    let mut s = s;
                    s.insert(i.index(s.len() + 1), c);
                    s
                }),
            ],
        ) {
            let valid = s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit());
            match Hash256::from_hex(&s) {
                Some(h) => {
                    prop_assert!(valid, "accepted {:?}", s);
                    prop_assert_eq!(h.to_hex(), s.to_ascii_lowercase());
                }
                None => prop_assert!(!valid, "refused {:?}", s),
            }
        }

        #[test]
        fn stored_times_round_trip_through_system_time(ms in prop_oneof![
            any::<u64>(),
            Just(0u64),
            Just(u64::MAX),
            0u64..4_102_444_800_000,
        ]) {
            prop_assert_eq!(unix_millis(from_unix_millis(ms)), ms);
        }
    }
}
