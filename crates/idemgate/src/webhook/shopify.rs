//! Shopify: `X-Shopify-Hmac-Sha256: <base64 HMAC-SHA256 of the body>`.

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use http::HeaderName;

use super::mac::{any_matches, hmac_sha256};
use super::request::malformed;
use super::{Secrets, SignatureError, SignedRequest, Verifier};

const SIGNATURE: HeaderName = HeaderName::from_static("x-shopify-hmac-sha256");

/// Shopify's webhook signature: `X-Shopify-Hmac-Sha256` is the base64 HMAC-SHA256 of the
/// body under the app's client secret (or, for webhooks made in a store's admin, the secret
/// shown there). It signs no timestamp; `X-Shopify-Webhook-Id` is what the route dedupes by.
///
/// ```
/// use idemgate::webhook::{Secrets, Shopify};
///
/// # fn main() -> Result<(), idemgate::webhook::SetupError> {
/// # let secrets = Secrets::new(["shpss_test"])?;
/// // In an app: Shopify::secret_env(["SHOPIFY_API_SECRET"])?
/// let policy = Shopify::new(secrets).policy();
/// assert_eq!(policy.route_name(), "shopify");
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct Shopify {
    secrets: Secrets,
}

super::scheme::secret_scheme!(Shopify, Shopify);

impl Verifier for Shopify {
    fn verify(&self, request: &SignedRequest<'_>) -> Result<(), SignatureError> {
        let value = request.header_str(&SIGNATURE)?;
        let signature = STANDARD
            .decode(value)
            .map_err(|_| malformed(&SIGNATURE, "the signature is not base64"))?;
        any_matches(&self.secrets, &[signature], |key| {
            hmac_sha256(key, &[request.body()])
        })
    }
}

#[cfg(test)]
mod tests {
    use http::HeaderMap;

    use super::*;

    const SECRET: &str = "shpss_test_secret";
    const BODY: &[u8] = br#"{"id":820982911946154508,"email":"jon@example.com"}"#;

    fn signed(secret: &str, body: &[u8]) -> String {
        STANDARD.encode(hmac_sha256(secret.as_bytes(), &[body]))
    }

    fn verify(secrets: &[&str], header: Option<&str>, body: &[u8]) -> Result<(), SignatureError> {
        let mut headers = HeaderMap::new();
        if let Some(header) = header {
            headers.insert(SIGNATURE, header.parse().unwrap());
        }
        Shopify::new(Secrets::new(secrets).unwrap()).verify(&SignedRequest::new(&headers, body))
    }

    #[test]
    fn a_good_signature_verifies_with_any_secret_of_a_rotation() {
        let header = signed(SECRET, BODY);
        assert_eq!(verify(&[SECRET], Some(&header), BODY), Ok(()));
        assert_eq!(verify(&["shpss_old", SECRET], Some(&header), BODY), Ok(()));
    }

    #[test]
    fn a_wrong_secret_or_a_tampered_body_is_a_mismatch() {
        let header = signed(SECRET, BODY);
        assert_eq!(
            verify(&["shpss_other"], Some(&header), BODY),
            Err(SignatureError::Mismatch)
        );
        let mut tampered = BODY.to_vec();
        tampered[10] ^= 1;
        assert_eq!(
            verify(&[SECRET], Some(&header), &tampered),
            Err(SignatureError::Mismatch)
        );
    }

    #[test]
    fn a_missing_or_malformed_header_is_refused() {
        assert_eq!(
            verify(&[SECRET], None, BODY),
            Err(SignatureError::MissingHeader(SIGNATURE))
        );
        assert!(matches!(
            verify(&[SECRET], Some("not base64!"), BODY),
            Err(SignatureError::Malformed { .. })
        ));
    }

    #[test]
    fn debug_does_not_show_the_secret() {
        let shown = format!("{:?}", Shopify::new(Secrets::new([SECRET]).unwrap()));
        assert!(!shown.contains("test_secret"), "{shown}");
    }
}
