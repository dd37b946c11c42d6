//! [`ResponseFuture`]: the future of [`IdempotencyService`](crate::IdempotencyService).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use http::Response;

use crate::body::ResponseBody;
use crate::response::without_owned_headers;
use crate::response::{Decision, Outcome};

/// What a keyed request's future ends with.
pub(crate) type Answer<B, E> = Result<Response<ResponseBody<B>>, E>;
/// A boxed future of an answer.
pub(crate) type BoxAnswer<B, E> = Pin<Box<dyn Future<Output = Answer<B, E>> + Send>>;
/// A boxed future of a keyed request's first step.
pub(crate) type BoxStep<B, E> = Pin<Box<dyn Future<Output = Step<B, E>> + Send>>;
/// Hands work that must finish to a task of its own (made where the types allow a spawn).
pub(crate) type Detacher<B, E> = fn(BoxAnswer<B, E>);

/// Where the first step of a keyed request (reading it, claiming its key) leads.
pub(crate) enum Step<B, E> {
    /// An answer right away: a replay, a refusal, a problem.
    Answer(Answer<B, E>),
    /// Work that, once started, runs to its end even if the caller goes away: the request
    /// holds the key and must complete or release it.
    Run(BoxAnswer<B, E>),
}

pin_project_lite::pin_project! {
    /// The response future of [`IdempotencyService`](crate::IdempotencyService). Opaque so its
    /// inside can change; requests that pass through cost no allocation.
    pub struct ResponseFuture<F, B, E> {
        #[pin]
        kind: Kind<F, B, E>,
        // Whether the layer's `Outcome` goes into the response's extensions (always, but for
        // the proxy's own layer, which reads it from the body).
        outcome_extension: bool,
    }
}

pin_project_lite::pin_project! {
    #[project = KindProj]
    enum Kind<F, B, E> {
        PassThrough { #[pin] future: F, route: Arc<str> },
        Ready { response: Option<Response<ResponseBody<B>>> },
        Keyed { step: BoxStep<B, E>, detach: Detacher<B, E> },
        Running { run: DetachOnDrop<B, E> },
    }
}

impl<F, B, E> ResponseFuture<F, B, E> {
    pub(crate) fn pass_through(outcome_extension: bool, future: F, route: Arc<str>) -> Self {
        Self {
            kind: Kind::PassThrough { future, route },
            outcome_extension,
        }
    }

    pub(crate) fn ready(outcome_extension: bool, response: Response<ResponseBody<B>>) -> Self {
        Self {
            kind: Kind::Ready {
                response: Some(response),
            },
            outcome_extension,
        }
    }

    /// A keyed request: `step` runs in the caller's task; if it leads to work that must
    /// finish, that work runs there too while the caller waits, and is handed to `detach` if
    /// the caller drops this future first.
    pub(crate) fn keyed(
        outcome_extension: bool,
        step: BoxStep<B, E>,
        detach: Detacher<B, E>,
    ) -> Self {
        Self {
            kind: Kind::Keyed { step, detach },
            outcome_extension,
        }
    }

    fn poll_answer(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Answer<B, E>>
    where
        F: Future<Output = Result<Response<B>, E>>,
    {
        loop {
            let next = match self.as_mut().project().kind.project() {
                KindProj::PassThrough { future, route } => {
                    let response = without_owned_headers(ready!(future.poll(cx))?);
                    let mut response = response.map(ResponseBody::inner);
                    response.body_mut().set_outcome(Outcome {
                        decision: Decision::PassedThrough,
                        route: route.clone(),
                        record: None,
                    });
                    return Poll::Ready(Ok(response));
                }
                KindProj::Ready { response } => match response.take() {
                    Some(response) => return Poll::Ready(Ok(response)),
                    None => panic!("ResponseFuture polled after completion"),
                },
                KindProj::Keyed { step, detach } => match ready!(step.as_mut().poll(cx)) {
                    Step::Answer(answer) => return Poll::Ready(answer),
                    Step::Run(run) => Kind::Running {
                        run: DetachOnDrop {
                            run: Some(run),
                            detach: *detach,
                        },
                    },
                },
                KindProj::Running { run } => return run.poll(cx),
            };
            self.as_mut().project().kind.set(next);
        }
    }
}

impl<F, B, E> Future for ResponseFuture<F, B, E>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Answer<B, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let answer = ready!(self.as_mut().poll_answer(cx));
        if !self.outcome_extension {
            return Poll::Ready(answer);
        }
        Poll::Ready(answer.map(|mut response| {
            if let Some(outcome) = response.body_mut().take_outcome() {
                response.extensions_mut().insert(outcome);
            }
            response
        }))
    }
}

/// Work polled in the caller's task that is handed to a task of its own if the caller drops
/// it before it finishes.
struct DetachOnDrop<B, E> {
    run: Option<BoxAnswer<B, E>>,
    detach: Detacher<B, E>,
}

impl<B, E> DetachOnDrop<B, E> {
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Answer<B, E>> {
        let Some(run) = self.run.as_mut() else {
            panic!("ResponseFuture polled after completion");
        };
        let answer = ready!(run.as_mut().poll(cx));
        self.run = None;
        Poll::Ready(answer)
    }
}

impl<B, E> Drop for DetachOnDrop<B, E> {
    fn drop(&mut self) {
        if let Some(run) = self.run.take() {
            (self.detach)(run);
        }
    }
}
