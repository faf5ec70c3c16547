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
//!
//! **Extra keys.** vLLM mixes more than tokens into a block's hash
//! (`vllm/v1/core/kv_cache_utils.py`: `generate_block_hash_extra_keys`, `hash_block_tokens`):
//! the tuple `(parent_hash, token_ids, extra_keys)` is hashed, where a text request's
//! `extra_keys` are its LoRA adapter's name on every block and its `cache_salt` on the first
//! block only (`(lora_name, cache_salt)` there; None when neither applies). kvroute keeps its
//! own hash function but the same rule ([`BlockKeys`]): a block with keys hashes its tokens'
//! bytes followed by [`encode_extra_keys`] of them, so the same tokens under another adapter
//! or salt are another block, and a block without keys hashes exactly as before. Multimodal
//! and prompt-embedding keys are not text: kvroute cannot produce them for a prompt, so
//! blocks that carry them are never indexed (`crate::index`).

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

/// The bytes one block's extra keys add to its hashed bytes: each key as its UTF-8 length
/// (u32, little-endian) then its bytes, so that no two key tuples encode alike. Empty for no
/// keys (vLLM's `extra_keys = None`), which keeps a plain block's hash what it always was.
pub fn encode_extra_keys<S: AsRef<str>>(keys: &[S]) -> Vec<u8> {
    let mut out = Vec::with_capacity(keys.iter().map(|k| 4 + k.as_ref().len()).sum());
    for key in keys {
        let key = key.as_ref().as_bytes();
        out.extend_from_slice(&(key.len() as u32).to_le_bytes());
        out.extend_from_slice(key);
    }
    out
}

/// What vLLM mixes into a text request's block hashes besides its tokens: the LoRA adapter's
/// name (every block) and the `cache_salt` (the first block of the sequence only). The
/// default, no adapter and no salt, is a plain request.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct BlockKeys {
    /// The LoRA adapter the request runs under (`model` naming a `--lora-modules` entry).
    pub lora_name: Option<String>,
    /// The request's `cache_salt` (vLLM ignores an empty one).
    pub cache_salt: Option<String>,
}

impl BlockKeys {
    /// A plain request's keys: none.
    pub const PLAIN: BlockKeys = BlockKeys {
        lora_name: None,
        cache_salt: None,
    };

    /// Keys for a request under `lora_name` with `cache_salt` (an empty salt counts as none,
    /// as in vLLM).
    pub fn new(lora_name: Option<&str>, cache_salt: Option<&str>) -> Self {
        Self {
            lora_name: lora_name.map(str::to_owned),
            cache_salt: cache_salt.filter(|s| !s.is_empty()).map(str::to_owned),
        }
    }

    /// No adapter and no salt: blocks hash by their tokens alone.
    pub fn is_plain(&self) -> bool {
        self.lora_name.is_none() && self.cache_salt.is_none()
    }

    /// The extra-key tuple of block `index` of the sequence, in vLLM's order (LoRA name, then
    /// the salt on block 0); empty when the block has none.
    pub fn for_block(&self, index: usize) -> Vec<&str> {
        let salt = self.cache_salt.as_deref().filter(|_| index == 0);
        self.lora_name.as_deref().into_iter().chain(salt).collect()
    }

    /// [`encode_extra_keys`] of block `index`'s tuple.
    fn encoded(&self, index: usize) -> Vec<u8> {
        encode_extra_keys(&self.for_block(index))
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
        self.chain_blocks(window, parent, out, |t| t, |_| None);
    }

    /// [`BlockHasher::extend_chain`] for a request with `keys`: `window` starts at block
    /// `first_block` of the sequence (0 exactly when `parent` is None), which decides where
    /// the salt goes.
    pub fn extend_chain_keyed(
        &self,
        window: &[u32],
        parent: Option<u64>,
        first_block: usize,
        keys: &BlockKeys,
        out: &mut Vec<u64>,
    ) {
        if keys.is_plain() {
            return self.extend_chain(window, parent, out);
        }
        let (first, rest) = (keys.encoded(first_block), keys.encoded(first_block + 1));
        self.chain_blocks(
            window,
            parent,
            out,
            |t| t,
            |i| Some(if i == 0 { &first[..] } else { &rest[..] }),
        );
    }

    /// [`BlockHasher::hash_blocks`] for a request with `keys` (see [`BlockKeys`]).
    pub fn hash_blocks_keyed(
        &self,
        tokens: &[u32],
        parent: Option<u64>,
        start_block: usize,
        stop_block: Option<usize>,
        keys: &BlockKeys,
    ) -> Vec<u64> {
        let full = tokens.len() / self.block_size;
        let stop = stop_block.map_or(full, |s| s.min(full));
        let start = start_block.min(stop);
        let mut out = Vec::with_capacity(stop - start);
        self.extend_chain_keyed(
            &tokens[start * self.block_size..stop * self.block_size],
            parent,
            start,
            keys,
            &mut out,
        );
        out
    }

    /// The chain of `window`'s full blocks after `parent`, appended to `out`, each token
    /// turned into its `u32` by `token`.
    /// `extra(i)` gives the encoded extra keys of the window's block `i` (None or empty:
    /// none), hashed after its tokens.
    #[inline]
    fn chain_blocks<'k, T: Copy>(
        &self,
        window: &[T],
        parent: Option<u64>,
        out: &mut Vec<u64>,
        mut token: impl FnMut(T) -> u32,
        extra: impl Fn(usize) -> Option<&'k [u8]>,
    ) {
        let mut h = parent.unwrap_or(self.seed);
        // A fixed buffer filled in place: no capacity check per token (the index's ingest
        // spends a third of its time here), on the stack for the usual block sizes.
        let (mut stack, mut heap) = ([0u8; STACK_BLOCK_BYTES], Vec::new());
        let buf = block_buffer(self.block_size, &mut stack, &mut heap);
        let mut keyed = Vec::new();
        out.reserve(window.len() / self.block_size);
        for (i, block) in window.chunks_exact(self.block_size).enumerate() {
            for (dst, &t) in buf.chunks_exact_mut(4).zip(block) {
                dst.copy_from_slice(&token(t).to_le_bytes());
            }
            h = match extra(i).filter(|k| !k.is_empty()) {
                None => xxh3_64_with_seed(buf, h),
                Some(keys) => {
                    keyed.clear();
                    keyed.extend_from_slice(buf);
                    keyed.extend_from_slice(keys);
                    xxh3_64_with_seed(&keyed, h)
                }
            };
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
        self.extend_chain_ids_keyed(window, parent, &[], out)
    }

    /// [`BlockHasher::extend_chain_ids`] with each block's encoded extra keys
    /// ([`encode_extra_keys`] of the tuple its `BlockStored` event carries; a block past the
    /// end of `keys` has none).
    pub fn extend_chain_ids_keyed(
        &self,
        window: &[i64],
        parent: Option<u64>,
        keys: &[Vec<u8>],
        out: &mut Vec<u64>,
    ) -> bool {
        let before = out.len();
        let mut high = 0u64;
        let token = |t: i64| {
            high |= (t as u64) >> 32;
            t as u32
        };
        if keys.is_empty() {
            self.chain_blocks(window, parent, out, token, |_| None);
        } else {
            self.chain_blocks(window, parent, out, token, |i| {
                keys.get(i).map(Vec::as_slice)
            });
        }
        if high != 0 {
            out.truncate(before);
            return false;
        }
        true
    }

    /// Extend `hashes` (the chain of the first `hashes.len()` blocks of `tokens`) with the
    /// hashes of the full blocks of `tokens` it lacks.
    pub fn extend(&self, hashes: &mut Vec<u64>, tokens: &[u32]) {
        self.extend_keyed(hashes, tokens, &BlockKeys::default());
    }

    /// [`BlockHasher::extend`] for a request with `keys`.
    pub fn extend_keyed(&self, hashes: &mut Vec<u64>, tokens: &[u32], keys: &BlockKeys) {
        let have = hashes.len();
        let full = tokens.len() / self.block_size;
        if full > have {
            let parent = hashes.last().copied();
            self.extend_chain_keyed(
                &tokens[have * self.block_size..full * self.block_size],
                parent,
                have,
                keys,
                hashes,
            );
        }
    }
}

/// The blocks of a vLLM pool of `num_blocks` that can hold KV: all but the reserved null
/// block (block 0). The one owner of that rule: the router counts a worker's
/// `num_gpu_blocks` by it, the engine model sizes its pool by it, and the Python side takes it
/// as `kvroute._native.usable_blocks`.
pub const fn usable_blocks(num_blocks: usize) -> usize {
    num_blocks.saturating_sub(1)
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
    fn extra_keys_follow_vllms_rule() {
        let h = BlockHasher::new(4, DEFAULT_HASH_SEED).unwrap();
        let tokens: Vec<u32> = (0..12).collect();
        let plain = h.hash_blocks(&tokens, None, 0, None);
        // No keys (and an empty salt, which vLLM ignores) hash as tokens alone.
        let none = BlockKeys::new(None, Some(""));
        assert!(none.is_plain());
        assert_eq!(h.hash_blocks_keyed(&tokens, None, 0, None, &none), plain);
        // A salt changes the first block, hence (by the chain) every block after it.
        let salted = h.hash_blocks_keyed(&tokens, None, 0, None, &BlockKeys::new(None, Some("s")));
        assert!(salted.iter().zip(&plain).all(|(a, b)| a != b));
        // ... but only the first block's own bytes: the rest hash as plain blocks on that parent.
        assert_eq!(
            h.hash_blocks(&tokens, Some(salted[0]), 1, None),
            salted[1..]
        );
        let other = h.hash_blocks_keyed(&tokens, None, 0, None, &BlockKeys::new(None, Some("t")));
        assert_ne!(salted[0], other[0]);
        // An adapter keys every block.
        let a = BlockKeys::new(Some("a"), None);
        let lora = h.hash_blocks_keyed(&tokens, None, 0, None, &a);
        assert_ne!(h.hash_blocks(&tokens, Some(lora[0]), 1, None), lora[1..]);
        assert_eq!(a.for_block(0), vec!["a"]);
        let both = BlockKeys::new(Some("a"), Some("s"));
        assert_eq!(both.for_block(0), vec!["a", "s"]);
        assert_eq!(both.for_block(3), vec!["a"]);
        // The ids path with per-block event keys agrees with the request path.
        let ids: Vec<i64> = tokens.iter().map(|&t| i64::from(t)).collect();
        let keys: Vec<Vec<u8>> = (0..3)
            .map(|i| encode_extra_keys(&both.for_block(i)))
            .collect();
        let mut out = Vec::new();
        assert!(h.extend_chain_ids_keyed(&ids, None, &keys, &mut out));
        assert_eq!(out, h.hash_blocks_keyed(&tokens, None, 0, None, &both));
        // Growing a keyed chain block by block gives the same chain.
        let mut grown = h.hash_blocks_keyed(&tokens[..4], None, 0, None, &both);
        h.extend_keyed(&mut grown, &tokens, &both);
        assert_eq!(grown, out);
        // Key tuples are encoded without ambiguity.
        assert_ne!(
            encode_extra_keys(&["ab", "c"]),
            encode_extra_keys(&["a", "bc"])
        );
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
