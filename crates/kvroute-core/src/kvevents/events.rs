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

/// A step's KV events reduced to what an index that takes the engine's block hashes as its
/// own reads of them (`crate::index::KvIndex::apply_hash_events`): which hashes were evicted
/// and which were stored under which parent, in the order the engine emitted them, and no
/// tokens. The simulator's own engines emit these to its own index instead of
/// [`KvCacheEvent`]s: a 12k-token prefill then costs one append of its hashes instead of a
/// copy of its tokens as `i64` and four allocations, and an eviction one append instead of
/// an event of its own (two allocations), the index's work being the same.
///
/// `runs` cut `hashes` into consecutive pieces; consecutive evictions share one run.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HashEvents {
    /// Every run's hashes, concatenated.
    pub hashes: Vec<u64>,
    /// The runs, in order.
    pub runs: Vec<HashRun>,
}

/// One run of [`HashEvents`]: what happened to `hashes[previous run's end..end]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HashRun {
    /// Evicted, one `BlockRemoved` each, in this order.
    Removed {
        /// End of the run in `hashes`.
        end: usize,
    },
    /// One `BlockStored` of these blocks, in chain order, after `parent`.
    Stored {
        /// The block before the first one (None: the first block starts the prompt).
        parent: Option<u64>,
        /// End of the run in `hashes`.
        end: usize,
    },
    /// `AllBlocksCleared` (a run of no hashes).
    AllCleared,
}

/// A borrowed [`HashRun`] with its hashes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HashEvent<'a> {
    /// Evicted, in order.
    Removed(&'a [u64]),
    /// Stored after `parent`, in chain order.
    Stored {
        /// The block before the first one.
        parent: Option<u64>,
        /// The blocks' hashes.
        hashes: &'a [u64],
    },
    /// Everything cleared.
    AllCleared,
}

impl HashEvents {
    /// Whether nothing happened.
    pub fn is_empty(&self) -> bool {
        self.runs.is_empty()
    }

    /// Forget every run (keeping the buffers).
    pub fn clear(&mut self) {
        self.hashes.clear();
        self.runs.clear();
    }

    /// One evicted block (joins the run of evictions just before it, if any).
    #[inline]
    pub fn push_removed(&mut self, hash: u64) {
        self.hashes.push(hash);
        let end = self.hashes.len();
        match self.runs.last_mut() {
            Some(HashRun::Removed { end: e }) => *e = end,
            _ => self.runs.push(HashRun::Removed { end }),
        }
    }

    /// Blocks stored in chain order after `parent`.
    pub fn push_stored(&mut self, parent: Option<u64>, hashes: &[u64]) {
        self.hashes.extend_from_slice(hashes);
        self.runs.push(HashRun::Stored {
            parent,
            end: self.hashes.len(),
        });
    }

    /// The cache was reset.
    pub fn push_cleared(&mut self) {
        self.runs.push(HashRun::AllCleared);
    }

    /// The hash events of full `events` (their token ids, block size and other fields
    /// dropped: for engines that hash as the index does and emit plain blocks).
    pub fn from_events(events: &[KvCacheEvent]) -> Self {
        let mut out = Self::default();
        for event in events {
            match event {
                KvCacheEvent::Stored(s) => out.push_stored(s.parent_block_hash, &s.block_hashes),
                KvCacheEvent::Removed(r) => {
                    r.block_hashes.iter().for_each(|&h| out.push_removed(h))
                }
                KvCacheEvent::AllCleared => out.push_cleared(),
            }
        }
        out
    }

    /// The runs in order, each with its hashes.
    pub fn iter(&self) -> impl Iterator<Item = HashEvent<'_>> + '_ {
        let mut start = 0;
        self.runs.iter().map(move |run| match *run {
            HashRun::Removed { end } => {
                let s = &self.hashes[start..end];
                start = end;
                HashEvent::Removed(s)
            }
            HashRun::Stored { parent, end } => {
                let s = &self.hashes[start..end];
                start = end;
                HashEvent::Stored { parent, hashes: s }
            }
            HashRun::AllCleared => HashEvent::AllCleared,
        })
    }
}
