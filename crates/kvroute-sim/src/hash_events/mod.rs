//! The simulator's fast path for its own engines' KV events: the engine model hashes blocks
//! with the index's own hasher, so its block hashes are the index's own hashes of the same
//! tokens. Its events then need neither re-hashing nor an engine → own map, and the engines
//! hand them over as [`HashEvents`] (hashes only, no tokens copied) to an index whose store
//! is [`EngineHashes`] ([`trust_engine_hashes`], [`apply_hash_events`]): the same entries and
//! answers as the router's own store, for half the table work per event.
//!
//! The router's index never takes an engine's hashes as its own (a real vLLM's depend on a
//! hash algorithm and seed it cannot know), hence this lives with the simulator.

mod store;

use kvroute_core::kvevents::events::KvCacheEvent;

pub use self::store::{EngineHashes, apply_hash_events, trust_engine_hashes, trusts_engine_hashes};

/// A step's KV events reduced to what an index that takes the engine's block hashes as its
/// own reads of them ([`apply_hash_events`]): which hashes were evicted
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
