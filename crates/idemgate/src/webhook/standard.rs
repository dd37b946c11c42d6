//! Standard Webhooks (Svix and the senders that follow the spec): `webhook-id`,
//! `webhook-timestamp` and `webhook-signature: v1,<base64> …` over `<id>.<timestamp>.<body>`.

use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use http::HeaderName;

use super::mac::{any_matches, hmac_sha256};
use super::request::malformed;
use super::timestamp::{self, DEFAULT_TOLERANCE};
use super::{Provider, Secrets, SetupError, SignatureError, SignedRequest, Verifier};
use crate::RoutePolicy;

const ID: HeaderName = HeaderName::from_static("webhook-id");
const TIMESTAMP: HeaderName = HeaderName::from_static("webhook-timestamp");
const SIGNATURE: HeaderName = HeaderName::from_static("webhook-signature");
const SECRET_PREFIX: &str = "whsec_";

/// The Standard Webhooks signature (standardwebhooks.com; Svix's scheme): `webhook-signature`
/// is a space-separated list of `v1,<base64>`, each an HMAC-SHA256 of `webhook-id`, `.`,
/// `webhook-timestamp`, `.` and the body under the secret — which is given as `whsec_` and
/// base64, and decoded when the verifier is made (a secret that is not base64 is refused
/// then, naming where it came from). Entries of other versions (`v1a`, asymmetric) are
/// skipped. The timestamp must be within the tolerance (default [`DEFAULT_TOLERANCE`])
/// either way.
///
/// ```
/// use idemgate::webhook::{Secrets, StandardWebhooks};
///
/// # fn main() -> Result<(), idemgate::webhook::SetupError> {
/// # let secrets = Secrets::new(["whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"])?;
/// // In an app: StandardWebhooks::secret_env(["WEBHOOK_SECRET"])?
/// let policy = StandardWebhooks::new(secrets)?.policy();
/// assert_eq!(policy.route_name(), "standard-webhooks");
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct StandardWebhooks {
    /// Decoded keys.
    keys: Secrets,
    tolerance: Duration,
}

impl StandardWebhooks {
    /// Checks signatures made with any of `secrets` (each `whsec_` and base64, or base64
    /// alone), timestamps within 5 minutes.
    pub fn new(secrets: impl Into<Secrets>) -> Result<Self, SetupError> {
        let keys = secrets.into().try_map(|secret, at| {
            let text = std::str::from_utf8(secret.expose()).unwrap_or("");
            let encoded = text.strip_prefix(SECRET_PREFIX).unwrap_or(text);
            match STANDARD.decode(encoded) {
                Ok(key) if !key.is_empty() => Ok(secret.with_bytes(key)),
                _ => Err(SetupError::InvalidBase64 {
                    from: secret.origin(at),
                }),
            }
        })?;
        Ok(Self {
            keys,
            tolerance: DEFAULT_TOLERANCE,
        })
    }

    /// Checks signatures made with the secrets held by these environment variables.
    pub fn secret_env<N: AsRef<str>>(
        names: impl IntoIterator<Item = N>,
    ) -> Result<Self, SetupError> {
        Self::new(Secrets::from_env(names)?)
    }

    /// How far `webhook-timestamp` may be from the receiver's clock, either way.
    #[must_use]
    pub fn tolerance(mut self, tolerance: Duration) -> Self {
        self.tolerance = tolerance;
        self
    }

    /// [`Provider::StandardWebhooks`]'s route setup, verified by this.
    pub fn policy(self) -> RoutePolicy {
        Provider::StandardWebhooks.policy().verify_with(self)
    }
}

impl Verifier for StandardWebhooks {
    fn verify(&self, request: &SignedRequest<'_>) -> Result<(), SignatureError> {
        let id = request.header_str(&ID)?;
        let time = request.header_str(&TIMESTAMP)?;
        let signed_at = timestamp::parse(time, &TIMESTAMP)?;
        let list = request.header_str(&SIGNATURE)?;
        let signatures: Vec<Vec<u8>> = list
            .split(' ')
            .filter_map(|entry| entry.strip_prefix("v1,"))
            // An entry that is not base64 matches nothing, as in the spec's libraries.
            .filter_map(|encoded| STANDARD.decode(encoded).ok())
            .collect();
        if signatures.is_empty() {
            return Err(malformed(&SIGNATURE, "it has no v1 signature"));
        }
        any_matches(&self.keys, &signatures, |key| {
            hmac_sha256(
                key,
                &[id.as_bytes(), b".", time.as_bytes(), b".", request.body()],
            )
        })?;
        timestamp::check(signed_at, request.now(), self.tolerance)
    }
}

#[cfg(test)]
mod tests {
    use std::time::UNIX_EPOCH;

    use http::HeaderMap;

    use super::*;

    // The test vector of the spec's reference libraries.
    const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    const MSG_ID: &str = "msg_p5jXN8AQM9LWM0D4loKWxJek";
    const T: u64 = 1_614_265_330;
    const BODY: &[u8] = br#"{"test": 2432232314}"#;
    const SIGNED: &str = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=";
    const OTHER: &str = "whsec_dGhlIG90aGVyIHNlY3JldCBvZiB0aGUgdGVzdHM=";

    fn headers(signature: Option<&str>) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(ID, MSG_ID.parse().unwrap());
        headers.insert(TIMESTAMP, T.to_string().parse().unwrap());
        if let Some(signature) = signature {
            headers.insert(SIGNATURE, signature.parse().unwrap());
        }
        headers
    }

    fn verify_at(
        secrets: &[&str],
        headers: &HeaderMap,
        body: &[u8],
        now: u64,
    ) -> Result<(), SignatureError> {
        let now = UNIX_EPOCH + Duration::from_secs(now);
        StandardWebhooks::new(Secrets::new(secrets).unwrap())
            .unwrap()
            .verify(&SignedRequest::new(headers, body).at(now))
    }

    fn verify(secrets: &[&str], headers: &HeaderMap, body: &[u8]) -> Result<(), SignatureError> {
        verify_at(secrets, headers, body, T + 5)
    }

    #[test]
    fn the_specs_test_vector_verifies_among_other_entries() {
        assert_eq!(verify(&[SECRET], &headers(Some(SIGNED)), BODY), Ok(()));
        let listed = format!("v1a,ignored v1,bm90IGl0 {SIGNED}");
        assert_eq!(verify(&[SECRET], &headers(Some(&listed)), BODY), Ok(()));
    }

    #[test]
    fn a_wrong_secret_a_tampered_body_or_another_id_is_a_mismatch() {
        let signed = headers(Some(SIGNED));
        assert_eq!(
            verify(&[OTHER], &signed, BODY),
            Err(SignatureError::Mismatch)
        );
        assert_eq!(
            verify(&[SECRET], &signed, br#"{"test": 2432232315}"#),
            Err(SignatureError::Mismatch)
        );
        let mut other_id = signed.clone();
        other_id.insert(ID, "msg_other".parse().unwrap());
        assert_eq!(
            verify(&[SECRET], &other_id, BODY),
            Err(SignatureError::Mismatch)
        );
    }

    #[test]
    fn any_secret_of_a_rotation_verifies() {
        assert_eq!(
            verify(&[OTHER, SECRET], &headers(Some(SIGNED)), BODY),
            Ok(())
        );
    }

    #[test]
    fn a_timestamp_outside_the_tolerance_is_refused_either_way() {
        let signed = headers(Some(SIGNED));
        for now in [T + 301, T - 301] {
            assert!(matches!(
                verify_at(&[SECRET], &signed, BODY, now),
                Err(SignatureError::OutsideTolerance { .. })
            ));
        }
    }

    #[test]
    fn missing_headers_are_refused() {
        assert_eq!(
            verify(&[SECRET], &headers(None), BODY),
            Err(SignatureError::MissingHeader(SIGNATURE))
        );
        let mut no_id = headers(Some(SIGNED));
        no_id.remove(ID);
        assert_eq!(
            verify(&[SECRET], &no_id, BODY),
            Err(SignatureError::MissingHeader(ID))
        );
        assert!(matches!(
            verify(&[SECRET], &headers(Some("v1a,abc")), BODY),
            Err(SignatureError::Malformed { .. })
        ));
    }

    #[test]
    fn a_secret_that_is_not_base64_is_refused_when_made() {
        let err = StandardWebhooks::new(Secrets::new(["whsec_not base64!"]).unwrap()).unwrap_err();
        assert_eq!(
            err,
            SetupError::InvalidBase64 {
                from: "number 1".into()
            }
        );
        assert!(!err.to_string().contains("not base64!"));
    }

    #[test]
    fn debug_does_not_show_the_secret_or_its_key() {
        let verifier = StandardWebhooks::new(Secrets::new([SECRET]).unwrap()).unwrap();
        let shown = format!("{verifier:?}");
        assert!(
            !shown.contains("MfKQ9r8G") && shown.contains("<redacted>"),
            "{shown}"
        );
    }
}
