//! The claim: one statement that decides and acts on the database's clock, and the reading of
//! its answer.
//!
//! The statement is a translation of [`decide`], the reference every store follows: its
//! `ON CONFLICT … DO UPDATE … WHERE` (and the `WHERE NOT EXISTS` that spares it) are the
//! table's rows that change a record (nothing or an expired record is acquired; a lapsed
//! lease is replaced under `Retry` and turns ambiguous under `Ambiguous`), and the answers
//! that change nothing are [`decide`] itself, applied here to the row the statement read.
//! Any change to `decide` must be made to [`CLAIM`] too; the conformance suite holds the two
//! together.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use tokio_postgres::Row;

use super::{BACKEND, corrupt};
use crate::record::OwnerToken;
use crate::store::decision::{ClaimStep, Found, Held, Moment, decide};
use crate::store::{Claim, StoreError, UnknownOutcome, decode_completion};

/// A point on the database's clock (`timestamptz`, microseconds), as the decision sees it.
impl Moment for SystemTime {
    fn until(self, later: Self) -> Duration {
        later.duration_since(self).unwrap_or_default()
    }
}

/// Parameters: `$1` key, `$2` fingerprint, `$3` the claim's owner token, `$4` lease and `$5`
/// ttl (microseconds), `$6` whether a lapsed lease is retried (`on_lapse = Retry`).
///
/// `found` reads the record in the statement's snapshot. When it is live and `decide` would
/// not change it (in flight under a live lease, completed, ambiguous), the statement writes
/// nothing and takes no lock, so a replay is a read-only transaction that waits for no WAL
/// flush, and the answer is `decide`'s on that row. Otherwise `written` inserts a fresh claim
/// under the claim's token, or, finding a row after all, replaces it if it expired or its
/// lease lapsed under `Retry`, or turns its lapsed lease ambiguous under `Ambiguous`, judged
/// on the row's latest version under its lock. When that judgement changes nothing, the
/// latest version is newer than the snapshot (a racing claim or transition committed in
/// between): `found` is then missing or shows a row `decide` would change, and the reader
/// runs the statement again, whose new snapshot has the newer row.
///
/// Each answer row: written, state, same fingerprint, owned by this claim, lease deadline,
/// expiry, kept response (only for a completed record of the same fingerprint), `now()`.
pub(super) const CLAIM: &str = "
WITH found AS (
    SELECT state, fingerprint, lease_deadline, expires_at, body
    FROM idemgate_records WHERE key = $1::bytea
), written AS (
    INSERT INTO idemgate_records AS r
        (key, state, fingerprint, owner, lease_deadline, stored_at, expires_at)
    SELECT $1::bytea, 'in_flight', $2::bytea, $3::bytea,
           now() + $4::float8 * interval '1 microsecond', now(),
           now() + $5::float8 * interval '1 microsecond'
    WHERE NOT EXISTS (
        SELECT FROM found
        WHERE expires_at > now() AND NOT (state = 'in_flight' AND lease_deadline <= now())
    )
    ON CONFLICT (key) DO UPDATE SET
        state = CASE WHEN r.expires_at <= now() OR $6::boolean
            THEN 'in_flight' ELSE 'ambiguous' END,
        fingerprint = CASE WHEN r.expires_at <= now() OR $6::boolean
            THEN excluded.fingerprint ELSE r.fingerprint END,
        owner = CASE WHEN r.expires_at <= now() OR $6::boolean THEN excluded.owner END,
        lease_deadline = CASE WHEN r.expires_at <= now() OR $6::boolean
            THEN excluded.lease_deadline END,
        stored_at = now(),
        expires_at = excluded.expires_at,
        body = NULL
    WHERE r.expires_at <= now() OR (r.state = 'in_flight' AND r.lease_deadline <= now())
    RETURNING r.state, r.fingerprint, r.owner
)
SELECT true, state, fingerprint = $2::bytea, owner = $3::bytea,
       NULL::timestamptz, NULL::timestamptz, NULL::bytea, now()
FROM written
UNION ALL
SELECT false, state, fingerprint = $2::bytea, false,
       lease_deadline, expires_at,
       CASE WHEN state = 'completed' AND fingerprint = $2::bytea THEN body END, now()
FROM found
WHERE NOT EXISTS (SELECT FROM written)
";

/// Parameters: `$1` key, `$2` fingerprint. The record as [`CLAIM`]'s read sees it, in the
/// shape of its answer rows, for a read-only first look: [`read`] answers from it when
/// [`decide`] would change nothing, and asks for [`CLAIM`] otherwise (no row, an expired
/// record, a lapsed lease). The claim never writes on the strength of it: [`CLAIM`] judges
/// the row again itself.
pub(super) const FOUND: &str = "
SELECT false, state, fingerprint = $2::bytea, false,
       lease_deadline, expires_at,
       CASE WHEN state = 'completed' AND fingerprint = $2::bytea THEN body END, now()
FROM idemgate_records WHERE key = $1::bytea
";

/// How many times a claim runs [`CLAIM`] when its read keeps predating the row it judged.
/// Once is the rule; a second run is common in a race (its snapshot then has the winner);
/// more needs the record to change again between each run.
pub(super) const ATTEMPTS: usize = 5;

/// What one run of [`CLAIM`] (or [`FOUND`]) answered.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Answer {
    /// The claim's answer, from the row the statement wrote.
    Written(Claim),
    /// The claim's answer, from the record as the statement read it: nothing was written.
    Found(Claim),
    /// The statement's read predates the row it judged: run it again.
    Again,
}

/// Reads the rows of one run of [`CLAIM`] for the claim that passed `token`.
pub(super) fn read(
    rows: &[Row],
    token: OwnerToken,
    on_lapse: UnknownOutcome,
) -> Result<Answer, StoreError> {
    let Some(row) = rows.first() else {
        return Ok(Answer::Again);
    };
    let written: bool = get(row, 0)?;
    let state: &str = get(row, 1)?;
    let same_fingerprint: bool = get(row, 2)?;
    if written {
        let ours: Option<bool> = get(row, 3)?;
        return match (state, ours) {
            ("in_flight", Some(true)) => Ok(Answer::Written(Claim::Acquired(token))),
            ("ambiguous", _) if same_fingerprint => Ok(Answer::Written(Claim::Ambiguous)),
            ("ambiguous", _) => Ok(Answer::Written(Claim::Mismatch)),
            _ => Err(corrupt("unexpected claim answer")),
        };
    }
    let lease_deadline: Option<SystemTime> = get(row, 4)?;
    let expires: SystemTime = get(row, 5)?;
    let body: Option<Vec<u8>> = get(row, 6)?;
    let now: SystemTime = get(row, 7)?;
    let state = match state {
        "in_flight" => Held::InFlight {
            lease_deadline: lease_deadline
                .ok_or_else(|| corrupt("in-flight record without a lease deadline"))?,
        },
        "completed" => Held::Completed(body),
        "ambiguous" => Held::Ambiguous,
        _ => return Err(corrupt("record with an unknown state")),
    };
    let found = Found {
        record: (),
        expires,
        same_fingerprint,
        state,
    };
    match decide(Some(found), on_lapse, now) {
        ClaimStep::Answer(claim) => Ok(Answer::Found(claim)),
        ClaimStep::Replay {
            completion: Some(body),
            ..
        } => Ok(Answer::Found(Claim::Completed(Arc::new(
            decode_completion(BACKEND, Bytes::from(body))?,
        )))),
        ClaimStep::Replay {
            completion: None, ..
        } => Err(corrupt("completed record without a body")),
        // The statement changes what these steps change; finding one here means the read saw
        // an older version of the row than the one the statement judged.
        ClaimStep::Acquire { .. } | ClaimStep::MakeAmbiguous { .. } => Ok(Answer::Again),
    }
}

/// Column `i` of `row`, a [`StoreError::Corrupt`] if it is not of the expected type.
pub(super) fn get<'a, T: tokio_postgres::types::FromSql<'a>>(
    row: &'a Row,
    i: usize,
) -> Result<T, StoreError> {
    row.try_get(i)
        .map_err(|_| corrupt("a column of an unexpected type"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_database_clock_counts_time_until_a_later_point() {
        let t = SystemTime::UNIX_EPOCH + Duration::from_secs(100);
        assert_eq!(
            t.until(t + Duration::from_micros(1_500)),
            Duration::from_micros(1_500)
        );
        assert_eq!(t.until(t), Duration::ZERO);
        assert_eq!(t.until(t - Duration::from_secs(1)), Duration::ZERO);
    }

    #[test]
    fn no_row_means_run_again() {
        assert_eq!(
            read(&[], OwnerToken::generate(), UnknownOutcome::Retry).ok(),
            Some(Answer::Again)
        );
    }
}
