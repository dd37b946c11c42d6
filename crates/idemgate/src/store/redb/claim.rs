//! How a claim sees the record it finds, and the answers a file that refuses writes
//! can still give.

use std::sync::Arc;

use super::codec::{Header, StateHeader, decode_completion, parse_row};
use super::corrupt;
use super::index::RowIndex;
use super::overlay::Records;
use crate::record::{DecodeError, FingerprintHash, Record, RecordKey};
use crate::store::decision::{ClaimStep, Found, Held, decide};
use crate::store::{Claim, ClaimOptions, StoreError};

/// `found` (with its completion bytes) as the claim decision sees it, for a claim of
/// `fingerprint`.
pub(super) fn seen<'a>(
    found: Header,
    completion: &'a [u8],
    fingerprint: &FingerprintHash,
) -> Found<u64, Header, &'a [u8]> {
    Found {
        record: found,
        expires: found.expires,
        same_fingerprint: found.fingerprint == *fingerprint,
        state: match found.state {
            StateHeader::InFlight { lease_deadline, .. } => Held::InFlight { lease_deadline },
            StateHeader::Completed { .. } => Held::Completed(completion),
            StateHeader::Ambiguous { .. } => Held::Ambiguous,
        },
    }
}

/// The records as a file that refuses writes still answers them: calls that change nothing.
pub(super) struct ReadView<'a, 't> {
    pub(super) records: &'a Records<'t>,
    pub(super) rows: &'a RowIndex,
}

impl ReadView<'_, '_> {
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
            let (header, completion) = parsed.ok()?;
            let found = seen(header, completion, fingerprint);
            match decide(Some(found), options.on_lapse, now) {
                ClaimStep::Answer(claim) => Some(Ok(claim)),
                ClaimStep::Replay { completion, .. } => {
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
