//! Prompt tokens of a published trace, synthesized per hash id.
//!
//! Mooncake's traces carry no text: each request lists `hash_ids`, one per 512-token block,
//! equal ids meaning equal content. A replay needs tokens whose blocks are equal exactly when
//! the ids are, at any engine block size dividing 512, so each id gets 512 token ids from a
//! pure function of the id (`kvroute.trace.format.block_tokens`, whose formula this is):
//! token `p` of id `h` is `vocab[splitmix64(key + p) % len(vocab)]` with
//! `key = splitmix64(seed · 2³² + h) · 512`, all in wrapping `u64`. Native because a long
//! trace has ~10⁵ distinct ids (~10⁸ tokens): elementwise in numpy that was most of a
//! replay's set-up.

use std::sync::Arc;

/// Tokens per hash id (Mooncake's block size).
pub const TRACE_BLOCK_TOKENS: usize = 512;

/// SplitMix64's finalizer (after its increment), the mixing step of the formula.
#[inline]
pub fn splitmix64(x: u64) -> u64 {
    let mut x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The key of hash id `h` under `seed`: token `p` of the id is drawn by `key + p`.
#[inline]
fn block_key(seed: u64, h: u64) -> u64 {
    splitmix64((seed << 32).wrapping_add(h)).wrapping_mul(TRACE_BLOCK_TOKENS as u64)
}

/// Write the [`TRACE_BLOCK_TOKENS`] tokens of each of `hash_ids` into `out` (that many per
/// id, in order), drawn from `vocab` (not empty) under `seed`.
pub fn blocks_tokens_into(hash_ids: &[u64], vocab: &[u32], seed: u64, out: &mut [u32]) {
    assert!(!vocab.is_empty(), "an empty vocabulary");
    assert_eq!(out.len(), hash_ids.len() * TRACE_BLOCK_TOKENS);
    let n = vocab.len() as u64;
    for (&h, block) in hash_ids
        .iter()
        .zip(out.chunks_exact_mut(TRACE_BLOCK_TOKENS))
    {
        let key = block_key(seed, h);
        for (p, t) in block.iter_mut().enumerate() {
            *t = vocab[(splitmix64(key.wrapping_add(p as u64)) % n) as usize];
        }
    }
}

/// A trace request's prompt: the tokens of its `hash_ids`, block after block, cut to its
/// first `input_length` (at most 512 per id), drawn straight into the shared slice the
/// simulator's requests hold (one allocation, no intermediate copy: a long trace's prompts
/// are ~10⁸ tokens, and touching fresh memory is most of what building them costs).
pub fn prompt_tokens(
    hash_ids: &[u64],
    input_length: usize,
    vocab: &[u32],
    seed: u64,
) -> Arc<[u32]> {
    assert!(!vocab.is_empty(), "an empty vocabulary");
    assert!(
        input_length <= hash_ids.len() * TRACE_BLOCK_TOKENS,
        "{input_length} tokens need more than {} hash ids",
        hash_ids.len()
    );
    let n = vocab.len() as u64;
    let keys: Vec<u64> = hash_ids.iter().map(|&h| block_key(seed, h)).collect();
    (0..input_length)
        .map(|p| {
            let key = keys[p / TRACE_BLOCK_TOKENS];
            vocab[(splitmix64(key.wrapping_add((p % TRACE_BLOCK_TOKENS) as u64)) % n) as usize]
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_ids_give_equal_blocks_and_tokens_come_from_the_vocabulary() {
        let vocab: Vec<u32> = (1000..30000).collect();
        let mut out = vec![0; 3 * TRACE_BLOCK_TOKENS];
        blocks_tokens_into(&[7, 8, 7], &vocab, 0, &mut out);
        let (a, rest) = out.split_at(TRACE_BLOCK_TOKENS);
        let (b, c) = rest.split_at(TRACE_BLOCK_TOKENS);
        assert_eq!(a, c);
        assert_ne!(a, b);
        assert!(out.iter().all(|t| (1000..30000).contains(t)));
        let mut seeded = vec![0; TRACE_BLOCK_TOKENS];
        blocks_tokens_into(&[7], &vocab, 1, &mut seeded);
        assert_ne!(a, &seeded[..]);
    }

    #[test]
    fn the_formula_by_hand() {
        // Token 3 of id 5 under seed 2, by the documented formula.
        let vocab: Vec<u32> = (0..97).collect();
        let mut out = vec![0; TRACE_BLOCK_TOKENS];
        blocks_tokens_into(&[5], &vocab, 2, &mut out);
        let key = splitmix64((2u64 << 32) + 5).wrapping_mul(512);
        assert_eq!(u64::from(out[3]), splitmix64(key + 3) % 97);
    }

    #[test]
    fn a_prompt_is_its_blocks_cut_to_its_length() {
        let vocab: Vec<u32> = (1000..30000).collect();
        let mut blocks = vec![0; 3 * TRACE_BLOCK_TOKENS];
        blocks_tokens_into(&[4, 9, 4], &vocab, 3, &mut blocks);
        let prompt = prompt_tokens(&[4, 9, 4], 2 * TRACE_BLOCK_TOKENS + 17, &vocab, 3);
        assert_eq!(&prompt[..], &blocks[..2 * TRACE_BLOCK_TOKENS + 17]);
        assert!(prompt_tokens(&[], 0, &vocab, 3).is_empty());
    }
}
