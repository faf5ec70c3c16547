//! The per-worker model of vLLM's LRU free queue as the router sees it: runs of blocks
//! ([`Segment`]s) that are a tracked prefix or garbage, head (next evicted) first, with its
//! twin that no refresh ever touched (the plain LRU), the prefixes the worker reused, and the
//! requests it runs now.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

/// A prefix the router saw a worker reuse.
#[derive(Clone, Debug)]
pub(super) struct Tracked {
    pub(super) blocks: usize,
    pub(super) prompt: Arc<[u32]>,
    pub(super) hashes: Arc<[u64]>,
    /// The worker's request count at its last use.
    pub(super) last_use: u64,
    /// Smoothed worker requests between uses.
    pub(super) gap: f64,
    /// Uses seen with the prefix credited (the first, which taught it, included).
    pub(super) reuses: u32,
    /// It took the place of shorter tracked prefixes inside it (a conversation's next turn).
    pub(super) extends: bool,
    /// The index said it was gone at the last check (cleared by its next use).
    pub(super) gone: bool,
    /// The worker's request count at its last use or refresh.
    pub(super) last_touch: u64,
}

impl Tracked {
    /// Worker requests between uses, as far as the router can tell now: the smoothed gap,
    /// or the time since the last use when that is longer (a prefix gone cold).
    pub(super) fn interval(&self, requests: u64) -> f64 {
        self.gap
            .max(requests.saturating_sub(self.last_use) as f64)
            .max(1.0)
    }
}

/// A run of blocks in a worker's modelled free queue: a tracked prefix, or (None) blocks no
/// later request shares.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Segment {
    pub(super) key: Option<u64>,
    pub(super) blocks: usize,
}

/// A modelled free queue, head (next evicted) first; blocks not in it are uncached.
#[derive(Clone, Debug, Default)]
pub(super) struct FreeQueue {
    pub(super) segments: VecDeque<Segment>,
}

impl FreeQueue {
    pub(super) fn held(&self) -> usize {
        self.segments.iter().map(|s| s.blocks).sum()
    }

    /// The leading blocks of tracked prefix `key` it holds.
    pub(super) fn holds(&self, key: u64) -> usize {
        self.segments
            .iter()
            .find(|s| s.key == Some(key))
            .map_or(0, |s| s.blocks)
    }

    pub(super) fn take(&mut self, key: u64) {
        if let Some(i) = self.segments.iter().position(|s| s.key == Some(key)) {
            self.segments.remove(i);
            // Merge the garbage on either side, so the queue stays short.
            if i > 0
                && i < self.segments.len()
                && self.segments[i - 1].key.is_none()
                && self.segments[i].key.is_none()
            {
                let b = self.segments[i].blocks;
                self.segments[i - 1].blocks += b;
                self.segments.remove(i);
            }
        }
    }

    /// A prefix no longer tracked: its blocks stay, as garbage.
    pub(super) fn forget(&mut self, key: u64) {
        if let Some(s) = self.segments.iter_mut().find(|s| s.key == Some(key)) {
            s.key = None;
        }
    }

    pub(super) fn push_tail(&mut self, key: Option<u64>, blocks: usize) {
        if blocks == 0 {
            return;
        }
        if key.is_none()
            && let Some(last) = self.segments.back_mut()
            && last.key.is_none()
        {
            last.blocks += blocks;
            return;
        }
        self.segments.push_back(Segment { key, blocks });
    }

    /// Make room for `n` blocks about to go to the tail: uncached ones first, then from the
    /// head (tail-first within a prefix: a shortened prefix segment is a partly evicted one).
    pub(super) fn allocate(&mut self, n: usize, capacity: usize) {
        let mut n = (self.held() + n).saturating_sub(capacity);
        while n > 0 {
            let Some(head) = self.segments.front_mut() else {
                break;
            };
            if head.blocks > n {
                head.blocks -= n;
                break;
            }
            n -= head.blocks;
            self.segments.pop_front();
        }
    }
}

/// One worker's model.
#[derive(Clone, Debug, Default)]
pub(super) struct WorkerModel {
    /// The modelled free queue, refreshes included.
    pub(super) queue: FreeQueue,
    /// The same worker's free queue had no refresh been sent (the same requests routed):
    /// what its plain LRU would hold, against which `auto` measures what refreshes buy.
    pub(super) shadow: FreeQueue,
    pub(super) tracked: HashMap<u64, Tracked>,
    /// Requests routed here.
    pub(super) requests: u64,
    /// Smoothed new blocks per request (its own suffix and output).
    pub(super) new_blocks: f64,
    /// The last requests routed here, newest last: (tracked prefix, its blocks, the request's
    /// own new blocks). Requests finish about in the order they came, so the newest
    /// `in_flight` of them are what the worker runs now.
    pub(super) recent: VecDeque<(Option<u64>, usize, usize)>,
    /// Its usable KV blocks as its engine reported them (None: the configured ones).
    pub(super) capacity: Option<usize>,
}

/// Requests remembered per worker for [`WorkerModel::recent`].
pub(super) const RECENT: usize = 64;

pub(super) const SMOOTHING: f64 = 0.3;

impl WorkerModel {
    /// What the running requests pin, and their prefixes: the newest `in_flight` routed here
    /// (requests finish about in the order they came), each its own blocks, and their
    /// prefixes once each.
    pub(super) fn running(&self, in_flight: i64) -> (usize, Vec<Option<u64>>) {
        let mut pinned = 0;
        let mut keys: Vec<Option<u64>> = Vec::new();
        for &(key, prefix, own) in self.recent.iter().rev().take(in_flight.max(0) as usize) {
            pinned += own;
            if key.is_none() || !keys.contains(&key) {
                pinned += prefix;
            }
            keys.push(key);
        }
        (pinned, keys)
    }
}
