//! One batch's calls applied to the open write transaction, each a single atomic step.

use std::sync::Arc;

use bytes::Bytes;

use super::claim::{ReadView, seen};
use super::clock::{after, millis};
use super::codec::{Found, Header, StateHeader, decode_completion, encode_row_into, parse_row};
use super::corrupt;
use super::index::RowIndex;
use super::journal::Journal;
use super::ops::{Done, Op, Reply, Settled, Unanswered, done};
use super::overlay::{Records, RowValue};
use crate::record::{FingerprintHash, OwnerToken, Record, RecordKey};
use crate::store::decision::{ClaimStep, decide};
use crate::store::{Claim, ClaimOptions, StoreError, Transition};

/// Most expired records removed by one sweep transaction.
pub(super) const SWEEP_BATCH: usize = 1000;

pub(super) struct Tables<'t> {
    pub(super) records: Records<'t>,
    pub(super) rows: &'t mut RowIndex,
    /// Where the batch's row changes are gathered for its journal frame.
    pub(super) journal: &'t mut Journal,
    /// Whether anything was written, so a batch that changed nothing skips the sync.
    pub(super) dirty: bool,
}

/// How to answer a change whose outcome is `result`, and the storage error that aborts the
/// batch, if any.
fn split<T: Send + 'static>(
    reply: Reply<T>,
    result: Result<Result<T, StoreError>, redb::Error>,
) -> (Done, Option<redb::Error>) {
    match result {
        Ok(answer) => (done(reply, answer), None),
        // Answered with the batch's failure, which this error causes.
        Err(e) => (
            Box::new(Settled {
                reply,
                answer: None,
            }),
            Some(e),
        ),
    }
}

impl Tables<'_> {
    /// Applies one change; returns how to answer it and the storage error that aborts the
    /// batch, if any.
    pub(super) fn apply(
        &mut self,
        op: Op,
        now: u64,
        swept_all: &mut bool,
    ) -> (Done, Option<redb::Error>) {
        match op {
            Op::Claim {
                key,
                fingerprint,
                token,
                options,
                reply,
            } => split(reply, self.claim(&key, &fingerprint, token, &options, now)),
            Op::Complete {
                key,
                token,
                completion,
                ttl,
                reply,
            } => split(
                reply,
                self.transition(&key, token, now, |header| {
                    header.state = StateHeader::Completed { stored_at: now };
                    header.expires = after(now, ttl);
                    Some(completion)
                }),
            ),
            Op::Release { key, token, reply } => split(reply, self.release(&key, token, now)),
            Op::Renew {
                key,
                token,
                lease,
                reply,
            } => split(
                reply,
                self.transition(&key, token, now, |header| {
                    let lease_deadline = after(now, lease);
                    header.state = StateHeader::InFlight {
                        token,
                        lease_deadline,
                        lease: millis(lease),
                    };
                    header.expires = header.expires.max(lease_deadline);
                    None
                }),
            ),
            Op::MarkAmbiguous {
                key,
                token,
                ttl,
                reply,
            } => split(
                reply,
                self.transition(&key, token, now, |header| {
                    header.state = StateHeader::Ambiguous { since: now };
                    header.expires = after(now, ttl);
                    None
                }),
            ),
            Op::Delete { key, reply } => split(reply, self.delete(&key, now).map(Ok)),
            Op::Get { key, reply } => split(reply, self.get(&key, now)),
            Op::Ping { reply } => (done(reply, Ok(())), None),
            Op::Sweep { reply } => self.sweep_op(reply, now, swept_all),
        }
    }

    /// A sweep asked for by a caller (`reply`) or by the writer's own tick.
    fn sweep_op(
        &mut self,
        reply: Option<Reply<usize>>,
        now: u64,
        swept_all: &mut bool,
    ) -> (Done, Option<redb::Error>) {
        let result = self.sweep(now, SWEEP_BATCH);
        if let Ok(removed) = result {
            *swept_all &= removed < SWEEP_BATCH;
        }
        match reply {
            Some(reply) => split(reply, result.map(Ok)),
            None => (Box::new(Unanswered), result.err()),
        }
    }

    /// The row number and stored row of `key`'s record, if it has one.
    pub(super) fn stored(
        &self,
        key: &RecordKey,
    ) -> Result<Option<(u64, RowValue<'_>)>, redb::Error> {
        let Some(row) = self.rows.row_of(key) else {
            return Ok(None);
        };
        Ok(self.records.get(row)?.map(|value| (row, value)))
    }

    /// The row number and header of `key`'s record, if it has one.
    pub(super) fn header(&self, key: &RecordKey) -> Result<Option<Found>, redb::Error> {
        Ok(self
            .stored(key)?
            .map(|(row, value)| (row, parse_row(value.value()).map(|(h, _)| h))))
    }

    /// Writes `header` (and `completion`) as `key`'s record in a new row at the end of the
    /// table, removing its previous row (row number and expiry) if it had one.
    pub(super) fn put(
        &mut self,
        key: &RecordKey,
        header: &Header,
        completion: &[u8],
        previous: Option<(u64, u64)>,
    ) -> Result<(), redb::Error> {
        if let Some((row, expiry)) = previous {
            self.remove_row(row, expiry)?;
        }
        let row = self.rows.take_next();
        // Encoded once, into the journal's frame, and inserted from there.
        let value = self.journal.put(row, |out| {
            encode_row_into(out, key, header, completion);
        });
        self.records.insert(row, value)?;
        self.rows.expiries.insert((header.expires, row));
        self.rows.set_row(*key, row);
        self.dirty = true;
        Ok(())
    }

    pub(super) fn remove(
        &mut self,
        key: &RecordKey,
        row: u64,
        expiry: u64,
    ) -> Result<(), redb::Error> {
        self.remove_row(row, expiry)?;
        self.rows.forget(key, None);
        self.dirty = true;
        Ok(())
    }

    /// Removes a row from the table and notes it in the batch's journal frame; `None` if
    /// there was no such row, else the record key it held (`None` if undecodable).
    pub(super) fn take_row(&mut self, row: u64) -> Result<Option<Option<RecordKey>>, redb::Error> {
        let removed = self.records.remove(row)?;
        if removed.is_some() {
            self.journal.remove(row);
        }
        Ok(removed)
    }

    /// Removes a row and its expiry entry (the key's entry is the caller's to update).
    pub(super) fn remove_row(&mut self, row: u64, expiry: u64) -> Result<(), redb::Error> {
        self.take_row(row)?;
        self.rows.expiries.remove(&(expiry, row));
        Ok(())
    }

    /// The live record of `key`, if there is one.
    pub(super) fn get(
        &self,
        key: &RecordKey,
        now: u64,
    ) -> Result<Result<Option<Record>, StoreError>, redb::Error> {
        let view = ReadView {
            records: &self.records,
            rows: self.rows,
        };
        view.get(key, now)
    }

    pub(super) fn claim(
        &mut self,
        key: &RecordKey,
        fingerprint: &FingerprintHash,
        token: OwnerToken,
        options: &ClaimOptions,
        now: u64,
    ) -> Result<Result<Claim, StoreError>, redb::Error> {
        // One read: a replay decodes the completion from it; a write drops it first.
        let value = self.stored(key)?;
        let row = value.as_ref().map(|(row, _)| *row);
        let found = match value.as_ref().map(|(_, v)| parse_row(v.value())) {
            None => None,
            Some(Ok((header, completion))) => Some(seen(header, completion, fingerprint)),
            Some(Err(e)) => return Ok(Err(corrupt(e))),
        };
        let previous = |found: Header| row.map(|row| (row, found.expires));
        Ok(Ok(match decide(found, options.on_lapse, now) {
            ClaimStep::Answer(claim) => claim,
            ClaimStep::Replay { completion, .. } => match decode_completion(completion) {
                Ok(c) => Claim::Completed(Arc::new(c)),
                Err(e) => return Ok(Err(e)),
            },
            ClaimStep::Acquire { replaces } => {
                drop(value);
                let header = Header {
                    fingerprint: *fingerprint,
                    expires: after(now, options.ttl),
                    state: StateHeader::InFlight {
                        token,
                        lease_deadline: after(now, options.lease),
                        lease: millis(options.lease),
                    },
                };
                self.put(key, &header, &[], replaces.and_then(previous))?;
                Claim::Acquired(token)
            }
            ClaimStep::MakeAmbiguous { record, answer } => {
                drop(value);
                let header = Header {
                    fingerprint: record.fingerprint,
                    expires: after(now, options.ttl),
                    state: StateHeader::Ambiguous { since: now },
                };
                self.put(key, &header, &[], previous(record))?;
                answer
            }
        }))
    }

    /// Changes `key`'s record with `change` if it is in flight under `token`; `change` may
    /// return the completion bytes of a completed record.
    pub(super) fn transition(
        &mut self,
        key: &RecordKey,
        token: OwnerToken,
        now: u64,
        change: impl FnOnce(&mut Header) -> Option<Bytes>,
    ) -> Result<Result<Transition, StoreError>, redb::Error> {
        let (row, mut header) = match self.header(key)? {
            Some((row, Ok(h))) if h.owned_by(token, now) => (row, h),
            Some((_, Ok(_))) | None => return Ok(Ok(Transition::Fenced)),
            Some((_, Err(e))) => return Ok(Err(corrupt(e))),
        };
        let old_expiry = header.expires;
        let completion = change(&mut header).unwrap_or_default();
        self.put(key, &header, &completion, Some((row, old_expiry)))?;
        Ok(Ok(Transition::Applied))
    }

    pub(super) fn release(
        &mut self,
        key: &RecordKey,
        token: OwnerToken,
        now: u64,
    ) -> Result<Result<Transition, StoreError>, redb::Error> {
        match self.header(key)? {
            Some((row, Ok(h))) if h.owned_by(token, now) => {
                self.remove(key, row, h.expires)?;
                Ok(Ok(Transition::Applied))
            }
            Some((_, Ok(_))) | None => Ok(Ok(Transition::Fenced)),
            Some((_, Err(e))) => Ok(Err(corrupt(e))),
        }
    }

    /// Removes whatever is under `key`, even an undecodable record (an operator's way out);
    /// returns whether a live one was there.
    pub(super) fn delete(&mut self, key: &RecordKey, now: u64) -> Result<bool, redb::Error> {
        let found = self.header(key)?;
        let Some((row, found)) = found else {
            return Ok(false);
        };
        match found {
            Ok(h) => {
                self.remove(key, row, h.expires)?;
                Ok(h.is_live(now))
            }
            Err(_) => {
                // Through the journal like every removal, or a crash brings the row back. Its
                // expiry entry finds no row when it comes due.
                self.take_row(row)?;
                self.rows.forget(key, None);
                self.dirty = true;
                Ok(true)
            }
        }
    }

    /// Removes up to `limit` records that expired by `now`, oldest first.
    pub(super) fn sweep(&mut self, now: u64, limit: usize) -> Result<usize, redb::Error> {
        let mut removed = 0;
        while removed < limit {
            let Some(&(expiry, row)) = self.rows.expiries.first() else {
                break;
            };
            if expiry > now {
                break;
            }
            self.rows.expiries.pop_first();
            removed += 1;
            // The index moves with every write, so a due entry is the row's own expiry. An
            // undecodable row is removed when due too.
            if let Some(Some(key)) = self.take_row(row)? {
                self.rows.forget(&key, Some(row));
            }
        }
        if removed > 0 {
            self.dirty = true;
        }
        Ok(removed)
    }
}
