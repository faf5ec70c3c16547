//! The router's index, the policies and the routing step for Python: `KvIndex`, `IndexStats`,
//! `RequestView`, `WorkerState`, `Policy` (the base of `kvroute.routing.policies`' thin
//! classes) and `RoutingStep` (what the simulator and the proxy both call per request).

use std::time::Instant;

use kvroute_core::blocks;
use kvroute_core::engine::events::{BlockRemoved, BlockStored, KvCacheEvent};
use kvroute_core::index::{self, MemoryBound};
use kvroute_core::policies::{self, Choose, KvAwareConfig, PrefixHashConfig};
use kvroute_core::pyrandom::PyRandom;
use kvroute_core::retention;
use kvroute_core::routing::{self, JournalEntry};
use kvroute_io::{SharedIndex, lock_index};
use pyo3::exceptions::{PyIndexError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedStr;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyList, PyTuple, PyType};

use crate::blocks::BlockHasher;

// -- events -------------------------------------------------------------------------------

/// `kvroute.engine.events`' classes, looked up once.
struct EventClasses {
    stored: Py<PyType>,
    removed: Py<PyType>,
    cleared: Py<PyType>,
}

static EVENT_CLASSES: PyOnceLock<EventClasses> = PyOnceLock::new();

fn event_classes(py: Python<'_>) -> PyResult<&EventClasses> {
    EVENT_CLASSES.get_or_try_init(py, || {
        let m = py.import("kvroute.engine.events")?;
        Ok(EventClasses {
            stored: m.getattr("BlockStored")?.cast_into::<PyType>()?.unbind(),
            removed: m.getattr("BlockRemoved")?.cast_into::<PyType>()?.unbind(),
            cleared: m
                .getattr("AllBlocksCleared")?
                .cast_into::<PyType>()?
                .unbind(),
        })
    })
}

/// A hash as vLLM sends it: an int that fits in 64 bits, signed or not.
fn hash_of(obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    match obj.extract::<u64>() {
        Ok(h) => Ok(h),
        Err(_) => Ok(obj.extract::<i64>()? as u64),
    }
}

fn hashes_of(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    obj.try_iter()?.map(|h| hash_of(&h?)).collect()
}

/// A Python event dataclass as the core's event.
fn event_of(py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<KvCacheEvent> {
    let classes = event_classes(py)?;
    if obj.is_instance(classes.removed.bind(py))? {
        return Ok(KvCacheEvent::Removed(BlockRemoved {
            block_hashes: hashes_of(&obj.getattr("block_hashes")?)?,
            medium: None,
            group_idx: 0,
        }));
    }
    if obj.is_instance(classes.stored.bind(py))? {
        let block_hashes = hashes_of(&obj.getattr("block_hashes")?)?;
        let parent = obj.getattr("parent_block_hash")?;
        let parent_block_hash = if parent.is_none() {
            None
        } else {
            Some(hash_of(&parent)?)
        };
        let block_size: usize = obj.getattr("block_size")?.extract()?;
        let tokens = obj.getattr("token_ids")?;
        // Ids beyond i64 are not token ids: -1 stands for them (the index skips the block).
        let token_ids: Vec<i64> = match tokens.extract::<Vec<i64>>() {
            Ok(t) => t,
            Err(_) => tokens
                .try_iter()?
                .map(|t| Ok(t?.extract::<i64>().unwrap_or(-1)))
                .collect::<PyResult<_>>()?,
        };
        let lora_id = obj.getattr("lora_id")?;
        let lora_name = obj.getattr("lora_name")?;
        let extra = obj.getattr("extra_keys")?;
        // The keys as msgpack, as vLLM sends them: the index hashes a LoRA name or a cache
        // salt into the block and skips any other key.
        let extra_keys = if extra.is_none() {
            None
        } else {
            Some(
                extra
                    .try_iter()?
                    .map(|k| crate::kvevents::extra_key_from_py(&k?))
                    .collect::<PyResult<Vec<_>>>()?,
            )
        };
        return Ok(KvCacheEvent::Stored(BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_id: lora_id.extract()?,
            medium: None,
            lora_name: lora_name.extract()?,
            extra_keys,
            group_idx: 0,
            kv_cache_spec_kind: None,
        }));
    }
    if obj.is_instance(classes.cleared.bind(py))? {
        return Ok(KvCacheEvent::AllCleared);
    }
    Err(PyTypeError::new_err(format!(
        "not a KV cache event: {}",
        obj.get_type().name()?
    )))
}

fn events_of(py: Python<'_>, events: &Bound<'_, PyAny>) -> PyResult<Vec<KvCacheEvent>> {
    events.try_iter()?.map(|e| event_of(py, &e?)).collect()
}

/// The core's event as `kvroute.engine.events`' dataclass (for the journal).
fn event_to_py<'py>(py: Python<'py>, event: &KvCacheEvent) -> PyResult<Bound<'py, PyAny>> {
    let classes = event_classes(py)?;
    match event {
        KvCacheEvent::Stored(s) => {
            let kwargs = PyDict::new(py);
            kwargs.set_item("lora_id", s.lora_id)?;
            kwargs.set_item("lora_name", s.lora_name.clone())?;
            if let Some(keys) = &s.extra_keys {
                let list = PyList::empty(py);
                for k in keys {
                    if k.is_some() {
                        list.append(PyTuple::empty(py))?;
                    } else {
                        list.append(py.None())?;
                    }
                }
                kwargs.set_item("extra_keys", list)?;
            }
            classes.stored.bind(py).call(
                (
                    s.block_hashes.clone(),
                    s.parent_block_hash,
                    s.token_ids.clone(),
                    s.block_size,
                ),
                Some(&kwargs),
            )
        }
        KvCacheEvent::Removed(r) => classes.removed.bind(py).call1((r.block_hashes.clone(),)),
        KvCacheEvent::AllCleared => classes.cleared.bind(py).call0(),
    }
}

// -- the index ----------------------------------------------------------------------------

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
        let events = events_of(py, events)?;
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

// -- requests and workers -----------------------------------------------------------------

/// What a policy may know about a request.
///
/// Args:
///     block_hashes: chained hashes of the prompt's full blocks.
///     prompt_tokens: prompt length in tokens.
///     overlap_blocks: leading blocks of the prompt each worker holds, aligned with the
///         ``workers`` passed to ``choose``; filled only for policies that ``needs_overlap``.
#[pyclass(module = "kvroute._native", get_all, set_all)]
pub struct RequestView {
    block_hashes: Vec<u64>,
    prompt_tokens: usize,
    overlap_blocks: Option<Vec<usize>>,
}

impl RequestView {
    fn view(&self) -> policies::RequestView<'_> {
        policies::RequestView {
            block_hashes: &self.block_hashes,
            prompt_tokens: self.prompt_tokens,
            overlap_blocks: self.overlap_blocks.as_deref(),
            admission_wait: None,
        }
    }
}

#[pymethods]
impl RequestView {
    #[new]
    #[pyo3(signature = (block_hashes, prompt_tokens, overlap_blocks = None))]
    fn new(
        block_hashes: Vec<u64>,
        prompt_tokens: usize,
        overlap_blocks: Option<Vec<usize>>,
    ) -> Self {
        Self {
            block_hashes,
            prompt_tokens,
            overlap_blocks,
        }
    }

    /// Prompt tokens worker ``worker`` would still compute: those after its cached overlap,
    /// and at least one.
    fn tokens_to_prefill(&self, worker: usize, block_size: usize) -> PyResult<usize> {
        if let Some(o) = &self.overlap_blocks
            && !o.is_empty()
            && worker >= o.len()
        {
            return Err(PyIndexError::new_err(
                "worker out of range of overlap_blocks",
            ));
        }
        Ok(self.view().tokens_to_prefill(worker, block_size))
    }

    fn __repr__(&self) -> String {
        format!(
            "RequestView(block_hashes=<{} blocks>, prompt_tokens={}, overlap_blocks={:?})",
            self.block_hashes.len(),
            self.prompt_tokens,
            self.overlap_blocks
        )
    }
}

/// What a policy may know about a worker: its name and the router's own load accounting.
///
/// Args:
///     name: the worker's stable name (the index's key).
///     in_flight: requests sent and not finished.
///     in_flight_tokens: prompt tokens of those requests still to prefill.
///     cached_blocks: blocks the router's index attributes to the worker (0 when unknown).
#[pyclass(module = "kvroute._native", eq)]
#[derive(Clone, PartialEq)]
pub struct WorkerState {
    inner: policies::WorkerState,
}

#[pymethods]
impl WorkerState {
    #[new]
    #[pyo3(signature = (name, in_flight = 0, in_flight_tokens = 0, cached_blocks = 0))]
    fn new(name: String, in_flight: i64, in_flight_tokens: i64, cached_blocks: i64) -> Self {
        Self {
            inner: policies::WorkerState {
                name,
                in_flight,
                in_flight_tokens,
                cached_blocks,
            },
        }
    }

    #[getter]
    fn name(&self) -> &str {
        &self.inner.name
    }
    #[setter]
    fn set_name(&mut self, v: String) {
        self.inner.name = v;
    }
    #[getter]
    fn in_flight(&self) -> i64 {
        self.inner.in_flight
    }
    #[setter]
    fn set_in_flight(&mut self, v: i64) {
        self.inner.in_flight = v;
    }
    #[getter]
    fn in_flight_tokens(&self) -> i64 {
        self.inner.in_flight_tokens
    }
    #[setter]
    fn set_in_flight_tokens(&mut self, v: i64) {
        self.inner.in_flight_tokens = v;
    }
    #[getter]
    fn cached_blocks(&self) -> i64 {
        self.inner.cached_blocks
    }
    #[setter]
    fn set_cached_blocks(&mut self, v: i64) {
        self.inner.cached_blocks = v;
    }

    fn __repr__(&self) -> String {
        let s = &self.inner;
        format!(
            "WorkerState(name={:?}, in_flight={}, in_flight_tokens={}, cached_blocks={})",
            s.name, s.in_flight, s.in_flight_tokens, s.cached_blocks
        )
    }
}

fn states_of<'py>(workers: &Bound<'py, PyAny>) -> PyResult<Vec<PyRef<'py, WorkerState>>> {
    let states: Vec<PyRef<'py, WorkerState>> = workers
        .try_iter()?
        .map(|w| w?.extract::<PyRef<'py, WorkerState>>().map_err(Into::into))
        .collect::<PyResult<_>>()?;
    if states.is_empty() {
        return Err(PyValueError::new_err("no workers to choose from"));
    }
    Ok(states)
}

// -- policies -----------------------------------------------------------------------------

/// `random.Random`'s generator state copied into a native one (a fresh unseeded
/// `random.Random()` when None): the policy then draws what that object would have drawn.
fn rng_of(py: Python<'_>, rng: Option<&Bound<'_, PyAny>>) -> PyResult<PyRandom> {
    let fresh;
    let rng = match rng {
        Some(r) if !r.is_none() => r,
        _ => {
            fresh = py.import("random")?.getattr("Random")?.call0()?;
            &fresh
        }
    };
    let state = rng.call_method0("getstate")?;
    let internal = state.get_item(1)?;
    let words: Vec<u64> = internal.extract()?;
    if words.len() != 625 {
        return Err(PyValueError::new_err("rng: not a random.Random state"));
    }
    let mt: Vec<u32> = words[..624].iter().map(|&w| w as u32).collect();
    PyRandom::from_state(&mt, words[624] as usize).map_err(|e| PyValueError::new_err(e.to_string()))
}

/// A native balancing policy; ``kvroute.routing.policies``' classes (one per name) derive
/// from it and say ``name`` and ``needs_overlap``.
///
/// Args:
///     kind: the policy's name.
///     rng: a ``random.Random`` whose state seeds the policy's draws (None: unseeded).
///     the rest: the options of that policy (see ``kvroute.routing.policies``).
#[pyclass(module = "kvroute._native", name = "Policy", subclass)]
pub struct PyPolicy {
    pub inner: policies::Policy,
}

#[pymethods]
impl PyPolicy {
    #[new]
    #[pyo3(signature = (kind, rng = None, *, block_size = 16, overlap_weight = 3.0, request_weight = 128.0, load_factor = None, share_factor = Some(0.35), share_window = 24.0, share_weight = 4.0, admission_wait = None, key_blocks = 1))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        kind: &str,
        rng: Option<&Bound<'_, PyAny>>,
        block_size: i64,
        overlap_weight: f64,
        request_weight: f64,
        load_factor: Option<f64>,
        share_factor: Option<f64>,
        share_window: f64,
        share_weight: f64,
        admission_wait: Option<f64>,
        key_blocks: i64,
    ) -> PyResult<Self> {
        let rng = rng_of(py, rng)?;
        // A negative count is refused (with the number given) by the kind that reads it.
        let count = |value: i64, what: &str, read_by: &str| match usize::try_from(value) {
            Ok(n) => Ok(n),
            Err(_) if kind == read_by => Err(PyValueError::new_err(format!(
                "{what} must be >= 1, got {value}"
            ))),
            Err(_) => Ok(0),
        };
        let kv_aware = KvAwareConfig {
            block_size: count(block_size, "block size", "kv-aware")?,
            overlap_weight,
            request_weight,
            load_factor,
            share_factor,
            share_window,
            share_weight,
            admission_wait,
        };
        let prefix_hash = PrefixHashConfig {
            key_blocks: count(key_blocks, "key blocks", "prefix-hash")?,
            load_factor,
        };
        let inner = policies::Policy::from_name(kind, rng, kv_aware, prefix_hash)
            .map_err(|e| PyValueError::new_err(e.0))?;
        Ok(Self { inner })
    }

    /// Index into ``workers`` of the worker to send ``request`` to.
    fn choose(
        &mut self,
        request: PyRef<'_, RequestView>,
        workers: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let states = states_of(workers)?;
        check_aligned(&request, states.len())?;
        let refs: Vec<&policies::WorkerState> = states.iter().map(|s| &s.inner).collect();
        Ok(self.inner.choose(&request.view(), &refs))
    }

    /// kv-aware: each worker's cost, aligned with ``workers``.
    fn costs(
        &self,
        request: PyRef<'_, RequestView>,
        workers: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<f64>> {
        let states = states_of(workers)?;
        check_aligned(&request, states.len())?;
        let refs: Vec<&policies::WorkerState> = states.iter().map(|s| &s.inner).collect();
        Ok(self.kv_aware()?.costs(&request.view(), &refs))
    }

    /// kv-aware: each worker's share of the recent decisions, aligned with ``workers``.
    fn shares(&self, workers: &Bound<'_, PyAny>) -> PyResult<Vec<f64>> {
        let states = states_of(workers)?;
        let refs: Vec<&policies::WorkerState> = states.iter().map(|s| &s.inner).collect();
        Ok(self.kv_aware()?.shares(&refs))
    }

    /// kv-aware: workers the guards let take one more request.
    fn eligible(&self, workers: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
        let states = states_of(workers)?;
        let refs: Vec<&policies::WorkerState> = states.iter().map(|s| &s.inner).collect();
        Ok(self.kv_aware()?.eligible(&refs))
    }

    /// kv-aware: replace the recent shares by worker name (a replica taking over another's
    /// state).
    fn restore_shares(&mut self, shares: Vec<(String, f64)>) -> PyResult<()> {
        match &mut self.inner {
            policies::Policy::KvAware(p) => {
                p.restore_shares(shares);
                Ok(())
            }
            _ => Err(PyTypeError::new_err("only kv-aware keeps shares")),
        }
    }

    /// prefix-hash: workers in this request's rendezvous order (owner first).
    fn ranking(
        &mut self,
        request: PyRef<'_, RequestView>,
        workers: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<usize>> {
        let states = states_of(workers)?;
        let refs: Vec<&policies::WorkerState> = states.iter().map(|s| &s.inner).collect();
        match &mut self.inner {
            policies::Policy::PrefixHash(p) => Ok(p.ranking(&request.view(), &refs)),
            _ => Err(PyTypeError::new_err("only prefix-hash ranks workers")),
        }
    }

    #[getter]
    fn block_size(&self) -> PyResult<usize> {
        Ok(self.kv_aware()?.config().block_size)
    }
    #[getter]
    fn overlap_weight(&self) -> PyResult<f64> {
        Ok(self.kv_aware()?.config().overlap_weight)
    }
    #[getter]
    fn request_weight(&self) -> PyResult<f64> {
        Ok(self.kv_aware()?.config().request_weight)
    }
    #[getter]
    fn share_factor(&self) -> PyResult<Option<f64>> {
        Ok(self.kv_aware()?.config().share_factor)
    }
    #[getter]
    fn share_window(&self) -> PyResult<f64> {
        Ok(self.kv_aware()?.config().share_window)
    }
    #[getter]
    fn share_weight(&self) -> PyResult<f64> {
        Ok(self.kv_aware()?.config().share_weight)
    }
    #[getter]
    fn admission_wait(&self) -> PyResult<Option<f64>> {
        Ok(self.kv_aware()?.config().admission_wait)
    }
    /// kv-aware: decisions its admission guard moved off a worker where the request would
    /// have waited for KV blocks (cumulative).
    #[getter]
    fn admission_diversions(&self) -> PyResult<u64> {
        Ok(self.kv_aware()?.admission_diversions())
    }
    /// Whether it reads the step's KV-admission model (``RoutingStep(kv_capacity_blocks=)``).
    #[getter]
    fn needs_admission(&self) -> bool {
        self.inner.needs_admission()
    }
    #[getter]
    fn load_factor(&self) -> PyResult<Option<f64>> {
        match &self.inner {
            policies::Policy::KvAware(p) => Ok(p.config().load_factor),
            policies::Policy::PrefixHash(p) => Ok(p.config.load_factor),
            _ => Err(PyTypeError::new_err("this policy has no load factor")),
        }
    }
    #[getter]
    fn key_blocks(&self) -> PyResult<usize> {
        match &self.inner {
            policies::Policy::PrefixHash(p) => Ok(p.config.key_blocks),
            _ => Err(PyTypeError::new_err("only prefix-hash has key blocks")),
        }
    }
}

impl PyPolicy {
    fn kv_aware(&self) -> PyResult<&policies::KvAware> {
        match &self.inner {
            policies::Policy::KvAware(p) => Ok(p),
            _ => Err(PyTypeError::new_err("a kv-aware policy only")),
        }
    }
}

fn check_aligned(request: &RequestView, workers: usize) -> PyResult<()> {
    match &request.overlap_blocks {
        Some(o) if !o.is_empty() && o.len() != workers => Err(PyValueError::new_err(
            "overlap_blocks is not aligned with workers",
        )),
        _ => Ok(()),
    }
}

/// A policy written in Python (a test's oracle): called with ``RequestView`` and
/// ``WorkerState`` objects; its first error is kept and raised after the step.
pub(crate) struct ForeignPolicy<'a, 'py> {
    pub(crate) policy: &'a Bound<'py, PyAny>,
    pub(crate) needs_overlap: bool,
    /// The first error the Python policy raised (its choice then reads 0).
    pub(crate) error: Option<PyErr>,
}

impl Choose for ForeignPolicy<'_, '_> {
    fn name(&self) -> &str {
        "foreign"
    }
    fn needs_overlap(&self) -> bool {
        self.needs_overlap
    }
    fn choose(
        &mut self,
        request: &policies::RequestView<'_>,
        workers: &[&policies::WorkerState],
    ) -> usize {
        let py = self.policy.py();
        let result = (|| -> PyResult<usize> {
            let view = RequestView {
                block_hashes: request.block_hashes.to_vec(),
                prompt_tokens: request.prompt_tokens,
                overlap_blocks: request.overlap_blocks.map(<[usize]>::to_vec),
            };
            let states = PyList::empty(py);
            for w in workers {
                states.append(WorkerState {
                    inner: (*w).clone(),
                })?;
            }
            let i: usize = self
                .policy
                .call_method1("choose", (view, states))?
                .extract()?;
            if i >= workers.len() {
                return Err(PyIndexError::new_err("the policy chose no candidate"));
            }
            Ok(i)
        })();
        result.unwrap_or_else(|e| {
            self.error.get_or_insert(e);
            0
        })
    }
}

// -- the routing step ---------------------------------------------------------------------

/// The one routing step (``kvroute_core::routing``): index look-up, policy, prediction and
/// load accounting, shared by the simulator and the live router.
///
/// Args:
///     policy: a ``kvroute.routing.policies`` policy (native), or any object with ``choose``
///         and ``needs_overlap``.
///     index: the ``KvIndex`` (None: no look-up, no predictions).
///     block_size: tokens per KV block (what an overlap is worth in prefill tokens).
///     kv_capacity_blocks: each worker's usable KV blocks; with a policy that
///         ``needs_admission`` the step then keeps its KV-admission model
///         (``kvroute_core::admission``), which only the native simulator drives (``route``
///         here refuses to: its ticket would be lost).
#[pyclass(module = "kvroute._native")]
pub struct RoutingStep {
    pub(crate) inner: routing::RoutingStep,
    pub(crate) policy: Py<PyAny>,
    pub(crate) native: Option<Py<PyPolicy>>,
    pub(crate) index: Option<Py<PyKvIndex>>,
}

#[pymethods]
impl RoutingStep {
    #[new]
    #[pyo3(signature = (policy, index = None, block_size = blocks::GPU_BLOCK_SIZE, kv_capacity_blocks = None))]
    fn new(
        policy: Bound<'_, PyAny>,
        index: Option<Bound<'_, PyKvIndex>>,
        block_size: usize,
        kv_capacity_blocks: Option<usize>,
    ) -> PyResult<Self> {
        if block_size == 0 {
            return Err(PyValueError::new_err("block size must be positive, got 0"));
        }
        let needs_admission = policy
            .cast::<PyPolicy>()
            .is_ok_and(|p| p.borrow().inner.needs_admission());
        let native = policy.cast::<PyPolicy>().ok().map(|p| p.clone().unbind());
        let mut inner = routing::RoutingStep::new(block_size);
        if let (Some(c), true) = (kv_capacity_blocks, needs_admission) {
            inner.track_admission(Some(c));
        }
        Ok(Self {
            inner,
            policy: policy.unbind(),
            native,
            index: index.map(Bound::unbind),
        })
    }

    #[getter]
    fn policy(&self, py: Python<'_>) -> Py<PyAny> {
        self.policy.clone_ref(py)
    }

    #[getter]
    fn index(&self, py: Python<'_>) -> Option<Py<PyKvIndex>> {
        self.index.as_ref().map(|i| i.clone_ref(py))
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }

    /// The slot of worker ``name``, adding it (idle) if it is not in the step.
    fn add_worker(&mut self, name: &str) -> usize {
        self.inner.add_worker(name)
    }

    /// Take worker ``name`` out (it left the pool); its slot's late accounting still works.
    fn remove_worker(&mut self, name: &str) {
        self.inner.remove_worker(name);
    }

    /// The slot of a worker in the step, or None.
    fn slot(&self, name: &str) -> Option<usize> {
        self.inner.slot(name)
    }

    /// The slots of the workers in the step, in the order they were added.
    fn slots(&self) -> Vec<usize> {
        self.inner.live_slots().to_vec()
    }

    /// A snapshot of a slot's load accounting.
    fn state(&self, slot: usize) -> PyResult<WorkerState> {
        self.check_slot(slot)?;
        Ok(WorkerState {
            inner: self.inner.state(slot).clone(),
        })
    }

    /// Route one request among ``candidates`` (slots; None: every worker) at ``now``:
    /// returns ``(slot, overlap_blocks, prefill_tokens)``, already counted in that worker's
    /// load until ``first_token`` / ``finished``.
    #[pyo3(signature = (block_hashes, prompt_tokens, now, candidates = None))]
    fn route(
        &mut self,
        py: Python<'_>,
        block_hashes: Vec<u64>,
        prompt_tokens: usize,
        now: f64,
        candidates: Option<Vec<usize>>,
    ) -> PyResult<(usize, usize, usize)> {
        if let Some(c) = &candidates {
            for &s in c {
                self.check_slot(s)?;
            }
            if c.is_empty() {
                return Err(PyValueError::new_err("no candidate worker"));
            }
        } else if self.inner.live_slots().is_empty() {
            return Err(PyValueError::new_err("no worker in the routing step"));
        }
        if self.inner.admission().is_some() {
            return Err(PyValueError::new_err(
                "a step with a KV-admission model is driven by the native simulator only",
            ));
        }
        // Locked for the decision: the consumer thread applies batches between decisions.
        let index_ref = self.index.as_ref().map(|i| i.borrow(py));
        let mut index = index_ref.as_ref().map(|i| lock_index(&i.inner));
        let ix = index.as_deref_mut();
        let routed = if let Some(native) = &self.native {
            let mut policy = native.borrow_mut(py);
            self.inner.route(
                ix,
                &mut policy.inner,
                &block_hashes,
                prompt_tokens,
                candidates.as_deref(),
                now,
            )
        } else {
            let policy = self.policy.bind(py);
            let needs_overlap = policy.getattr("needs_overlap")?.is_truthy()?;
            let mut foreign = ForeignPolicy {
                policy,
                needs_overlap,
                error: None,
            };
            let routed = self.inner.route(
                ix,
                &mut foreign,
                &block_hashes,
                prompt_tokens,
                candidates.as_deref(),
                now,
            );
            if let Some(e) = foreign.error {
                return Err(e);
            }
            routed
        };
        Ok((routed.worker, routed.overlap, routed.prefill_tokens))
    }

    /// Route one request to ``slot``, chosen by the caller (the policy is not asked: see
    /// ``Retention.room_for``): returns ``(slot, overlap_blocks, prefill_tokens)`` as
    /// ``route`` does.
    fn route_to(
        &mut self,
        py: Python<'_>,
        slot: usize,
        block_hashes: Vec<u64>,
        prompt_tokens: usize,
        now: f64,
    ) -> PyResult<(usize, usize, usize)> {
        self.check_slot(slot)?;
        let index_ref = self.index.as_ref().map(|i| i.borrow(py));
        let mut index = index_ref.as_ref().map(|i| lock_index(&i.inner));
        let routed = self.inner.route_to(
            index.as_deref_mut(),
            slot,
            &block_hashes,
            prompt_tokens,
            now,
        );
        Ok((routed.worker, routed.overlap, routed.prefill_tokens))
    }

    /// The request routed to ``slot`` with ``prefill_tokens`` produced its first token.
    fn first_token(&mut self, slot: usize, prefill_tokens: usize) -> PyResult<()> {
        self.check_slot(slot)?;
        self.inner.first_token(slot, prefill_tokens);
        Ok(())
    }

    /// A request routed to ``slot`` finished.
    fn finished(&mut self, slot: usize) -> PyResult<()> {
        self.check_slot(slot)?;
        self.inner.finished(slot, None, 0.0);
        Ok(())
    }

    /// Apply worker ``slot``'s KV events (``kvroute.engine.events``) to the index.
    #[pyo3(signature = (slot, events, now = 0.0))]
    fn apply(
        &mut self,
        py: Python<'_>,
        slot: usize,
        events: &Bound<'_, PyAny>,
        now: f64,
    ) -> PyResult<()> {
        self.check_slot(slot)?;
        let Some(index) = &self.index else {
            return Ok(());
        };
        let events = events_of(py, events)?;
        let index = index.borrow(py);
        self.inner
            .apply_events(&mut lock_index(&index.inner), slot, &events, now);
        Ok(())
    }

    /// Start recording the step's inputs (dropping what was recorded).
    fn start_journal(&mut self) {
        self.inner.set_journal(true);
    }

    /// The inputs recorded since ``start_journal``, in order: ``("route", block_hashes,
    /// prompt_tokens, candidates, now, slot, overlap, prefill_tokens)``, ``("first_token",
    /// slot, prefill_tokens)``, ``("finished", slot)``, ``("events", slot, events, now)``.
    fn journal<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        for entry in self.inner.journal() {
            let item = match entry {
                JournalEntry::Route {
                    block_hashes,
                    prompt_tokens,
                    candidates,
                    now,
                    routed,
                } => (
                    "route",
                    block_hashes.clone(),
                    *prompt_tokens,
                    candidates.clone(),
                    *now,
                    routed.worker,
                    routed.overlap,
                    routed.prefill_tokens,
                )
                    .into_pyobject(py)?
                    .into_any(),
                JournalEntry::FirstToken {
                    worker,
                    prefill_tokens,
                } => ("first_token", *worker, *prefill_tokens)
                    .into_pyobject(py)?
                    .into_any(),
                JournalEntry::Finished { worker, .. } => {
                    ("finished", *worker).into_pyobject(py)?.into_any()
                }
                JournalEntry::Events {
                    worker,
                    events,
                    now,
                } => {
                    let list = PyList::empty(py);
                    for e in events {
                        list.append(event_to_py(py, e)?)?;
                    }
                    ("events", *worker, list, *now)
                        .into_pyobject(py)?
                        .into_any()
                }
            };
            out.append(item)?;
        }
        Ok(out)
    }
}

impl RoutingStep {
    fn check_slot(&self, slot: usize) -> PyResult<()> {
        if slot >= self.inner.slot_count() {
            return Err(PyIndexError::new_err(format!("no worker slot {slot}")));
        }
        Ok(())
    }
}

// -- CPython's generator ------------------------------------------------------------------

/// ``kvroute_core::pyrandom``: CPython's ``random.Random`` reimplemented, exposed so tests
/// can check its draws against Python's own.
///
/// Args:
///     seed: an int of any size (its absolute value is used, as CPython does).
#[pyclass(module = "kvroute._native", name = "NativeRandom")]
pub struct NativeRandom {
    inner: PyRandom,
}

#[pymethods]
impl NativeRandom {
    #[new]
    fn new(seed: &Bound<'_, PyAny>) -> PyResult<Self> {
        let n = seed.call_method0("__abs__")?;
        let bits: usize = n.call_method0("bit_length")?.extract()?;
        let bytes: Vec<u8> = n
            .call_method1("to_bytes", (bits.div_ceil(32).max(1) * 4, "little"))?
            .extract()?;
        let key: Vec<u32> = bytes
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        Ok(Self {
            inner: PyRandom::from_key(&key),
        })
    }

    /// A generator in the state of ``rng`` (a ``random.Random``).
    #[staticmethod]
    fn from_random(py: Python<'_>, rng: &Bound<'_, PyAny>) -> PyResult<Self> {
        Ok(Self {
            inner: rng_of(py, Some(rng))?,
        })
    }

    fn random(&mut self) -> f64 {
        self.inner.random()
    }

    fn getrandbits(&mut self, k: u32) -> PyResult<u64> {
        if k > 64 {
            return Err(PyValueError::new_err("at most 64 bits"));
        }
        Ok(self.inner.getrandbits(k))
    }

    fn randrange(&mut self, n: usize) -> PyResult<usize> {
        if n == 0 {
            return Err(PyValueError::new_err("empty range for randrange()"));
        }
        Ok(self.inner.randrange(n))
    }
}

// -- benchmarks ---------------------------------------------------------------------------

/// Prompts a benchmark worker's cache holds.
const RESIDENT_PROMPTS: usize = 4;

/// One benchmark worker's events: ``prompts`` distinct prompts of ``blocks`` 16-token blocks
/// (in events of ``per`` blocks, chained, engine hashes from another seed) into a cache of
/// [`RESIDENT_PROMPTS`] prompts, the oldest evicted block by block, tail first, as vLLM does.
fn bench_events(w: usize, prompts: usize, blocks: usize, per: usize) -> (Vec<KvCacheEvent>, u64) {
    let bs = 16;
    let engine = blocks::BlockHasher::new(bs, 987_654_321).expect("16");
    let mut events = Vec::new();
    let mut block_events = 0u64;
    let mut resident: std::collections::VecDeque<Vec<u64>> = Default::default();
    for p in 0..prompts {
        let start = ((w * prompts + p) * blocks * bs) as u32;
        let tokens: Vec<u32> = (start..start + (blocks * bs) as u32).collect();
        let hashes = engine.hash_blocks(&tokens, None, 0, None);
        for first in (0..blocks).step_by(per) {
            let stop = (first + per).min(blocks);
            events.push(KvCacheEvent::Stored(BlockStored::plain(
                hashes[first..stop].to_vec(),
                first.checked_sub(1).map(|i| hashes[i]),
                tokens[first * bs..stop * bs]
                    .iter()
                    .map(|&t| t as i64)
                    .collect(),
                bs,
            )));
        }
        block_events += blocks as u64;
        resident.push_back(hashes);
        if resident.len() > RESIDENT_PROMPTS {
            let old = resident.pop_front().expect("non-empty");
            for &h in old.iter().rev() {
                events.push(KvCacheEvent::Removed(BlockRemoved::plain(vec![h])));
            }
            block_events += old.len() as u64;
        }
    }
    (events, block_events)
}

/// Native ingest speed, for ``benchmarks/index_speed.py``: ``workers`` workers' events
/// (see the stream above) are built natively, one worker at a time just before they are
/// applied (as a decoder hands over a batch it has just decoded, still in cache), and only
/// ``KvIndex::apply`` is timed. Returns ``(block_events, seconds, evicted_blocks)``.
#[pyfunction]
#[pyo3(signature = (workers = 64, prompts = 40, blocks = 150, blocks_per_event = 16, max_blocks = None))]
fn bench_index_ingest(
    py: Python<'_>,
    workers: usize,
    prompts: usize,
    blocks: usize,
    blocks_per_event: usize,
    max_blocks: Option<usize>,
) -> (u64, f64, u64) {
    let own = blocks::BlockHasher::new(16, blocks::DEFAULT_HASH_SEED).expect("16");
    py.detach(|| {
        let mut index =
            index::KvIndex::new(own, Some(2.0), None, max_blocks.map(MemoryBound::Blocks))
                .expect("valid");
        let (mut total, mut seconds) = (0u64, 0.0);
        for w in 0..workers {
            let (events, n) = bench_events(w, prompts, blocks, blocks_per_event.max(1));
            let name = format!("worker-{w}");
            let t0 = Instant::now();
            index.apply(&name, &events);
            seconds += t0.elapsed().as_secs_f64();
            total += n;
        }
        let stats = index.stats();
        if max_blocks.is_none() {
            assert_eq!((stats.orphan_blocks, stats.unknown_removals), (0, 0));
        }
        (total, seconds, stats.evicted_blocks)
    })
}

/// Native look-up speed: ``workers`` workers, each holding a distinct depth of one
/// ``blocks``-block prompt, the whole prompt looked up ``repeat`` times over all of them.
/// Returns seconds per look-up.
#[pyfunction]
#[pyo3(signature = (workers = 64, blocks = 150, repeat = 100_000))]
fn bench_index_lookup(
    py: Python<'_>,
    workers: usize,
    blocks: usize,
    repeat: usize,
) -> PyResult<f64> {
    let bs = 16;
    let own = blocks::BlockHasher::new(bs, blocks::DEFAULT_HASH_SEED).expect("16");
    let tokens: Vec<u32> = (0..(blocks * bs) as u32).collect();
    let hashes = own.hash_blocks(&tokens, None, 0, None);
    Ok(py.detach(|| {
        let mut index = index::KvIndex::new(own, Some(2.0), None, None).expect("valid");
        let mut ids = Vec::new();
        for w in 0..workers {
            let name = format!("worker-{w}");
            // Everyone holds the whole prompt: the worst case, every block matched by all.
            let stored = KvCacheEvent::Stored(BlockStored::plain(
                hashes.clone(),
                None,
                tokens.iter().map(|&t| t as i64).collect(),
                bs,
            ));
            index.apply(&name, &[stored]);
            ids.push(index.worker_id(&name));
        }
        let mut out = Vec::new();
        let t0 = Instant::now();
        for _ in 0..repeat {
            index.overlaps_into(&hashes, &ids, 0.0, &mut out);
        }
        let per = t0.elapsed().as_secs_f64() / repeat as f64;
        assert!(out.iter().all(|&o| o == blocks));
        per
    }))
}

// -- retention ----------------------------------------------------------------------------

/// A refresh as Python sees it: (prompt token ids, block hashes, blocks).
type RefreshTuple = (Vec<u32>, Vec<u64>, usize);

/// Retention (``kvroute_core::retention``): the router refreshing the prefixes each worker's
/// LRU would otherwise evict, with a minimal request (the prefix's tokens plus one,
/// ``max_tokens`` 1). Fed the routing step's decisions (``routed``) and asked, after anything
/// happened to a worker, for the refreshes to send there (``poll``).
///
/// Args:
///     mode: ``off``, ``on`` or ``auto`` (only with slack, and only where it pays).
///     block_size: tokens per KV block.
///     capacity_blocks: usable KV blocks per worker (``num_gpu_blocks`` − 1).
///     margin_requests, refresh_cost_tokens, value_ratio, min_prefix_blocks, max_tracked,
///     reserve_factor, min_coverage, min_reuses, refresh_after_requests,
///     room_slack_requests, room_max_fill, min_payoff_tokens: the knobs of ``RetentionConfig`` (defaults
///     when None).
#[pyclass(module = "kvroute._native", name = "Retention")]
pub struct PyRetention {
    pub(crate) inner: retention::Retention,
}

#[pymethods]
impl PyRetention {
    #[new]
    #[pyo3(signature = (mode, block_size, capacity_blocks, margin_requests = None, refresh_cost_tokens = None, value_ratio = None, min_prefix_blocks = None, max_tracked = None, reserve_factor = None, min_coverage = None, min_reuses = None, refresh_after_requests = None, room_slack_requests = None, room_max_fill = None, min_payoff_tokens = None, pressure_tokens = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        mode: &str,
        block_size: usize,
        capacity_blocks: usize,
        margin_requests: Option<f64>,
        refresh_cost_tokens: Option<f64>,
        value_ratio: Option<f64>,
        min_prefix_blocks: Option<usize>,
        max_tracked: Option<usize>,
        reserve_factor: Option<f64>,
        min_coverage: Option<f64>,
        min_reuses: Option<u32>,
        refresh_after_requests: Option<u64>,
        room_slack_requests: Option<f64>,
        room_max_fill: Option<f64>,
        min_payoff_tokens: Option<f64>,
        pressure_tokens: Option<f64>,
    ) -> PyResult<Self> {
        let mode: retention::RetentionMode = mode.parse().map_err(PyValueError::new_err)?;
        if block_size == 0 {
            return Err(PyValueError::new_err("block size must be positive, got 0"));
        }
        let mut config = retention::RetentionConfig::new(mode, block_size, capacity_blocks);
        if let Some(v) = margin_requests {
            config.margin_requests = v;
        }
        if let Some(v) = refresh_cost_tokens {
            config.refresh_cost_tokens = v;
        }
        if let Some(v) = value_ratio {
            config.value_ratio = v;
        }
        if let Some(v) = min_prefix_blocks {
            config.min_prefix_blocks = v.max(1);
        }
        if let Some(v) = max_tracked {
            config.max_tracked = v.max(1);
        }
        if let Some(v) = reserve_factor {
            config.reserve_factor = v.max(0.0);
        }
        if let Some(v) = min_coverage {
            config.min_coverage = v;
        }
        if let Some(v) = min_reuses {
            config.min_reuses = v;
        }
        if let Some(v) = refresh_after_requests {
            config.refresh_after_requests = v;
        }
        if let Some(v) = room_slack_requests {
            config.room_slack_requests = v;
        }
        if let Some(v) = room_max_fill {
            config.room_max_fill = v;
        }
        if let Some(v) = min_payoff_tokens {
            config.min_payoff_tokens = v;
        }
        if let Some(v) = pressure_tokens {
            config.pressure_tokens = v;
        }
        Ok(Self {
            inner: retention::Retention::new(config),
        })
    }

    /// The mode's name.
    #[getter]
    fn mode(&self) -> &'static str {
        self.inner.config().mode.name()
    }

    /// A request was routed to ``slot``: its own block hashes, its prompt token ids, the
    /// overlap the step credited, its output budget.
    #[pyo3(signature = (slot, block_hashes, prompt, overlap, output_tokens, now))]
    #[allow(clippy::too_many_arguments)]
    fn routed(
        &mut self,
        py: Python<'_>,
        slot: usize,
        block_hashes: Vec<u64>,
        prompt: &Bound<'_, PyAny>,
        overlap: usize,
        output_tokens: usize,
        now: f64,
    ) -> PyResult<()> {
        let tokens = crate::tokens::extract_tokens(py, prompt)?;
        if tokens.is_empty() {
            return Ok(());
        }
        self.inner
            .routed(slot, &block_hashes, &tokens, overlap, output_tokens, now);
        Ok(())
    }

    /// The refreshes to send to ``slot`` now, as ``(prompt token ids, block hashes, blocks)``;
    /// each is checked against and recorded in ``routing``'s index. Called with the new
    /// blocks of a request just routed there (``incoming_blocks``) before it is forwarded
    /// (the refreshes go first, and a busy worker takes both into its next step; ``auto``
    /// sends none ahead of a request to an idle one), and with 0 when ``slot``'s last
    /// request has finished (the refreshes find it idle).
    #[pyo3(signature = (routing, slot, now, incoming_blocks = 0))]
    fn poll(
        &mut self,
        py: Python<'_>,
        routing: &Bound<'_, RoutingStep>,
        slot: usize,
        now: f64,
        incoming_blocks: usize,
    ) -> PyResult<Vec<RefreshTuple>> {
        let step = routing.borrow();
        step.check_slot(slot)?;
        let index_ref = step.index.as_ref().map(|i| i.borrow(py));
        let mut index = index_ref.as_ref().map(|i| lock_index(&i.inner));
        let mut out = Vec::new();
        self.inner.poll_step(
            &step.inner,
            index.as_deref_mut(),
            slot,
            incoming_blocks,
            now,
            &mut out,
        );
        Ok(out
            .into_iter()
            .map(|r| (r.prompt.to_vec(), r.block_hashes.to_vec(), r.blocks))
            .collect())
    }

    /// Where among ``slots`` a prompt of these block hashes goes, or None where the policy
    /// decides (``Retention::room_for``): a prompt ``routing``'s index finds cached nowhere
    /// goes to the worker home to the fewest prefix families; route it with
    /// ``RoutingStep.route_to``.
    fn room_for(
        &self,
        py: Python<'_>,
        routing: &Bound<'_, RoutingStep>,
        slots: Vec<usize>,
        block_hashes: Vec<u64>,
        now: f64,
    ) -> PyResult<Option<usize>> {
        let step = routing.borrow();
        for &slot in &slots {
            step.check_slot(slot)?;
        }
        let index_ref = step.index.as_ref().map(|i| i.borrow(py));
        let mut index = index_ref.as_ref().map(|i| lock_index(&i.inner));
        Ok(self.inner.room_for(
            &step.inner,
            index.as_deref_mut(),
            &slots,
            &block_hashes,
            now,
        ))
    }

    /// Forget what it knew of ``slot`` (the worker left or reset its cache).
    fn reset_worker(&mut self, slot: usize) {
        self.inner.reset_worker(slot);
    }

    /// Prefixes tracked on ``slot``.
    fn tracked(&self, slot: usize) -> usize {
        self.inner.tracked(slot)
    }

    /// What it did: ``refreshes``, ``refreshed_blocks``, ``skipped_evicted``, ``partial``,
    /// ``deferred_busy``, ``deferred_idle``, ``deferred_full``, ``declined_value``, ``declined_coverage``,
    /// ``declined_held_elsewhere``, ``declined_payoff``, ``saved_blocks``, ``lost_blocks``.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        retention_stats_dict(py, &self.inner.stats())
    }
}

/// Retention's counters as a dict (``Retention.stats``, ``NativeRouter.retention_stats``).
pub fn retention_stats_dict<'py>(
    py: Python<'py>,
    s: &kvroute_core::retention::RetentionStats,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("refreshes", s.refreshes)?;
    d.set_item("refreshed_blocks", s.refreshed_blocks)?;
    d.set_item("skipped_evicted", s.skipped_evicted)?;
    d.set_item("partial", s.partial)?;
    d.set_item("deferred_busy", s.deferred_busy)?;
    d.set_item("deferred_idle", s.deferred_idle)?;
    d.set_item("deferred_full", s.deferred_full)?;
    d.set_item("declined_value", s.declined_value)?;
    d.set_item("declined_coverage", s.declined_coverage)?;
    d.set_item("declined_held_elsewhere", s.declined_held_elsewhere)?;
    d.set_item("declined_payoff", s.declined_payoff)?;
    d.set_item("saved_blocks", s.saved_blocks)?;
    d.set_item("lost_blocks", s.lost_blocks)?;
    Ok(d)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyKvIndex>()?;
    m.add_class::<IndexStats>()?;
    m.add_class::<RequestView>()?;
    m.add_class::<WorkerState>()?;
    m.add_class::<PyPolicy>()?;
    m.add_class::<RoutingStep>()?;
    m.add_class::<PyRetention>()?;
    m.add_class::<NativeRandom>()?;
    m.add_function(wrap_pyfunction!(bench_index_ingest, m)?)?;
    m.add_function(wrap_pyfunction!(bench_index_lookup, m)?)?;
    m.add("INDEX_ENTRY_BYTES", index::ENTRY_BYTES)?;
    m.add("POLICY_NAMES", policies::POLICY_NAMES.to_vec())?;
    Ok(())
}
