//! The deliveries `sign.mjs` signs with the providers' own SDKs, as the tests read them.
//! Included with `#[path]` by `crates/idemgate/tests/webhook_signatures.rs` (through the
//! layer) and `crates/idemgate-gateway/tests/webhooks_e2e.rs` (through the binary).

#![allow(dead_code)]

use std::path::Path;
use std::process::{Command, Stdio};

/// One delivery `sign.mjs` printed.
#[derive(Clone, Debug, serde::Deserialize)]
pub(crate) struct Delivery {
    /// `github`, `stripe`, `shopify`, `standard-webhooks`, `slack` or `twilio`.
    pub(crate) provider: String,
    /// `valid`, `rotated-secret`, `wrong-secret`, `tampered-body`, `missing-signature`,
    /// `stale-timestamp`, `future-timestamp`, `json-valid`, `json-tampered-body`.
    pub(crate) case: String,
    /// Whether a route with the primary and secondary secrets accepts it.
    pub(crate) accept: bool,
    /// The delivery's id: its idempotency key.
    pub(crate) key: String,
    /// The part of the path after the route's prefix (Twilio's; empty for the others).
    pub(crate) route_path: String,
    pub(crate) query: Option<String>,
    pub(crate) headers: Vec<(String, String)>,
    pub(crate) body: String,
    /// What signed it.
    pub(crate) signed_by: String,
}

/// Runs `sign.mjs` in `senders` (this folder) with each provider's secrets (`[primary,
/// secondary, wrong]`) and Twilio's public URL. Panics, saying what to install, when node or
/// the packages are missing: a test that skipped itself would pass without checking anything.
pub(crate) fn signed_deliveries<'a>(
    senders: &str,
    twilio_public_url: &str,
    secrets: impl IntoIterator<Item = (&'a str, [&'a str; 3])>,
) -> Vec<Delivery> {
    let node = Command::new("node").arg("--version").output();
    assert!(
        node.is_ok_and(|out| out.status.success()),
        "`node` is not installed (Node.js 20 or newer); .ci/install-deps installs it"
    );
    assert!(
        Path::new(senders).join("node_modules").is_dir(),
        "{senders}/node_modules is missing, so the providers' SDKs cannot sign the test's \
         deliveries; run .ci/install-deps (or npm ci --prefix {senders})"
    );
    let mut config = serde_json::json!({ "twilio_public_url": twilio_public_url, "secrets": {} });
    for (provider, [primary, secondary, wrong]) in secrets {
        config["secrets"][provider] =
            serde_json::json!({ "primary": primary, "secondary": secondary, "wrong": wrong });
    }
    let mut node = Command::new("node")
        .arg("sign.mjs")
        .current_dir(senders)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("node starts");
    serde_json::to_writer(node.stdin.take().unwrap(), &config).unwrap();
    let out = node.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "sign.mjs failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("sign.mjs prints deliveries")
}
