//! The interface every balancing policy implements, and the error its options raise.

use super::view::{RequestView, WorkerState};

/// A balancing policy.
pub trait Choose {
    /// The policy's name (`kvroute serve --policy`).
    fn name(&self) -> &str;
    /// Whether `choose` reads `RequestView::overlap_blocks` (the caller then fills it from
    /// the index and fills `WorkerState::cached_blocks`).
    fn needs_overlap(&self) -> bool;
    /// Whether `choose` reads `RequestView::admission_wait`.
    fn needs_admission(&self) -> bool {
        false
    }
    /// Index into `workers` (non-empty) of the worker to send `request` to.
    fn choose(&mut self, request: &RequestView<'_>, workers: &[&WorkerState]) -> usize;
    /// Another router replica sent a request to `workers[chosen]` (the replica mesh): a
    /// policy whose state follows its decisions (kv-aware's recent shares) counts it as its
    /// own, so that replicas seeing the same decisions keep the same state. None keeps state
    /// by default.
    fn observe(&mut self, _workers: &[&WorkerState], _chosen: usize) {}
}

/// A policy option out of range; the message is the one users see.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyError(pub String);

impl std::fmt::Display for PolicyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for PolicyError {}
