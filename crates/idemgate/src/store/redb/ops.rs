//! The calls the writer takes, and how their answers reach the callers once a batch is
//! committed or failed.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::oneshot;

use super::{RedbError, unavailable};
use crate::record::{FingerprintHash, OwnerToken, Record, RecordKey};
use crate::store::answer_queue::QueuedAnswer;
use crate::store::{Claim, ClaimOptions, StoreError, Transition};

pub(super) type Reply<T> = oneshot::Sender<Result<T, StoreError>>;

pub(super) enum Op {
    Claim {
        key: RecordKey,
        fingerprint: FingerprintHash,
        token: OwnerToken,
        options: ClaimOptions,
        reply: Reply<Claim>,
    },
    Complete {
        key: RecordKey,
        token: OwnerToken,
        completion: Bytes,
        ttl: Duration,
        reply: Reply<Transition>,
    },
    Release {
        key: RecordKey,
        token: OwnerToken,
        reply: Reply<Transition>,
    },
    Renew {
        key: RecordKey,
        token: OwnerToken,
        lease: Duration,
        reply: Reply<Transition>,
    },
    MarkAmbiguous {
        key: RecordKey,
        token: OwnerToken,
        ttl: Duration,
        reply: Reply<Transition>,
    },
    Delete {
        key: RecordKey,
        reply: Reply<bool>,
    },
    Get {
        key: RecordKey,
        reply: Reply<Option<Record>>,
    },
    Ping {
        reply: Reply<()>,
    },
    Sweep {
        reply: Option<Reply<usize>>,
    },
}

/// Why a batch failed; every change in it answers with this.
pub(super) struct Failure {
    pub(super) path: Arc<Path>,
    pub(super) cause: Arc<redb::Error>,
    pub(super) poisoned: bool,
}

impl Failure {
    pub(super) fn error(&self) -> StoreError {
        let path = Arc::clone(&self.path);
        let source = Arc::clone(&self.cause);
        unavailable(if self.poisoned {
            RedbError::Poisoned { path, source }
        } else {
            RedbError::Storage { path, source }
        })
    }
}

/// A change's answer, held until its batch is committed, then sent through the
/// [`AnswerQueue`](crate::store::answer_queue::AnswerQueue).
pub(super) type Done = Box<dyn Settle>;

/// An answer of any type, as [`Done`] holds it.
pub(super) trait Settle: Send {
    /// Replaces the answer with the batch's failure.
    fn fail(&mut self, failure: &Failure);
    /// Sends the answer; `false` if the caller is gone.
    fn send(self: Box<Self>) -> bool;
}

pub(super) struct Settled<T> {
    pub(super) reply: Reply<T>,
    /// `None` for a change whose storage error failed the batch: its answer is the failure.
    pub(super) answer: Option<Result<T, StoreError>>,
}

impl<T: Send> Settle for Settled<T> {
    fn fail(&mut self, failure: &Failure) {
        self.answer = Some(Err(failure.error()));
    }

    fn send(self: Box<Self>) -> bool {
        match self.answer {
            Some(answer) => self.reply.send(answer).is_ok(),
            None => false,
        }
    }
}

/// A change nobody waits for (the writer's own sweep).
pub(super) struct Unanswered;

impl Settle for Unanswered {
    fn fail(&mut self, _: &Failure) {}

    fn send(self: Box<Self>) -> bool {
        false
    }
}

impl QueuedAnswer for Done {
    fn send(self) -> bool {
        Settle::send(self)
    }
}

pub(super) fn done<T: Send + 'static>(reply: Reply<T>, answer: Result<T, StoreError>) -> Done {
    Box::new(Settled {
        reply,
        answer: Some(answer),
    })
}

impl Op {
    /// Answers a change that was never applied with `failure`.
    pub(super) fn fail(self, failure: &Failure) {
        let error = failure.error();
        match self {
            Op::Claim { reply, .. } => drop(reply.send(Err(error))),
            Op::Complete { reply, .. }
            | Op::Release { reply, .. }
            | Op::Renew { reply, .. }
            | Op::MarkAmbiguous { reply, .. } => drop(reply.send(Err(error))),
            Op::Delete { reply, .. } => drop(reply.send(Err(error))),
            Op::Get { reply, .. } => drop(reply.send(Err(error))),
            Op::Ping { reply } => drop(reply.send(Err(error))),
            Op::Sweep { reply } => {
                if let Some(reply) = reply {
                    drop(reply.send(Err(error)));
                }
            }
        }
    }
}
