//! End to end: the real `idemgate` binary with a `provider = "…"` route for each webhook
//! sender, in front of a real upstream on 127.0.0.1, sent deliveries signed by the providers'
//! own SDKs.
//!
//! The deliveries come from the library's `tests/webhook_senders/sign.mjs`, run with `node`
//! (`.ci/install-deps` installs its packages): for each provider a valid delivery, one signed
//! with the second secret of a rotation, and forged ones (a wrong secret, a body changed by one
//! byte, the signature removed, and where the provider signs one a timestamp ten minutes old
//! or ahead). The secrets are given to the gateway's process only, by environment variables
//! its config names; this test's own environment is never changed.
#![cfg(feature = "webhooks")]

#[path = "../../idemgate/tests/webhook_senders/deliveries.rs"]
mod deliveries;
#[path = "support/proxy.rs"]
mod support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use deliveries::Delivery;

use support::{Gateway, Resp, TempDir, TestUpstream, admin_get, assert_metrics_show, send};

/// The library's signing script and its SDKs, beside this crate.
const SENDERS: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../idemgate/tests/webhook_senders"
);
/// Where Twilio reaches the gateway's `/webhooks/twilio` route: another path than the
/// route's prefix, as behind a load balancer.
const TWILIO_PUBLIC_URL: &str = "https://hooks.example.com/twilio";
const PROVIDERS: [&str; 6] = [
    "github",
    "stripe",
    "shopify",
    "standard-webhooks",
    "slack",
    "twilio",
];
const PROBLEM_TYPE: &str = "urn:idemgate:problem:invalid-signature";

/// Per provider: the two secrets the route accepts (a rotation: the SDK signs "primary" and
/// "secondary" with them), and one it does not.
fn secrets(provider: &str) -> [&'static str; 3] {
    match provider {
        "github" => ["gh-s3cr3t-current", "gh-s3cr3t-next", "gh-s3cr3t-forger"],
        "stripe" => [
            "whsec_s3cr3t_current",
            "whsec_s3cr3t_next",
            "whsec_s3cr3t_forger",
        ],
        "shopify" => [
            "shpss_s3cr3t_current",
            "shpss_s3cr3t_next",
            "shpss_s3cr3t_forger",
        ],
        // whsec_ + base64 of "s3cr3t current…", "s3cr3t next…", "s3cr3t forger…".
        "standard-webhooks" => [
            "whsec_czNjcjN0IGN1cnJlbnQgb2YgdGhlIGUyZSB0ZXN0",
            "whsec_czNjcjN0IG5leHQgb2YgdGhlIGUyZSB0ZXN0",
            "whsec_czNjcjN0IGZvcmdlciBvZiB0aGUgZTJlIHRlc3Q=",
        ],
        "slack" => [
            "slack-s3cr3t-current",
            "slack-s3cr3t-next",
            "slack-s3cr3t-forger",
        ],
        "twilio" => [
            "twilio-s3cr3t-current",
            "twilio-s3cr3t-next",
            "twilio-s3cr3t-forger",
        ],
        other => panic!("no secrets for {other}"),
    }
}

/// The environment variables holding `provider`'s two accepted secrets.
fn secret_vars(provider: &str) -> [String; 2] {
    let stem = format!(
        "IDEMGATE_E2E_{}_SECRET",
        provider.replace('-', "_").to_ascii_uppercase()
    );
    [stem.clone(), format!("{stem}_NEXT")]
}

fn prefix(provider: &str) -> String {
    format!("/webhooks/{provider}")
}

impl Delivery {
    /// The path and query on the gateway, under the provider's route (or `route`).
    fn target(&self, route: &str) -> String {
        let mut target = format!("{route}{}", self.route_path);
        if let Some(query) = &self.query {
            target = format!("{target}?{query}");
        }
        target
    }

    async fn send_to(&self, gw: &Gateway, route: &str, extra: &[(&str, &str)]) -> Resp {
        let mut headers: Vec<(&str, &str)> = self
            .headers
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .collect();
        headers.extend_from_slice(extra);
        send("POST", &gw.url(&self.target(route)), &headers, &self.body).await
    }

    async fn send(&self, gw: &Gateway) -> Resp {
        self.send_to(gw, &prefix(&self.provider), &[]).await
    }

    fn what(&self) -> String {
        format!("{} {} ({})", self.provider, self.case, self.signed_by)
    }

    /// The same delivery, its id and signature kept, with a body of the forger's: still
    /// carrying the event's id (Stripe's and Slack's are in the body), no longer what was
    /// signed.
    fn forged(&self) -> Delivery {
        let form = self.headers.iter().any(|(n, v)| {
            n == "content-type" && v.starts_with("application/x-www-form-urlencoded")
        });
        let body = if form {
            format!("{}&Body=refund+9900", self.body)
        } else {
            // Whitespace after the JSON text: the same document, other bytes.
            format!("{} ", self.body)
        };
        Delivery {
            case: "forged-with-the-real-id".into(),
            accept: false,
            body,
            ..self.clone()
        }
    }
}

/// The SDK-signed deliveries, for the secrets above.
fn signed_deliveries() -> Vec<Delivery> {
    deliveries::signed_deliveries(
        SENDERS,
        TWILIO_PUBLIC_URL,
        PROVIDERS.map(|provider| (provider, secrets(provider))),
    )
}

/// A provider route for each provider, each accepting two secrets (a rotation), and a second
/// Stripe route that accepts only the first secret with a longer tolerance.
fn config(dir: &TempDir) -> String {
    let mut text = String::from(
        "store = \"memory\"\nupstream_timeout = \"10s\"\n# Never applies to provider routes.\nttl = \"1s\"\n",
    );
    for provider in PROVIDERS {
        let [current, next] = secret_vars(provider);
        text.push_str(&format!(
            "\n[[routes]]\nprefix = \"{}\"\nprovider = \"{provider}\"\nsecret_env = [\"{current}\", \"{next}\"]\n\
             # Retries wait for the delivery in flight (the providers' setup already does).\nconcurrent = \"wait\"\n",
            prefix(provider)
        ));
        if provider == "twilio" {
            text.push_str(&format!("public_url = \"{TWILIO_PUBLIC_URL}\"\n"));
        }
    }
    let [stripe_current, _] = secret_vars("stripe");
    text.push_str(&format!(
        "\n[[routes]]\nprefix = \"/webhooks/stripe-lenient\"\nname = \"stripe-lenient\"\n\
         provider = \"stripe\"\nsecret_env = \"{stripe_current}\"\nsignature_tolerance = \"15m\"\n"
    ));
    dir.write("webhooks.toml", &text)
        .to_string_lossy()
        .into_owned()
}

/// The gateway in front of `upstream` (at a base path, so the route's path the signature
/// check sees is the client's, not the forwarded one), with every secret in its environment.
fn start_gateway(dir: &TempDir, upstream: &TestUpstream) -> Gateway {
    let path = config(dir);
    let base = format!("{}/base", upstream.url());
    let mut env = Vec::new();
    for provider in PROVIDERS {
        let [primary, secondary, _] = secrets(provider);
        let [current, next] = secret_vars(provider);
        env.push((current, primary));
        env.push((next, secondary));
    }
    let env: Vec<(&str, &str)> = env.iter().map(|(n, v)| (n.as_str(), *v)).collect();
    Gateway::start_with(&["--config", &path, "--upstream", &base], &env)
}

/// The signed deliveries, and the gateway with their secrets in front of an upstream.
async fn signed_and_started() -> (Vec<Delivery>, TestUpstream, Gateway, TempDir) {
    let deliveries = signed_deliveries();
    let upstream = TestUpstream::start().await;
    let dir = TempDir::new();
    let gw = start_gateway(&dir, &upstream);
    (deliveries, upstream, gw, dir)
}

/// `provider`'s delivery for `case`.
fn one_of<'a>(deliveries: &'a [Delivery], provider: &str, case: &str) -> &'a Delivery {
    deliveries
        .iter()
        .find(|d| d.provider == provider && d.case == case)
        .unwrap_or_else(|| panic!("no {provider} {case} delivery"))
}

#[track_caller]
fn assert_refused(resp: &Resp, what: &str) {
    assert_eq!(resp.status, 401, "{what}: {}", resp.text());
    assert_eq!(resp.problem_type(), PROBLEM_TYPE, "{what}");
    assert_eq!(
        resp.headers
            .get("www-authenticate")
            .map(|v| v.to_str().unwrap()),
        Some("Webhook-Signature"),
        "{what}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn sdk_signed_deliveries_run_once_and_forged_ones_never_reach_the_upstream() {
    let (deliveries, upstream, gw, _dir) = signed_and_started().await;

    let mut refused: BTreeMap<String, u64> = BTreeMap::new();
    let mut executed: BTreeMap<String, u64> = BTreeMap::new();
    let mut told = Vec::new();
    for delivery in &deliveries {
        let what = delivery.what();
        if delivery.accept && delivery.case == "valid" {
            // First a forger who knows the event's id (Stripe's and Slack's are in the body,
            // the others' in a header) but not the secret. Were it let through, its claim
            // would hold the real delivery for 3 s (the upstream answers it late) and the
            // real one would be answered with the forger's response.
            let forged = delivery.forged();
            let started = Instant::now();
            let forgery = forged
                .send_to(&gw, &prefix(&delivery.provider), &[("x-delay-ms", "3000")])
                .await;
            assert_refused(&forgery, &forged.what());
            *refused.entry(delivery.provider.clone()).or_default() += 1;
            let real = delivery.send(&gw).await;
            assert_eq!(real.status, 201, "{what}: {}", real.text());
            assert!(
                !real.replayed(),
                "{what}: the forger's response was replayed"
            );
            assert!(
                started.elapsed() < Duration::from_secs(2),
                "{what}: the real delivery was held by the forged one"
            );
            assert_eq!(upstream.times_seen(forged.body.as_bytes()), 0, "{what}");
            assert_eq!(upstream.times_seen(delivery.body.as_bytes()), 1, "{what}");
            told.push(format!(
                "{} forged with the real id → 401, then valid → 201",
                delivery.provider
            ));
        }
        let first = if delivery.case == "valid" {
            None
        } else {
            Some(delivery.send(&gw).await)
        };
        if delivery.accept {
            if let Some(first) = &first {
                assert_eq!(first.status, 201, "{what}: {}", first.text());
                assert!(!first.replayed(), "{what}");
            }
            // The redelivery is answered from the record.
            let again = delivery.send(&gw).await;
            assert_eq!(again.status, 201, "{what}: {}", again.text());
            assert!(again.replayed(), "{what}: a redelivery is replayed");
            assert_eq!(
                upstream.times_seen(delivery.body.as_bytes()),
                1,
                "{what}: ran once"
            );
            *executed.entry(delivery.provider.clone()).or_default() += 1;
            told.push(format!(
                "{} {} → 201, redelivery → 201 replayed",
                delivery.provider, delivery.case
            ));
        } else {
            let first = first.expect("a forged delivery");
            assert_refused(&first, &what);
            let detail = first.json()["detail"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            if delivery.case.ends_with("-timestamp") {
                assert!(detail.contains("tolerance"), "{what}: {detail}");
            }
            assert_eq!(
                upstream.times_seen(delivery.body.as_bytes()),
                0,
                "{what}: reached the upstream"
            );
            *refused.entry(delivery.provider.clone()).or_default() += 1;
            told.push(format!(
                "{} {} → 401 {detail}",
                delivery.provider, delivery.case
            ));
        }
    }
    // Every provider was sent its valid, rotated and forged deliveries.
    for provider in PROVIDERS {
        let timestamped = matches!(provider, "stripe" | "standard-webhooks" | "slack");
        let forged = if timestamped { 5 } else { 3 } + u64::from(provider == "twilio");
        let accepted = 2 + u64::from(provider == "twilio");
        assert_eq!(
            refused.get(provider),
            Some(&(forged + 1)),
            "{provider}: {told:#?}"
        );
        assert_eq!(
            executed.get(provider),
            Some(&accepted),
            "{provider}: {told:#?}"
        );
    }

    // Per route, and in total.
    let total: u64 = refused.values().sum();
    let mut lines: Vec<String> = PROVIDERS
        .iter()
        .flat_map(|provider| {
            [
                format!(
                    "idemgate_requests_total{{route=\"{provider}\",outcome=\"signature_rejected\"}} {}",
                    refused[*provider]
                ),
                format!(
                    "idemgate_requests_total{{route=\"{provider}\",outcome=\"executed\"}} {}",
                    executed[*provider]
                ),
                format!(
                    "idemgate_requests_total{{route=\"{provider}\",outcome=\"replayed\"}} {}",
                    executed[*provider]
                ),
            ]
        })
        .collect();
    lines.push(format!("idemgate_signature_rejections_total {total}"));
    let lines: Vec<&str> = lines.iter().map(String::as_str).collect();
    assert_metrics_show(&gw, &lines).await;

    // No secret is ever shown: not in /metrics, not in the logs.
    let metrics = admin_get(&gw, "/metrics", &[]).await.text();
    let logs = gw
        .logs_with("signature_rejected")
        .await
        .expect("refusals are logged");
    for provider in PROVIDERS {
        for secret in secrets(provider) {
            assert!(!metrics.contains(secret), "{provider}'s secret in /metrics");
            assert!(!logs.contains(secret), "{provider}'s secret in the logs");
        }
    }
    eprintln!("{told:#?}");
}

/// `signature_tolerance` widens the window, and a route naming one secret accepts only it.
#[tokio::test(flavor = "multi_thread")]
async fn a_routes_own_tolerance_and_secrets_apply() {
    let (deliveries, upstream, gw, _dir) = signed_and_started().await;
    let stripe = |case: &str| one_of(&deliveries, "stripe", case);
    let lenient = "/webhooks/stripe-lenient";
    // Ten minutes off is outside the default 5 minutes, inside this route's 15.
    for case in ["stale-timestamp", "future-timestamp"] {
        let delivery = stripe(case);
        let strict = delivery.send(&gw).await;
        assert_refused(&strict, &delivery.what());
        let first = delivery.send_to(&gw, lenient, &[]).await;
        assert_eq!(first.status, 201, "{}: {}", delivery.what(), first.text());
        let again = delivery.send_to(&gw, lenient, &[]).await;
        assert!(again.replayed(), "{}", delivery.what());
        assert_eq!(upstream.times_seen(delivery.body.as_bytes()), 1);
    }
    // This route names only the first secret: the second one's signature is refused here.
    let rotated = stripe("rotated-secret");
    assert_refused(&rotated.send_to(&gw, lenient, &[]).await, &rotated.what());
    assert_eq!(upstream.times_seen(rotated.body.as_bytes()), 0);
    assert_metrics_show(
        &gw,
        &[
            "idemgate_requests_total{route=\"stripe-lenient\",outcome=\"executed\"} 2",
            "idemgate_requests_total{route=\"stripe-lenient\",outcome=\"signature_rejected\"} 1",
            "idemgate_requests_total{route=\"stripe\",outcome=\"signature_rejected\"} 2",
            "idemgate_signature_rejections_total 3",
        ],
    )
    .await;
}

/// Twilio signs the public URL it requested: behind a gateway the route rebuilds it from
/// `public_url`, the rest of the path after the route's prefix and the query. The same
/// delivery sent to another path, or without its query, was not signed for it.
#[tokio::test(flavor = "multi_thread")]
async fn twilio_behind_a_public_url_with_a_prefix_and_a_query() {
    let (deliveries, upstream, gw, _dir) = signed_and_started().await;
    let twilio = |case: &str| one_of(&deliveries, "twilio", case).clone();
    let valid = twilio("valid");
    assert_eq!(valid.route_path, "/sms");
    assert!(valid.query.as_deref().is_some_and(|q| q.contains('&')));
    // Another query, none, or another path: each is a URL Twilio did not sign.
    for moved in [
        Delivery {
            query: Some("tenant=other&lang=en".into()),
            ..valid.clone()
        },
        Delivery {
            query: None,
            ..valid.clone()
        },
        Delivery {
            route_path: "/voice".into(),
            ..valid.clone()
        },
    ] {
        let target = moved.target(&prefix("twilio"));
        assert_refused(&moved.send(&gw).await, &target);
    }
    assert_eq!(upstream.times_seen(valid.body.as_bytes()), 0);
    // Where Twilio sent it: accepted, forwarded under the upstream's base path, replayed.
    let first = valid.send(&gw).await;
    assert_eq!(first.status, 201, "{}", first.text());
    assert_eq!(
        first.json()["path"],
        "/base/webhooks/twilio/sms",
        "forwarded as the client sent it, under the upstream's base path"
    );
    assert!(valid.send(&gw).await.replayed());
    // A JSON body is signed through the URL's bodySHA256.
    let json = twilio("json-valid");
    assert_eq!(json.send(&gw).await.status, 201);
    assert!(json.send(&gw).await.replayed());
    assert_eq!(upstream.times_seen(json.body.as_bytes()), 1);
    assert_metrics_show(
        &gw,
        &[
            "idemgate_requests_total{route=\"twilio\",outcome=\"signature_rejected\"} 3",
            "idemgate_requests_total{route=\"twilio\",outcome=\"executed\"} 2",
        ],
    )
    .await;
}
