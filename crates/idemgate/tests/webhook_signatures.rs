//! Deliveries signed by the providers' own SDKs, sent through the layer with each provider's
//! preset in front of an axum app: a correctly signed delivery runs once and its redelivery
//! is replayed; a forged one (wrong secret, a byte of the body changed, the signature
//! removed, a timestamp ten minutes off) is refused `401 invalid-signature`, never reaches the
//! app, and leaves no record.
//!
//! The deliveries come from `tests/webhook_senders/sign.mjs` (run with `node`; `.ci/install-deps`
//! installs its packages). Without `node` or those packages the test fails, saying what to
//! install.

#[path = "webhook_senders/deliveries.rs"]
mod deliveries;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::State;
use axum::routing::post;
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, StatusCode};
use http_body_util::BodyExt;
use idemgate::webhook::{DEFAULT_TOLERANCE, Provider, Secrets};
use idemgate::{Decision, IdempotencyLayer, MemoryStore, Outcome, Store};
use tower::ServiceExt;

use deliveries::Delivery;

const SENDERS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/webhook_senders");
const TWILIO_PUBLIC_URL: &str = "https://hooks.example.com/twilio";

/// Per provider: the two secrets the route accepts (a rotation), and one it does not.
fn secrets(provider: Provider) -> [&'static str; 3] {
    match provider {
        Provider::GitHub => ["gh-secret-current", "gh-secret-next", "gh-secret-forger"],
        Provider::Stripe => ["whsec_current", "whsec_next", "whsec_forger"],
        Provider::Shopify => ["shpss_current", "shpss_next", "shpss_forger"],
        Provider::StandardWebhooks => [
            "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
            "whsec_bmV4dCBzZWNyZXQgb2YgdGhlIHJvdGF0aW9uIQ==",
            "whsec_Zm9yZ2VyJ3Mgc2VjcmV0LCBub3QgdGhlIHJvdXRlJ3M=",
        ],
        Provider::Slack => ["slack-current", "slack-next", "slack-forger"],
        Provider::Twilio => [
            "twilio-token-current",
            "twilio-token-next",
            "twilio-token-forger",
        ],
        other => panic!("no secrets for {other}"),
    }
}

fn prefix(provider: Provider) -> String {
    format!("/webhooks/{provider}")
}

impl Delivery {
    fn provider(&self) -> Provider {
        self.provider.parse().unwrap()
    }

    fn request(&self) -> Request<axum::body::Body> {
        let mut uri = format!("{}{}", prefix(self.provider()), self.route_path);
        if let Some(query) = &self.query {
            uri = format!("{uri}?{query}");
        }
        let mut request = Request::post(uri);
        for (name, value) in &self.headers {
            request = request.header(name, value);
        }
        request
            .body(axum::body::Body::from(self.body.clone()))
            .unwrap()
    }

    fn record(&self) -> idemgate::record::RecordKey {
        idemgate::fingerprint::record_key(
            self.provider().as_str(),
            &[],
            &HeaderMap::new(),
            &self.key,
        )
    }
}

/// The SDK-signed deliveries, for the secrets above.
fn signed_deliveries() -> Vec<Delivery> {
    deliveries::signed_deliveries(
        SENDERS,
        TWILIO_PUBLIC_URL,
        Provider::ALL.map(|provider| (provider.as_str(), secrets(provider))),
    )
}

/// The app behind the layer: records every body it is handed, answers `200`.
async fn receive(State(seen): State<Arc<Mutex<Vec<Bytes>>>>, body: Bytes) -> String {
    let mut seen = seen.lock().unwrap();
    seen.push(body);
    format!("{{\"handled\":{}}}", seen.len())
}

#[tokio::test]
async fn sdk_signed_deliveries_run_once_and_forged_ones_never_reach_the_app() {
    let deliveries = signed_deliveries();
    let store = Arc::new(MemoryStore::default());
    let mut layer = IdempotencyLayer::new(store.clone());
    for provider in Provider::ALL {
        let [primary, secondary, _] = secrets(provider);
        let secrets = Secrets::new([primary, secondary]).unwrap();
        let policy = provider
            .verified_policy(secrets, DEFAULT_TOLERANCE, Some(TWILIO_PUBLIC_URL))
            .unwrap();
        layer = layer.route(prefix(provider), policy);
    }
    let stats = layer.stats();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let mut app = Router::new();
    for provider in Provider::ALL {
        app = app
            .route(&prefix(provider), post(receive))
            .route(&format!("{}/{{*rest}}", prefix(provider)), post(receive));
    }
    let app = app.with_state(seen.clone()).layer(layer);
    let times_seen = |body: &str| {
        let seen = seen.lock().unwrap();
        seen.iter()
            .filter(|b| b.as_ref() == body.as_bytes())
            .count()
    };

    let mut checked: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut refused = 0;
    for delivery in &deliveries {
        let what = format!(
            "{} {} ({})",
            delivery.provider, delivery.case, delivery.signed_by
        );
        let first = app.clone().oneshot(delivery.request()).await.unwrap();
        let decision = first.extensions().get::<Outcome>().map(|o| o.decision);
        let status = first.status();
        let www_authenticate = first.headers().get(http::header::WWW_AUTHENTICATE).cloned();
        let body = first.into_body().collect().await.unwrap().to_bytes();
        if delivery.accept {
            assert_eq!(status, StatusCode::OK, "{what}: {body:?}");
            assert_eq!(decision, Some(Decision::Executed), "{what}");
            let redelivery = app.clone().oneshot(delivery.request()).await.unwrap();
            assert_eq!(redelivery.status(), StatusCode::OK, "{what}");
            assert_eq!(
                redelivery.headers()["idempotent-replayed"],
                "true",
                "{what}"
            );
            let replayed = redelivery.into_body().collect().await.unwrap().to_bytes();
            assert_eq!(replayed, body, "{what}");
            assert_eq!(times_seen(&delivery.body), 1, "{what}: ran once");
            assert!(
                store.get(&delivery.record()).await.unwrap().is_some(),
                "{what}"
            );
        } else {
            refused += 1;
            assert_eq!(status, StatusCode::UNAUTHORIZED, "{what}: {body:?}");
            assert_eq!(decision, Some(Decision::SignatureRejected), "{what}");
            assert_eq!(
                www_authenticate,
                Some(HeaderValue::from_static("Webhook-Signature"))
            );
            let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(
                problem["type"], "urn:idemgate:problem:invalid-signature",
                "{what}"
            );
            assert_eq!(times_seen(&delivery.body), 0, "{what}: reached the app");
            assert!(
                store.get(&delivery.record()).await.unwrap().is_none(),
                "{what}: left a record"
            );
            let detail = problem["detail"].as_str().unwrap();
            if delivery.case.ends_with("-timestamp") {
                assert!(detail.contains("tolerance"), "{what}: {detail}");
            }
            // The refusal says what was wrong, and never repeats a signature it was sent.
            for (_, signature) in delivery.headers.iter().filter(|(n, _)| n.contains("sig")) {
                assert!(!detail.contains(signature.as_str()), "{what}: {detail}");
            }
        }
        checked
            .entry(delivery.provider.clone())
            .or_default()
            .push(format!("{} → {}", delivery.case, status.as_u16()));
    }
    assert_eq!(stats.signature_rejections(), refused);
    // Every provider was exercised with every case (a change to sign.mjs that drops one fails
    // here rather than passing quietly).
    for provider in Provider::ALL {
        let cases = checked
            .get(provider.as_str())
            .map_or(&[][..], Vec::as_slice);
        let timestamped = matches!(
            provider,
            Provider::Stripe | Provider::StandardWebhooks | Provider::Slack
        );
        let expected =
            if timestamped { 7 } else { 5 } + usize::from(provider == Provider::Twilio) * 2;
        assert_eq!(cases.len(), expected, "{provider}: {cases:?}");
    }
    eprintln!("{checked:#?}");
}
