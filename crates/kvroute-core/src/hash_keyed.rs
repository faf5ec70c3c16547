//! Hash maps keyed by values that are hashes already (block hashes, engine digests): one
//! cheap mixer for all of them, shared by the index and the engine model's block pool.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// A mixer for keys that are hashes already (xxh3 of tokens, vLLM's digests): SipHash would
/// cost more than the rest of a look-up. One folded multiply (the 128-bit product's halves
/// XORed, as foldhash and wyhash do) carries every input bit to both the low bits (the
/// bucket) and the top seven (the table's control byte), so small or sequential keys (tests,
/// odd engines) spread too; it is one `mul` where a splitmix finalizer is two and three
/// shifts.
#[derive(Default, Clone, Copy)]
pub struct MixHasher(u64);

/// An odd constant with well-spread bits (the 64-bit golden ratio).
const MIX: u64 = 0x9e37_79b9_7f4a_7c15;

impl Hasher for MixHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    #[inline]
    fn write_u64(&mut self, x: u64) {
        let full = u128::from(x ^ self.0.rotate_left(23) ^ MIX) * u128::from(MIX);
        self.0 = (full as u64) ^ ((full >> 64) as u64);
    }
}

/// A hash map keyed by a hash.
pub type HashKeyed<V> = HashMap<u64, V, BuildHasherDefault<MixHasher>>;
