//! Chained per-block hashing of token ids.
//!
//! Every part of kvroute that needs to say "these tokens are the same cached block" uses this
//! module: the engine model (as its block identity), the router's index (over the token ids
//! that vLLM's KV events carry) and the router's prompt matcher. vLLM's own hashes depend on
//! its `--prefix-caching-hash-algo` and a seed, so kvroute never tries to reproduce them; it
//! hashes token ids itself, the same way everywhere.
//!
//! A block's hash chains its parent's: `h[i] = xxh3_64(tokens[i] as little-endian u32,
//! seed = h[i-1])` with `h[-1] = root seed`. Only full blocks are hashed (vLLM caches only
//! full blocks). The bytes hashed are exactly those the earlier Python implementation hashed
//! (`xxhash.xxh3_64_intdigest` over a little-endian `uint32` buffer), so recorded hashes stay
//! valid.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Root of every chain ("kvroute" in ASCII); any fixed value works, it only has to be shared.
pub const DEFAULT_HASH_SEED: u64 = 0x006B_7672_6F75_7465;

/// vLLM's KV block size on GPU.
pub const GPU_BLOCK_SIZE: usize = 16;

/// Bytes of one block's tokens hashed from a buffer on the stack (block sizes up to 64
/// tokens; larger ones use the heap).
const STACK_BLOCK_BYTES: usize = 256;

/// A `block_size * 4`-byte buffer for one block's tokens: `stack` when it fits, else `heap`.
fn block_buffer<'a>(
    block_size: usize,
    stack: &'a mut [u8; STACK_BLOCK_BYTES],
    heap: &'a mut Vec<u8>,
) -> &'a mut [u8] {
    let len = block_size * 4;
    if len <= STACK_BLOCK_BYTES {
        &mut stack[..len]
    } else {
        heap.resize(len, 0);
        heap
    }
}

/// Hashes token sequences into chained per-block hashes.
///
/// Two hashers agree only if their block size and seed agree.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockHasher {
    block_size: usize,
    seed: u64,
}

/// A block size of zero cannot chunk anything.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ZeroBlockSize;

impl std::fmt::Display for ZeroBlockSize {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("block size must be positive, got 0")
    }
}

impl std::error::Error for ZeroBlockSize {}

impl BlockHasher {
    /// A hasher for `block_size`-token blocks whose chains start at `seed`.
    pub fn new(block_size: usize, seed: u64) -> Result<Self, ZeroBlockSize> {
        if block_size == 0 {
            return Err(ZeroBlockSize);
        }
        Ok(Self { block_size, seed })
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The root of every chain.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Hashes of the full blocks `[start_block, stop_block)` of `tokens` (the whole sequence
    /// from the start of the prompt); `parent` is the hash of block `start_block - 1` (None at
    /// the start of a chain). `stop_block` None means every full block.
    pub fn hash_blocks(
        &self,
        tokens: &[u32],
        parent: Option<u64>,
        start_block: usize,
        stop_block: Option<usize>,
    ) -> Vec<u64> {
        let full = tokens.len() / self.block_size;
        let stop = stop_block.map_or(full, |s| s.min(full));
        let mut out = Vec::with_capacity(stop.saturating_sub(start_block));
        self.extend_chain(
            &tokens[start_block.min(stop) * self.block_size..stop * self.block_size],
            parent,
            &mut out,
        );
        out
    }

    /// Append to `out` the chained hashes of the full blocks of `window`, a run of whole
    /// blocks whose first block follows the block hashed `parent` (None: the chain's start).
    /// A trailing partial block is ignored.
    pub fn extend_chain(&self, window: &[u32], parent: Option<u64>, out: &mut Vec<u64>) {
        self.chain_blocks(window, parent, out, |t| t);
    }

    /// The chain of `window`'s full blocks after `parent`, appended to `out`, each token
    /// turned into its `u32` by `token`.
    #[inline]
    fn chain_blocks<T: Copy>(
        &self,
        window: &[T],
        parent: Option<u64>,
        out: &mut Vec<u64>,
        mut token: impl FnMut(T) -> u32,
    ) {
        let mut h = parent.unwrap_or(self.seed);
        // A fixed buffer filled in place: no capacity check per token (the index's ingest
        // spends a third of its time here), on the stack for the usual block sizes.
        let (mut stack, mut heap) = ([0u8; STACK_BLOCK_BYTES], Vec::new());
        let buf = block_buffer(self.block_size, &mut stack, &mut heap);
        out.reserve(window.len() / self.block_size);
        for block in window.chunks_exact(self.block_size) {
            for (dst, &t) in buf.chunks_exact_mut(4).zip(block) {
                dst.copy_from_slice(&token(t).to_le_bytes());
            }
            h = xxh3_64_with_seed(buf, h);
            out.push(h);
        }
    }

    /// [`BlockHasher::extend_chain`] over token ids as KV events carry them (`i64`, see
    /// `BlockStored::token_ids`), converted as they are hashed instead of into a copy first
    /// (the index's ingest). False, with `out` left as it was, if an id of `window` is not a
    /// `u32`: those are not token ids, and nothing can be hashed.
    pub fn extend_chain_ids(
        &self,
        window: &[i64],
        parent: Option<u64>,
        out: &mut Vec<u64>,
    ) -> bool {
        let before = out.len();
        let mut high = 0u64;
        self.chain_blocks(window, parent, out, |t: i64| {
            high |= (t as u64) >> 32;
            t as u32
        });
        if high != 0 {
            out.truncate(before);
            return false;
        }
        true
    }

    /// Extend `hashes` (the chain of the first `hashes.len()` blocks of `tokens`) with the
    /// hashes of the full blocks of `tokens` it lacks.
    pub fn extend(&self, hashes: &mut Vec<u64>, tokens: &[u32]) {
        let have = hashes.len();
        let full = tokens.len() / self.block_size;
        if full > have {
            let parent = hashes.last().copied();
            self.extend_chain(
                &tokens[have * self.block_size..full * self.block_size],
                parent,
                hashes,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_token_ids_hash_as_tokens_do() {
        for bs in [4, 16, 100] {
            let h = BlockHasher::new(bs, 7).unwrap();
            let tokens: Vec<u32> = (0..(3 * bs as u32 + 1)).map(|t| t * 40_503).collect();
            let ids: Vec<i64> = tokens.iter().map(|&t| i64::from(t)).collect();
            let mut out = vec![1];
            assert!(h.extend_chain_ids(&ids, Some(9), &mut out));
            let mut want = vec![1];
            h.extend_chain(&tokens, Some(9), &mut want);
            assert_eq!(out, want);
            // An id that is not a u32 (here in the last block) hashes nothing.
            for bad in [-1, 1 << 32] {
                let mut ids = ids.clone();
                ids[3 * bs - 1] = bad;
                assert!(!h.extend_chain_ids(&ids, None, &mut out));
                assert_eq!(out, want);
            }
        }
    }

    #[test]
    fn chains_and_ignores_the_partial_block() {
        let h = BlockHasher::new(4, DEFAULT_HASH_SEED).unwrap();
        let tokens: Vec<u32> = (0..10).collect();
        let all = h.hash_blocks(&tokens, None, 0, None);
        assert_eq!(all.len(), 2);
        let first = xxh3_64_with_seed(
            &[0u32, 1, 2, 3]
                .iter()
                .flat_map(|t| t.to_le_bytes())
                .collect::<Vec<u8>>(),
            DEFAULT_HASH_SEED,
        );
        assert_eq!(all[0], first);
        assert_eq!(h.hash_blocks(&tokens, Some(all[0]), 1, None), vec![all[1]]);
        let mut grown = vec![all[0]];
        h.extend(&mut grown, &tokens);
        assert_eq!(grown, all);
    }

    #[test]
    fn the_seed_and_block_size_matter() {
        let tokens: Vec<u32> = (0..16).collect();
        let a = BlockHasher::new(4, 1)
            .unwrap()
            .hash_blocks(&tokens, None, 0, None);
        let b = BlockHasher::new(4, 2)
            .unwrap()
            .hash_blocks(&tokens, None, 0, None);
        let c = BlockHasher::new(8, 1)
            .unwrap()
            .hash_blocks(&tokens, None, 0, None);
        assert_ne!(a[0], b[0]);
        assert_ne!(a[1], c[0]);
        assert!(BlockHasher::new(0, 1).is_err());
    }
}
