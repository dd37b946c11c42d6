//! One try of one message: a `POST` to the handler through the proxy's own layer and
//! forwarder, and what its [`Outcome`](idemgate::Outcome) means for the entry ([`Verdict`]).

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::{HeaderName, HeaderValue, Method, Request, StatusCode, Uri};
use http_body_util::{BodyExt, Full};
use idemgate::policy::UnknownOutcome;
use idemgate::response::{Decision, UpstreamFailure};
use idemgate::{IdempotencyService, RoutePolicy};
use tower_service::Service;

use super::message::Message;
use crate::forward::Forwarder;
use crate::metrics::Metrics;

/// What one try settled about an entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The handler's response is kept (it ran now, or earlier and this is a replay):
    /// acknowledge the entry.
    Settled {
        /// Answered from the record; the handler did not run for this entry.
        replayed: bool,
    },
    /// The handler refused it with a status the route does not keep, or was not reached:
    /// try again after a backoff, and dead-letter it after the last try.
    Retry {
        /// The handler's status, when it answered.
        status: Option<StatusCode>,
    },
    /// Not this entry's fault, and nothing ran: the key is in flight elsewhere, or the store
    /// is unavailable. Try again later without counting a try.
    Wait {
        /// Why.
        why: &'static str,
    },
    /// Settled without a kept response: dead-letter the entry and acknowledge it.
    DeadLetter {
        /// The dead letter's `reason`.
        reason: &'static str,
        /// What happened.
        detail: String,
        /// Whether the handler may have run.
        ambiguous: bool,
        /// The handler's status, when it answered.
        status: Option<StatusCode>,
    },
}

/// What a response with `decision` and `status` (and the forwarder's `failure` mark) means
/// for the entry, under the route `policy`.
pub fn verdict(
    decision: Decision,
    status: StatusCode,
    failure: Option<UpstreamFailure>,
    policy: &RoutePolicy,
) -> Verdict {
    let dead = |reason, detail: &str, ambiguous| Verdict::DeadLetter {
        reason,
        detail: detail.to_owned(),
        ambiguous,
        status: Some(status),
    };
    match decision {
        Decision::Replayed | Decision::NotReplayable => Verdict::Settled { replayed: true },
        Decision::Executed | Decision::Unprotected | Decision::PassedThrough => {
            if policy.stored_statuses().contains(status) {
                Verdict::Settled { replayed: false }
            } else {
                Verdict::Retry {
                    status: Some(status),
                }
            }
        }
        Decision::UpstreamFailed => match (failure, policy.unknown_outcome_rule()) {
            (Some(UpstreamFailure::NotSent), _) | (_, UnknownOutcome::Retry) => {
                Verdict::Retry { status: None }
            }
            _ => dead(
                "ambiguous",
                "the handler gave no answer in time after the message was sent: it may have run; the record is ambiguous and the message is not sent again on its own",
                true,
            ),
        },
        Decision::OutcomeUnknown => dead(
            "ambiguous",
            "an earlier try's outcome is unknown (its handler gave no answer, or its consumer died while it ran): the record is ambiguous and the message is not sent again on its own",
            true,
        ),
        Decision::InFlight => Verdict::Wait {
            why: "the key is in flight elsewhere",
        },
        Decision::StoreUnavailable => Verdict::Wait {
            why: "the store is unavailable",
        },
        Decision::Mismatch => dead(
            "key_mismatch",
            "this key was used before with a different body: the message is not the event the key was first used for",
            false,
        ),
        Decision::InvalidKey | Decision::MissingKey => dead(
            "invalid_key",
            "the key is not a valid idempotency key (printable ASCII, at most 255 bytes)",
            false,
        ),
        Decision::RequestRejected => dead(
            "too_large",
            "the message is over the route's max_request_bytes",
            false,
        ),
        Decision::SignatureRejected => dead(
            "signature_rejected",
            "the handler's route verifies a webhook signature, which a queued message does not carry",
            false,
        ),
        // A decision added to the library later: nothing ran that is known to be kept.
        _ => Verdict::Wait {
            why: "an answer the consumer does not know",
        },
    }
}

/// Sends messages to one handler.
#[derive(Clone, Debug)]
pub struct Deliverer {
    service: IdempotencyService<Forwarder>,
    uri: Uri,
    key_header: HeaderName,
    policy: RoutePolicy,
    metrics: Arc<Metrics>,
}

impl Deliverer {
    /// `service` (the proxy's layer over a forwarder to the handler's server) sends to the
    /// path of `uri`, which falls on the route `policy`, with each message's key in
    /// `key_header` (the header that route reads keys from, `Idempotency-Key` unless it names
    /// another); each try's decision is counted in `metrics` as the proxy counts a request's.
    pub fn new(
        service: IdempotencyService<Forwarder>,
        uri: Uri,
        key_header: HeaderName,
        policy: RoutePolicy,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            service,
            uri,
            key_header,
            policy,
            metrics,
        }
    }

    /// Tries `message` once.
    pub async fn deliver(&self, message: &Message) -> Verdict {
        let Ok(key) = HeaderValue::try_from(message.key.as_str()) else {
            return Verdict::DeadLetter {
                reason: "invalid_key",
                detail: "the key cannot be sent in a header".into(),
                ambiguous: false,
                status: None,
            };
        };
        let mut request = Request::new(Full::new(message.body.clone()));
        *request.method_mut() = Method::POST;
        *request.uri_mut() = self.uri.clone();
        let headers = request.headers_mut();
        headers.insert(self.key_header.clone(), key);
        headers.insert(CONTENT_TYPE, HeaderValue::from_static(message.content_type));
        let mut service = self.service.clone();
        let Ok(response) = call(&mut service, request).await;
        let status = response.status();
        let failure = response.extensions().get::<UpstreamFailure>().copied();
        let (_, mut body) = response.into_parts();
        let decision = match body.outcome() {
            Some(outcome) => {
                self.metrics.count_request(&outcome.route, outcome.decision);
                outcome.decision
            }
            None => Decision::PassedThrough,
        };
        // Read to its end, kept or not: the connection goes back to the pool, and a response
        // the route keeps too large to buffer is completed as it is read.
        while let Some(frame) = body.frame().await {
            if frame.is_err() {
                break;
            }
        }
        verdict(decision, status, failure, &self.policy)
    }
}

async fn call<S>(service: &mut S, request: Request<Full<Bytes>>) -> Result<S::Response, Infallible>
where
    S: Service<Request<Full<Bytes>>, Error = Infallible>,
{
    std::future::poll_fn(|cx| service.poll_ready(cx)).await?;
    service.call(request).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(code: u16) -> StatusCode {
        StatusCode::from_u16(code).unwrap()
    }

    #[test]
    fn outcomes_map_to_what_becomes_of_the_entry() {
        let api = RoutePolicy::api();
        let webhook = RoutePolicy::webhook();
        let settled = Verdict::Settled { replayed: false };
        let retry = |code| Verdict::Retry {
            status: Some(s(code)),
        };
        assert_eq!(verdict(Decision::Executed, s(201), None, &api), settled);
        assert_eq!(verdict(Decision::Executed, s(404), None, &api), settled);
        assert_eq!(
            verdict(Decision::Executed, s(404), None, &webhook),
            retry(404)
        );
        assert_eq!(verdict(Decision::Executed, s(500), None, &api), retry(500));
        assert_eq!(
            verdict(Decision::Replayed, s(201), None, &api),
            Verdict::Settled { replayed: true }
        );
        let unknown = Some(UpstreamFailure::Unknown);
        let not_sent = Some(UpstreamFailure::NotSent);
        assert!(matches!(
            verdict(Decision::UpstreamFailed, s(504), unknown, &api),
            Verdict::DeadLetter {
                reason: "ambiguous",
                ambiguous: true,
                ..
            }
        ));
        assert_eq!(
            verdict(Decision::UpstreamFailed, s(504), unknown, &webhook),
            Verdict::Retry { status: None }
        );
        assert_eq!(
            verdict(Decision::UpstreamFailed, s(502), not_sent, &api),
            Verdict::Retry { status: None }
        );
        assert!(matches!(
            verdict(Decision::OutcomeUnknown, s(409), None, &api),
            Verdict::DeadLetter {
                ambiguous: true,
                ..
            }
        ));
        assert!(matches!(
            verdict(Decision::InFlight, s(409), None, &api),
            Verdict::Wait { .. }
        ));
        assert!(matches!(
            verdict(Decision::StoreUnavailable, s(503), None, &api),
            Verdict::Wait { .. }
        ));
        assert!(matches!(
            verdict(Decision::Mismatch, s(422), None, &api),
            Verdict::DeadLetter {
                reason: "key_mismatch",
                ambiguous: false,
                ..
            }
        ));
    }
}
