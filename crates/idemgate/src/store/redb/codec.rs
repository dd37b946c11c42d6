//! How a record is stored: a row of the records table is the record key, then the record
//! (version, state tag, fingerprint, expiry, then the state's fields).

use bytes::Bytes;
use redb::TableDefinition;

use super::BACKEND;
use crate::record::{
    Completion, DecodeError, FingerprintHash, OwnerToken, Record, RecordKey, from_unix_millis,
};
use crate::store::StoreError;

/// The records table: a row number (the order of writing), then the row.
pub(super) const RECORDS: TableDefinition<u64, &[u8]> = TableDefinition::new("records_by_write");

pub(super) const VERSION: u8 = 1;
pub(super) const TAG_IN_FLIGHT: u8 = 1;
pub(super) const TAG_COMPLETED: u8 = 2;
pub(super) const TAG_AMBIGUOUS: u8 = 3;
/// Version, tag, fingerprint, expiry.
pub(super) const HEADER_LEN: usize = 1 + 1 + 32 + 8;
/// An in-flight record as first written: the header, the owner token and the lease deadline.
/// Since then the lease's length follows (older binaries read the record without it).
pub(super) const IN_FLIGHT_LEN_V1: usize = HEADER_LEN + 16 + 8;

/// A stored record without its completion bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Header {
    pub(super) fingerprint: FingerprintHash,
    pub(super) expires: u64,
    pub(super) state: StateHeader,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum StateHeader {
    InFlight {
        token: OwnerToken,
        lease_deadline: u64,
        /// The lease's length in milliseconds, so a record found in flight at open can be
        /// given a whole lease from then on; 0 in rows written before it was kept.
        lease: u64,
    },
    Completed {
        stored_at: u64,
    },
    Ambiguous {
        since: u64,
    },
}

pub(super) fn read_u64(bytes: &[u8], at: usize) -> Result<u64, DecodeError> {
    bytes
        .get(at..at + 8)
        .and_then(|b| b.try_into().ok())
        .map(u64::from_be_bytes)
        .ok_or(DecodeError("truncated record"))
}

impl Header {
    /// Parses a stored value; for a completed record also returns the completion bytes.
    pub(super) fn parse(value: &[u8]) -> Result<(Self, &[u8]), DecodeError> {
        if value.len() < HEADER_LEN {
            return Err(DecodeError("truncated record"));
        }
        if value[0] != VERSION {
            return Err(DecodeError("unknown record version"));
        }
        let mut fingerprint = [0u8; 32];
        fingerprint.copy_from_slice(&value[2..34]);
        let expires = read_u64(value, 34)?;
        let (state, rest) = match value[1] {
            TAG_IN_FLIGHT => {
                let token = value
                    .get(HEADER_LEN..HEADER_LEN + 16)
                    .and_then(|b| b.try_into().ok())
                    .map(u128::from_be_bytes)
                    .ok_or(DecodeError("truncated record"))?;
                let lease_deadline = read_u64(value, HEADER_LEN + 16)?;
                let lease = match value.len() {
                    IN_FLIGHT_LEN_V1 => 0,
                    _ => read_u64(value, IN_FLIGHT_LEN_V1)?,
                };
                (
                    StateHeader::InFlight {
                        token: OwnerToken(token),
                        lease_deadline,
                        lease,
                    },
                    &[][..],
                )
            }
            TAG_COMPLETED => (
                StateHeader::Completed {
                    stored_at: read_u64(value, HEADER_LEN)?,
                },
                &value[HEADER_LEN + 8..],
            ),
            TAG_AMBIGUOUS => (
                StateHeader::Ambiguous {
                    since: read_u64(value, HEADER_LEN)?,
                },
                &[][..],
            ),
            _ => return Err(DecodeError("unknown record state")),
        };
        Ok((
            Header {
                fingerprint: FingerprintHash(fingerprint),
                expires,
                state,
            },
            rest,
        ))
    }

    /// Appends the encoded record to `out`, with `completion` after the header of a completed
    /// one.
    pub(super) fn encode_into(&self, out: &mut Vec<u8>, completion: &[u8]) {
        let tag = match self.state {
            StateHeader::InFlight { .. } => TAG_IN_FLIGHT,
            StateHeader::Completed { .. } => TAG_COMPLETED,
            StateHeader::Ambiguous { .. } => TAG_AMBIGUOUS,
        };
        out.push(VERSION);
        out.push(tag);
        out.extend_from_slice(&self.fingerprint.0);
        out.extend_from_slice(&self.expires.to_be_bytes());
        match self.state {
            StateHeader::InFlight {
                token,
                lease_deadline,
                lease,
            } => {
                out.extend_from_slice(&token.0.to_be_bytes());
                out.extend_from_slice(&lease_deadline.to_be_bytes());
                out.extend_from_slice(&lease.to_be_bytes());
            }
            StateHeader::Completed { stored_at } => {
                out.extend_from_slice(&stored_at.to_be_bytes());
                out.extend_from_slice(completion);
            }
            StateHeader::Ambiguous { since } => out.extend_from_slice(&since.to_be_bytes()),
        }
    }

    pub(super) fn is_live(&self, now: u64) -> bool {
        self.expires > now
    }

    pub(super) fn owned_by(&self, token: OwnerToken, now: u64) -> bool {
        self.is_live(now)
            && matches!(self.state, StateHeader::InFlight { token: t, .. } if t == token)
    }

    pub(super) fn to_record(self, completion: &[u8]) -> Result<Record, StoreError> {
        let fingerprint = self.fingerprint;
        Ok(match self.state {
            StateHeader::InFlight { lease_deadline, .. } => Record::InFlight {
                fingerprint,
                lease_deadline: from_unix_millis(lease_deadline),
            },
            StateHeader::Completed { stored_at } => Record::Completed {
                fingerprint,
                completion: decode_completion(completion)?,
                stored_at: from_unix_millis(stored_at),
            },
            StateHeader::Ambiguous { since } => Record::Ambiguous {
                fingerprint,
                since: from_unix_millis(since),
            },
        })
    }
}

/// Decodes the completion bytes of a stored record (copied out of redb's page).
pub(super) fn decode_completion(bytes: &[u8]) -> Result<Completion, StoreError> {
    crate::store::decode_completion(BACKEND, Bytes::copy_from_slice(bytes))
}

/// When a stored row expires. A row whose record cannot be read still has its expiry read
/// from its place in the record (after the version, tag and fingerprint); a row too short to
/// hold one is due now.
pub(super) fn row_expiry(row: &[u8]) -> u64 {
    match parse_row(row) {
        Ok((header, _)) => header.expires,
        Err(_) => row
            .get(32..)
            .and_then(|record| read_u64(record, 34).ok())
            .unwrap_or(0),
    }
}

/// A stored row: the record key, then the record.
pub(super) fn encode_row(key: &RecordKey, header: &Header, completion: &[u8]) -> Vec<u8> {
    // Key, header, then the largest state fields (an owner token and a lease deadline).
    let mut row = Vec::with_capacity(32 + HEADER_LEN + 24 + completion.len());
    encode_row_into(&mut row, key, header, completion);
    row
}

/// Appends a row (record key, then the record) to `out`.
pub(super) fn encode_row_into(
    out: &mut Vec<u8>,
    key: &RecordKey,
    header: &Header,
    completion: &[u8],
) {
    out.extend_from_slice(&key.0);
    header.encode_into(out, completion);
}

/// Splits a stored row into its record key and its record.
pub(super) fn split_row(row: &[u8]) -> Result<(RecordKey, &[u8]), DecodeError> {
    let (key, record) = row
        .split_first_chunk::<32>()
        .ok_or(DecodeError("truncated record"))?;
    Ok((RecordKey(*key), record))
}

/// The header of a stored row's record and, for a completed one, its completion bytes.
pub(super) fn parse_row(row: &[u8]) -> Result<(Header, &[u8]), DecodeError> {
    split_row(row).and_then(|(_, record)| Header::parse(record))
}

/// A record's row number and its header (or why it could not be read).
pub(super) type Found = (u64, Result<Header, DecodeError>);

#[cfg(test)]
mod proptests {
    use proptest::prelude::*;

    use super::*;
    use crate::record::proptests::{apply, config, mutation};

    pub(super) fn header() -> impl Strategy<Value = Header> {
        let state = prop_oneof![
            (any::<u128>(), any::<u64>(), any::<u64>()).prop_map(
                |(token, lease_deadline, lease)| {
                    StateHeader::InFlight {
                        token: OwnerToken(token),
                        lease_deadline,
                        lease,
                    }
                }
            ),
            any::<u64>().prop_map(|stored_at| StateHeader::Completed { stored_at }),
            any::<u64>().prop_map(|since| StateHeader::Ambiguous { since }),
        ];
        (any::<[u8; 32]>(), any::<u64>(), state).prop_map(|(fingerprint, expires, state)| Header {
            fingerprint: FingerprintHash(fingerprint),
            expires,
            state,
        })
    }

    proptest! {
        #![proptest_config(config())]

        /// decode(encode(x)) = x for a stored row: key, header and completion bytes.
        #[test]
        fn a_row_parses_back_to_what_was_encoded(
            key in any::<[u8; 32]>(),
            header in header(),
            completion in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            let completion = match header.state {
                StateHeader::Completed { .. } => completion,
                _ => Vec::new(),
            };
            let row = encode_row(&RecordKey(key), &header, &completion);
            let (parsed_key, record) = split_row(&row).unwrap();
            prop_assert_eq!(parsed_key, RecordKey(key));
            let (parsed, rest) = Header::parse(record).unwrap();
            prop_assert_eq!(parsed, header);
            prop_assert_eq!(rest, &completion[..]);
            prop_assert_eq!(row_expiry(&row), header.expires);
        }

        /// Damaged rows and arbitrary bytes never panic the row's decoders.
        #[test]
        fn damaged_rows_never_panic(
            key in any::<[u8; 32]>(),
            header in header(),
            mutations in proptest::collection::vec(mutation(), 0..4),
            arbitrary in proptest::collection::vec(any::<u8>(), 0..128),
        ) {
            let mut row = encode_row(&RecordKey(key), &header, b"completion");
            for m in &mutations {
                apply(&mut row, m);
            }
            for bytes in [&row[..], &arbitrary[..]] {
                let _ = parse_row(bytes);
                let _ = row_expiry(bytes);
                let _ = Header::parse(bytes);
            }
        }
    }
}
