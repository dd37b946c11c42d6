//! [`IdempotencyService`]: the middleware that decides, for each request, whether to pass it
//! through, run it under a claim, or answer it from the store.

use std::convert::Infallible;
use std::future::Future;
use std::mem;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, Response, header};
use http_body::Body;
use http_body_util::BodyExt;
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;
use tower_service::Service;

use crate::ErrorChain;
use crate::body::{Capped, RequestBody, ResponseBody, read_capped};
use crate::fingerprint;
use crate::future::{Answer, BoxAnswer, ResponseFuture, Step};
use crate::key;
use crate::policy::{Concurrent, KeySource, OnStoreError, UnknownOutcome};
use crate::record::{Completion, FingerprintHash, Hash256, OwnerToken, RecordKey, StoredResponse};
use crate::response::{
    Decision, IDEMPOTENT_REPLAYED, Outcome, Problem, UpstreamFailure, into_replay,
    without_owned_headers,
};
use crate::settings::{LayerSettings, Route};
use crate::store::{BoxError, Claim, ClaimOptions, StoreError, Transition};

/// How soon a client told `409` should try again.
const IN_FLIGHT_RETRY_AFTER: Duration = Duration::from_secs(1);
/// Polling bounds while a `concurrent = "wait"` request waits for the first one.
const WAIT_POLL_MIN: Duration = Duration::from_millis(5);
const WAIT_POLL_MAX: Duration = Duration::from_millis(200);
/// Claims being undone at once, in this process: past it a claim whose answer was lost lapses
/// with its lease, so a long store outage under heavy load holds bounded memory.
const MAX_UNDOING: usize = 4096;
static UNDOING: AtomicUsize = AtomicUsize::new(0);
/// Frames of an over-limit response buffered between the upstream and a slow client.
const RELAY_FRAMES: usize = 8;

/// The middleware made by [`IdempotencyLayer`](crate::IdempotencyLayer).
///
/// ```
/// use std::sync::Arc;
/// use tower::{Layer, service_fn};
/// use idemgate::{IdempotencyLayer, MemoryStore};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let app = service_fn(|_: http::Request<String>| async {
///     Ok::<_, std::convert::Infallible>(http::Response::new(String::from("done")))
/// });
/// let service = IdempotencyLayer::new(Arc::new(MemoryStore::new())).layer(app);
/// let _app = service.into_inner();
/// # }
/// ```
#[derive(Clone)]
pub struct IdempotencyService<S> {
    inner: S,
    settings: Arc<LayerSettings>,
}

impl<S> IdempotencyService<S> {
    pub(crate) fn new(inner: S, settings: Arc<LayerSettings>) -> Self {
        Self { inner, settings }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The wrapped service, to change.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// The wrapped service, unwrapped.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: std::fmt::Debug> std::fmt::Debug for IdempotencyService<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyService")
            .field("inner", &self.inner)
            .field("store", &self.settings.store.backend())
            .finish_non_exhaustive()
    }
}

impl<S, ReqB, ResB> Service<Request<ReqB>> for IdempotencyService<S>
where
    S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqB: Body<Data = Bytes> + Send + Unpin + 'static,
    ResB: Body<Data = Bytes> + Send + Unpin + 'static,
    ResB::Error: Into<BoxError> + Send,
{
    type Response = Response<ResponseBody<ResB>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResB, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<ReqB>) -> Self::Future {
        // Call the service that was polled ready; leave its clone behind for the next call.
        let clone = self.inner.clone();
        let mut inner = mem::replace(&mut self.inner, clone);
        // Only idemgate says whether a response is a replay.
        crate::headers::remove(req.headers_mut(), &IDEMPOTENT_REPLAYED);

        let route = self.settings.route_for(req.uri().path()).clone();
        let policy = &route.policy;
        let outcome_extension = self.settings.outcome_extension;
        if !policy.methods.contains(req.method()) {
            return pass_through(&mut inner, req, route, outcome_extension);
        }
        let header_key = match &policy.key {
            // A route that verifies its sender reads and checks the body before it says a word
            // about the key (`handle_keyed`).
            _ if policy.verifier.is_some() => None,
            KeySource::Header(name) => match key::from_header(req.headers(), name) {
                Ok(Some(key)) => Some(key),
                Ok(None) if policy.require_key => {
                    let problem = Problem::missing_key(&policy.key);
                    return ResponseFuture::ready(
                        outcome_extension,
                        answer(problem, Decision::MissingKey, &route, None),
                    );
                }
                Ok(None) => return pass_through(&mut inner, req, route, outcome_extension),
                Err(why) => {
                    let problem = Problem::invalid_key(why);
                    return ResponseFuture::ready(
                        outcome_extension,
                        answer(problem, Decision::InvalidKey, &route, None),
                    );
                }
            },
            KeySource::JsonPointer(_) => None,
        };
        let settings = self.settings.clone();
        // Split here, so the future holds the head once rather than the request and its head.
        let (parts, body) = req.into_parts();
        ResponseFuture::keyed(
            outcome_extension,
            Box::pin(handle_keyed(
                settings, route, inner, parts, body, header_key,
            )),
            detach::<ResB, S::Error>,
        )
    }
}

/// Hands a request that holds its key, dropped by its caller half-way, to a task of its own:
/// a client that hangs up must not cancel an upstream call half-way, nor leave a claim
/// behind that never completes.
fn detach<B: Send + 'static, E: Send + 'static>(run: BoxAnswer<B, E>) {
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => {
            runtime.spawn(async move {
                let _ = run.await;
            });
        }
        // Only when the runtime itself is going away: the claim lapses with its lease.
        Err(_) => tracing::warn!("a claimed request was dropped outside a runtime"),
    }
}

fn pass_through<S, ReqB, ResB>(
    inner: &mut S,
    req: Request<ReqB>,
    route: Arc<Route>,
    outcome_extension: bool,
) -> ResponseFuture<S::Future, ResB, S::Error>
where
    S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>>,
{
    ResponseFuture::pass_through(
        outcome_extension,
        inner.call(req.map(RequestBody::streaming)),
        route.name.clone(),
    )
}

/// A keyed request answered before it has a record.
fn early<B, E>(problem: Problem, decision: Decision, route: &Route) -> Step<B, E> {
    Step::Answer(Ok(answer(problem, decision, route, None)))
}

/// A response made here (problem or replay), tagged with what was decided.
fn answer<B>(
    problem: Problem,
    decision: Decision,
    route: &Route,
    record: Option<RecordKey>,
) -> Response<ResponseBody<B>> {
    tag(
        problem.into_response().map(ResponseBody::full),
        decision,
        route,
        record,
    )
}

fn tag<B>(
    mut response: Response<ResponseBody<B>>,
    decision: Decision,
    route: &Route,
    record: Option<RecordKey>,
) -> Response<ResponseBody<B>> {
    response.body_mut().set_outcome(Outcome {
        decision,
        route: route.name.clone(),
        record,
    });
    response
}

/// Reads a keyed request's body, finds its key and fingerprint, claims it
/// ([`Keyed::claim`]) and answers or runs it ([`Keyed::answer`]).
///
/// A plain function returning an `async move` block, not an `async fn`: an `async fn` keeps
/// each argument in its state for its whole life and copies it into a local of its own as it
/// starts, so the request head (over 200 bytes) would be held twice and copied once more, on
/// every keyed request. For the same reason the claim is a small future borrowing the
/// [`Keyed`], and the request's head and body stay here until they are needed.
#[allow(
    clippy::manual_async_fn,
    reason = "an async fn would hold its arguments twice (above)"
)]
fn handle_keyed<S, ReqB, ResB>(
    settings: Arc<LayerSettings>,
    route: Arc<Route>,
    inner: S,
    parts: http::request::Parts,
    body: ReqB,
    header_key: Option<String>,
) -> impl Future<Output = Step<ResB, S::Error>>
where
    S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqB: Body<Data = Bytes> + Send + Unpin + 'static,
    ResB: Body<Data = Bytes> + Send + Unpin + 'static,
    ResB::Error: Into<BoxError> + Send,
{
    async move {
        let policy = &route.policy;
        let body = match read_capped(body, policy.max_request_bytes).await {
            Ok(body) => body,
            Err(Capped::Over { .. }) => {
                let problem = Problem::request_too_large(policy.max_request_bytes);
                return early(problem, Decision::RequestRejected, &route);
            }
            Err(Capped::Failed(_)) => {
                let problem = Problem::request_body_error();
                return early(problem, Decision::RequestRejected, &route);
            }
        };
        if let Some(verifier) = &policy.verifier
            && let Err(why) = verifier.check(&route.prefix, &parts, &body)
        {
            settings.stats.count_signature_rejected();
            tracing::info!(route = %route.name, reason = %why, "signature refused; nothing claimed or forwarded");
            let problem = Problem::invalid_signature(&why);
            return early(problem, Decision::SignatureRejected, &route);
        }
        let key = match key_of(header_key, &policy.key, &parts.headers, &body) {
            Ok(Some(key)) => key,
            Ok(None) if policy.require_key => {
                let problem = Problem::missing_key(&policy.key);
                return early(problem, Decision::MissingKey, &route);
            }
            Ok(None) => {
                let req = Request::from_parts(parts, RequestBody::buffered(body));
                return Step::Answer(call(inner, req).await.map(|response| {
                    tag(
                        response.map(ResponseBody::inner),
                        Decision::PassedThrough,
                        &route,
                        None,
                    )
                }));
            }
            Err(why) => return early(Problem::invalid_key(why), Decision::InvalidKey, &route),
        };
        let record =
            fingerprint::record_key(&route.name, &policy.scope_headers, &parts.headers, &key);
        let fingerprint = fingerprint::fingerprint(
            &parts.method,
            &parts.uri,
            &parts.headers,
            &policy.fingerprint_headers,
            &body,
        );
        let keyed = Keyed {
            settings,
            route,
            record,
            fingerprint,
        };
        let claim = keyed.claim().await;
        keyed.answer(claim, inner, parts, body)
    }
}

/// The request's key: the one `call` read from its header, or else the one its route's key
/// source finds in the body or (on a route that verifies its sender, where `call` left it for
/// after the check) in the header.
fn key_of(
    header_key: Option<String>,
    source: &KeySource,
    headers: &http::HeaderMap,
    body: &Bytes,
) -> Result<Option<String>, key::KeyError> {
    match (header_key, source) {
        (Some(key), _) => Ok(Some(key)),
        (None, KeySource::JsonPointer(pointer)) => key::from_json_body(body, pointer),
        (None, KeySource::Header(name)) => key::from_header(headers, name),
    }
}

/// The life of one keyed request after its key and fingerprint are known.
#[derive(Clone)]
struct Keyed {
    settings: Arc<LayerSettings>,
    route: Arc<Route>,
    record: RecordKey,
    fingerprint: FingerprintHash,
}

impl Keyed {
    /// Claims the key, waiting for a request in flight if the route says so. Until the store
    /// has answered, a dropped claim is undone (see [`UndoClaim`]).
    async fn claim(&self) -> Result<Claim, StoreError> {
        let policy = &self.route.policy;
        let options = ClaimOptions {
            lease: policy.lease,
            ttl: policy.ttl,
            on_lapse: policy.unknown_outcome,
        };
        let wait_until = match policy.concurrent {
            Concurrent::Wait(limit) => Some(tokio::time::Instant::now() + limit),
            Concurrent::Reject => None,
        };
        let mut poll = WAIT_POLL_MIN;
        let token = OwnerToken::generate();
        loop {
            // Until the store has answered, a claim may have landed that nobody will run:
            // dropped armed (the store failed or timed out, or the client hung up), the guard
            // undoes it.
            let undo = UndoClaim {
                settings: &self.settings,
                record: self.record,
                token,
                lease: policy.lease,
                on_lapse: policy.unknown_outcome,
            };
            let store = &self.settings.store;
            let claim = self
                .store_call(store.claim(&self.record, &self.fingerprint, token, &options))
                .await;
            if claim.is_ok() {
                undo.disarm();
            }
            match (claim, wait_until) {
                // The last look is at the deadline itself.
                (Ok(Claim::InFlight { .. }), Some(end)) if tokio::time::Instant::now() < end => {
                    let next = tokio::time::Instant::now() + poll;
                    tokio::time::sleep_until(next.min(end)).await;
                    poll = (poll * 2).min(WAIT_POLL_MAX);
                }
                (other, _) => return other,
            }
        }
    }

    /// Answers from what the store said, in the caller's task: a replay or a refusal costs no
    /// task of its own. An acquired claim's work is returned as a [`Step::Run`]: it goes on in
    /// the caller's task, and in a task of its own if the caller goes away, because from then
    /// on it must finish (see [`ResponseFuture::keyed`]). Not async: nothing can come between
    /// the claim and handing back its work. The request is handed over as its head and read
    /// body, and put back together only if it runs: a replay or a refusal never builds it.
    fn answer<S, ReqB, ResB>(
        self,
        claim: Result<Claim, StoreError>,
        inner: S,
        parts: http::request::Parts,
        body: Bytes,
    ) -> Step<ResB, S::Error>
    where
        S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>> + Send + 'static,
        S::Future: Send + 'static,
        S::Error: Send + 'static,
        ReqB: Body<Data = Bytes> + Send + Unpin + 'static,
        ResB: Body<Data = Bytes> + Send + Unpin + 'static,
        ResB::Error: Into<BoxError> + Send,
    {
        let answer = match claim {
            Ok(Claim::Acquired(token)) => {
                // The inner service is called here, so the work holds only its future (the
                // proxy's is boxed), not the service and the request it was made from.
                let called = call(
                    inner,
                    Request::from_parts(parts, RequestBody::buffered(body)),
                );
                return Step::Run(Box::pin(async move {
                    // Built in place and lent out: the work future (large) is not moved into
                    // each future that awaits it.
                    let work = std::pin::pin!(self.execute(called, token));
                    self.under_lease(token, work).await
                }));
            }
            Ok(Claim::Completed(completion)) => self.completed(completion),
            Ok(Claim::InFlight { .. }) => self.problem(
                Problem::request_in_flight(IN_FLIGHT_RETRY_AFTER),
                Decision::InFlight,
            ),
            Ok(Claim::Ambiguous) => {
                self.problem(Problem::outcome_unknown(), Decision::OutcomeUnknown)
            }
            Ok(Claim::Mismatch) => self.problem(
                Problem::key_mismatch(self.route.policy.mismatch_status),
                Decision::Mismatch,
            ),
            Err(error) => match self.settings.on_store_error {
                OnStoreError::Reject => {
                    tracing::warn!(record = %self.record.short(), error = %ErrorChain(&error), "store failed; request refused");
                    self.problem(
                        Problem::store_unavailable(self.settings.store_timeout),
                        Decision::StoreUnavailable,
                    )
                }
                OnStoreError::Pass => {
                    self.settings.stats.count_unprotected();
                    tracing::warn!(record = %self.record.short(), error = %ErrorChain(&error), "store failed; request forwarded without protection");
                    // Like a claimed request, it runs to its end even if the client leaves.
                    return Step::Run(Box::pin(async move {
                        let req = Request::from_parts(parts, RequestBody::buffered(body));
                        call(inner, req).await.map(|response| {
                            self.tag(response.map(ResponseBody::inner), Decision::Unprotected)
                        })
                    }));
                }
            },
        };
        Step::Answer(Ok(answer))
    }

    /// Runs `work` while renewing the claim `token`'s lease beside it, counted as in flight.
    async fn under_lease<T>(
        &self,
        token: OwnerToken,
        work: Pin<&mut impl Future<Output = T>>,
    ) -> T {
        let _in_flight = self.settings.stats.enter();
        tokio::select! {
            biased;
            out = work => out,
            never = self.keep_lease(token) => match never {},
        }
    }

    /// Awaits the inner service's answer (`called`) under the claim `token`, keeps what the
    /// route says to keep, and answers.
    ///
    /// Not an `async fn`, for the reason given at [`handle_keyed`]; what follows the answer is
    /// a future of its own ([`Keyed::settle`]), so the response is not held beside the waits
    /// of the failure paths.
    #[allow(
        clippy::manual_async_fn,
        reason = "an async fn would hold its arguments twice (see handle_keyed)"
    )]
    fn execute<F, ResB, E>(
        &self,
        called: Called<F>,
        token: OwnerToken,
    ) -> impl Future<Output = Answer<ResB, E>>
    where
        F: Future<Output = Result<Response<ResB>, E>>,
        ResB: Body<Data = Bytes> + Send + Unpin + 'static,
        ResB::Error: Into<BoxError> + Send,
    {
        async move {
            let deadline = self
                .settings
                .upstream_timeout
                .map(|after| tokio::time::Instant::now() + after);
            let error = match with_deadline(deadline, called).await {
                Some(Ok(response)) => {
                    let (parts, body) = response.into_parts();
                    return self.settle(parts, body, deadline, token).await;
                }
                Some(Err(error)) => Some(error),
                None => None,
            };
            match error {
                Some(error) => {
                    self.outcome_unknown(token).await;
                    Err(error)
                }
                None => Ok(self.timed_out(token).await),
            }
        }
    }

    /// Settles the claim `token` by the inner service's response: keeps it if the route says
    /// to (reading its body by `deadline`), or releases the key or applies `unknown_outcome`;
    /// then answers.
    #[allow(
        clippy::manual_async_fn,
        reason = "an async fn would hold its arguments twice (see handle_keyed)"
    )]
    fn settle<ResB, E>(
        &self,
        parts: http::response::Parts,
        body: ResB,
        deadline: Option<tokio::time::Instant>,
        token: OwnerToken,
    ) -> impl Future<Output = Answer<ResB, E>>
    where
        ResB: Body<Data = Bytes> + Send + Unpin + 'static,
        ResB::Error: Into<BoxError> + Send,
    {
        async move {
            let policy = &self.route.policy;
            if let Some(&failure) = parts.extensions.get::<UpstreamFailure>() {
                match failure {
                    UpstreamFailure::NotSent => self.release(token).await,
                    UpstreamFailure::Unknown => self.outcome_unknown(token).await,
                }
                let response = Response::from_parts(parts, ResponseBody::inner(body));
                return Ok(self.tag(response, Decision::UpstreamFailed));
            }
            if !policy.store_statuses.contains(parts.status) {
                // Not kept, so nothing to buffer: release first so the retry may run, then stream.
                self.release(token).await;
                let response = Response::from_parts(parts, ResponseBody::inner(body));
                return Ok(self.tag(response, Decision::Executed));
            }

            let Some(body) =
                with_deadline(deadline, read_capped(body, policy.max_response_bytes)).await
            else {
                return Ok(self.timed_out(token).await);
            };
            match body {
                Ok(body) => {
                    let stored = StoredResponse {
                        status: parts.status,
                        headers: self.storable(&parts.headers),
                        body: body.clone(),
                    };
                    self.complete(token, Completion::Response(stored)).await;
                    let response = Response::from_parts(parts, ResponseBody::full(body));
                    Ok(self.tag(response, Decision::Executed))
                }
                Err(Capped::Failed(error)) => {
                    let error: BoxError = error.into();
                    tracing::warn!(record = %self.record.short(), %error, "upstream response broke off");
                    self.outcome_unknown(token).await;
                    Ok(self.problem(Problem::response_interrupted(), Decision::OutcomeUnknown))
                }
                Err(Capped::Over { head, rest }) => {
                    Ok(self.relay_too_large(token, parts, head, rest))
                }
            }
        }
    }

    /// The inner service did not answer (or finish a response the route keeps) within the
    /// upstream timeout: its call is dropped and the outcome is unknown.
    async fn timed_out<B>(&self, token: OwnerToken) -> Response<ResponseBody<B>> {
        // Only a run with a bound can time out.
        let after = self.settings.upstream_timeout.unwrap_or_default();
        tracing::warn!(record = %self.record.short(), after_ms = after.as_millis(), "inner service did not answer in time; call dropped");
        self.outcome_unknown(token).await;
        self.problem(Problem::upstream_timeout(after), Decision::UpstreamFailed)
    }

    /// Delivers a response over `max_response_bytes` whole while keeping only its status and
    /// digest, so a retry is told it ran rather than running it again. The rest of the body
    /// is read by a task of its own, under the lease, which then completes the record.
    fn relay_too_large<ResB>(
        &self,
        token: OwnerToken,
        parts: http::response::Parts,
        head: Bytes,
        rest: ResB,
    ) -> Response<ResponseBody<ResB>>
    where
        ResB: Body<Data = Bytes> + Send + Unpin + 'static,
        ResB::Error: Into<BoxError> + Send,
    {
        let status = parts.status;
        let (tx, rx) = mpsc::channel(RELAY_FRAMES);
        let relay = self.clone();
        let mut digest = Sha256::new();
        digest.update(&head);
        let read = head.len() as u64;
        tokio::spawn(async move {
            let work = std::pin::pin!(relay.relay_rest(token, status, (digest, read), rest, tx));
            relay.under_lease(token, work).await;
        });
        let response = Response::from_parts(parts, ResponseBody::relayed(head, rx));
        self.tag(response, Decision::Executed)
    }

    /// Reads the rest of a relayed body to its end, sending it to the client while the client
    /// stays, and completes the record with the body's length and digest.
    async fn relay_rest<ResB>(
        &self,
        token: OwnerToken,
        status: http::StatusCode,
        (mut digest, mut len): (Sha256, u64),
        mut rest: ResB,
        tx: mpsc::Sender<Result<Bytes, BoxError>>,
    ) where
        ResB: Body<Data = Bytes> + Unpin,
        ResB::Error: Into<BoxError> + Send,
    {
        // A client that hung up stops receiving, but the body is still read to its end so the
        // record can be completed.
        let mut client = Some(tx);
        while let Some(frame) = rest.frame().await {
            match frame {
                Ok(frame) => {
                    let Ok(data) = frame.into_data() else {
                        continue;
                    };
                    digest.update(&data);
                    len += data.len() as u64;
                    if let Some(tx) = &client
                        && tx.send(Ok(data)).await.is_err()
                    {
                        client = None;
                    }
                }
                Err(error) => {
                    let error: BoxError = error.into();
                    tracing::warn!(record = %self.record.short(), %error, "upstream response broke off");
                    if let Some(tx) = client {
                        let _ = tx.send(Err(error)).await;
                    }
                    self.outcome_unknown(token).await;
                    return;
                }
            }
        }
        let completion = Completion::TooLarge {
            status,
            body_digest: Hash256(digest.finalize().into()),
            body_len: len,
        };
        self.complete(token, completion).await;
    }

    /// Renews the lease at a third of its length; never ends (dropped when the work is done).
    async fn keep_lease(&self, token: OwnerToken) -> Infallible {
        let lease = self.route.policy.lease;
        let record = &self.record;
        loop {
            tokio::time::sleep(lease / 3).await;
            let renewal = self.store_call(self.settings.store.renew(record, token, lease));
            match renewal.await {
                Ok(Transition::Applied) => {}
                Ok(Transition::Fenced) => {
                    tracing::warn!(record = %record.short(), "lease lost to another owner while the request ran");
                    break;
                }
                // A timeout is a `StoreError::Timeout`, counted like any failure.
                Err(error) => {
                    tracing::warn!(record = %record.short(), error = %ErrorChain(&error), "lease renewal failed");
                }
            }
        }
        std::future::pending().await
    }

    /// The store's call is made here, not in the returned future: the completion (a response's
    /// head, over 100 bytes) goes straight into it instead of being held and moved again.
    fn complete(&self, token: OwnerToken, completion: Completion) -> impl Future<Output = ()> {
        let ttl = self.route.policy.ttl;
        let call = self
            .settings
            .store
            .complete(&self.record, token, completion, ttl);
        async move {
            let result = self.store_call(call).await;
            self.after_transition("complete", result);
        }
    }

    async fn release(&self, token: OwnerToken) {
        let result = self
            .store_call(self.settings.store.release(&self.record, token))
            .await;
        self.after_transition("release", result);
    }

    /// Applies the route's `unknown_outcome` to the caller's record.
    async fn outcome_unknown(&self, token: OwnerToken) {
        match self.route.policy.unknown_outcome {
            UnknownOutcome::Ambiguous => {
                let ttl = self.route.policy.ttl;
                let result = self
                    .store_call(self.settings.store.mark_ambiguous(&self.record, token, ttl))
                    .await;
                self.after_transition("mark ambiguous", result);
            }
            UnknownOutcome::Retry => self.release(token).await,
        }
    }

    fn after_transition(&self, what: &'static str, result: Result<Transition, StoreError>) {
        match result {
            Ok(Transition::Applied) => {}
            Ok(Transition::Fenced) => {
                self.settings.stats.count_fenced();
                tracing::warn!(record = %self.record.short(), "{what} refused: the record has a newer owner");
            }
            // The record stays in flight; its lease lapses into the route's unknown outcome.
            Err(error) => {
                tracing::error!(record = %self.record.short(), error = %ErrorChain(&error), "{what} failed")
            }
        }
    }

    /// Runs a store call under the store timeout, counting failures.
    async fn store_call<T>(
        &self,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let timeout = self.settings.store_timeout;
        let result = match StoreCallTimeout::new(call, timeout).await {
            Some(result) => result,
            None => Err(StoreError::Timeout {
                backend: self.settings.store.backend(),
                after: timeout,
            }),
        };
        if result.is_err() {
            self.settings.stats.count_store_error();
        }
        result
    }

    /// The headers kept for replay: end-to-end ones only, and no `Set-Cookie` unless the route
    /// says so (one client's session must not be handed to another replaying the key).
    fn storable(&self, headers: &HeaderMap) -> HeaderMap {
        let mut kept = headers.clone();
        crate::headers::strip_hop_by_hop(&mut kept);
        if !self.route.policy.store_set_cookie {
            kept.remove(header::SET_COOKIE);
        }
        kept
    }

    fn tag<B>(
        &self,
        response: Response<ResponseBody<B>>,
        decision: Decision,
    ) -> Response<ResponseBody<B>> {
        tag(response, decision, &self.route, Some(self.record))
    }

    fn made<B>(&self, response: Response<Bytes>, decision: Decision) -> Response<ResponseBody<B>> {
        self.tag(response.map(ResponseBody::full), decision)
    }

    /// The answer to a retry of a completed request: the stored response, or a problem if it
    /// was too large to keep. A completion held by this caller alone (stores that decode each
    /// record hand out a fresh one) becomes the response as it is, with no copy.
    fn completed<B>(&self, completion: Arc<Completion>) -> Response<ResponseBody<B>> {
        match Arc::try_unwrap(completion).unwrap_or_else(|settings| Completion::clone(&settings)) {
            Completion::Response(stored) => self.made(into_replay(stored), Decision::Replayed),
            Completion::TooLarge {
                status, body_len, ..
            } => self.problem(
                Problem::response_not_replayable(status, body_len),
                Decision::NotReplayable,
            ),
        }
    }

    fn problem<B>(&self, problem: Problem, decision: Decision) -> Response<ResponseBody<B>> {
        answer(problem, decision, &self.route, Some(self.record))
    }
}

/// Calls a service that was already polled ready by the caller of the middleware, and removes
/// the headers only idemgate may set from its response. The service is dropped once called
/// (as tower's `Oneshot` does): its future owns what it needs.
fn call<S, R, B>(mut inner: S, req: R) -> Called<S::Future>
where
    S: Service<R, Response = Response<B>>,
{
    Called {
        future: inner.call(req),
    }
}

pin_project_lite::pin_project! {
    /// The future of [`call`]. Plain futures here and in [`WithDeadline`], not `async fn`s: an
    /// `async fn` would hold the service and the request (over 300 bytes) in its state beside
    /// the future it awaits, and `with_deadline`'s would hold all of that again, on every keyed
    /// request.
    struct Called<F> {
        #[pin]
        future: F,
    }
}

impl<F, B, E> Future for Called<F>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.project()
            .future
            .poll(cx)
            .map(|out| out.map(without_owned_headers))
    }
}

/// Runs `work` until `deadline`, if there is one; `None` when the time ran out first.
fn with_deadline<F: Future>(deadline: Option<tokio::time::Instant>, work: F) -> WithDeadline<F> {
    match deadline {
        Some(deadline) => WithDeadline::Timed {
            work: tokio::time::timeout_at(deadline, work),
        },
        None => WithDeadline::Unbounded { work },
    }
}

pin_project_lite::pin_project! {
    /// The future of [`with_deadline`].
    #[project = WithDeadlineProj]
    enum WithDeadline<F> {
        Unbounded { #[pin] work: F },
        Timed { #[pin] work: tokio::time::Timeout<F> },
    }
}

impl<F: Future> Future for WithDeadline<F> {
    type Output = Option<F::Output>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project() {
            WithDeadlineProj::Unbounded { work } => work.poll(cx).map(Some),
            WithDeadlineProj::Timed { work } => work.poll(cx).map(Result::ok),
        }
    }
}

pin_project_lite::pin_project! {
    /// A store call bounded by the store timeout; `None` when the time ran out. The deadline
    /// is set only if the call does not finish at its first poll, so a store that answers at
    /// once (the memory store) costs no timer and no clock read.
    struct StoreCallTimeout<F> {
        #[pin]
        call: F,
        timeout: Duration,
        #[pin]
        deadline: Option<tokio::time::Sleep>,
    }
}

impl<F> StoreCallTimeout<F> {
    fn new(call: F, timeout: Duration) -> Self {
        Self {
            call,
            timeout,
            deadline: None,
        }
    }
}

impl<F: Future> Future for StoreCallTimeout<F> {
    type Output = Option<F::Output>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        if let Poll::Ready(out) = this.call.poll(cx) {
            return Poll::Ready(Some(out));
        }
        if this.deadline.is_none() {
            this.deadline.set(Some(tokio::time::sleep(*this.timeout)));
        }
        match this.deadline.as_pin_mut().map(|deadline| deadline.poll(cx)) {
            Some(Poll::Ready(())) => Poll::Ready(None),
            _ => Poll::Pending,
        }
    }
}

/// A claim whose answer was lost (a timeout, a dropped connection, a client that hung up
/// while it was on its way) may still have landed in the store, holding the key for a request
/// that never ran. Dropped without [`disarm`](Self::disarm), this releases it with the token
/// it would carry: fenced, so it removes that claim and nothing else. Stores apply one
/// caller's commands in order, so the release lands after a late claim.
///
/// A store that lost one answer may be failing: the release is tried again, an attempt
/// starting every store timeout, at least twice and then for as long as the claim's lease
/// could hold the key. Given up earlier, a claim under `unknown_outcome = "ambiguous"` would
/// lapse into an ambiguous record, and every retry of a request that never ran would be told
/// its outcome is unknown. (A release after the lease is still safe: it is fenced, and
/// removes the claim only if no other claim has taken the record over.)
struct UndoClaim<'a> {
    settings: &'a LayerSettings,
    record: RecordKey,
    token: OwnerToken,
    lease: Duration,
    /// What the claim turns into if it landed and is never undone.
    on_lapse: UnknownOutcome,
}

impl UndoClaim<'_> {
    /// The store answered: there is nothing to undo.
    fn disarm(self) {
        mem::forget(self);
    }
}

impl Drop for UndoClaim<'_> {
    fn drop(&mut self) {
        // Without a runtime (the caller dropped outside one) the claim lapses with its lease.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let Some(undoing) = Undoing::start() else {
            tracing::warn!(record = %self.record.short(), "too many claims being undone; this one lapses with its lease");
            return;
        };
        let store = Arc::clone(&self.settings.store);
        let (record, token, timeout) = (self.record, self.token, self.settings.store_timeout);
        let (lease, on_lapse) = (self.lease, self.on_lapse);
        // The claim landed, if it did, before now: its lease ends by then.
        let lease_end = tokio::time::Instant::now() + lease;
        runtime.spawn(async move {
            let _undoing = undoing;
            let mut attempts = 0u32;
            let failure = loop {
                attempts += 1;
                let started = tokio::time::Instant::now();
                let failure = match tokio::time::timeout(timeout, store.release(&record, token))
                    .await
                {
                    Ok(Ok(Transition::Applied)) => {
                        tracing::info!(record = %record.short(), attempts, "undid a claim whose answer was lost: the next retry runs the request");
                        return;
                    }
                    Ok(Ok(Transition::Fenced)) => {
                        tracing::debug!(record = %record.short(), attempts, "a claim whose answer was lost had not landed (or was taken over): nothing to undo");
                        return;
                    }
                    Ok(Err(error)) => ErrorChain(&error).to_string(),
                    Err(_) => format!("no answer within {} ms", timeout.as_millis()),
                };
                // Attempts start a store timeout apart; a second one is always made, more only
                // while the lease could still hold the key.
                let next = started + timeout;
                if attempts >= 2 && next >= lease_end {
                    break failure;
                }
                tokio::time::sleep_until(next).await;
            };
            let then = match on_lapse {
                UnknownOutcome::Ambiguous => {
                    "turns ambiguous: retries are answered 502 outcome-unknown until an operator deletes the record or it expires"
                }
                UnknownOutcome::Retry => "is taken over by the next retry, which runs the request",
            };
            tracing::warn!(
                record = %record.short(),
                attempts,
                last_error = %failure,
                lease_ms = lease.as_millis() as u64,
                "could not undo a claim whose answer was lost; if it landed, it holds the key until its lease ends and then {then}",
            );
        });
    }
}

/// One claim being undone, counted against [`MAX_UNDOING`] until dropped (also when its task
/// is dropped with a runtime that shuts down).
struct Undoing;

impl Undoing {
    fn start() -> Option<Self> {
        if UNDOING.fetch_add(1, Ordering::Relaxed) < MAX_UNDOING {
            Some(Undoing)
        } else {
            UNDOING.fetch_sub(1, Ordering::Relaxed);
            None
        }
    }
}

impl Drop for Undoing {
    fn drop(&mut self) {
        UNDOING.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use async_trait::async_trait;
    use http_body_util::Full;
    use tower::{Layer, ServiceExt, service_fn};

    use super::*;
    use crate::record::{Completion, Record};
    use crate::store::{MemoryStore, Store};
    use crate::{IdempotencyLayer, policy::RoutePolicy};

    /// A memory store behind one slow, ordered connection, like a network store: each command
    /// takes `delay` to apply, commands apply in the order they were sent, and a command that
    /// was sent applies even if its caller stops waiting for the answer.
    struct SlowConnection {
        inner: MemoryStore,
        delay: Duration,
        connection: Arc<tokio::sync::Mutex<()>>,
        /// Claims the inner store has applied.
        landed: Arc<AtomicUsize>,
    }

    impl SlowConnection {
        fn new(delay: Duration) -> Arc<Self> {
            Arc::new(Self {
                inner: MemoryStore::default(),
                delay,
                connection: Arc::default(),
                landed: Arc::default(),
            })
        }

        /// Sends `command` down the connection; it applies after the commands sent before it.
        async fn send<T: Send + 'static>(
            &self,
            command: impl Future<Output = T> + Send + 'static,
        ) -> Result<T, StoreError> {
            let turn = Arc::clone(&self.connection).lock_owned().await;
            let delay = self.delay;
            let applied = tokio::spawn(async move {
                let _turn = turn;
                tokio::time::sleep(delay).await;
                command.await
            });
            applied.await.map_err(|error| StoreError::Unavailable {
                backend: "slow",
                source: Box::new(error),
            })
        }
    }

    #[async_trait]
    impl Store for SlowConnection {
        async fn claim(
            &self,
            key: &RecordKey,
            fingerprint: &FingerprintHash,
            token: OwnerToken,
            options: &ClaimOptions,
        ) -> Result<Claim, StoreError> {
            let (inner, landed) = (self.inner.clone(), Arc::clone(&self.landed));
            let (key, fingerprint, options) = (*key, *fingerprint, *options);
            self.send(async move {
                let claim = inner.claim(&key, &fingerprint, token, &options).await;
                landed.fetch_add(1, Ordering::SeqCst);
                claim
            })
            .await?
        }
        async fn complete(
            &self,
            key: &RecordKey,
            token: OwnerToken,
            completion: Completion,
            ttl: Duration,
        ) -> Result<Transition, StoreError> {
            self.inner.complete(key, token, completion, ttl).await
        }
        async fn release(
            &self,
            key: &RecordKey,
            token: OwnerToken,
        ) -> Result<Transition, StoreError> {
            let (inner, key) = (self.inner.clone(), *key);
            self.send(async move { inner.release(&key, token).await })
                .await?
        }
        async fn renew(
            &self,
            key: &RecordKey,
            token: OwnerToken,
            lease: Duration,
        ) -> Result<Transition, StoreError> {
            self.inner.renew(key, token, lease).await
        }
        async fn mark_ambiguous(
            &self,
            key: &RecordKey,
            token: OwnerToken,
            ttl: Duration,
        ) -> Result<Transition, StoreError> {
            self.inner.mark_ambiguous(key, token, ttl).await
        }
        async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
            self.inner.get(key).await
        }
        async fn delete(&self, key: &RecordKey) -> Result<bool, StoreError> {
            self.inner.delete(key).await
        }
        async fn ping(&self) -> Result<(), StoreError> {
            Ok(())
        }
        fn backend(&self) -> &'static str {
            "slow"
        }
    }

    fn keyed_post() -> Request<Full<Bytes>> {
        let mut req = Request::new(Full::new(Bytes::from_static(b"{}")));
        *req.method_mut() = http::Method::POST;
        *req.uri_mut() = http::Uri::from_static("/payments");
        req.headers_mut()
            .insert("idempotency-key", http::HeaderValue::from_static("k"));
        req
    }

    fn record() -> RecordKey {
        crate::fingerprint::record_key("default", &[header::AUTHORIZATION], &HeaderMap::new(), "k")
    }

    /// The layer over `store` around an upstream that counts its calls.
    fn service(
        store: Arc<dyn Store>,
        store_timeout: Duration,
        calls: Arc<AtomicUsize>,
    ) -> impl Service<
        Request<Full<Bytes>>,
        Response = Response<ResponseBody<Full<Bytes>>>,
        Error = Infallible,
        Future: Send,
    > {
        let upstream = service_fn(move |_: Request<RequestBody<Full<Bytes>>>| {
            calls.fetch_add(1, Ordering::SeqCst);
            async { Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok")))) }
        });
        IdempotencyLayer::new(store)
            .default_route(RoutePolicy::api())
            .store_timeout(store_timeout)
            .layer(upstream)
    }

    /// Waits for the slow claim to land, then for its record to be gone.
    async fn landed_then_released(store: &SlowConnection) -> bool {
        for _ in 0..200 {
            let landed = store.landed.load(Ordering::SeqCst) == 1;
            if landed && store.inner.get(&record()).await.ok().flatten().is_none() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        false
    }

    #[tokio::test]
    async fn the_outcome_is_an_extension_unless_the_layer_leaves_it_on_the_body() {
        let upstream = service_fn(|_: Request<RequestBody<Full<Bytes>>>| async {
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
        });
        let documented = IdempotencyLayer::new(Arc::new(MemoryStore::default())).layer(upstream);
        let for_proxy = IdempotencyLayer::new(Arc::new(MemoryStore::default()))
            .outcome_on_body_only()
            .layer(upstream);
        let unkeyed = || Request::post("/").body(Full::new(Bytes::new())).unwrap();

        // Keyed and passed through alike: the outcome is in the extensions, not left on the body.
        for req in [keyed_post(), unkeyed()] {
            let mut response = documented.clone().oneshot(req).await.unwrap();
            assert!(response.extensions().get::<Outcome>().is_some());
            assert!(response.body_mut().take_outcome().is_none());
        }
        // The proxy's layer: on the body only.
        let response = for_proxy.clone().oneshot(keyed_post()).await.unwrap();
        assert!(response.extensions().get::<Outcome>().is_none());
        let outcome = response.body().outcome().expect("outcome on the body");
        assert_eq!(outcome.decision, Decision::Executed);
        assert_eq!(outcome.record, Some(record()));
        let response = for_proxy.oneshot(unkeyed()).await.unwrap();
        assert!(response.extensions().get::<Outcome>().is_none());
        assert_eq!(
            response.body().outcome().map(|outcome| outcome.decision),
            Some(Decision::PassedThrough)
        );
    }

    #[tokio::test]
    async fn a_claim_abandoned_by_its_client_is_undone() {
        let store = SlowConnection::new(Duration::from_millis(50));
        let calls = Arc::new(AtomicUsize::new(0));
        let svc = service(store.clone(), Duration::from_secs(2), calls.clone());
        // The client hangs up while the claim is on its way to the store.
        let gave_up =
            tokio::time::timeout(Duration::from_millis(10), svc.oneshot(keyed_post())).await;
        assert!(gave_up.is_err());
        // The claim lands after the client left; it is undone, never left in flight.
        assert!(
            landed_then_released(&store).await,
            "the claim was left behind"
        );
        assert_eq!(calls.load(Ordering::SeqCst), 0);
    }

    #[tokio::test]
    async fn a_claim_that_outlives_the_store_timeout_is_undone() {
        let store = SlowConnection::new(Duration::from_millis(50));
        let calls = Arc::new(AtomicUsize::new(0));
        let svc = service(store.clone(), Duration::from_millis(10), calls.clone());
        let response = svc.oneshot(keyed_post()).await.unwrap();
        assert_eq!(response.status(), http::StatusCode::SERVICE_UNAVAILABLE);
        assert!(
            landed_then_released(&store).await,
            "the claim was left behind"
        );
        assert_eq!(calls.load(Ordering::SeqCst), 0);
    }
}
