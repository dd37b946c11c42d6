//! [`ResponseFuture`]: the future of [`IdempotencyService`](crate::IdempotencyService).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use http::Response;

use crate::body::ResponseBody;
use crate::response::{Decision, Outcome};
use crate::service::without_owned_headers;

type BoxAnswer<B, E> = Pin<Box<dyn Future<Output = Result<Response<ResponseBody<B>>, E>> + Send>>;

pin_project_lite::pin_project! {
    /// The response future of [`IdempotencyService`](crate::IdempotencyService). Opaque so its
    /// inside can change; requests that pass through cost no allocation.
    pub struct ResponseFuture<F, B, E> {
        #[pin]
        kind: Kind<F, B, E>,
    }
}

pin_project_lite::pin_project! {
    #[project = KindProj]
    enum Kind<F, B, E> {
        PassThrough { #[pin] future: F, route: Arc<str> },
        Ready { response: Option<Response<ResponseBody<B>>> },
        Keyed { future: BoxAnswer<B, E> },
    }
}

impl<F, B, E> ResponseFuture<F, B, E> {
    pub(crate) fn pass_through(future: F, route: Arc<str>) -> Self {
        Self {
            kind: Kind::PassThrough { future, route },
        }
    }

    pub(crate) fn ready(response: Response<ResponseBody<B>>) -> Self {
        Self {
            kind: Kind::Ready {
                response: Some(response),
            },
        }
    }

    pub(crate) fn boxed(future: BoxAnswer<B, E>) -> Self {
        Self {
            kind: Kind::Keyed { future },
        }
    }
}

impl<F, B, E> Future for ResponseFuture<F, B, E>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<ResponseBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::PassThrough { future, route } => {
                let mut response = without_owned_headers(ready!(future.poll(cx))?);
                response.extensions_mut().insert(Outcome {
                    decision: Decision::PassedThrough,
                    route: route.clone(),
                    record: None,
                });
                Poll::Ready(Ok(response.map(ResponseBody::inner)))
            }
            KindProj::Ready { response } => match response.take() {
                Some(response) => Poll::Ready(Ok(response)),
                None => panic!("ResponseFuture polled after completion"),
            },
            KindProj::Keyed { future } => future.as_mut().poll(cx),
        }
    }
}
