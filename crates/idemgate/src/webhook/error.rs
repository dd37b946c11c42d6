//! Why a request's signature was refused.

use std::borrow::Cow;
use std::time::Duration;

use http::HeaderName;

/// Why a request's signature was refused. Its `Display` becomes the `detail` of the
/// `401 invalid-signature` answer, so it says what the sender got wrong and never carries a
/// secret, an expected signature or a header's value.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SignatureError {
    /// A header the scheme needs is absent.
    #[error("the request has no {0} header")]
    MissingHeader(HeaderName),
    /// A header the scheme needs is present but not in the scheme's form (sent twice, not
    /// ASCII, a signature that is not hex or base64, a timestamp that is not a number…).
    #[error("the {header} header is malformed: {why}")]
    Malformed {
        /// The header.
        header: HeaderName,
        /// What is wrong with it.
        why: &'static str,
    },
    /// The signature is well formed but matches none of the route's secrets.
    #[error("the signature does not match the request and any of the route's secrets")]
    Mismatch,
    /// The signed timestamp is further from the receiver's clock than the tolerance allows:
    /// an old delivery replayed, or a sender whose clock is wrong.
    #[error(
        "the signed timestamp is {} s {} the receiver's clock, outside the {} s tolerance",
        offset_secs.unsigned_abs(),
        if *offset_secs >= 0 { "behind" } else { "ahead of" },
        tolerance.as_secs()
    )]
    OutsideTolerance {
        /// How far the signed time is behind the receiver's clock, in seconds (negative: ahead).
        offset_secs: i64,
        /// The tolerance the route allows either way.
        tolerance: Duration,
    },
    /// Any other reason, from a verifier of the application's own.
    #[error("{0}")]
    Other(Cow<'static, str>),
}

impl SignatureError {
    /// A refusal for a reason of the application's own, for a closure [`Verifier`](super::Verifier).
    ///
    /// ```
    /// use idemgate::webhook::SignatureError;
    ///
    /// let why = SignatureError::other("the sender's address is not on the allow list");
    /// assert_eq!(why.to_string(), "the sender's address is not on the allow list");
    /// ```
    pub fn other(why: impl Into<Cow<'static, str>>) -> Self {
        SignatureError::Other(why.into())
    }
}
