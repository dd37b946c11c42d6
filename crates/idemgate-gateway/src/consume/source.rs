//! [`Source`]: what the consumer needs of a broker. Redis Streams is the one built
//! (`redis_stream`); docs/consume.md says what Kafka, SQS or NATS would need.

use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;

/// One message as the broker delivered it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// The broker's id of this delivery (a stream entry id), used to acknowledge it; never the
    /// message's idempotency key on its own, since a producer's retry gets a new one.
    pub id: String,
    /// The message's fields, in the broker's order.
    pub fields: Vec<(String, Bytes)>,
}

impl Entry {
    /// The value of the field `name`, if the entry has it.
    pub fn field(&self, name: &str) -> Option<&Bytes> {
        self.fields
            .iter()
            .find_map(|(field, value)| (field == name).then_some(value))
    }
}

/// Why an entry goes to the dead letters, as written beside it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeadLetter {
    /// A short, fixed word: `ambiguous`, `rejected`, `missing_key`, `invalid_key`,
    /// `key_mismatch`, `too_large`, `signature_rejected`.
    pub reason: &'static str,
    /// What happened, for a person.
    pub detail: String,
    /// Whether the handler may have run: the entry must not be sent again on its own.
    pub ambiguous: bool,
    /// The handler's last status, when it answered.
    pub status: Option<u16>,
    /// Tries made by this consumer.
    pub attempts: u32,
    /// The key, when one was found.
    pub key: Option<String>,
}

/// How far behind a source is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Backlog {
    /// Entries delivered to a consumer of the group and not yet acknowledged.
    pub pending: u64,
    /// Entries not yet delivered to the group, when the broker knows.
    pub lag: Option<u64>,
}

/// A broker failure; the consumer logs it, waits and tries again.
#[derive(Debug, thiserror::Error)]
#[error("{source_name}: {what} failed")]
pub struct SourceError {
    /// The source, without credentials.
    pub source_name: String,
    /// The operation.
    pub what: &'static str,
    /// Why.
    #[source]
    pub cause: Box<dyn std::error::Error + Send + Sync>,
}

/// A queue read through a group of consumers that share its messages, each message handed
/// to one consumer at a time and redelivered until acknowledged (at least once).
///
/// # Contract
///
/// - **Pending until acknowledged.** An entry [`read`](Source::read) or
///   [`claim_stale`](Source::claim_stale) stays pending on this consumer until
///   [`ack`](Source::ack) or [`dead_letter`](Source::dead_letter); a consumer that dies
///   leaves it pending for another to claim.
/// - **Own pending first.** After a restart under the same consumer name, `read` hands back
///   this consumer's pending entries before new ones.
/// - **Dead letter and acknowledgement are one step.** `dead_letter` writes the letter and
///   acknowledges the entry atomically: never one without the other.
/// - **Cancellation.** The consumer never drops a `read` half-way (a dropped read could hand
///   entries to this consumer that nobody handles until they are claimed as stale).
#[async_trait]
pub trait Source: Send + Sync + 'static {
    /// The source for logs and metrics, without credentials.
    fn name(&self) -> &str;

    /// Up to `max` entries: this consumer's own pending ones first, then new ones, waiting up
    /// to `block` for one to arrive.
    async fn read(&self, max: usize, block: Duration) -> Result<Vec<Entry>, SourceError>;

    /// Up to `max` entries pending on any consumer of the group for longer than `min_idle`,
    /// now this consumer's.
    async fn claim_stale(&self, min_idle: Duration, max: usize) -> Result<Vec<Entry>, SourceError>;

    /// Tells the broker this consumer is still working on the entry (a message waiting for
    /// its next try): its idle time starts again, so no other consumer takes it over meanwhile.
    async fn touch(&self, id: &str) -> Result<(), SourceError>;

    /// Acknowledges the entry: it is settled and never delivered again.
    async fn ack(&self, id: &str) -> Result<(), SourceError>;

    /// Writes `entry` with `letter` to the dead letters and acknowledges it, in one step.
    async fn dead_letter(&self, entry: &Entry, letter: &DeadLetter) -> Result<(), SourceError>;

    /// How far behind the group is.
    async fn backlog(&self) -> Result<Backlog, SourceError>;
}
