//! Twilio: `X-Twilio-Signature: <base64 HMAC-SHA1>` over the URL Twilio requested and the
//! sorted form parameters, or over the URL alone with its `bodySHA256` for a JSON body.

use std::collections::{BTreeMap, BTreeSet};

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use http::{HeaderName, header};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use super::mac::{any_matches, hmac_sha1};
use super::request::malformed;
use super::{Provider, Secrets, SetupError, SignatureError, SignedRequest, Verifier};
use crate::RoutePolicy;

const SIGNATURE: HeaderName = HeaderName::from_static("x-twilio-signature");
const BODY_HASH: &str = "bodySHA256";

/// Twilio's request signature: `X-Twilio-Signature` is the base64 HMAC-SHA1, under the
/// account's auth token, of the full URL Twilio requested followed by every parameter of a
/// form body, sorted by name, each as name then value. For a JSON body the URL carries a
/// `bodySHA256` parameter instead: the URL alone is signed, and `bodySHA256` must be the hex
/// SHA-256 of the body. Twilio signs no timestamp.
///
/// Twilio signs the URL as entered in its console, which the receiver behind a gateway cannot
/// see: `public_url` is the public URL of the route's prefix, and the part of the request's
/// path after the prefix and its query are appended to it (`https://example.com/twilio` and
/// a request for `/hooks/twilio/sms?x=1` on the route `/hooks/twilio` rebuild
/// `https://example.com/twilio/sms?x=1`). As Twilio's own library does, the URL is also tried
/// with its scheme's default port added or removed.
///
/// ```
/// use idemgate::webhook::{Secrets, Twilio};
///
/// # fn main() -> Result<(), idemgate::webhook::SetupError> {
/// # let secrets = Secrets::new(["12345"])?;
/// // In an app: Twilio::secret_env(["TWILIO_AUTH_TOKEN"], "https://hooks.example.com/twilio")?
/// let policy = Twilio::new(secrets, "https://hooks.example.com/twilio")?.policy();
/// assert_eq!(policy.route_name(), "twilio");
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct Twilio {
    secrets: Secrets,
    public_url: String,
}

impl Twilio {
    /// Checks signatures made with any of `secrets` (auth tokens) for requests Twilio sent to
    /// `public_url` (an absolute `http` or `https` URL with no query or fragment).
    pub fn new(
        secrets: impl Into<Secrets>,
        public_url: impl Into<String>,
    ) -> Result<Self, SetupError> {
        let public_url = public_url.into();
        let invalid = |why| SetupError::InvalidPublicUrl {
            url: public_url.clone(),
            why,
        };
        if public_url.contains(['?', '#']) {
            return Err(invalid("it may not have a query or a fragment"));
        }
        let uri: http::Uri = public_url.parse().map_err(|_| invalid("it is not a URL"))?;
        if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.host().is_none() {
            return Err(invalid(
                "it must be an absolute http:// or https:// URL with a host",
            ));
        }
        Ok(Self {
            secrets: secrets.into(),
            public_url,
        })
    }

    /// Checks signatures made with the auth tokens held by these environment variables.
    pub fn secret_env<N: AsRef<str>>(
        names: impl IntoIterator<Item = N>,
        public_url: impl Into<String>,
    ) -> Result<Self, SetupError> {
        Self::new(Secrets::from_env(names)?, public_url)
    }

    /// [`Provider::Twilio`]'s route setup, verified by this.
    pub fn policy(self) -> RoutePolicy {
        Provider::Twilio.policy().verify_with(self)
    }

    /// The URL Twilio signed for `request`.
    fn signed_url(&self, request: &SignedRequest<'_>) -> String {
        let path = request.route_path();
        let mut url = self.public_url.clone();
        if url.ends_with('/') && path.starts_with('/') {
            url.pop();
        }
        url.push_str(path);
        if let Some(query) = request.query() {
            url.push('?');
            url.push_str(query);
        }
        url
    }
}

impl Verifier for Twilio {
    fn verify(&self, request: &SignedRequest<'_>) -> Result<(), SignatureError> {
        let value = request.header_str(&SIGNATURE)?;
        let signature = STANDARD
            .decode(value)
            .map_err(|_| malformed(&SIGNATURE, "the signature is not base64"))?;
        let url = self.signed_url(request);
        let body_hash = request.query().and_then(|query| {
            form_urlencoded::parse(query.as_bytes())
                .find(|(name, _)| name == BODY_HASH)
                .map(|(_, value)| value.into_owned())
        });
        // A JSON body is signed through its hash in the URL; a form body by its parameters.
        let params = match &body_hash {
            Some(_) => String::new(),
            None if is_form(request) => sorted_params(request.body()),
            None => String::new(),
        };
        let signed = [without_port(&url), with_port(&url)].iter().any(|url| {
            any_matches(&self.secrets, std::slice::from_ref(&signature), |key| {
                hmac_sha1(key, &[url.as_bytes(), params.as_bytes()])
            })
            .is_ok()
        });
        if !signed {
            return Err(SignatureError::Mismatch);
        }
        match body_hash {
            Some(claimed) => {
                let actual = hex::encode(Sha256::digest(request.body()));
                if bool::from(actual.as_bytes().ct_eq(claimed.as_bytes())) {
                    Ok(())
                } else {
                    Err(SignatureError::other(
                        "the body's SHA-256 is not the bodySHA256 the signed URL carries",
                    ))
                }
            }
            None => Ok(()),
        }
    }
}

fn is_form(request: &SignedRequest<'_>) -> bool {
    request
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| {
            value.split(';').next().is_some_and(|mime| {
                mime.trim()
                    .eq_ignore_ascii_case("application/x-www-form-urlencoded")
            })
        })
}

/// The form parameters as Twilio signs them: sorted by name, a repeated name's values
/// deduplicated and sorted, each as name then value.
fn sorted_params(body: &[u8]) -> String {
    let mut params: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (name, value) in form_urlencoded::parse(body) {
        params
            .entry(name.into_owned())
            .or_default()
            .insert(value.into_owned());
    }
    let mut joined = String::new();
    for (name, values) in &params {
        for value in values {
            joined.push_str(name);
            joined.push_str(value);
        }
    }
    joined
}

/// `url` split as `scheme://`, `userinfo@host`, `:port` (possibly empty) and the rest.
fn split_url(url: &str) -> Option<(&str, &str, &str, &str)> {
    let scheme_end = url.find("://")? + 3;
    let after = &url[scheme_end..];
    let authority_len = after.find(['/', '?', '#']).unwrap_or(after.len());
    let (authority, rest) = after.split_at(authority_len);
    // A colon starts the port only after an IPv6 literal's closing bracket.
    let from = authority.rfind(']').map_or(0, |at| at + 1);
    let port_at = authority[from..].rfind(':').map(|at| at + from);
    let (host, port) = match port_at {
        Some(at) if !authority[at + 1..].contains('@') => authority.split_at(at),
        _ => (authority, ""),
    };
    Some((&url[..scheme_end], host, port, rest))
}

fn without_port(url: &str) -> String {
    match split_url(url) {
        Some((scheme, host, _, rest)) => format!("{scheme}{host}{rest}"),
        None => url.to_owned(),
    }
}

fn with_port(url: &str) -> String {
    match split_url(url) {
        Some((scheme, host, "", rest)) => {
            let port = if scheme.eq_ignore_ascii_case("https://") {
                ":443"
            } else {
                ":80"
            };
            format!("{scheme}{host}{port}{rest}")
        }
        _ => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use http::HeaderMap;

    use super::*;

    // Twilio's documented example ("Webhooks security"): auth token 12345.
    const TOKEN: &str = "12345";
    const PUBLIC_URL: &str = "https://mycompany.com";
    const PATH: &str = "/myapp.php";
    const QUERY: &str = "foo=1&bar=2";
    const FORM: &[u8] = b"CallSid=CA1234567890ABCDE&Caller=%2B12349013030&Digits=1234&From=%2B12349013030&To=%2B18005551212";

    fn sign(token: &str, url: &str, params: &str) -> String {
        STANDARD.encode(hmac_sha1(
            token.as_bytes(),
            &[url.as_bytes(), params.as_bytes()],
        ))
    }

    fn form_headers(signature: Option<&str>) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONTENT_TYPE,
            "application/x-www-form-urlencoded".parse().unwrap(),
        );
        if let Some(signature) = signature {
            headers.insert(SIGNATURE, signature.parse().unwrap());
        }
        headers
    }

    fn verify(
        tokens: &[&str],
        headers: &HeaderMap,
        body: &[u8],
        query: &str,
    ) -> Result<(), SignatureError> {
        Twilio::new(Secrets::new(tokens).unwrap(), PUBLIC_URL)
            .unwrap()
            .verify(
                &SignedRequest::new(headers, body)
                    .with_route_path(PATH)
                    .with_query(Some(query)),
            )
    }

    fn documented_signature() -> String {
        let url = format!("{PUBLIC_URL}{PATH}?{QUERY}");
        sign(
            TOKEN,
            &url,
            "CallSidCA1234567890ABCDECaller+12349013030Digits1234From+12349013030To+18005551212",
        )
    }

    #[test]
    fn a_form_body_is_signed_by_its_sorted_parameters() {
        let signature = documented_signature();
        assert_eq!(signature, "0/KCTR6DLpKmkAf8muzZqo1nDgQ=");
        assert_eq!(
            verify(&[TOKEN], &form_headers(Some(&signature)), FORM, QUERY),
            Ok(())
        );
        assert_eq!(
            verify(
                &["old", TOKEN],
                &form_headers(Some(&signature)),
                FORM,
                QUERY
            ),
            Ok(())
        );
        // The same parameters in another order are the same request.
        let reordered = b"To=%2B18005551212&CallSid=CA1234567890ABCDE&Caller=%2B12349013030&Digits=1234&From=%2B12349013030";
        assert_eq!(
            verify(&[TOKEN], &form_headers(Some(&signature)), reordered, QUERY),
            Ok(())
        );
    }

    #[test]
    fn a_wrong_token_a_changed_parameter_or_another_url_is_a_mismatch() {
        let signed = form_headers(Some(&documented_signature()));
        assert_eq!(
            verify(&["54321"], &signed, FORM, QUERY),
            Err(SignatureError::Mismatch)
        );
        let changed = b"CallSid=CA1234567890ABCDE&Caller=%2B12349013030&Digits=1235&From=%2B12349013030&To=%2B18005551212";
        assert_eq!(
            verify(&[TOKEN], &signed, changed, QUERY),
            Err(SignatureError::Mismatch)
        );
        assert_eq!(
            verify(&[TOKEN], &signed, FORM, "foo=1&bar=3"),
            Err(SignatureError::Mismatch)
        );
    }

    #[test]
    fn a_json_body_is_signed_through_its_hash_in_the_url() {
        let body = br#"{"status":"delivered"}"#;
        let query = format!("{BODY_HASH}={}", hex::encode(Sha256::digest(body)));
        let signature = sign(TOKEN, &format!("{PUBLIC_URL}{PATH}?{query}"), "");
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_TYPE, "application/json".parse().unwrap());
        headers.insert(SIGNATURE, signature.parse().unwrap());
        assert_eq!(verify(&[TOKEN], &headers, body, &query), Ok(()));
        assert!(matches!(
            verify(&[TOKEN], &headers, br#"{"status":"failed"}"#, &query),
            Err(SignatureError::Other(_))
        ));
    }

    #[test]
    fn the_url_is_tried_with_and_without_its_default_port() {
        let signature = sign(
            TOKEN,
            &format!("https://mycompany.com:443{PATH}?{QUERY}"),
            "",
        );
        let mut headers = HeaderMap::new();
        headers.insert(SIGNATURE, signature.parse().unwrap());
        assert_eq!(verify(&[TOKEN], &headers, b"", QUERY), Ok(()));
        assert_eq!(
            without_port("https://u@[::1]:8443/a?b=c"),
            "https://u@[::1]/a?b=c"
        );
        assert_eq!(with_port("http://example.com"), "http://example.com:80");
    }

    #[test]
    fn a_missing_header_or_a_bad_public_url_is_refused() {
        assert_eq!(
            verify(&[TOKEN], &form_headers(None), FORM, QUERY),
            Err(SignatureError::MissingHeader(SIGNATURE))
        );
        for bad in [
            "mycompany.com/hook",
            "ftp://mycompany.com",
            "https://mycompany.com/h?x=1",
            "https://",
        ] {
            assert!(
                matches!(
                    Twilio::new(Secrets::new([TOKEN]).unwrap(), bad),
                    Err(SetupError::InvalidPublicUrl { .. })
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn the_route_path_joins_the_public_url_with_one_slash() {
        let twilio =
            Twilio::new(Secrets::new([TOKEN]).unwrap(), "https://x.example/hooks/").unwrap();
        let headers = HeaderMap::new();
        let request = SignedRequest::new(&headers, b"")
            .with_route_path("/sms")
            .with_query(None);
        assert_eq!(twilio.signed_url(&request), "https://x.example/hooks/sms");
        let request = SignedRequest::new(&headers, b"");
        assert_eq!(twilio.signed_url(&request), "https://x.example/hooks/");
    }

    #[test]
    fn debug_does_not_show_the_token() {
        let shown = format!(
            "{:?}",
            Twilio::new(Secrets::new(["tok_secret_value"]).unwrap(), PUBLIC_URL).unwrap()
        );
        assert!(!shown.contains("tok_secret_value"), "{shown}");
    }
}
