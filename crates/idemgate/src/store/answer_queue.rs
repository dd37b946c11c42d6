//! [`AnswerQueue`]: a worker thread answers a batch of async callers with one cross-runtime wake.
//!
//! Waking a task from a thread outside its runtime costs a system call: the runtime is told
//! through its event descriptor, whether or not it is asleep. A worker that answers each
//! caller of a batch itself pays that once per caller. Through an [`AnswerQueue`], the worker
//! sends one answer and queues the rest; the caller it woke, running on its runtime's thread,
//! sends the rest from there, where a wake is a push onto the runtime's own queue.
//!
//! Nothing is left waiting: the worker queues before it sends, and the caller it reached
//! hands out the queue when its answer arrives or, if it went away first, when it is dropped
//! (after closing its receiver, so the worker either reached it before, or finds it gone and
//! tries the next caller). Nor is anyone left waiting on another runtime's turn: answers the
//! reached caller has not handed out by the worker's next delivery (its runtime is busy or
//! stalled) are sent by the worker itself then.

use std::future::Future;
use std::mem;
use std::pin::Pin;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, ready};

use tokio::sync::oneshot;

/// An answer to one caller, ready to send.
pub(crate) trait QueuedAnswer: Send {
    /// Sends the answer, waking its caller; `false` if the caller is gone.
    fn send(self) -> bool;
}

/// Answers queued by a worker, handed out by the first caller it woke.
pub(crate) struct AnswerQueue<A> {
    queued: Mutex<Vec<A>>,
    /// Whether `queued` may hold anything, so a caller looks without taking the lock.
    any: AtomicBool,
}

impl<A: QueuedAnswer> AnswerQueue<A> {
    pub(crate) fn new() -> Self {
        Self {
            queued: Mutex::new(Vec::new()),
            any: AtomicBool::new(false),
        }
    }

    /// Called by the worker: queues `answers`, then sends them one by one until a caller is
    /// reached (who then sends the rest) or none is left. Answers of an earlier delivery still
    /// queued are sent first, from here.
    pub(crate) fn deliver(&self, answers: impl IntoIterator<Item = A>) {
        let mut queued = self.lock();
        // Rare: a caller reached a whole delivery ago has not run since.
        for late in queued.drain(..) {
            late.send();
        }
        queued.extend(answers);
        self.any.store(!queued.is_empty(), Ordering::Release);
        while let Some(answer) = queued.pop() {
            self.any.store(!queued.is_empty(), Ordering::Release);
            // Sent under the lock: a caller that takes the queue meanwhile waits, then finds
            // what is left. The caller reached cannot take the lock before this returns.
            if answer.send() {
                return;
            }
        }
    }

    /// Called by a caller once its answer came or it went away: sends every queued answer.
    fn hand_out(&self) {
        if !self.any.load(Ordering::Acquire) {
            return;
        }
        let answers = {
            let mut queued = self.lock();
            self.any.store(false, Ordering::Release);
            mem::take(&mut *queued)
        };
        for answer in answers {
            answer.send();
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<A>> {
        // Changed only by extends, pops and takes, so a poisoned lock holds a whole queue.
        crate::lock::lock(&self.queued)
    }

    /// Waits for the answer `receiver` gets through this queue.
    pub(crate) fn wait<T>(&self, receiver: oneshot::Receiver<T>) -> Waiting<'_, A, T> {
        Waiting {
            receiver: Some(receiver),
            queue: self,
        }
    }
}

/// A caller waiting for its answer; hands out the queue once it comes, or when dropped.
pub(crate) struct Waiting<'h, A: QueuedAnswer, T> {
    receiver: Option<oneshot::Receiver<T>>,
    queue: &'h AnswerQueue<A>,
}

impl<A: QueuedAnswer, T> Future for Waiting<'_, A, T> {
    type Output = Result<T, oneshot::error::RecvError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(receiver) = self.receiver.as_mut() else {
            panic!("Waiting polled after completion");
        };
        let answer = ready!(Pin::new(receiver).poll(cx));
        self.receiver = None;
        self.queue.hand_out();
        Poll::Ready(answer)
    }
}

impl<A: QueuedAnswer, T> Drop for Waiting<'_, A, T> {
    fn drop(&mut self) {
        if let Some(receiver) = self.receiver.take() {
            // Closed first: from here on the worker cannot reach this caller, so whatever it
            // queued before reaching it is already in the queue.
            drop(receiver);
            self.queue.hand_out();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::AtomicUsize;

    struct Reply {
        sender: oneshot::Sender<usize>,
        value: usize,
        sent: Arc<AtomicUsize>,
    }

    impl QueuedAnswer for Reply {
        fn send(self) -> bool {
            self.sent.fetch_add(1, Ordering::Relaxed);
            self.sender.send(self.value).is_ok()
        }
    }

    fn replies(n: usize, sent: &Arc<AtomicUsize>) -> (Vec<Reply>, Vec<oneshot::Receiver<usize>>) {
        (0..n)
            .map(|value| {
                let (sender, receiver) = oneshot::channel();
                let sent = Arc::clone(sent);
                (
                    Reply {
                        sender,
                        value,
                        sent,
                    },
                    receiver,
                )
            })
            .unzip()
    }

    #[tokio::test]
    async fn the_worker_sends_one_answer_and_its_caller_the_rest() {
        let queue = AnswerQueue::new();
        let sent = Arc::new(AtomicUsize::new(0));
        let (answers, receivers) = replies(5, &sent);
        queue.deliver(answers);
        assert_eq!(sent.load(Ordering::Relaxed), 1, "the worker sent only one");
        let mut waiting: Vec<_> = receivers.into_iter().map(|r| queue.wait(r)).collect();
        // The last answer was the one sent; its caller hands out the other four.
        assert_eq!(waiting.pop().unwrap().await.unwrap(), 4);
        assert_eq!(sent.load(Ordering::Relaxed), 5);
        for (value, wait) in waiting.into_iter().enumerate() {
            assert_eq!(wait.await.unwrap(), value);
        }
    }

    #[tokio::test]
    async fn callers_that_went_away_are_skipped() {
        let queue = AnswerQueue::new();
        let sent = Arc::new(AtomicUsize::new(0));
        let (answers, mut receivers) = replies(4, &sent);
        // The last two callers are gone before the answers come.
        drop(receivers.pop());
        drop(receivers.pop());
        queue.deliver(answers);
        assert_eq!(
            sent.load(Ordering::Relaxed),
            3,
            "two gone, then one reached"
        );
        let second = receivers.pop().unwrap();
        assert_eq!(queue.wait(second).await.unwrap(), 1);
        let first = receivers.pop().unwrap();
        assert_eq!(queue.wait(first).await.unwrap(), 0);
    }

    #[tokio::test]
    async fn a_reached_caller_that_goes_away_still_hands_out_the_rest() {
        let queue = AnswerQueue::new();
        let sent = Arc::new(AtomicUsize::new(0));
        let (answers, mut receivers) = replies(3, &sent);
        let reached = queue.wait(receivers.pop().unwrap());
        queue.deliver(answers);
        assert_eq!(sent.load(Ordering::Relaxed), 1);
        // Dropped without being polled, like a call cut off by its timeout.
        drop(reached);
        assert_eq!(sent.load(Ordering::Relaxed), 3);
        for (value, receiver) in receivers.into_iter().enumerate() {
            assert_eq!(receiver.await.unwrap(), value);
        }
    }

    #[tokio::test]
    async fn answers_the_reached_caller_has_not_handed_out_go_with_the_next_delivery() {
        let queue = AnswerQueue::new();
        let sent = Arc::new(AtomicUsize::new(0));
        let (first, mut first_receivers) = replies(3, &sent);
        // Reached, but its task does not run (its runtime is busy): it neither polls nor drops.
        let reached = queue.wait(first_receivers.pop().unwrap());
        queue.deliver(first);
        assert_eq!(sent.load(Ordering::Relaxed), 1);
        let (second, mut second_receivers) = replies(2, &sent);
        queue.deliver(second);
        // The first delivery's two others, then one of the second's.
        assert_eq!(sent.load(Ordering::Relaxed), 4);
        for (value, receiver) in first_receivers.into_iter().enumerate() {
            assert_eq!(receiver.await.unwrap(), value);
        }
        assert_eq!(reached.await.unwrap(), 2);
        // Its caller handed out the second delivery's rest.
        assert_eq!(sent.load(Ordering::Relaxed), 5);
        assert_eq!(second_receivers.remove(0).await.unwrap(), 0);
        assert_eq!(second_receivers.remove(0).await.unwrap(), 1);
    }

    #[test]
    fn answers_from_another_thread_reach_every_caller() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let queue = Arc::new(AnswerQueue::new());
        let sent = Arc::new(AtomicUsize::new(0));
        runtime.block_on(async {
            for round in 0..50 {
                let (answers, receivers) = replies(1 + round % 7, &sent);
                let worker = {
                    let queue = Arc::clone(&queue);
                    std::thread::spawn(move || queue.deliver(answers))
                };
                let waits = receivers.into_iter().map(|r| {
                    let queue = Arc::clone(&queue);
                    tokio::spawn(async move { queue.wait(r).await.unwrap() })
                });
                let waits: Vec<_> = waits.collect();
                for (value, wait) in waits.into_iter().enumerate() {
                    assert_eq!(wait.await.unwrap(), value);
                }
                worker.join().unwrap();
            }
        });
    }
}
