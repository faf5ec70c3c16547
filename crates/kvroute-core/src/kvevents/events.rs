//! KV cache events as plain data.
//!
//! These mirror vLLM's `vllm.distributed.kv_events` (BlockStored, BlockRemoved,
//! AllBlocksCleared) field for field, so the emulator's publisher can put them on the wire
//! unchanged and the router's index consumes the same values decoded from a real vLLM
//! (`crate::kvevents::codec`). The engine model emits them; it never serializes anything.

/// An `extra_keys` entry of a stored block: vLLM sends one per block (multimodal hashes,
/// cache salt, LoRA…), or none. The index only needs to know whether a block has any, so
/// values are kept as opaque msgpack.
pub type ExtraKey = Option<Vec<u8>>;

/// Full blocks newly cached, in chain order.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockStored {
    /// The engine's hashes of the blocks (low 64 bits of its digest).
    pub block_hashes: Vec<u64>,
    /// The engine hash of the block before the first one; None when the first block starts
    /// the prompt.
    pub parent_block_hash: Option<u64>,
    /// Every token of those blocks (`block_hashes.len() * block_size`), generated ones
    /// included. i64, not u32: a malformed event may carry anything, and the index must be
    /// able to tell (and skip) ids that are not `u32`.
    pub token_ids: Vec<i64>,
    pub block_size: usize,
    pub lora_id: Option<i64>,
    pub medium: Option<String>,
    pub lora_name: Option<String>,
    /// None when the event carried no `extra_keys` field or null.
    pub extra_keys: Option<Vec<ExtraKey>>,
    pub group_idx: i64,
    pub kv_cache_spec_kind: Option<String>,
}

/// Cached blocks evicted because their memory was reused (not when a request finishes).
#[derive(Clone, Debug, PartialEq)]
pub struct BlockRemoved {
    pub block_hashes: Vec<u64>,
    pub medium: Option<String>,
    pub group_idx: i64,
}

/// One KV cache event.
#[derive(Clone, Debug, PartialEq)]
pub enum KvCacheEvent {
    Stored(BlockStored),
    Removed(BlockRemoved),
    /// The whole prefix cache was reset.
    AllCleared,
}

/// Events produced by one engine step, stamped with the step's time (seconds).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EventBatch {
    pub ts: f64,
    pub events: Vec<KvCacheEvent>,
    pub data_parallel_rank: Option<i64>,
}

impl BlockStored {
    /// A plain stored run as the engine model emits it (GPU medium, group 0, no LoRA, no
    /// extra keys, full attention).
    pub fn plain(
        block_hashes: Vec<u64>,
        parent_block_hash: Option<u64>,
        token_ids: Vec<i64>,
        block_size: usize,
    ) -> Self {
        Self {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_id: None,
            medium: Some("GPU".into()),
            lora_name: None,
            extra_keys: None,
            group_idx: 0,
            kv_cache_spec_kind: Some("full_attention".into()),
        }
    }
}

impl BlockRemoved {
    /// A removal as the engine model emits it: one hash, GPU medium, group 0.
    pub fn plain(block_hashes: Vec<u64>) -> Self {
        Self {
            block_hashes,
            medium: Some("GPU".into()),
            group_idx: 0,
        }
    }
}
