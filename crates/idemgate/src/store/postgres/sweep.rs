//! Deleting expired records: in batches through the index on `expires_at`, by one gateway at
//! a time, from a background task that ends with the store.

use std::sync::Weak;
use std::time::Duration;

use super::Inner;
use crate::store::StoreError;

/// The advisory lock a gateway holds (for one batch's transaction) while it deletes expired
/// records, so that gateways sharing the table do not all scan and delete the same rows.
/// "idemgatf": [`super::schema`]'s set-up lock, plus one.
pub(super) const SWEEP_LOCK: i64 = 0x6964_656d_6761_7466;

pub(super) const TRY_LOCK: &str = "SELECT pg_try_advisory_xact_lock($1)";

/// `$1` the batch size. The oldest expired rows first, skipping any a claim is replacing
/// right now (it holds their row lock); the expiry is checked again on the locked row. The
/// keys go to the delete as an array, which it looks up one by one in the key's index: with
/// `IN (subquery)` PostgreSQL joins the batch against every expired row, so each batch read
/// the whole backlog.
pub(super) const DELETE_EXPIRED: &str = "
DELETE FROM idemgate_records
WHERE key = ANY (ARRAY(
    SELECT key FROM idemgate_records
    WHERE expires_at <= now()
    ORDER BY expires_at
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)) AND expires_at <= now()
";

/// Starts the background deletion on the current Tokio runtime: every `interval`, a run that
/// deletes batch after batch for as long as they come back full, so deletion keeps up however
/// fast records expire (a cap on the batches of a run capped how many rows a second the table
/// could lose, and past it the table grew without bound). It holds the store for one batch at
/// a time, so it ends once the last handle to the store is dropped.
pub(super) fn spawn_sweeper(inner: Weak<Inner>, interval: Duration) {
    let interval = interval.max(Duration::from_millis(10));
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticks.tick().await;
        loop {
            ticks.tick().await;
            loop {
                let Some(inner) = inner.upgrade() else {
                    return;
                };
                match inner.delete_expired_batch().await {
                    Ok(Some(deleted)) if deleted >= u64::from(inner.sweep_batch) => continue,
                    Ok(_) => break,
                    Err(error) => {
                        log_failure(&inner.server, &error);
                        break;
                    }
                }
            }
        }
    });
}

fn log_failure(server: &str, error: &StoreError) {
    tracing::debug!(
        postgres = %server,
        error = %crate::ErrorChain(error),
        "deleting expired idempotency records failed; retried at the next sweep",
    );
}
