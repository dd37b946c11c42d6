//! The [`Verifier`] policy and the handle a route keeps of it.

use std::fmt;
use std::sync::Arc;

use super::{SignatureError, SignedRequest};

/// Decides whether a request really comes from the sender it claims, before the layer claims
/// its key. Set on a route with [`RoutePolicy::verify_with`](crate::RoutePolicy::verify_with).
///
/// Implemented by the provider schemes of this module (with the `webhooks` feature) and by
/// every closure `Fn(&SignedRequest<'_>) -> Result<(), SignatureError>`:
///
/// ```
/// use idemgate::RoutePolicy;
/// use idemgate::webhook::{SignatureError, SignedRequest};
///
/// let token = http::HeaderName::from_static("x-hook-token");
/// let policy = RoutePolicy::webhook().name("hooks").verify_with(
///     move |request: &SignedRequest<'_>| match request.header_str(&token)? {
///         // A real check compares in constant time; the provider schemes do.
///         "expected" => Ok(()),
///         _ => Err(SignatureError::Mismatch),
///     },
/// );
/// # let _ = policy;
/// ```
pub trait Verifier: Send + Sync + 'static {
    /// `Ok` when `request` is signed by the sender; otherwise why not (it becomes the
    /// `detail` of the `401`, so it must not carry a secret).
    fn verify(&self, request: &SignedRequest<'_>) -> Result<(), SignatureError>;
}

impl<F> Verifier for F
where
    F: Fn(&SignedRequest<'_>) -> Result<(), SignatureError> + Send + Sync + 'static,
{
    fn verify(&self, request: &SignedRequest<'_>) -> Result<(), SignatureError> {
        self(request)
    }
}

/// A route's verifier, shared by every clone of the route.
#[derive(Clone)]
pub(crate) struct RouteVerifier {
    verifier: Arc<dyn Verifier>,
    /// The verifier's type, for `Debug` (a closure prints no better; a scheme never prints
    /// its secrets).
    kind: &'static str,
}

impl RouteVerifier {
    pub(crate) fn new<V: Verifier>(verifier: V) -> Self {
        Self {
            verifier: Arc::new(verifier),
            kind: std::any::type_name::<V>(),
        }
    }

    /// Checks a request of a route matched at `prefix`, as the layer read it.
    pub(crate) fn check(
        &self,
        prefix: &str,
        head: &http::request::Parts,
        body: &[u8],
    ) -> Result<(), SignatureError> {
        let path = head.uri.path();
        let route_path = path.strip_prefix(prefix).unwrap_or(path);
        let request = SignedRequest::new(&head.headers, body)
            .with_route_path(route_path)
            .with_query(head.uri.query());
        self.verifier.verify(&request)
    }
}

impl fmt::Debug for RouteVerifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.kind)
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use bytes::Bytes;
    use http::{Request, Response, StatusCode};
    use http_body_util::Full;
    use tower::{Layer, ServiceExt, service_fn};

    use super::*;
    use crate::body::RequestBody;
    use crate::store::{MemoryStore, Store};
    use crate::{Decision, IdempotencyLayer, Outcome, RoutePolicy};

    const TOKEN: http::HeaderName = http::HeaderName::from_static("x-token");

    /// A route at `/hooks` whose sender proves itself with `x-token: good` and whose key is
    /// the `x-id` header, in front of an upstream that counts its calls.
    async fn send(
        request: Request<Full<Bytes>>,
        store: Arc<MemoryStore>,
        calls: Arc<AtomicUsize>,
    ) -> (StatusCode, Decision, Option<String>) {
        let policy = RoutePolicy::webhook()
            .name("hooks")
            .key_header(http::HeaderName::from_static("x-id"))
            .require_key(true)
            .scope_headers([])
            .verify_with(|request: &SignedRequest<'_>| {
                match (request.header_str(&TOKEN)?, request.route_path()) {
                    ("good", "/github") => Ok(()),
                    _ => Err(SignatureError::Mismatch),
                }
            });
        let layer = IdempotencyLayer::new(store).route("/hooks", policy);
        let stats = layer.stats();
        let upstream = service_fn(move |_: Request<RequestBody<Full<Bytes>>>| {
            calls.fetch_add(1, Ordering::SeqCst);
            async { Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok")))) }
        });
        let response = layer.layer(upstream).oneshot(request).await.unwrap();
        let decision = response.extensions().get::<Outcome>().unwrap().decision;
        let rejections = stats.signature_rejections();
        assert_eq!(
            rejections,
            u64::from(decision == Decision::SignatureRejected)
        );
        let challenge = response.headers().get(http::header::WWW_AUTHENTICATE);
        (
            response.status(),
            decision,
            challenge.map(|v| v.to_str().unwrap().to_owned()),
        )
    }

    fn post(token: Option<&str>, id: Option<&str>) -> Request<Full<Bytes>> {
        let mut request = Request::post("/hooks/github");
        if let Some(token) = token {
            request = request.header(TOKEN, token);
        }
        if let Some(id) = id {
            request = request.header("x-id", id);
        }
        request.body(Full::new(Bytes::from_static(b"{}"))).unwrap()
    }

    #[tokio::test]
    async fn a_failed_signature_is_answered_before_the_key_or_the_store() {
        let store = Arc::new(MemoryStore::default());
        let calls = Arc::new(AtomicUsize::new(0));
        // No key and no signature: the signature is what the sender hears about.
        for request in [
            post(None, None),
            post(Some("forged"), Some("d-1")),
            post(None, Some("d-1")),
        ] {
            let (status, decision, challenge) = send(request, store.clone(), calls.clone()).await;
            assert_eq!(status, StatusCode::UNAUTHORIZED);
            assert_eq!(decision, Decision::SignatureRejected);
            assert_eq!(challenge.as_deref(), Some("Webhook-Signature"));
        }
        assert_eq!(calls.load(Ordering::SeqCst), 0);
        let record = crate::fingerprint::record_key("hooks", &[], &http::HeaderMap::new(), "d-1");
        assert!(store.get(&record).await.unwrap().is_none());
    }

    #[tokio::test]
    async fn a_verified_request_then_meets_the_key_rules() {
        let store = Arc::new(MemoryStore::default());
        let calls = Arc::new(AtomicUsize::new(0));
        let (status, decision, _) =
            send(post(Some("good"), None), store.clone(), calls.clone()).await;
        assert_eq!(
            (status, decision),
            (StatusCode::BAD_REQUEST, Decision::MissingKey)
        );
        let (status, decision, _) = send(
            post(Some("good"), Some("d-1")),
            store.clone(),
            calls.clone(),
        )
        .await;
        assert_eq!((status, decision), (StatusCode::OK, Decision::Executed));
        let (_, decision, _) = send(post(Some("good"), Some("d-1")), store, calls.clone()).await;
        assert_eq!(decision, Decision::Replayed);
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_route_verifier_prints_its_type_only() {
        let verifier = RouteVerifier::new(|_: &SignedRequest<'_>| Ok(()));
        assert!(format!("{verifier:?}").contains("verifier"));
    }
}
