//! Slack: `X-Slack-Signature: v0=<hex>` over `v0:<X-Slack-Request-Timestamp>:<body>`.

use std::time::Duration;

use http::HeaderName;

use super::mac::{any_matches, hmac_sha256};
use super::request::malformed;
use super::timestamp;
use super::{Secrets, SignatureError, SignedRequest, Verifier};

const SIGNATURE: HeaderName = HeaderName::from_static("x-slack-signature");
const TIMESTAMP: HeaderName = HeaderName::from_static("x-slack-request-timestamp");

/// Slack's request signature: `X-Slack-Signature` is `v0=` and the hex HMAC-SHA256 of
/// `v0:`, `X-Slack-Request-Timestamp`, `:` and the body under the app's signing secret. The
/// timestamp must be within the tolerance (default [`DEFAULT_TOLERANCE`](super::DEFAULT_TOLERANCE)) either way.
///
/// ```
/// use idemgate::webhook::{Secrets, Slack};
///
/// # fn main() -> Result<(), idemgate::webhook::SetupError> {
/// # let secrets = Secrets::new(["8f742231b10e8888abcd99yyyzzz85a5"])?;
/// // In an app: Slack::secret_env(["SLACK_SIGNING_SECRET"])?
/// let policy = Slack::new(secrets).policy();
/// assert_eq!(policy.route_name(), "slack");
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct Slack {
    secrets: Secrets,
    tolerance: Duration,
}

super::scheme::secret_scheme!(Slack, Slack, timestamp = "X-Slack-Request-Timestamp");

impl Verifier for Slack {
    fn verify(&self, request: &SignedRequest<'_>) -> Result<(), SignatureError> {
        let time = request.header_str(&TIMESTAMP)?;
        let signed_at = timestamp::parse(time, &TIMESTAMP)?;
        let value = request.header_str(&SIGNATURE)?;
        let hex_mac = value
            .strip_prefix("v0=")
            .ok_or_else(|| malformed(&SIGNATURE, "it does not start with \"v0=\""))?;
        let signature =
            hex::decode(hex_mac).map_err(|_| malformed(&SIGNATURE, "the signature is not hex"))?;
        any_matches(&self.secrets, &[signature], |key| {
            hmac_sha256(key, &[b"v0:", time.as_bytes(), b":", request.body()])
        })?;
        timestamp::check(signed_at, request.now(), self.tolerance)
    }
}

#[cfg(test)]
mod tests {
    use std::time::UNIX_EPOCH;

    use http::HeaderMap;

    use super::*;

    // Slack's own example ("Verifying requests from Slack").
    const SECRET: &str = "8f742231b10e8888abcd99yyyzzz85a5";
    const T: u64 = 1_531_420_618;
    const BODY: &[u8] = b"token=xyzz0WbapA4vBCDEFasx0q6G&team_id=T1DC2JH3J&team_domain=testteamnow&channel_id=G8PSS9T3V&channel_name=foobar&user_id=U2CERLKJA&user_name=roadrunner&command=%2Fwebhook-collect&text=&response_url=https%3A%2F%2Fhooks.slack.com%2Fcommands%2FT1DC2JH3J%2F397700885554%2F96rGlfmibIGlgcZRskXaIFfN&trigger_id=398738663015.47445629121.803a0bc887a14d10d2c447fce8b6703c";
    const SIGNED: &str = "v0=a2114d57b48eac39b9ad189dd8316235a7b4a8d21a10bd27519666489c69b503";

    fn headers(signature: Option<&str>) -> HeaderMap {
        let mut headers = HeaderMap::new();
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
        Slack::new(Secrets::new(secrets).unwrap())
            .verify(&SignedRequest::new(headers, body).at(now))
    }

    fn verify(secrets: &[&str], headers: &HeaderMap, body: &[u8]) -> Result<(), SignatureError> {
        verify_at(secrets, headers, body, T + 1)
    }

    #[test]
    fn slacks_own_example_verifies_with_any_secret_of_a_rotation() {
        assert_eq!(verify(&[SECRET], &headers(Some(SIGNED)), BODY), Ok(()));
        assert_eq!(
            verify(&["old", SECRET], &headers(Some(SIGNED)), BODY),
            Ok(())
        );
    }

    #[test]
    fn a_wrong_secret_or_a_tampered_body_is_a_mismatch() {
        let signed = headers(Some(SIGNED));
        assert_eq!(
            verify(&["another"], &signed, BODY),
            Err(SignatureError::Mismatch)
        );
        assert_eq!(
            verify(&[SECRET], &signed, &BODY[1..]),
            Err(SignatureError::Mismatch)
        );
    }

    #[test]
    fn a_timestamp_outside_the_tolerance_is_refused_either_way() {
        for now in [T + 301, T - 301] {
            assert!(matches!(
                verify_at(&[SECRET], &headers(Some(SIGNED)), BODY, now),
                Err(SignatureError::OutsideTolerance { .. })
            ));
        }
    }

    #[test]
    fn missing_or_malformed_headers_are_refused() {
        assert_eq!(
            verify(&[SECRET], &headers(None), BODY),
            Err(SignatureError::MissingHeader(SIGNATURE))
        );
        let mut no_time = headers(Some(SIGNED));
        no_time.remove(TIMESTAMP);
        assert_eq!(
            verify(&[SECRET], &no_time, BODY),
            Err(SignatureError::MissingHeader(TIMESTAMP))
        );
        assert!(matches!(
            verify(&[SECRET], &headers(Some("v1=a2114d57")), BODY),
            Err(SignatureError::Malformed { .. })
        ));
    }

    #[test]
    fn debug_does_not_show_the_secret() {
        let shown = format!("{:?}", Slack::new(Secrets::new([SECRET]).unwrap()));
        assert!(!shown.contains("8f742231"), "{shown}");
    }
}
