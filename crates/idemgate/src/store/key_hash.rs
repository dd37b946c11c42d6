//! [`KeyHasher`]: the hash of a record key in the stores' in-memory indexes.

use std::hash::{BuildHasher, RandomState};

use crate::record::RecordKey;

/// Hashes record keys for a hash table. A record key is a SHA-256 digest, so its bits are
/// already evenly spread: two of its words, each mixed with a secret random seed and
/// multiplied together (the high and low halves of the product folded into one word), make the
/// hash. That is a few instructions instead of a SipHash pass over 32 bytes, and it stays
/// keyed: a client can choose keys whose digests it knows, but without the seeds it cannot
/// aim them at one place in the table.
pub(crate) struct KeyHasher {
    seeds: [u64; 2],
}

impl KeyHasher {
    /// A hasher with fresh random seeds.
    pub(crate) fn new() -> Self {
        // A fresh RandomState is seeded from the OS: what it hashes anything to is random.
        let seed = |n: u64| RandomState::new().hash_one(n);
        Self {
            seeds: [seed(0), seed(1)],
        }
    }

    pub(crate) fn hash(&self, key: &RecordKey) -> u64 {
        let word = |at: usize| {
            let mut bytes = [0; 8];
            bytes.copy_from_slice(&key.0[at..at + 8]);
            u64::from_le_bytes(bytes)
        };
        let product = u128::from(word(0) ^ self.seeds[0]) * u128::from(word(8) ^ self.seeds[1]);
        (product as u64) ^ ((product >> 64) as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_keys_hash_alike_and_hashers_differ() {
        let key = RecordKey::of(b"order-1");
        let (a, b) = (KeyHasher::new(), KeyHasher::new());
        assert_eq!(a.hash(&key), a.hash(&RecordKey::of(b"order-1")));
        assert_ne!(a.hash(&key), a.hash(&RecordKey::of(b"order-2")));
        // Each hasher draws its own seeds, so where a key lands is not known in advance.
        assert_ne!(a.hash(&key), b.hash(&key));
    }

    #[test]
    fn the_hash_spreads_keys_over_a_table() {
        // 4096 keys into 1024 buckets by the hash's low bits (hashbrown's position) and into
        // 128 groups by its top 7 bits (hashbrown's tag): no place gets far more than its
        // share of 4 or 32.
        let hasher = KeyHasher::new();
        let mut low = vec![0u32; 1024];
        let mut top = vec![0u32; 128];
        for i in 0..4096u32 {
            let h = hasher.hash(&RecordKey::of(&i.to_le_bytes()));
            low[(h & 1023) as usize] += 1;
            top[(h >> 57) as usize] += 1;
        }
        assert!(low.iter().all(|&n| n <= 20), "{:?}", low.iter().max());
        assert!(top.iter().all(|&n| n <= 64), "{:?}", top.iter().max());
    }
}
