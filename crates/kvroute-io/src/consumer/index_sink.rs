//! Where one stream's items go: decoded batches and resets for the shared index (applied at
//! the end of a turn, under one lock), notices and counters for Python.

use std::sync::Arc;

use kvroute_core::index::{KvIndex, WorkerId};
use kvroute_core::kvevents::codec::{self, DecodedBatch};

use super::shared::{Counters, Item, Notice, Shared, SharedIndex, bump};

/// What the index must do for one stream, in order, at the end of the turn (under one lock
/// for every stream).
pub(super) enum IndexOp {
    Apply(DecodedBatch),
    Reset,
}

/// Where one stream's items go.
pub(super) struct IndexSink {
    pub(super) worker: String,
    pub(super) index: Option<SharedIndex>,
    pub(super) counters: Arc<Counters>,
    pub(super) shared: Arc<Shared>,
    /// Index mode: what this turn decoded, applied at its end.
    pub(super) pending: Vec<IndexOp>,
    /// The worker's id in the index and the index's epoch it was resolved at (ids stay
    /// valid while the epoch does): no look-up by name per batch.
    pub(super) id: Option<(u64, WorkerId)>,
}

impl IndexSink {
    pub(super) fn post(&self, item: Item) {
        self.shared.post(Notice {
            worker: self.worker.clone(),
            item,
        });
    }

    /// Decode and deliver batch `seq`: queue it for the index (index mode) or post it.
    pub(super) fn deliver(&mut self, seq: u64, payload: &[u8], replayed: bool) {
        match codec::decode_batch(payload) {
            Ok(batch) => {
                let c = &self.counters;
                bump(&c.batches, 1);
                bump(&c.events, batch.events.len() as u64);
                bump(&c.unknown_events, batch.unknown_events as u64);
                if self.index.is_some() {
                    self.pending.push(IndexOp::Apply(batch));
                } else {
                    self.post(Item::Batch {
                        seq,
                        batch,
                        replayed,
                    });
                }
            }
            Err(error) => self.malformed(Some(seq), error.0),
        }
    }

    /// Do what this turn queued to `index`.
    pub(super) fn apply(&mut self, index: &mut KvIndex) {
        for op in self.pending.drain(..) {
            match op {
                IndexOp::Apply(batch) => {
                    let id = match self.id {
                        Some((epoch, id)) if epoch == index.epoch() => id,
                        _ => {
                            let id = index.ensure_worker(&self.worker);
                            self.id = Some((index.epoch(), id));
                            id
                        }
                    };
                    index.apply_to(id, &batch.events);
                }
                IndexOp::Reset => index.reset_worker(&self.worker),
            }
        }
    }

    pub(super) fn reset(&mut self) {
        if self.index.is_some() {
            // What was queued before is superseded.
            self.pending.clear();
            self.pending.push(IndexOp::Reset);
        }
    }

    pub(super) fn gap(&self, expected: u64, got: u64) {
        bump(&self.counters.gaps, 1);
        if self.index.is_none() {
            self.post(Item::Gap { expected, got });
        }
    }

    pub(super) fn replay_failed(&mut self, expected: u64, got: u64, reason: String) {
        bump(&self.counters.replay_failures, 1);
        self.reset();
        self.post(Item::ReplayFailed {
            expected,
            got,
            reason,
        });
    }

    pub(super) fn restarted(&mut self, last_seq: Option<u64>, new_seq: u64) {
        bump(&self.counters.restarts, 1);
        self.reset();
        self.post(Item::Restarted { last_seq, new_seq });
    }

    pub(super) fn malformed(&mut self, seq: Option<u64>, error: String) {
        bump(&self.counters.malformed, 1);
        self.reset();
        self.post(Item::Malformed { seq, error });
    }
}
