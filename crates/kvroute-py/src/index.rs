//! The router's KV index for Python: `KvIndex` (shared with the native KV-event consumer)
//! and its `IndexStats`.

use kvroute_core::blocks;
use kvroute_core::index::{self, MemoryBound};
use kvroute_io::{SharedIndex, lock_index};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedStr;
use pyo3::types::PyDict;

use crate::blocks::BlockHasher;
use crate::events::events_from_py;

/// Size and health of the index: ``blocks`` counts event-backed (worker, block) pairs,
/// ``predicted`` the predicted entries alive at the last call given a ``now``; the last four
/// are cumulative counts of blocks or removals the index left out or dropped
/// (``evicted_blocks``: by its memory bound).
#[pyclass(module = "kvroute._native", frozen, eq, get_all)]
#[derive(Clone, PartialEq)]
pub struct IndexStats {
    workers: usize,
    blocks: usize,
    predicted: usize,
    orphan_blocks: u64,
    skipped_blocks: u64,
    unknown_removals: u64,
    evicted_blocks: u64,
}

#[pymethods]
impl IndexStats {
    fn __repr__(&self) -> String {
        format!(
            "IndexStats(workers={}, blocks={}, predicted={}, orphan_blocks={}, skipped_blocks={}, unknown_removals={}, evicted_blocks={})",
            self.workers,
            self.blocks,
            self.predicted,
            self.orphan_blocks,
            self.skipped_blocks,
            self.unknown_removals,
            self.evicted_blocks
        )
    }
}

/// Which worker holds which block, keyed by kvroute's OWN chained block hashes (see
/// ``kvroute.routing.index``).
///
/// Args:
///     hasher: the router's block hasher; prompts must be hashed with the same one.
///     predicted_ttl: seconds a predicted entry lives; None keeps it until evicted by
///         capacity (no-events mode).
///     predicted_capacity_blocks: at most this many predicted entries per worker, least
///         recently routed evicted first; None for no per-worker limit.
///     max_blocks / max_bytes: the memory bound over event-backed (worker, block) entries
///         (at most one of them; bytes are converted at ``ENTRY_BYTES`` per entry); beyond it
///         the least recently touched entries are dropped. None: unbounded.
///
/// The index is shared (``Arc<Mutex<..>>``) with the native KV-event consumer
/// (``kvroute.kvevents.KvEventConsumer``), which applies batches from its own thread.
#[pyclass(module = "kvroute._native", name = "KvIndex")]
pub struct PyKvIndex {
    /// The core's index, shared with a consumer thread that feeds it.
    pub inner: SharedIndex,
    hasher: Py<BlockHasher>,
}

impl PyKvIndex {
    fn index(&self) -> std::sync::MutexGuard<'_, index::KvIndex> {
        lock_index(&self.inner)
    }

    /// A Python face of an index another owner shares (the native router's).
    pub fn from_shared(py: Python<'_>, inner: SharedIndex) -> PyResult<Self> {
        let hasher = lock_index(&inner).hasher();
        Ok(Self {
            inner,
            hasher: Py::new(py, BlockHasher { inner: hasher })?,
        })
    }
}

#[pymethods]
impl PyKvIndex {
    #[new]
    #[pyo3(signature = (hasher, *, predicted_ttl = Some(2.0), predicted_capacity_blocks = None, max_blocks = None, max_bytes = None))]
    fn new(
        hasher: Bound<'_, BlockHasher>,
        predicted_ttl: Option<f64>,
        predicted_capacity_blocks: Option<i64>,
        max_blocks: Option<i64>,
        max_bytes: Option<i64>,
    ) -> PyResult<Self> {
        if let Some(c) = predicted_capacity_blocks
            && c < 0
        {
            return Err(PyValueError::new_err(format!(
                "predicted_capacity_blocks must be >= 0, got {c}"
            )));
        }
        let bound = match (max_blocks, max_bytes) {
            (Some(_), Some(_)) => {
                return Err(PyValueError::new_err(
                    "give max_blocks or max_bytes, not both",
                ));
            }
            (Some(b), None) if b >= 0 => Some(MemoryBound::Blocks(b as usize)),
            (None, Some(b)) if b >= 0 => Some(MemoryBound::Bytes(b as usize)),
            (None, None) => None,
            _ => return Err(PyValueError::new_err("the memory bound must be >= 0")),
        };
        let core_hasher: blocks::BlockHasher = hasher.get().inner;
        let inner = index::KvIndex::new(
            core_hasher,
            predicted_ttl,
            predicted_capacity_blocks.map(|c| c as usize),
            bound,
        )
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(Self {
            inner: std::sync::Arc::new(std::sync::Mutex::new(inner)),
            hasher: hasher.unbind(),
        })
    }

    #[getter]
    fn hasher(&self, py: Python<'_>) -> Py<BlockHasher> {
        self.hasher.clone_ref(py)
    }

    #[getter]
    fn predicted_ttl(&self) -> Option<f64> {
        self.index().predicted_ttl()
    }

    #[getter]
    fn predicted_capacity_blocks(&self) -> Option<usize> {
        self.index().predicted_capacity()
    }

    /// The memory bound in (worker, block) entries, or None.
    #[getter]
    fn max_blocks(&self) -> Option<usize> {
        self.index().bound_blocks()
    }

    /// Apply one worker's KV cache events (``kvroute.engine.events``), in the order the
    /// engine emitted them.
    fn apply(&mut self, py: Python<'_>, worker: &str, events: &Bound<'_, PyAny>) -> PyResult<()> {
        let events = events_from_py(py, events)?;
        self.index().apply(worker, &events);
        Ok(())
    }

    /// Apply one worker's batch as the native decoder left it
    /// (``kvroute.kvevents.wire.decode_native``): no Python event objects on the way. What a
    /// router's subscriber does with every batch it receives.
    fn apply_native(&mut self, worker: &str, batch: PyRef<'_, crate::kvevents::NativeEventBatch>) {
        self.index().apply(worker, batch.events());
    }

    /// The router sent a prompt with these own block hashes to ``worker`` at ``now``.
    fn record_routed(&mut self, worker: &str, block_hashes: Vec<u64>, now: f64) {
        self.index().record_routed(worker, &block_hashes, now);
    }

    /// Number of leading blocks of the prompt each worker holds, aligned with ``workers``
    /// (distinct names; a worker the index has never heard of holds nothing).
    fn overlaps(
        &mut self,
        block_hashes: Vec<u64>,
        workers: Vec<PyBackedStr>,
        now: f64,
    ) -> Vec<usize> {
        // Names borrowed from the Python strings: no copy of each per look-up.
        let mut index = self.index();
        let ids: Vec<Option<usize>> = workers.iter().map(|n| index.worker_id(n)).collect();
        let mut out = Vec::with_capacity(ids.len());
        index.overlaps_into(&block_hashes, &ids, now, &mut out);
        out
    }

    /// Blocks the index attributes to ``worker`` (event-backed plus predicted).
    fn worker_blocks(&self, worker: &str) -> usize {
        self.index().worker_blocks(worker)
    }

    /// Forget what ``worker`` holds (engine restart, AllBlocksCleared, lost events); it
    /// stays known and starts again from an empty cache.
    fn reset_worker(&mut self, worker: &str) {
        self.index().reset_worker(worker);
    }

    /// Forget ``worker`` entirely (it left the pool).
    fn remove_worker(&mut self, worker: &str) {
        self.index().remove_worker(worker);
    }

    fn stats(&self) -> IndexStats {
        let s = self.index().stats();
        IndexStats {
            workers: s.workers,
            blocks: s.blocks,
            predicted: s.predicted,
            orphan_blocks: s.orphan_blocks,
            skipped_blocks: s.skipped_blocks,
            unknown_removals: s.unknown_removals,
            evicted_blocks: s.evicted_blocks,
        }
    }

    /// Sizes of the internal tables (to check that nothing is left behind).
    fn table_sizes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let t = self.index().table_sizes();
        let d = PyDict::new(py);
        d.set_item("held_keys", t.held_keys)?;
        d.set_item("predicted_keys", t.predicted_keys)?;
        d.set_item("expiry_queue", t.expiry_queue)?;
        d.set_item("engine_entries", t.engine_entries)?;
        d.set_item("duplicate_copies", t.duplicate_copies)?;
        Ok(d)
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyKvIndex>()?;
    m.add_class::<IndexStats>()?;
    m.add("INDEX_ENTRY_BYTES", index::ENTRY_BYTES)?;
    Ok(())
}
