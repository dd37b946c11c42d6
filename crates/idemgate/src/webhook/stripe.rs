//! Stripe: `Stripe-Signature: t=<time>,v1=<hex>[,v1=<hex>…]` over `<time>.<body>`.

use std::time::Duration;

use http::HeaderName;

use super::mac::{any_matches, hmac_sha256};
use super::request::malformed;
use super::timestamp;
use super::{Secrets, SignatureError, SignedRequest, Verifier};

const SIGNATURE: HeaderName = HeaderName::from_static("stripe-signature");

/// Stripe's webhook signature: `Stripe-Signature` holds `t=` (seconds since the epoch) and
/// one or more `v1=`, each a hex HMAC-SHA256 of `t`, `.` and the body under the endpoint's
/// signing secret (`whsec_…`, used as it is). Stripe sends several `v1` while an endpoint's
/// secret is being rolled; any one matching is enough. Other schemes (`v0`) are ignored. The
/// timestamp must be within the tolerance (default [`DEFAULT_TOLERANCE`](super::DEFAULT_TOLERANCE)) either way.
///
/// ```
/// use std::time::Duration;
/// use idemgate::webhook::{Secrets, Stripe};
///
/// # fn main() -> Result<(), idemgate::webhook::SetupError> {
/// # let secrets = Secrets::new(["whsec_test"])?;
/// // In an app: Stripe::secret_env(["STRIPE_WEBHOOK_SECRET"])?
/// let policy = Stripe::new(secrets).tolerance(Duration::from_secs(600)).policy();
/// assert_eq!(policy.route_name(), "stripe");
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct Stripe {
    secrets: Secrets,
    tolerance: Duration,
}

super::scheme::secret_scheme!(Stripe, Stripe, timestamp = "t=");

impl Verifier for Stripe {
    fn verify(&self, request: &SignedRequest<'_>) -> Result<(), SignatureError> {
        let value = request.header_str(&SIGNATURE)?;
        let mut time = None;
        let mut signatures = Vec::new();
        for item in value.split(',') {
            match item.trim().split_once('=') {
                Some(("t", t)) => time = Some(t),
                Some(("v1", hex_mac)) => signatures.push(
                    hex::decode(hex_mac)
                        .map_err(|_| malformed(&SIGNATURE, "a v1 signature is not hex"))?,
                ),
                _ => {}
            }
        }
        let time = time.ok_or_else(|| malformed(&SIGNATURE, "it has no t= timestamp"))?;
        let signed_at = timestamp::parse(time, &SIGNATURE)?;
        if signatures.is_empty() {
            return Err(malformed(&SIGNATURE, "it has no v1= signature"));
        }
        any_matches(&self.secrets, &signatures, |key| {
            hmac_sha256(key, &[time.as_bytes(), b".", request.body()])
        })?;
        timestamp::check(signed_at, request.now(), self.tolerance)
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, UNIX_EPOCH};

    use http::HeaderMap;

    use super::*;

    const SECRET: &str = "whsec_test_secret";
    const BODY: &[u8] = br#"{"id":"evt_1","object":"event"}"#;
    const T: u64 = 1_700_000_000;

    fn header(secret: &str, t: u64, body: &[u8]) -> String {
        let mac = hmac_sha256(secret.as_bytes(), &[t.to_string().as_bytes(), b".", body]);
        format!("t={t},v1={},v0=00", hex::encode(mac))
    }

    fn verify_at(
        secrets: &[&str],
        header: Option<&str>,
        body: &[u8],
        now: u64,
    ) -> Result<(), SignatureError> {
        let mut headers = HeaderMap::new();
        if let Some(header) = header {
            headers.insert(SIGNATURE, header.parse().unwrap());
        }
        let now = UNIX_EPOCH + Duration::from_secs(now);
        Stripe::new(Secrets::new(secrets).unwrap())
            .verify(&SignedRequest::new(&headers, body).at(now))
    }

    fn verify(secrets: &[&str], header: Option<&str>, body: &[u8]) -> Result<(), SignatureError> {
        verify_at(secrets, header, body, T + 10)
    }

    #[test]
    fn a_good_signature_verifies() {
        assert_eq!(
            verify(&[SECRET], Some(&header(SECRET, T, BODY)), BODY),
            Ok(())
        );
    }

    #[test]
    fn a_wrong_secret_or_a_tampered_body_is_a_mismatch() {
        let signed = header(SECRET, T, BODY);
        assert_eq!(
            verify(&["whsec_other"], Some(&signed), BODY),
            Err(SignatureError::Mismatch)
        );
        assert_eq!(
            verify(
                &[SECRET],
                Some(&signed),
                br#"{"id":"evt_2","object":"event"}"#
            ),
            Err(SignatureError::Mismatch)
        );
    }

    #[test]
    fn any_secret_or_any_v1_of_a_rotation_verifies() {
        assert_eq!(
            verify(&["whsec_old", SECRET], Some(&header(SECRET, T, BODY)), BODY),
            Ok(())
        );
        // Stripe rolling a secret: two v1 entries, one per secret.
        let old = header("whsec_old", T, BODY);
        let new = header(SECRET, T, BODY);
        let both = format!("{old},{}", new.split(',').nth(1).unwrap());
        assert_eq!(verify(&[SECRET], Some(&both), BODY), Ok(()));
    }

    #[test]
    fn a_timestamp_outside_the_tolerance_is_refused_either_way() {
        let signed = header(SECRET, T, BODY);
        for now in [T + 301, T - 301] {
            assert!(
                matches!(
                    verify_at(&[SECRET], Some(&signed), BODY, now),
                    Err(SignatureError::OutsideTolerance { .. })
                ),
                "{now}"
            );
        }
        assert_eq!(verify_at(&[SECRET], Some(&signed), BODY, T + 300), Ok(()));
        let lenient =
            Stripe::new(Secrets::new([SECRET]).unwrap()).tolerance(Duration::from_secs(3600));
        let mut headers = HeaderMap::new();
        headers.insert(SIGNATURE, signed.parse().unwrap());
        let later = UNIX_EPOCH + Duration::from_secs(T + 3000);
        assert_eq!(
            lenient.verify(&SignedRequest::new(&headers, BODY).at(later)),
            Ok(())
        );
    }

    #[test]
    fn a_missing_or_malformed_header_is_refused() {
        assert_eq!(
            verify(&[SECRET], None, BODY),
            Err(SignatureError::MissingHeader(SIGNATURE))
        );
        for bad in [
            "v1=00",
            "t=1700000000",
            "t=soon,v1=00",
            "t=1700000000,v1=xyz",
        ] {
            assert!(
                matches!(
                    verify(&[SECRET], Some(bad), BODY),
                    Err(SignatureError::Malformed { .. })
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn debug_does_not_show_the_secret() {
        let shown = format!("{:?}", Stripe::new(Secrets::new([SECRET]).unwrap()));
        assert!(!shown.contains("test_secret"), "{shown}");
    }
}
