//! What a claim does about the record it finds, and the answers a file that refuses writes
//! can still give.

use std::sync::Arc;
use std::time::Duration;

use redb::ReadableTable;

use super::codec::{Header, StateHeader, decode_completion, parse_row};
use super::corrupt;
use super::index::RowIndex;
use crate::record::{DecodeError, FingerprintHash, Record, RecordKey};
use crate::store::{Claim, ClaimOptions, StoreError, UnknownOutcome};

/// What a claim does about the record it found.
pub(super) enum ClaimStep {
    /// Answer without a change.
    Answer(Claim),
    /// Answer with the stored completion.
    Replay,
    /// Write a fresh in-flight record, replacing the expired or lapsed one (with its expiry).
    Acquire { replaces: Option<u64> },
    /// Turn the lapsed in-flight record (with its fingerprint and expiry) ambiguous, then
    /// answer.
    MakeAmbiguous {
        fingerprint: FingerprintHash,
        old_expiry: u64,
        answer: Claim,
    },
}

pub(super) fn decide(
    found: Option<&Header>,
    fingerprint: &FingerprintHash,
    options: &ClaimOptions,
    now: u64,
) -> ClaimStep {
    let Some(found) = found else {
        return ClaimStep::Acquire { replaces: None };
    };
    if !found.is_live(now) {
        return ClaimStep::Acquire {
            replaces: Some(found.expires),
        };
    }
    let same = found.fingerprint == *fingerprint;
    match found.state {
        StateHeader::InFlight { lease_deadline, .. } if lease_deadline > now => {
            ClaimStep::Answer(if same {
                Claim::InFlight {
                    lease_remaining: Duration::from_millis(lease_deadline - now),
                }
            } else {
                Claim::Mismatch
            })
        }
        StateHeader::InFlight { .. } => match options.on_lapse {
            UnknownOutcome::Retry => ClaimStep::Acquire {
                replaces: Some(found.expires),
            },
            UnknownOutcome::Ambiguous => ClaimStep::MakeAmbiguous {
                fingerprint: found.fingerprint,
                old_expiry: found.expires,
                answer: if same {
                    Claim::Ambiguous
                } else {
                    Claim::Mismatch
                },
            },
        },
        _ if !same => ClaimStep::Answer(Claim::Mismatch),
        StateHeader::Completed { .. } => ClaimStep::Replay,
        StateHeader::Ambiguous { .. } => ClaimStep::Answer(Claim::Ambiguous),
    }
}

/// The records as a file that refuses writes still answers them: calls that change nothing.
pub(super) struct ReadView<'a, T> {
    pub(super) records: &'a T,
    pub(super) rows: &'a RowIndex,
}

impl<T: ReadableTable<u64, &'static [u8]>> ReadView<'_, T> {
    /// The header and completion bytes of `key`'s record, read in place, if it has one.
    pub(super) fn with_record<R>(
        &self,
        key: &RecordKey,
        f: impl FnOnce(Result<(Header, &[u8]), DecodeError>) -> R,
    ) -> Result<Option<R>, redb::Error> {
        let Some(row) = self.rows.row_of(key) else {
            return Ok(None);
        };
        Ok(self
            .records
            .get(row)?
            .map(|value| f(parse_row(value.value()))))
    }

    /// The answer to a claim that changes nothing (a replay, a conflict); `None` for one that
    /// would write (a new or expired key, a lapsed lease) or could not be read.
    pub(super) fn claim(
        &self,
        key: &RecordKey,
        fingerprint: &FingerprintHash,
        options: &ClaimOptions,
        now: u64,
    ) -> Option<Result<Claim, StoreError>> {
        self.with_record(key, |parsed| {
            let (found, completion) = parsed.ok()?;
            match decide(Some(&found), fingerprint, options, now) {
                ClaimStep::Answer(claim) => Some(Ok(claim)),
                ClaimStep::Replay => {
                    Some(decode_completion(completion).map(|c| Claim::Completed(Arc::new(c))))
                }
                ClaimStep::Acquire { .. } | ClaimStep::MakeAmbiguous { .. } => None,
            }
        })
        .ok()
        .flatten()
        .flatten()
    }

    /// The live record of `key`, if there is one.
    pub(super) fn get(
        &self,
        key: &RecordKey,
        now: u64,
    ) -> Result<Result<Option<Record>, StoreError>, redb::Error> {
        Ok(self
            .with_record(key, |parsed| match parsed {
                Ok((header, _)) if !header.is_live(now) => Ok(None),
                Ok((header, completion)) => header.to_record(completion).map(Some),
                Err(e) => Err(corrupt(e)),
            })?
            .unwrap_or(Ok(None)))
    }
}
