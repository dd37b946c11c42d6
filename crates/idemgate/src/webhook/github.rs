//! GitHub: `X-Hub-Signature-256: sha256=<hex HMAC-SHA256 of the body>`.

use http::HeaderName;

use super::mac::{any_matches, hmac_sha256};
use super::request::malformed;
use super::{Secrets, SignatureError, SignedRequest, Verifier};

const SIGNATURE: HeaderName = HeaderName::from_static("x-hub-signature-256");

/// GitHub's webhook signature: `X-Hub-Signature-256` is `sha256=` and the hex HMAC-SHA256 of
/// the body under the webhook's secret. It signs no timestamp, so a captured delivery stays
/// valid; its `X-GitHub-Delivery` id is what the route dedupes it by.
///
/// ```
/// use idemgate::webhook::{GitHub, Secrets};
///
/// # fn main() -> Result<(), idemgate::webhook::SetupError> {
/// # let secrets = Secrets::new(["It's a Secret to Everybody"])?;
/// // In an app: GitHub::secret_env(["GITHUB_WEBHOOK_SECRET"])?
/// let policy = GitHub::new(secrets).policy();
/// assert_eq!(policy.route_name(), "github");
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct GitHub {
    secrets: Secrets,
}

super::scheme::secret_scheme!(GitHub, GitHub);

impl Verifier for GitHub {
    fn verify(&self, request: &SignedRequest<'_>) -> Result<(), SignatureError> {
        let value = request.header_str(&SIGNATURE)?;
        let hex_mac = value
            .strip_prefix("sha256=")
            .ok_or_else(|| malformed(&SIGNATURE, "it does not start with \"sha256=\""))?;
        let signature =
            hex::decode(hex_mac).map_err(|_| malformed(&SIGNATURE, "the signature is not hex"))?;
        any_matches(&self.secrets, &[signature], |key| {
            hmac_sha256(key, &[request.body()])
        })
    }
}

#[cfg(test)]
mod tests {
    use http::HeaderMap;

    use super::*;

    // GitHub's own example ("Validating webhook deliveries").
    const SECRET: &str = "It's a Secret to Everybody";
    const BODY: &[u8] = b"Hello, World!";
    const SIGNED: &str = "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17";

    fn headers(signature: Option<&str>) -> HeaderMap {
        let mut headers = HeaderMap::new();
        if let Some(signature) = signature {
            headers.insert(SIGNATURE, signature.parse().unwrap());
        }
        headers
    }

    fn verify(secrets: &[&str], headers: &HeaderMap, body: &[u8]) -> Result<(), SignatureError> {
        GitHub::new(Secrets::new(secrets).unwrap()).verify(&SignedRequest::new(headers, body))
    }

    #[test]
    fn githubs_own_example_verifies() {
        assert_eq!(verify(&[SECRET], &headers(Some(SIGNED)), BODY), Ok(()));
    }

    #[test]
    fn a_wrong_secret_or_a_tampered_body_is_a_mismatch() {
        let signed = headers(Some(SIGNED));
        assert_eq!(
            verify(&["another"], &signed, BODY),
            Err(SignatureError::Mismatch)
        );
        assert_eq!(
            verify(&[SECRET], &signed, b"Hello, World?"),
            Err(SignatureError::Mismatch)
        );
    }

    #[test]
    fn any_secret_of_a_rotation_verifies() {
        assert_eq!(
            verify(&["old", SECRET], &headers(Some(SIGNED)), BODY),
            Ok(())
        );
    }

    #[test]
    fn a_missing_or_malformed_header_is_refused() {
        assert_eq!(
            verify(&[SECRET], &headers(None), BODY),
            Err(SignatureError::MissingHeader(SIGNATURE))
        );
        for bad in ["757107ea", "sha1=757107ea", "sha256=zz"] {
            assert!(
                matches!(
                    verify(&[SECRET], &headers(Some(bad)), BODY),
                    Err(SignatureError::Malformed { .. })
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn debug_does_not_show_the_secret() {
        let shown = format!("{:?}", GitHub::new(Secrets::new([SECRET]).unwrap()));
        assert!(!shown.contains("Secret to"), "{shown}");
    }
}
