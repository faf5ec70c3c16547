//! The engine model for Python: `CostModel` helpers, `BlockPool`, `EngineRequest`, `Engine`,
//! `StepResult`, `RequestOutput` and `PrefixCacheStats` over `kvroute_sim::engine`.
//!
//! KV events come back as the dataclasses of `kvroute.engine.events` (the Python face of
//! events, which the publisher and the index consume). An `EngineRequest` is the Python
//! handle of a request: the engine owns the state and copies it into the handle after every
//! step that touched the request (scheduled, preempted, finished) and on abort, so between
//! steps the handle reads exactly what the engine holds.

use std::collections::HashMap;
use std::sync::Arc;

use kvroute_core::blocks::{self, BlockKeys, DEFAULT_HASH_SEED};
use kvroute_core::kvevents::events::EventBatch as CoreBatch;
use kvroute_sim::engine::cost;
use kvroute_sim::engine::pool::{self, TokenSeq};
use kvroute_sim::engine::scheduler::{self, NewRequest, RequestKey, RequestSummary};
use pyo3::exceptions::{PyKeyError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::blocks::{BlockHasher, hash_of, hashes_of};
use crate::events::events_to_py;
use crate::tokens::extract_tokens;

// -- cost model --------------------------------------------------------------------------------

/// A cost model from any object with `CostModel`'s fields (the Python dataclass).
pub(crate) fn cost_of(obj: &Bound<'_, PyAny>) -> PyResult<cost::CostModel> {
    Ok(cost::CostModel {
        name: obj.getattr("name")?.extract()?,
        step_base_s: obj.getattr("step_base_s")?.extract()?,
        prefill_token_s: obj.getattr("prefill_token_s")?.extract()?,
        decode_seq_s: obj.getattr("decode_seq_s")?.extract()?,
        frontend_s: obj.getattr("frontend_s")?.extract()?,
        max_num_batched_tokens: obj.getattr("max_num_batched_tokens")?.extract()?,
        max_num_seqs: obj.getattr("max_num_seqs")?.extract()?,
    })
}

type CostFields = (String, f64, f64, f64, f64, usize, usize);

fn cost_fields(m: cost::CostModel) -> CostFields {
    (
        m.name,
        m.step_base_s,
        m.prefill_token_s,
        m.decode_seq_s,
        m.frontend_s,
        m.max_num_batched_tokens,
        m.max_num_seqs,
    )
}

/// Step time of `cost` (any object with `CostModel`'s fields) for this batch.
#[pyfunction]
fn cost_step_time(
    cost: &Bound<'_, PyAny>,
    prefill_tokens: usize,
    decode_seqs: usize,
) -> PyResult<f64> {
    Ok(cost_of(cost)?.step_time(prefill_tokens, decode_seqs))
}

/// The fields of `cost` running `factor` times faster.
#[pyfunction]
fn cost_scaled(cost: &Bound<'_, PyAny>, factor: f64) -> PyResult<CostFields> {
    let m = cost_of(cost)?
        .scaled(factor)
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    Ok(cost_fields(m))
}

/// The blocks of a pool of ``num_blocks`` that can hold KV: all but vLLM's null block
/// (``kvroute_core::blocks::usable_blocks``).
#[pyfunction]
fn usable_blocks(num_blocks: usize) -> usize {
    kvroute_core::blocks::usable_blocks(num_blocks)
}

/// The fields of every timing preset, in listing order.
#[pyfunction]
fn cost_presets() -> Vec<CostFields> {
    cost::CostModel::presets()
        .into_iter()
        .map(cost_fields)
        .collect()
}

// -- events ------------------------------------------------------------------------------------

fn py_batch<'py>(py: Python<'py>, batch: CoreBatch) -> PyResult<Bound<'py, PyAny>> {
    let events = events_to_py(py, &batch.events)?;
    py.import("kvroute.engine.events")?
        .getattr("EventBatch")?
        .call1((batch.ts, events, batch.data_parallel_rank))
}

// -- pool views --------------------------------------------------------------------------------

fn free_queue_dict<'py>(py: Python<'py>, p: &pool::BlockPool) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (b, h) in p.free_queue() {
        d.set_item(b, h)?;
    }
    Ok(d)
}

fn cached_dict<'py>(py: Python<'py>, p: &pool::BlockPool) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for h in p.cached_hashes() {
        d.set_item(h, p.get_cached_block(h))?;
    }
    Ok(d)
}

fn more_holders_dict<'py>(py: Python<'py>, p: &pool::BlockPool) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for h in p.cached_hashes() {
        let holders = p.holders(h);
        if holders.len() > 1 {
            d.set_item(h, holders[1..].to_vec())?;
        }
    }
    Ok(d)
}

fn ref_counts(p: &pool::BlockPool) -> Vec<u32> {
    (0..p.num_blocks() as u32).map(|b| p.ref_cnt(b)).collect()
}

/// The KV block allocator and prefix cache of one vLLM v1 worker (vLLM's `block_pool.py`).
///
/// Args:
///     num_blocks: total KV blocks, the null block included.
///     block_size: tokens per block.
///     enable_caching: when False, nothing is cached or looked up.
///     emit_events: collect KV events for a publisher.
#[pyclass(module = "kvroute._native")]
pub struct BlockPool {
    inner: pool::BlockPool,
}

#[pymethods]
impl BlockPool {
    #[new]
    #[pyo3(signature = (num_blocks, block_size, enable_caching = true, emit_events = false))]
    fn new(
        num_blocks: usize,
        block_size: usize,
        enable_caching: bool,
        emit_events: bool,
    ) -> PyResult<Self> {
        if num_blocks < 2 {
            return Err(PyValueError::new_err(format!(
                "need at least 2 KV blocks (one is the null block), got {num_blocks}"
            )));
        }
        if block_size == 0 {
            return Err(PyValueError::new_err("block size must be positive, got 0"));
        }
        Ok(Self {
            inner: pool::BlockPool::new(num_blocks, block_size, enable_caching, emit_events),
        })
    }
    #[getter]
    fn num_blocks(&self) -> usize {
        self.inner.num_blocks()
    }
    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }
    #[getter]
    fn enable_caching(&self) -> bool {
        self.inner.enable_caching()
    }
    #[getter]
    fn emit_events(&self) -> bool {
        self.inner.emit_events()
    }
    #[getter]
    fn num_free_blocks(&self) -> usize {
        self.inner.num_free_blocks()
    }
    /// Bumped by every change that could let a waiting request in.
    #[getter]
    fn version(&self) -> u64 {
        self.inner.version()
    }
    /// Ref count by block (``pool.ref_cnt[b]``), a snapshot.
    #[getter]
    fn ref_cnt(&self) -> Vec<u32> {
        ref_counts(&self.inner)
    }
    /// Fraction of usable blocks held by requests (vLLM's ``kv_cache_usage_perc``).
    #[getter]
    fn usage(&self) -> f64 {
        self.inner.usage()
    }
    /// The free queue, head (evicted first) to tail: ``{block: hash it holds or None}``.
    #[getter]
    fn free_queue<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        free_queue_dict(py, &self.inner)
    }
    /// ``{hash: oldest block holding it}``.
    #[getter]
    fn cached<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        cached_dict(py, &self.inner)
    }
    /// ``{hash: younger holders, oldest first}`` for hashes held more than once.
    #[getter]
    fn _more_holders<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        more_holders_dict(py, &self.inner)
    }
    fn get_cached_block(&self, block_hash: &Bound<'_, PyAny>) -> PyResult<Option<u32>> {
        Ok(self.inner.get_cached_block(hash_of(block_hash)?))
    }
    /// Blocks of the longest cached prefix of ``block_hashes`` (at most ``max_blocks``).
    fn find_longest_hit(
        &self,
        block_hashes: &Bound<'_, PyAny>,
        max_blocks: i64,
    ) -> PyResult<Vec<u32>> {
        Ok(self
            .inner
            .find_longest_hit(&hashes_of(block_hashes)?, max_blocks.max(0) as usize))
    }
    fn num_evictable(&self, blocks: Vec<u32>) -> usize {
        self.inner.num_evictable(&blocks)
    }
    /// Take hit blocks into use: ref count +1, out of the free queue if they were free.
    fn touch(&mut self, blocks: Vec<u32>) {
        self.inner.touch(&blocks)
    }
    /// Take ``n`` blocks from the head of the free queue, evicting their cached hashes.
    fn get_new_blocks(&mut self, n: i64) -> PyResult<Vec<u32>> {
        self.inner
            .get_new_blocks(n.max(0) as usize)
            .map_err(|e| PyValueError::new_err(e.to_string()))
    }
    /// Register blocks ``[num_cached, num_full)`` as cached; ``token_ids`` (the request's
    /// tokens) feed the BlockStored event and may be None when events are off.
    fn cache_full_blocks(
        &mut self,
        py: Python<'_>,
        blocks: Vec<u32>,
        block_hashes: &Bound<'_, PyAny>,
        num_cached: usize,
        num_full: usize,
        token_ids: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let block_hashes = hashes_of(block_hashes)?;
        if num_full > blocks.len() || num_full > block_hashes.len() {
            return Err(PyValueError::new_err(
                "num_full exceeds the blocks or hashes given",
            ));
        }
        let tokens = if token_ids.is_none() {
            Vec::new()
        } else {
            extract_tokens(py, token_ids)?
        };
        if self.inner.emit_events()
            && self.inner.enable_caching()
            && num_full > num_cached
            && tokens.len() < num_full * self.inner.block_size()
        {
            return Err(PyValueError::new_err(
                "token_ids must cover the blocks stored",
            ));
        }
        let seq = TokenSeq::new(&tokens, &[]);
        self.inner
            .cache_full_blocks(&blocks, &block_hashes, num_cached, num_full, seq);
        Ok(())
    }
    /// Drop one reference from each block; those reaching 0 join the free queue's tail in
    /// the given order (pass a request's blocks reversed: tail evicted first).
    fn free_blocks(&mut self, ordered_blocks: Vec<u32>) -> PyResult<()> {
        if let Some(b) = ordered_blocks
            .iter()
            .find(|&&b| b as usize >= self.inner.num_blocks() || self.inner.ref_cnt(b) == 0)
        {
            return Err(PyValueError::new_err(format!("block {b} is not in use")));
        }
        self.inner.free_blocks(ordered_blocks);
        Ok(())
    }
    /// Forget every cached hash (refused, False, while any request holds blocks).
    fn reset_prefix_cache(&mut self) -> bool {
        self.inner.reset_prefix_cache()
    }
    fn take_events<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        events_to_py(py, &self.inner.take_events())
    }
}

/// An engine's pool, read through the engine (``engine.pool``): the engine alone changes it.
#[pyclass(module = "kvroute._native", frozen)]
pub struct EnginePool {
    engine: Py<Engine>,
}

#[pymethods]
impl EnginePool {
    #[getter]
    fn num_blocks(&self, py: Python<'_>) -> usize {
        self.engine.borrow(py).core.pool().num_blocks()
    }
    #[getter]
    fn block_size(&self, py: Python<'_>) -> usize {
        self.engine.borrow(py).core.pool().block_size()
    }
    #[getter]
    fn enable_caching(&self, py: Python<'_>) -> bool {
        self.engine.borrow(py).core.pool().enable_caching()
    }
    #[getter]
    fn emit_events(&self, py: Python<'_>) -> bool {
        self.engine.borrow(py).core.pool().emit_events()
    }
    #[getter]
    fn num_free_blocks(&self, py: Python<'_>) -> usize {
        self.engine.borrow(py).core.pool().num_free_blocks()
    }
    #[getter]
    fn usage(&self, py: Python<'_>) -> f64 {
        self.engine.borrow(py).core.pool().usage()
    }
    #[getter]
    fn ref_cnt(&self, py: Python<'_>) -> Vec<u32> {
        ref_counts(self.engine.borrow(py).core.pool())
    }
    #[getter]
    fn free_queue<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        free_queue_dict(py, self.engine.borrow(py).core.pool())
    }
    #[getter]
    fn cached<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        cached_dict(py, self.engine.borrow(py).core.pool())
    }
    #[getter]
    fn _more_holders<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        more_holders_dict(py, self.engine.borrow(py).core.pool())
    }
    fn get_cached_block(
        &self,
        py: Python<'_>,
        block_hash: &Bound<'_, PyAny>,
    ) -> PyResult<Option<u32>> {
        let h = hash_of(block_hash)?;
        Ok(self.engine.borrow(py).core.pool().get_cached_block(h))
    }
    #[getter]
    fn version(&self, py: Python<'_>) -> u64 {
        self.engine.borrow(py).core.pool().version()
    }
    /// Blocks of the longest cached prefix of ``block_hashes`` (at most ``max_blocks``).
    fn find_longest_hit(
        &self,
        py: Python<'_>,
        block_hashes: &Bound<'_, PyAny>,
        max_blocks: i64,
    ) -> PyResult<Vec<u32>> {
        let hashes = hashes_of(block_hashes)?;
        Ok(self
            .engine
            .borrow(py)
            .core
            .pool()
            .find_longest_hit(&hashes, max_blocks.max(0) as usize))
    }
    fn num_evictable(&self, py: Python<'_>, blocks: Vec<u32>) -> usize {
        self.engine.borrow(py).core.pool().num_evictable(&blocks)
    }
    /// Events collected outside a step (a reset on an idle engine).
    fn take_events<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let events = self.engine.borrow_mut(py).core.take_pool_events();
        events_to_py(py, &events)
    }
}

// -- requests, outputs, stats --------------------------------------------------------------------

/// One request inside the engine.
///
/// Args:
///     request_id: unique id.
///     prompt_token_ids: the prompt.
///     output_token_ids: the tokens the "sampler" will produce, in order; the request
///         finishes after ``max_tokens`` of them (or all of them, if fewer are given).
///     arrival_time: when the engine received it (after any front-end delay).
///     block_hashes: hashes of the prompt's first full blocks, if the caller has them.
///     max_tokens: -1 for all of ``output_token_ids``.
///     lora_name: the LoRA adapter it runs under (keys every block hash, as in vLLM).
///     lora_id: that adapter's id (vLLM's ``lora_int_id``, sent in ``BlockStored.lora_id``).
///     cache_salt: its cache salt (keys the first block; an empty salt counts as none).
///
/// The state (``num_output``, ``num_cached_tokens`` (-1 before admission), ``blocks``, …) is
/// the engine's, copied in after every step that touched the request.
#[pyclass(module = "kvroute._native")]
pub struct EngineRequest {
    #[pyo3(get, set)]
    request_id: String,
    #[pyo3(get)]
    prompt_token_ids: Py<PyAny>,
    #[pyo3(get)]
    output_token_ids: Py<PyAny>,
    #[pyo3(get)]
    arrival_time: f64,
    #[pyo3(get)]
    block_hashes: Vec<u64>,
    #[pyo3(get)]
    max_tokens: usize,
    #[pyo3(get)]
    lora_name: Option<String>,
    #[pyo3(get)]
    lora_id: Option<i64>,
    #[pyo3(get)]
    cache_salt: Option<String>,
    prompt: Vec<u32>,
    output: Arc<[u32]>,
    #[pyo3(get)]
    num_output: usize,
    #[pyo3(get)]
    num_computed_tokens: usize,
    #[pyo3(get)]
    num_cached_tokens: i64,
    #[pyo3(get)]
    num_cached_blocks: usize,
    #[pyo3(get)]
    num_preemptions: u32,
    #[pyo3(get)]
    blocks: Vec<u32>,
    #[pyo3(get)]
    first_token_time: Option<f64>,
    #[pyo3(get)]
    finish_time: Option<f64>,
    /// Whether it was handed to an engine already.
    added: bool,
}

fn token_array<'py>(py: Python<'py>, obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    py.import("numpy")?
        .call_method1("ascontiguousarray", (obj, "<u4"))
}

impl EngineRequest {
    fn sync(&mut self, s: &RequestSummary, blocks: Option<&[u32]>) {
        self.num_output = s.num_output;
        self.num_computed_tokens = s.num_computed_tokens;
        self.num_cached_tokens = s.num_cached_tokens;
        self.num_cached_blocks = s.num_cached_blocks;
        self.num_preemptions = s.num_preemptions;
        self.first_token_time = s.first_token_time;
        self.finish_time = s.finish_time;
        self.blocks.clear();
        if let Some(b) = blocks {
            self.blocks.extend_from_slice(b);
        }
    }
}

#[pymethods]
impl EngineRequest {
    #[new]
    #[pyo3(signature = (
        request_id, prompt_token_ids, output_token_ids, arrival_time, block_hashes = None,
        max_tokens = -1, *, lora_name = None, lora_id = None, cache_salt = None
    ))]
    // Mirrors vLLM's `Request` constructor (id, prompt and output ids, arrival, block hashes,
    // max tokens, LoRA and salt), as the emulator and the engine parity tests build one.
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        request_id: String,
        prompt_token_ids: &Bound<'_, PyAny>,
        output_token_ids: &Bound<'_, PyAny>,
        arrival_time: f64,
        block_hashes: Option<&Bound<'_, PyAny>>,
        max_tokens: i64,
        lora_name: Option<String>,
        lora_id: Option<i64>,
        cache_salt: Option<String>,
    ) -> PyResult<Self> {
        let block_hashes = block_hashes.map(hashes_of).transpose()?;
        let prompt_arr = token_array(py, prompt_token_ids)?;
        let output_arr = token_array(py, output_token_ids)?;
        let prompt = extract_tokens(py, &prompt_arr)?;
        let output: Arc<[u32]> = extract_tokens(py, &output_arr)?.into();
        let max_tokens = if max_tokens < 0 || max_tokens as usize > output.len() {
            output.len()
        } else {
            max_tokens as usize
        };
        if max_tokens < 1 {
            return Err(PyValueError::new_err(
                "a request must generate at least one token",
            ));
        }
        Ok(Self {
            request_id,
            prompt_token_ids: prompt_arr.unbind(),
            output_token_ids: output_arr.unbind(),
            arrival_time,
            block_hashes: block_hashes.unwrap_or_default(),
            max_tokens,
            lora_name,
            lora_id,
            cache_salt,
            prompt,
            output,
            num_output: 0,
            num_computed_tokens: 0,
            num_cached_tokens: -1,
            num_cached_blocks: 0,
            num_preemptions: 0,
            blocks: Vec::new(),
            first_token_time: None,
            finish_time: None,
            added: false,
        })
    }
    #[getter]
    fn num_prompt_tokens(&self) -> usize {
        self.prompt.len()
    }
    /// Prompt plus generated tokens so far.
    #[getter]
    fn num_tokens(&self) -> usize {
        self.prompt.len() + self.num_output
    }
    fn __repr__(&self) -> String {
        format!(
            "EngineRequest({:?}, prompt={} tokens, output {}/{}, cached {})",
            self.request_id,
            self.prompt.len(),
            self.num_output,
            self.max_tokens,
            self.num_cached_tokens
        )
    }
}

/// What one step produced for one request.
#[pyclass(module = "kvroute._native", frozen, get_all)]
pub struct RequestOutput {
    request: Py<EngineRequest>,
    new_token_id: u32,
    first_token: bool,
    finished: bool,
}

/// One engine step: scheduled at ``start``, outputs ready at ``end``.
#[pyclass(module = "kvroute._native", frozen, get_all)]
pub struct StepResult {
    start: f64,
    end: f64,
    prefill_tokens: usize,
    decode_seqs: usize,
    outputs: Py<PyList>,
    events: Option<Py<PyAny>>,
}

/// vLLM's prefix-cache counters (tokens), cumulative.
#[pyclass(module = "kvroute._native", get_all, set_all, eq)]
#[derive(Clone, PartialEq)]
pub struct PrefixCacheStats {
    requests: u64,
    queries: u64,
    hits: u64,
    preempted_requests: u64,
    preempted_queries: u64,
    preempted_hits: u64,
}

impl From<scheduler::PrefixCacheStats> for PrefixCacheStats {
    fn from(s: scheduler::PrefixCacheStats) -> Self {
        Self {
            requests: s.requests,
            queries: s.queries,
            hits: s.hits,
            preempted_requests: s.preempted_requests,
            preempted_queries: s.preempted_queries,
            preempted_hits: s.preempted_hits,
        }
    }
}

#[pymethods]
impl PrefixCacheStats {
    #[new]
    #[pyo3(signature = (requests = 0, queries = 0, hits = 0, preempted_requests = 0, preempted_queries = 0, preempted_hits = 0))]
    fn new(
        requests: u64,
        queries: u64,
        hits: u64,
        preempted_requests: u64,
        preempted_queries: u64,
        preempted_hits: u64,
    ) -> Self {
        Self {
            requests,
            queries,
            hits,
            preempted_requests,
            preempted_queries,
            preempted_hits,
        }
    }
    fn __repr__(&self) -> String {
        format!(
            "PrefixCacheStats(requests={}, queries={}, hits={}, preempted_requests={}, preempted_queries={}, preempted_hits={})",
            self.requests,
            self.queries,
            self.hits,
            self.preempted_requests,
            self.preempted_queries,
            self.preempted_hits
        )
    }
}

// -- the engine --------------------------------------------------------------------------------

/// One vLLM worker: a BlockPool, a scheduler and a cost model.
///
/// Args:
///     num_blocks: KV blocks including the null block.
///     block_size: tokens per block.
///     cost: the step-time model (``kvroute.engine.CostModel``).
///     hasher: the block hasher (default: ``BlockHasher(block_size)``).
///     enable_caching: prefix caching on (vLLM's default in v1).
///     emit_events: collect KV events per step (the emulator publishes them).
#[pyclass(module = "kvroute._native", subclass)]
pub struct Engine {
    pub(crate) core: scheduler::Engine,
    /// The Python handle of each live request, by key.
    handles: Vec<Option<Py<EngineRequest>>>,
    ids: HashMap<String, RequestKey>,
    pub(crate) cost_obj: Py<PyAny>,
    hasher_obj: Py<BlockHasher>,
}

impl Engine {
    fn sync_live(&self, py: Python<'_>, key: RequestKey) {
        if let (Some(r), Some(Some(h))) = (self.core.request(key), self.handles.get(key)) {
            h.borrow_mut(py).sync(&r.summary(), Some(&r.blocks));
        }
    }

    fn forget(&mut self, key: RequestKey) -> Option<Py<EngineRequest>> {
        let handle = self.handles.get_mut(key)?.take()?;
        Python::attach(|py| {
            self.ids.remove(&handle.borrow(py).request_id);
        });
        Some(handle)
    }
}

#[pymethods]
impl Engine {
    #[new]
    #[pyo3(signature = (num_blocks, block_size, cost, hasher = None, enable_caching = true, emit_events = false))]
    fn new(
        py: Python<'_>,
        num_blocks: usize,
        block_size: usize,
        cost: &Bound<'_, PyAny>,
        hasher: Option<Py<BlockHasher>>,
        enable_caching: bool,
        emit_events: bool,
    ) -> PyResult<Self> {
        if num_blocks < 2 {
            return Err(PyValueError::new_err(format!(
                "need at least 2 KV blocks (one is the null block), got {num_blocks}"
            )));
        }
        let hasher = match hasher {
            Some(h) => h,
            None => {
                let inner = blocks::BlockHasher::new(block_size, DEFAULT_HASH_SEED)
                    .map_err(|e| PyValueError::new_err(e.to_string()))?;
                Py::new(py, BlockHasher { inner })?
            }
        };
        let inner = hasher.borrow(py).inner;
        if inner.block_size() != block_size {
            return Err(PyValueError::new_err(
                "hasher block size differs from the engine's",
            ));
        }
        Ok(Self {
            core: scheduler::Engine::new(
                num_blocks,
                cost_of(cost)?,
                inner,
                enable_caching,
                emit_events,
            ),
            handles: Vec::new(),
            ids: HashMap::new(),
            cost_obj: cost.clone().unbind(),
            hasher_obj: hasher,
        })
    }

    #[getter]
    fn cost(&self, py: Python<'_>) -> Py<PyAny> {
        self.cost_obj.clone_ref(py)
    }
    #[getter]
    fn hasher(&self, py: Python<'_>) -> Py<BlockHasher> {
        self.hasher_obj.clone_ref(py)
    }

    /// Model LoRA adapters as vLLM's ``--max-loras``: a batch holds requests of at most
    /// ``max_loras`` adapters (a request of another waits), and a step that brings an
    /// adapter into one of the ``max_loras`` slots takes ``load_s`` longer per adapter.
    fn set_lora_slots(&mut self, max_loras: usize, load_s: f64) -> PyResult<()> {
        if max_loras < 1 || load_s.is_nan() || load_s < 0.0 {
            return Err(PyValueError::new_err(
                "max_loras must be positive and load_s non-negative",
            ));
        }
        self.core
            .set_lora_slots(scheduler::LoraSlots::new(max_loras, load_s));
        Ok(())
    }

    /// Adapters brought into a LoRA slot so far (0 when adapters are not modelled).
    #[getter]
    fn lora_loads(&self) -> u64 {
        self.core.lora_slots().map_or(0, |l| l.loads)
    }
    #[getter]
    fn block_size(&self) -> usize {
        self.core.block_size()
    }
    /// The engine's BlockPool (read-only view).
    #[getter]
    fn pool(slf: Bound<'_, Self>) -> PyResult<EnginePool> {
        Ok(EnginePool {
            engine: slf.unbind(),
        })
    }
    #[getter]
    fn has_work(&self) -> bool {
        self.core.has_work()
    }
    #[getter]
    fn num_running(&self) -> usize {
        self.core.num_running()
    }
    #[getter]
    fn num_waiting(&self) -> usize {
        self.core.num_waiting()
    }
    /// The requests in the running batch, in admission order.
    #[getter]
    fn running(&self, py: Python<'_>) -> Vec<Py<EngineRequest>> {
        self.core
            .running()
            .iter()
            .filter_map(|&k| self.handles[k].as_ref().map(|h| h.clone_ref(py)))
            .collect()
    }
    /// The waiting requests, head first.
    #[getter]
    fn waiting(&self, py: Python<'_>) -> Vec<Py<EngineRequest>> {
        self.core
            .waiting()
            .filter_map(|k| self.handles[k].as_ref().map(|h| h.clone_ref(py)))
            .collect()
    }
    /// The prefix-cache counters (a snapshot).
    #[getter]
    fn stats(&self) -> PrefixCacheStats {
        self.core.stats().into()
    }
    #[getter]
    fn num_preemptions(&self) -> u64 {
        self.core.num_preemptions()
    }
    #[getter]
    fn prompt_tokens_total(&self) -> u64 {
        self.core.prompt_tokens_total()
    }
    #[getter]
    fn generation_tokens_total(&self) -> u64 {
        self.core.generation_tokens_total()
    }

    fn add_request(&mut self, py: Python<'_>, request: Py<EngineRequest>) -> PyResult<()> {
        let new = {
            let mut r = request.borrow_mut(py);
            if self.ids.contains_key(&r.request_id) {
                return Err(PyValueError::new_err(format!(
                    "duplicate request id {:?}",
                    r.request_id
                )));
            }
            if r.added {
                return Err(PyValueError::new_err(format!(
                    "request {:?} was added to an engine already",
                    r.request_id
                )));
            }
            r.added = true;
            NewRequest {
                prompt_head: Arc::default(),
                prompt: r.prompt.clone(),
                output: r.output.clone(),
                max_tokens: r.max_tokens,
                arrival_time: r.arrival_time,
                block_hashes: r.block_hashes.clone(),
                keys: BlockKeys::new(r.lora_name.as_deref(), r.cache_salt.as_deref()),
                lora_id: r.lora_id,
            }
        };
        let key = self
            .core
            .add_request(new)
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        if self.handles.len() <= key {
            self.handles.resize_with(key + 1, || None);
        }
        self.ids.insert(request.borrow(py).request_id.clone(), key);
        self.handles[key] = Some(request);
        Ok(())
    }

    /// Drop a request (client went away); its blocks are freed like a finished one's.
    fn abort_request(&mut self, py: Python<'_>, request_id: &str) -> bool {
        let Some(&key) = self.ids.get(request_id) else {
            return false;
        };
        let summary = self.core.abort_request(key).expect("a live request");
        if let Some(h) = self.forget(key) {
            h.borrow_mut(py).sync(&summary, None);
        }
        true
    }

    /// Forget every cached block (refused, False, while requests hold blocks).
    fn reset_prefix_cache(&mut self) -> bool {
        self.core.reset_prefix_cache()
    }

    /// Schedule and run one step starting at ``now``.
    fn step(&mut self, py: Python<'_>, now: f64) -> PyResult<StepResult> {
        let result = self.core.step(now);
        for &(key, _) in &result.scheduled {
            self.sync_live(py, key);
        }
        for &key in &result.preempted {
            self.sync_live(py, key);
        }
        let outputs = PyList::empty(py);
        for o in &result.outputs {
            let handle = if o.finished {
                let h = self
                    .forget(o.key)
                    .ok_or_else(|| PyKeyError::new_err("unknown request"))?;
                h.borrow_mut(py).sync(&o.summary, None);
                h
            } else {
                self.handles[o.key]
                    .as_ref()
                    .expect("a live request")
                    .clone_ref(py)
            };
            outputs.append(RequestOutput {
                request: handle,
                new_token_id: o.new_token_id,
                first_token: o.first_token,
                finished: o.finished,
            })?;
        }
        let events = match result.events {
            Some(batch) => Some(py_batch(py, batch)?.unbind()),
            None => None,
        };
        Ok(StepResult {
            start: result.start,
            end: result.end,
            prefill_tokens: result.prefill_tokens,
            decode_seqs: result.decode_seqs,
            outputs: outputs.unbind(),
            events,
        })
    }

    /// Step time of a decode-only step of the running batch.
    fn decode_step_time(&self) -> f64 {
        self.core.cost().step_time(0, self.core.num_running())
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<BlockPool>()?;
    m.add_class::<EnginePool>()?;
    m.add_class::<EngineRequest>()?;
    m.add_class::<RequestOutput>()?;
    m.add_class::<StepResult>()?;
    m.add_class::<PrefixCacheStats>()?;
    m.add_class::<Engine>()?;
    m.add_function(wrap_pyfunction!(cost_step_time, m)?)?;
    m.add_function(wrap_pyfunction!(cost_scaled, m)?)?;
    m.add_function(wrap_pyfunction!(cost_presets, m)?)?;
    m.add_function(wrap_pyfunction!(usable_blocks, m)?)?;
    m.add("NULL_BLOCK", pool::NULL_BLOCK)?;
    Ok(())
}
