//! What only a Redis Cluster asks of [`RedisStore`](super::RedisStore): its URLs, hash
//! slots, and the keys of the per-slot data markers.
//!
//! A script may touch keys of one slot only, so the data marker a claim checks must sit in
//! the slot of the record it acquires. The store keeps one marker per slot, all holding the
//! same value: `{key_prefix}data-marker:{TAG}`, where `TAG` is a short tag chosen to land on
//! that slot (see [`slot_tags`]). A marker travels with its slot when the cluster is
//! resharded, and vanishes with the records of its slot when a node loses them, which is the
//! loss it is there to reveal.

use std::future::Future;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use futures_util::{StreamExt, TryStreamExt, stream};

use super::{RedisStore, StoreError};

/// The number of hash slots of a Redis Cluster.
pub(super) const SLOTS: u16 = 16384;

/// CRC16-XMODEM, the hash Redis Cluster places keys by.
fn crc16(data: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &byte in data {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// The slot of `key`: of its hash tag (what lies between its first `{` and the next `}`,
/// unless that is empty), or of the whole key.
pub(super) fn slot(key: &[u8]) -> u16 {
    let tag = key.iter().position(|b| *b == b'{').and_then(|open| {
        let rest = &key[open + 1..];
        let close = rest.iter().position(|b| *b == b'}')?;
        (close > 0).then(|| &rest[..close])
    });
    crc16(tag.unwrap_or(key)) % SLOTS
}

/// For each slot, a hash tag that lands on it: the smallest decimal number that does.
/// Computed once (about 170,000 hashes, a few milliseconds); the same in every gateway.
fn slot_tags() -> &'static [Box<str>] {
    static TAGS: OnceLock<Vec<Box<str>>> = OnceLock::new();
    TAGS.get_or_init(|| {
        let mut tags: Vec<Option<Box<str>>> = vec![None; usize::from(SLOTS)];
        let mut missing = usize::from(SLOTS);
        let mut n: u32 = 0;
        while missing > 0 {
            assert!(
                n < 10_000_000,
                "decimal hash tags cover every slot long before"
            );
            let tag = n.to_string();
            let found = &mut tags[usize::from(crc16(tag.as_bytes()) % SLOTS)];
            if found.is_none() {
                *found = Some(tag.into_boxed_str());
                missing -= 1;
            }
            n += 1;
        }
        tags.into_iter().flatten().collect()
    })
}

/// The data marker of `slot`: `{key_prefix}data-marker:{TAG}`.
pub(super) fn marker_key(prefix: &[u8], slot: u16) -> Vec<u8> {
    slot_key(prefix, "data-marker:", slot)
}

/// The flag that holds the value every slot's marker was last written with (in slot 0,
/// beside its marker, so that a node losing slot 0 loses both).
pub(super) fn markers_complete_key(prefix: &[u8]) -> Vec<u8> {
    slot_key(prefix, "data-marker-complete:", 0)
}

fn slot_key(prefix: &[u8], name: &str, slot: u16) -> Vec<u8> {
    let tag = &slot_tags()[usize::from(slot)];
    [prefix, name.as_bytes(), b"{", tag.as_bytes(), b"}"].concat()
}

/// How long writing every slot's marker (16,384 keys, at the first start and on an
/// acknowledgement) may take; a single call's `timeout` would be too
/// short on a busy cluster.
const MARKERS_TIMEOUT: Duration = Duration::from_secs(10);

/// How many marker writes are in flight at once.
const MARKER_WRITES_IN_FLIGHT: usize = 256;

impl RedisStore {
    /// [`adopt_marker`](RedisStore::adopt_marker) on a cluster: returns whether this store
    /// wrote the markers, and their value.
    ///
    /// The flag in slot 0 holds the value every slot's marker was last written with, and is
    /// written only once they all hold it. At first contact a store adopts the flag's value;
    /// with no flag (a first start, or slot 0's node lost its data), slot 0's marker decides
    /// the value (written with `fresh` if there is none, so gateways starting together agree)
    /// and every missing marker is written with it. A marker found holding another value
    /// means its slot lost its data and a store set up since wrote it again: that is a loss
    /// found, and the flag is left unwritten. A store never fills in a missing marker once
    /// the flag is there, so a node's loss is never covered up by a gateway starting after
    /// it.
    ///
    /// Acknowledging adopts the flag's value if it changed since this store adopted its own
    /// (another gateway acknowledged first), and otherwise writes `fresh` to every slot.
    pub(super) async fn adopt_slot_markers(
        &self,
        acknowledging: bool,
        fresh: &[u8],
    ) -> Result<(bool, Vec<u8>), StoreError> {
        let prefix = &self.marker.key;
        let mut connection = self.connection.clone();
        let flag: Option<Vec<u8>> = self
            .run(
                redis::cmd("GET")
                    .arg(markers_complete_key(prefix))
                    .query_async(&mut connection),
            )
            .await?;
        if acknowledging {
            let expected = self.marker_slot().clone();
            if let Some(flag) = flag
                && expected.as_deref() != Some(flag.as_slice())
            {
                return Ok((false, flag));
            }
            self.write_slot_markers(fresh, false).await?;
            return Ok((true, fresh.to_vec()));
        }
        if let Some(flag) = flag {
            return Ok((false, flag));
        }
        let (created, value) = self.ensure_marker(&marker_key(prefix, 0), fresh).await?;
        if !self.write_slot_markers(&value, true).await? {
            // Slot 0's value is adopted all the same: claims in the slots that hold another
            // are refused until an operator acknowledges.
            self.data_lost("a slot's data marker key holds another value");
        }
        Ok((created, value))
    }

    /// Writes `value` to every slot's marker (slot 0 included), only where there is none if
    /// `only_missing`; then, if every marker holds `value`, the flag that says so. Returns
    /// whether they all do.
    async fn write_slot_markers(
        &self,
        value: &[u8],
        only_missing: bool,
    ) -> Result<bool, StoreError> {
        let prefix = &self.marker.key;
        let writes = stream::iter(0..SLOTS)
            .map(|slot| async move {
                let key = marker_key(prefix, slot);
                if only_missing {
                    let (_, found) = self.ensure_marker(&key, value).await?;
                    Ok(found == value)
                } else {
                    let mut connection = self.connection.clone();
                    self.run(
                        redis::cmd("SET")
                            .arg(&key)
                            .arg(value)
                            .query_async::<()>(&mut connection),
                    )
                    .await?;
                    Ok(true)
                }
            })
            .buffer_unordered(MARKER_WRITES_IN_FLIGHT)
            .try_fold(
                true,
                |all, same| async move { Ok::<_, StoreError>(all && same) },
            );
        let all_same = self.bounded(writes).await?;
        if all_same {
            let mut connection = self.connection.clone();
            self.run(
                redis::cmd("SET")
                    .arg(markers_complete_key(prefix))
                    .arg(value)
                    .query_async::<()>(&mut connection),
            )
            .await?;
        }
        Ok(all_same)
    }

    /// [`check_marker`](RedisStore::check_marker) on a cluster, after a reconnect: the flag
    /// in slot 0 must still hold `expected`. A loss in another slot is found by the first
    /// claim there (every acquiring claim checks its slot's marker); reading all 16,384
    /// markers after every reconnect would cost more than it finds.
    pub(super) async fn check_slot_markers(&self, expected: &Arc<[u8]>) -> Result<(), StoreError> {
        let mut connection = self.connection.clone();
        let flag: Option<Vec<u8>> = self
            .run(
                redis::cmd("GET")
                    .arg(markers_complete_key(&self.marker.key))
                    .query_async(&mut connection),
            )
            .await?;
        match flag {
            Some(flag) if *flag == **expected => {}
            Some(_) => self.data_lost_since(expected, "the data marker keys were replaced"),
            None => self.data_lost_since(expected, "slot 0's data marker key is gone"),
        }
        Ok(())
    }

    /// Bounds a walk over every slot by [`MARKERS_TIMEOUT`] (or the store's timeout, if
    /// longer).
    async fn bounded<T>(
        &self,
        walk: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let bound = self.timeout.max(MARKERS_TIMEOUT);
        tokio::time::timeout(bound, walk).await.unwrap_or_else(|_| {
            self.sync
                .due
                .store(true, std::sync::atomic::Ordering::Relaxed);
            Err(StoreError::Timeout {
                backend: super::BACKEND,
                after: bound,
            })
        })
    }
}

/// The nodes of a `redis-cluster://[user[:password]@]host:port[,host:port…][/db][?params]`
/// URL (`rediss-cluster://` for TLS), each as a `redis://` (`rediss://`) URL with the same
/// credentials and parameters. `None` if `url` is not a cluster URL.
pub(super) fn node_urls(url: &str) -> Option<Result<Vec<String>, &'static str>> {
    let (scheme, rest) = if let Some(rest) = url.strip_prefix("redis-cluster://") {
        ("redis", rest)
    } else if let Some(rest) = url.strip_prefix("rediss-cluster://") {
        ("rediss", rest)
    } else {
        return None;
    };
    let (userinfo, rest) = match rest.rfind('@') {
        Some(at) => rest.split_at(at + 1),
        None => ("", rest),
    };
    let (hosts, tail) = rest.split_at(rest.find(['/', '?']).unwrap_or(rest.len()));
    let nodes: Vec<String> = hosts
        .split(',')
        .map(|host| format!("{scheme}://{userinfo}{host}{tail}"))
        .collect();
    if hosts
        .split(',')
        .any(|host| host.is_empty() || host.starts_with(':'))
    {
        return Some(Err(
            "a cluster URL names its nodes as host:port[,host:port…]; one is empty",
        ));
    }
    Some(Ok(nodes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_redis_clusters() {
        // As `CLUSTER KEYSLOT` answers, and the CRC16-XMODEM check value.
        assert_eq!(crc16(b"123456789"), 0x31c3);
        assert_eq!(slot(b"foo"), 12182);
        assert_eq!(slot(b"idemgate:{foo}"), 12182);
        assert_eq!(slot(b"{user1000}.following"), slot(b"{user1000}.followers"));
        assert_eq!(slot(b"foo{}{bar}"), crc16(b"foo{}{bar}") % SLOTS);
        assert_eq!(slot(b"foo{{bar}}zap"), crc16(b"{bar") % SLOTS);
    }

    #[test]
    fn every_slot_has_a_marker_of_its_own() {
        let prefix = b"idemgate:";
        for s in 0..SLOTS {
            assert_eq!(slot(&marker_key(prefix, s)), s);
        }
        assert_eq!(slot(&markers_complete_key(prefix)), 0);
    }

    #[test]
    fn cluster_urls_become_one_url_per_node() {
        assert_eq!(node_urls("redis://127.0.0.1:6379"), None);
        assert_eq!(
            node_urls("redis-cluster://a:7000,b:7001"),
            Some(Ok(vec!["redis://a:7000".into(), "redis://b:7001".into()]))
        );
        assert_eq!(
            node_urls("rediss-cluster://app:pw@a:7000,b:7001/0?protocol=resp3"),
            Some(Ok(vec![
                "rediss://app:pw@a:7000/0?protocol=resp3".into(),
                "rediss://app:pw@b:7001/0?protocol=resp3".into()
            ]))
        );
        for bad in [
            "redis-cluster://",
            "redis-cluster://a:1,,b:2",
            "redis-cluster://:7000",
        ] {
            assert!(matches!(node_urls(bad), Some(Err(_))), "{bad}");
        }
    }
}
