//! Each provider's whole route setup.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use http::{HeaderName, Method, header};

use super::{GitHub, Secrets, SetupError, Shopify, Slack, StandardWebhooks, Stripe, Twilio};
use crate::policy::{Concurrent, Preset, RoutePolicy};

/// The webhook senders idemgate has presets and signature schemes for.
///
/// [`Provider::policy`] is the provider's route setup, with every part still overridable:
///
/// | provider | key | `require_key` | fingerprint headers | `concurrent` |
/// | --- | --- | --- | --- | --- |
/// | `github` | `X-GitHub-Delivery` | yes | `Content-Type`, `X-GitHub-Event` | wait 8 s (GitHub gives up at 10 s) |
/// | `stripe` | the body's `/id` (`evt_…`) | yes | `Content-Type` | wait 10 s |
/// | `shopify` | `X-Shopify-Webhook-Id` | yes | `Content-Type`, `X-Shopify-Topic` | wait 4 s (Shopify gives up at 5 s) |
/// | `standard-webhooks` | `webhook-id` | yes | `Content-Type` | wait 10 s |
/// | `slack` | the body's `/event_id` | no: Slack's `url_verification` and interactive payloads carry none | `Content-Type` | wait 2 s (Slack gives up, and retries, after 3 s) |
/// | `twilio` | `I-Twilio-Idempotency-Token` | yes | `Content-Type` | wait 10 s (Twilio gives up at 15 s) |
///
/// Every one takes `POST` only, has no `Authorization` scope (senders share no credential),
/// starts from the `webhook` preset (`2xx` kept, an unknown outcome runs again on the next
/// delivery) and keeps records 72 h, past every provider's automatic redelivery (Stripe's is
/// the longest, 3 days). A request waiting for the same delivery in flight answers before the
/// sender gives up on it. Signature headers (Stripe's timestamp changes on every retry) are
/// never fingerprinted. The route is named after the provider.
///
/// ```
/// use idemgate::webhook::Provider;
///
/// let policy: idemgate::RoutePolicy = "stripe".parse::<Provider>().unwrap().policy();
/// assert_eq!(policy.route_name(), "stripe");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Provider {
    /// GitHub ([`GitHub`]).
    GitHub,
    /// Stripe ([`Stripe`]).
    Stripe,
    /// Shopify ([`Shopify`]).
    Shopify,
    /// Standard Webhooks and Svix ([`StandardWebhooks`]).
    StandardWebhooks,
    /// Slack's Events API ([`Slack`]).
    Slack,
    /// Twilio ([`Twilio`]).
    Twilio,
}

impl Provider {
    /// Every provider.
    pub const ALL: [Provider; 6] = [
        Provider::GitHub,
        Provider::Stripe,
        Provider::Shopify,
        Provider::StandardWebhooks,
        Provider::Slack,
        Provider::Twilio,
    ];

    /// The provider's name in config (`github`, `stripe`, `shopify`, `standard-webhooks`,
    /// `slack`, `twilio`), also its route's name.
    pub fn as_str(self) -> &'static str {
        match self {
            Provider::GitHub => "github",
            Provider::Stripe => "stripe",
            Provider::Shopify => "shopify",
            Provider::StandardWebhooks => "standard-webhooks",
            Provider::Slack => "slack",
            Provider::Twilio => "twilio",
        }
    }

    /// The provider's route setup (the table above), without a verifier: add one with
    /// [`RoutePolicy::verify_with`], or start from a scheme's own `policy()`, or from
    /// [`Provider::verified_policy`].
    pub fn policy(self) -> RoutePolicy {
        let base = RoutePolicy::preset(Preset::Webhook)
            .name(self.as_str())
            .methods([Method::POST])
            .require_key(true)
            .scope_headers([]);
        let (base, extra_fingerprint, wait_secs) = match self {
            Provider::GitHub => (
                base.key_header(HeaderName::from_static("x-github-delivery")),
                Some(HeaderName::from_static("x-github-event")),
                8,
            ),
            Provider::Stripe => (base.key_json_pointer("/id"), None, 10),
            Provider::Shopify => (
                base.key_header(HeaderName::from_static("x-shopify-webhook-id")),
                Some(HeaderName::from_static("x-shopify-topic")),
                4,
            ),
            Provider::StandardWebhooks => (
                base.key_header(HeaderName::from_static("webhook-id")),
                None,
                10,
            ),
            Provider::Slack => (
                base.key_json_pointer("/event_id").require_key(false),
                None,
                2,
            ),
            Provider::Twilio => (
                base.key_header(HeaderName::from_static("i-twilio-idempotency-token")),
                None,
                10,
            ),
        };
        base.fingerprint_headers(std::iter::once(header::CONTENT_TYPE).chain(extra_fingerprint))
            .concurrent(Concurrent::Wait(Duration::from_secs(wait_secs)))
    }

    /// The provider's route setup verified by its scheme, as a config file would ask for it:
    /// the secrets, the `tolerance` for the schemes that sign a timestamp (Stripe, Standard
    /// Webhooks, Slack; the others ignore it), and the public URL Twilio needs (the others
    /// ignore it).
    ///
    /// ```
    /// use idemgate::webhook::{DEFAULT_TOLERANCE, Provider, Secrets, SetupError};
    ///
    /// let secrets = Secrets::new(["12345"]).unwrap();
    /// let twilio = Provider::Twilio.verified_policy(secrets.clone(), DEFAULT_TOLERANCE, None);
    /// assert!(matches!(twilio, Err(SetupError::InvalidPublicUrl { .. })));
    /// let github = Provider::GitHub.verified_policy(secrets, DEFAULT_TOLERANCE, None).unwrap();
    /// assert_eq!(github.route_name(), "github");
    /// ```
    pub fn verified_policy(
        self,
        secrets: Secrets,
        tolerance: Duration,
        public_url: Option<&str>,
    ) -> Result<RoutePolicy, SetupError> {
        Ok(match self {
            Provider::GitHub => GitHub::new(secrets).policy(),
            Provider::Stripe => Stripe::new(secrets).tolerance(tolerance).policy(),
            Provider::Shopify => Shopify::new(secrets).policy(),
            Provider::StandardWebhooks => StandardWebhooks::new(secrets)?
                .tolerance(tolerance)
                .policy(),
            Provider::Slack => Slack::new(secrets).tolerance(tolerance).policy(),
            Provider::Twilio => {
                let public_url = public_url.ok_or_else(|| SetupError::InvalidPublicUrl {
                    url: String::new(),
                    why: "Twilio signs the URL it requested, so its route needs a public URL",
                })?;
                Twilio::new(secrets, public_url)?.policy()
            }
        })
    }
}

impl fmt::Display for Provider {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Provider {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Provider::ALL
            .into_iter()
            .find(|provider| provider.as_str() == s)
            .ok_or_else(|| {
                format!(
                    "unknown provider {s:?}; expected one of \"github\", \"stripe\", \"shopify\", \
                     \"standard-webhooks\", \"slack\", \"twilio\""
                )
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::KeySource;

    #[test]
    fn every_provider_is_a_verified_post_only_unscoped_webhook_route() {
        for provider in Provider::ALL {
            assert_eq!(provider.as_str().parse::<Provider>(), Ok(provider));
            let policy = provider.policy();
            assert_eq!(policy.route_name(), provider.as_str());
            assert_eq!(policy.methods, [Method::POST]);
            assert!(policy.scope_headers.is_empty());
            assert!(policy.ttl >= Duration::from_secs(72 * 3600), "{provider}");
            assert_eq!(policy.store_statuses, Preset::Webhook.store_statuses());
            assert!(policy.fingerprint_headers.contains(&header::CONTENT_TYPE));
            assert!(policy.verifier.is_none());
            assert_eq!(
                policy.require_key,
                provider != Provider::Slack,
                "{provider}"
            );
            let secrets = Secrets::new(["d2hzZWNfdGVzdA=="]).unwrap();
            let verified = provider
                .verified_policy(
                    secrets,
                    Duration::from_secs(60),
                    Some("https://example.com/hooks"),
                )
                .unwrap();
            assert!(verified.verifier.is_some(), "{provider}");
        }
        assert!("gitlab".parse::<Provider>().is_err());
    }

    #[test]
    fn keys_come_from_where_each_provider_puts_its_delivery_id() {
        let key = |p: Provider| p.policy().key;
        let header = |name| KeySource::Header(HeaderName::from_static(name));
        assert_eq!(key(Provider::GitHub), header("x-github-delivery"));
        assert_eq!(key(Provider::Stripe), KeySource::JsonPointer("/id".into()));
        assert_eq!(key(Provider::Shopify), header("x-shopify-webhook-id"));
        assert_eq!(key(Provider::StandardWebhooks), header("webhook-id"));
        assert_eq!(
            key(Provider::Slack),
            KeySource::JsonPointer("/event_id".into())
        );
        assert_eq!(key(Provider::Twilio), header("i-twilio-idempotency-token"));
    }

    #[test]
    fn slack_retries_are_answered_within_its_three_seconds() {
        match Provider::Slack.policy().concurrent {
            Concurrent::Wait(limit) => assert!(limit < Duration::from_secs(3)),
            other => panic!("{other:?}"),
        }
    }
}
