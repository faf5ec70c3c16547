//! A cache from byte strings to token ids, bounded in bytes.
//!
//! Two generations approximate LRU in O(1) with no per-entry links: entries go into the current
//! generation; when it holds half the budget it becomes the previous one and the old previous one
//! is dropped whole. A hit in the previous generation moves the entry into the current one, so
//! what is used survives and what is not ages out within two generations. The key is the hash
//! the caller already computed (see [`crate::cuts::Piece::hash`]), so a lookup hashes nothing;
//! the key's bytes are stored and compared, so a hash collision is a miss, never wrong ids.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Bytes charged per entry beyond its key and ids: the table slot and two allocations' headers.
pub const ENTRY_OVERHEAD: usize = 64;

/// Passes a precomputed 64-bit hash through (the keys are already xxh3 hashes, seeded per
/// process so clients cannot aim collisions at one bucket).
#[derive(Default)]
pub struct PassThrough(u64);

impl Hasher for PassThrough {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only u64 keys are hashed; fold anything else in case a caller ever does.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

struct Entry {
    key: Box<[u8]>,
    ids: Box<[u32]>,
}

impl Entry {
    fn size(&self) -> usize {
        self.key.len() + 4 * self.ids.len() + ENTRY_OVERHEAD
    }
}

type Generation = HashMap<u64, Entry, BuildHasherDefault<PassThrough>>;

/// Token ids by byte string, within `max_bytes` (keys, ids and [`ENTRY_OVERHEAD`] each).
pub struct ByteCache {
    current: Generation,
    previous: Generation,
    current_bytes: usize,
    previous_bytes: usize,
    max_bytes: usize,
    /// Entries dropped to stay within the bound (cumulative).
    pub evictions: u64,
}

impl ByteCache {
    /// An empty cache that holds at most `max_bytes`.
    pub fn new(max_bytes: usize) -> Self {
        Self {
            current: Generation::default(),
            previous: Generation::default(),
            current_bytes: 0,
            previous_bytes: 0,
            max_bytes,
            evictions: 0,
        }
    }

    /// Whether an entry of `key_len` bytes and `ids` ids is small enough to be cached at all
    /// (an eighth of the budget: one huge text must not flush everything else).
    pub fn admits(&self, key_len: usize, ids: usize) -> bool {
        (key_len + 4 * ids + ENTRY_OVERHEAD).saturating_mul(8) <= self.max_bytes
    }

    /// The ids cached for `key` (whose hash is `hash`), kept fresh.
    #[inline]
    pub fn get(&mut self, hash: u64, key: &[u8]) -> Option<&[u32]> {
        if self.current.get(&hash).is_some_and(|e| *e.key == *key) {
            return self.current.get(&hash).map(|e| &*e.ids);
        }
        if self.previous.get(&hash).is_none_or(|e| *e.key != *key) {
            return None;
        }
        let entry = self.previous.remove(&hash).expect("present");
        self.previous_bytes -= entry.size();
        self.insert_entry(hash, entry);
        self.current.get(&hash).map(|e| &*e.ids)
    }

    /// Caches `ids` for `key` (hash `hash`) if [`admits`](Self::admits) allows; replaces what
    /// the hash held (the same key again, or a colliding one).
    pub fn insert(&mut self, hash: u64, key: &[u8], ids: &[u32]) {
        if !self.admits(key.len(), ids.len()) {
            return;
        }
        self.insert_entry(
            hash,
            Entry {
                key: key.into(),
                ids: ids.into(),
            },
        );
    }

    fn insert_entry(&mut self, hash: u64, entry: Entry) {
        if self.current_bytes + entry.size() > self.max_bytes / 2 {
            self.evictions += self.previous.len() as u64;
            self.previous = std::mem::take(&mut self.current);
            self.previous_bytes = self.current_bytes;
            self.current_bytes = 0;
        }
        if let Some(old) = self.previous.remove(&hash) {
            self.previous_bytes -= old.size();
            self.evictions += 1;
        }
        self.current_bytes += entry.size();
        if let Some(old) = self.current.insert(hash, entry) {
            self.current_bytes -= old.size();
            self.evictions += 1;
        }
    }

    /// Bytes the entries hold (at most the budget).
    pub fn nbytes(&self) -> usize {
        self.current_bytes + self.previous_bytes
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.current.len() + self.previous.len()
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops every entry (not counted as evictions).
    pub fn clear(&mut self) {
        self.current.clear();
        self.previous.clear();
        self.current_bytes = 0;
        self.previous_bytes = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hit_miss_and_collision() {
        let mut c = ByteCache::new(1 << 20);
        c.insert(1, b"abc", &[1, 2]);
        assert_eq!(c.get(1, b"abc"), Some(&[1u32, 2][..]));
        // Same hash, other bytes: a miss, and inserting it replaces the entry.
        assert_eq!(c.get(1, b"abd"), None);
        c.insert(1, b"abd", &[3]);
        assert_eq!(c.get(1, b"abc"), None);
        assert_eq!(c.get(1, b"abd"), Some(&[3u32][..]));
        assert_eq!(c.len(), 1);
    }

    #[test]
    fn stays_within_bytes_and_keeps_what_is_used() {
        let budget = 64 * 1024;
        let mut c = ByteCache::new(budget);
        let key = [7u8; 100];
        let ids = [0u32; 100];
        let hot = 1_000_000u64;
        c.insert(hot, b"hot", &[42]);
        for h in 0..10_000u64 {
            c.insert(h, &key, &ids);
            assert!(c.nbytes() <= budget, "{} > {budget}", c.nbytes());
            assert_eq!(c.get(hot, b"hot"), Some(&[42u32][..]), "after {h}");
        }
        assert!(c.evictions > 9_000);
        assert!(!c.admits(budget, 0));
        c.insert(5, &vec![0u8; budget], &[]);
        assert_eq!(c.get(5, &vec![0u8; budget]), None);
    }
}
