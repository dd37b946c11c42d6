//! One source's loop: read entries (and take over stale ones), deliver each under a permit
//! with its key's order kept, then acknowledge, retry, wait or dead-letter it.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::time::Instant;

use super::config::MAX_RETRY_BACKOFF;
use super::deliver::{Deliverer, Verdict};
use super::keys::KeyQueues;
use super::message::{Message, Reading};
use super::metrics::SourceMetrics;
use super::source::{DeadLetter, Entry, Source};
use idemgate::ErrorChain;

/// How long one read waits for new entries; also how soon a stop is noticed.
pub(super) const READ_BLOCK: Duration = Duration::from_millis(500);
/// How often the group's backlog is read for the metrics.
const BACKLOG_EVERY: Duration = Duration::from_secs(1);
/// Tries of an acknowledgement or a dead letter the broker refused, before the entry is left
/// pending (it is then delivered again, and answered from its record).
const SETTLE_TRIES: u32 = 12;

/// What one source runs with.
pub(super) struct Runner {
    /// The broker.
    pub(super) source: Arc<dyn Source>,
    /// The handler, through the layer.
    pub(super) deliverer: Deliverer,
    /// How entries become messages.
    pub(super) reading: Reading,
    /// The source's series.
    pub(super) metrics: SourceMetrics,
    /// Cap on entries in flight.
    pub(super) max_in_flight: usize,
    /// Tries before a refused entry is dead-lettered.
    pub(super) max_attempts: u32,
    /// Wait before the second try.
    pub(super) retry_backoff: Duration,
    /// Idle time after which a pending entry is taken over.
    pub(super) claim_idle: Duration,
}

impl std::fmt::Debug for Runner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runner")
            .field("source", &self.source.name())
            .field("max_in_flight", &self.max_in_flight)
            .finish_non_exhaustive()
    }
}

/// An entry to deliver, holding one of the source's permits.
struct Job {
    entry: Entry,
    message: Message,
    _permit: OwnedSemaphorePermit,
}

/// What the source's tasks share.
struct Shared {
    runner: Runner,
    permits: Arc<Semaphore>,
    keys: KeyQueues<Job>,
    /// Ids of the entries held now, so that a stale entry claimed while this consumer still
    /// holds it is not delivered twice at once.
    held: Mutex<HashSet<String>>,
    stop: watch::Receiver<bool>,
}

impl Runner {
    /// Runs until `stop` turns true, then lets the tries in flight finish (settling what they
    /// settle) for at most `grace`.
    pub(super) async fn run(self, stop: watch::Receiver<bool>, grace: Duration) {
        let name = self.source.name().to_owned();
        let max = self.max_in_flight;
        let shared = Arc::new(Shared {
            permits: Arc::new(Semaphore::new(max)),
            runner: self,
            keys: KeyQueues::default(),
            held: Mutex::default(),
            stop,
        });
        let backlog = tokio::spawn(watch_backlog(Arc::clone(&shared)));
        read_loop(&shared).await;
        tracing::info!(source = %name, "stopped reading; finishing the messages in flight");
        let all = u32::try_from(max).unwrap_or(u32::MAX);
        let drained = tokio::time::timeout(grace, shared.permits.acquire_many(all)).await;
        backlog.abort();
        match drained {
            Ok(_) => tracing::info!(source = %name, "drained"),
            Err(_) => tracing::warn!(
                source = %name,
                in_flight = max - shared.permits.available_permits(),
                "shutdown grace passed with messages in flight; they stay pending"
            ),
        }
    }
}

fn stopping(shared: &Shared) -> bool {
    *shared.stop.borrow()
}

/// Reads until stopped. A read is never cancelled half-way (see [`Source`]): a stop is
/// noticed between reads, at most [`READ_BLOCK`] later.
async fn read_loop(shared: &Arc<Shared>) {
    let runner = &shared.runner;
    let claim_every =
        (runner.claim_idle / 2).clamp(Duration::from_millis(100), Duration::from_secs(10));
    let mut next_claim = Instant::now();
    let mut failures = 0u32;
    let mut stop = shared.stop.clone();
    while !stopping(shared) {
        // Wait for room: every entry read takes a permit.
        let free = shared.permits.available_permits();
        if free == 0 {
            tokio::select! {
                permit = shared.permits.acquire() => drop(permit),
                _ = stop.wait_for(|s| *s) => {}
            }
            continue;
        }
        let read = if Instant::now() >= next_claim {
            next_claim = Instant::now() + claim_every;
            runner.source.claim_stale(runner.claim_idle, free).await
        } else {
            runner.source.read(free, READ_BLOCK).await
        };
        match read {
            Ok(entries) => {
                failures = 0;
                for entry in entries {
                    dispatch(shared, entry).await;
                }
            }
            Err(error) => {
                failures += 1;
                tracing::warn!(source = %runner.source.name(), error = %ErrorChain(&error), "reading the source failed; trying again");
                let pause = backoff(Duration::from_millis(100), failures, Duration::from_secs(5));
                tokio::select! {
                    () = tokio::time::sleep(pause) => {}
                    _ = stop.wait_for(|s| *s) => {}
                }
            }
        }
    }
}

/// Starts delivering `entry`, or queues it behind the entry with its key in flight; an entry
/// without a key is dead-lettered at once.
async fn dispatch(shared: &Arc<Shared>, entry: Entry) {
    let runner = &shared.runner;
    if !shared
        .held
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(entry.id.clone())
    {
        return;
    }
    if entry.fields.is_empty() {
        // Deleted from the stream while it was pending: nothing to deliver.
        settle(shared, &entry, None).await;
        release(shared, &entry.id);
        return;
    }
    let Ok(permit) = Arc::clone(&shared.permits).acquire_owned().await else {
        return;
    };
    let message = match runner.reading.message(&entry) {
        Ok(message) => message,
        Err(why) => {
            let letter = DeadLetter {
                reason: "missing_key",
                detail: why,
                ambiguous: false,
                status: None,
                attempts: 0,
                key: None,
            };
            let shared = Arc::clone(shared);
            tokio::spawn(async move {
                settle(&shared, &entry, Some(&letter)).await;
                release(&shared, &entry.id);
                drop(permit);
            });
            return;
        }
    };
    let key = message.key.clone();
    let job = Job {
        entry,
        message,
        _permit: permit,
    };
    if let Some(job) = shared.keys.start_or_queue(&key, job) {
        tokio::spawn(deliver_key(Arc::clone(shared), key, job));
    }
}

/// Delivers `job`, then every entry queued behind it with the same key.
async fn deliver_key(shared: Arc<Shared>, key: String, mut job: Job) {
    loop {
        shared.runner.metrics.set_in_flight(in_flight(&shared));
        if !stopping(&shared) {
            deliver(&shared, &job.entry, &job.message).await;
        }
        release(&shared, &job.entry.id);
        drop(job);
        match shared.keys.next(&key) {
            Some(next) => job = next,
            None => break,
        }
    }
    shared.runner.metrics.set_in_flight(in_flight(&shared));
}

fn in_flight(shared: &Shared) -> usize {
    shared.runner.max_in_flight - shared.permits.available_permits()
}

fn release(shared: &Shared, id: &str) {
    shared
        .held
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .remove(id);
}

/// Tries `message` until it settles, is dead-lettered, or the consumer stops (then it stays
/// pending).
async fn deliver(shared: &Shared, entry: &Entry, message: &Message) {
    let runner = &shared.runner;
    let mut attempts = 0u32;
    let mut waits = 0u32;
    loop {
        let verdict = runner.deliverer.deliver(message).await;
        let pause = match verdict {
            Verdict::Settled { replayed } => {
                if settle(shared, entry, None).await {
                    runner.metrics.settled(replayed);
                }
                return;
            }
            Verdict::DeadLetter {
                reason,
                detail,
                ambiguous,
                status,
            } => {
                let letter = DeadLetter {
                    reason,
                    detail,
                    ambiguous,
                    status: status.map(|s| s.as_u16()),
                    attempts: attempts + 1,
                    key: Some(message.key.clone()),
                };
                settle(shared, entry, Some(&letter)).await;
                return;
            }
            Verdict::Retry { status } => {
                attempts += 1;
                if attempts >= runner.max_attempts {
                    let letter = refused(attempts, status, &message.key);
                    settle(shared, entry, Some(&letter)).await;
                    return;
                }
                runner.metrics.retried();
                tracing::debug!(source = %runner.source.name(), entry = %entry.id, attempts, status = ?status, "refused; trying again");
                backoff(runner.retry_backoff, attempts, MAX_RETRY_BACKOFF)
            }
            Verdict::Wait { why } => {
                waits += 1;
                tracing::debug!(source = %runner.source.name(), entry = %entry.id, why, "not now; trying again");
                backoff(runner.retry_backoff, waits, MAX_RETRY_BACKOFF)
            }
        };
        // The entry stays this consumer's while it waits: its idle time starts again here,
        // and the wait is at most half of claim_idle.
        if let Err(error) = runner.source.touch(&entry.id).await {
            tracing::debug!(source = %runner.source.name(), entry = %entry.id, error = %ErrorChain(&error), "keeping the entry failed");
        }
        if !pause_unless_stopped(shared, pause.min(runner.claim_idle / 2)).await {
            return;
        }
    }
}

fn refused(attempts: u32, status: Option<http::StatusCode>, key: &str) -> DeadLetter {
    let detail = match status {
        Some(status) => format!(
            "the handler answered {status} to each of {attempts} tries, a status the route does not keep"
        ),
        None => format!("the handler could not be reached in {attempts} tries"),
    };
    DeadLetter {
        reason: "rejected",
        detail,
        ambiguous: false,
        status: status.map(|s| s.as_u16()),
        attempts,
        key: Some(key.to_owned()),
    }
}

/// Sleeps `pause`; false if the consumer stopped meanwhile.
async fn pause_unless_stopped(shared: &Shared, pause: Duration) -> bool {
    let mut stop = shared.stop.clone();
    tokio::select! {
        () = tokio::time::sleep(pause) => !stopping(shared),
        _ = stop.wait_for(|s| *s) => false,
    }
}

/// Acknowledges `entry`, or dead-letters it with `letter`, trying again while the broker
/// refuses; true once done. Given up on, the entry stays pending and comes back, to be
/// answered from its record.
async fn settle(shared: &Shared, entry: &Entry, letter: Option<&DeadLetter>) -> bool {
    let runner = &shared.runner;
    for attempt in 1..=SETTLE_TRIES {
        let done = match letter {
            Some(letter) => runner.source.dead_letter(entry, letter).await,
            None => runner.source.ack(&entry.id).await,
        };
        match done {
            Ok(()) => {
                if let Some(letter) = letter {
                    runner.metrics.dead_lettered(letter.reason);
                    tracing::warn!(source = %runner.source.name(), entry = %entry.id, reason = letter.reason, detail = %letter.detail, "message dead-lettered");
                }
                return true;
            }
            Err(error) => {
                tracing::warn!(source = %runner.source.name(), entry = %entry.id, error = %ErrorChain(&error), "settling the message failed");
                tokio::time::sleep(backoff(
                    Duration::from_millis(100),
                    attempt,
                    Duration::from_secs(2),
                ))
                .await;
            }
        }
    }
    false
}

/// `first`, doubled for each try after the first, at most `max`.
fn backoff(first: Duration, tries: u32, max: Duration) -> Duration {
    let doublings = tries.saturating_sub(1).min(16);
    first.saturating_mul(1 << doublings).min(max)
}

/// Keeps the source's pending and lag series current.
async fn watch_backlog(shared: Arc<Shared>) {
    let runner = &shared.runner;
    loop {
        match runner.source.backlog().await {
            Ok(backlog) => runner.metrics.set_backlog(backlog),
            Err(error) => {
                tracing::debug!(source = %runner.source.name(), error = %ErrorChain(&error), "reading the backlog failed")
            }
        }
        tokio::time::sleep(BACKLOG_EVERY).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_its_cap() {
        let ms = Duration::from_millis;
        assert_eq!(backoff(ms(100), 1, ms(1000)), ms(100));
        assert_eq!(backoff(ms(100), 2, ms(1000)), ms(200));
        assert_eq!(backoff(ms(100), 4, ms(1000)), ms(800));
        assert_eq!(backoff(ms(100), 5, ms(1000)), ms(1000));
        assert_eq!(backoff(ms(100), 99, ms(1000)), ms(1000));
    }
}
