//! What a policy may know about a request and the workers: `RequestView`, `WorkerState`.

use kvroute_core::policies;
use pyo3::exceptions::{PyIndexError, PyValueError};
use pyo3::prelude::*;

/// What a policy may know about a request.
///
/// Args:
///     block_hashes: chained hashes of the prompt's full blocks.
///     prompt_tokens: prompt length in tokens.
///     overlap_blocks: leading blocks of the prompt each worker holds, aligned with the
///         ``workers`` passed to ``choose``; filled only for policies that ``needs_overlap``.
#[pyclass(module = "kvroute._native", get_all, set_all)]
pub struct RequestView {
    pub(crate) block_hashes: Vec<u64>,
    pub(crate) prompt_tokens: usize,
    pub(crate) overlap_blocks: Option<Vec<usize>>,
}

impl RequestView {
    pub(crate) fn view(&self) -> policies::RequestView<'_> {
        policies::RequestView {
            block_hashes: &self.block_hashes,
            prompt_tokens: self.prompt_tokens,
            overlap_blocks: self.overlap_blocks.as_deref(),
            admission_wait: None,
            adapter: None,
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
    pub(crate) inner: policies::WorkerState,
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
                adapters: Vec::new(),
                lora_slots: 0,
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

pub(crate) fn states_of<'py>(
    workers: &Bound<'py, PyAny>,
) -> PyResult<Vec<PyRef<'py, WorkerState>>> {
    let states: Vec<PyRef<'py, WorkerState>> = workers
        .try_iter()?
        .map(|w| w?.extract::<PyRef<'py, WorkerState>>().map_err(Into::into))
        .collect::<PyResult<_>>()?;
    if states.is_empty() {
        return Err(PyValueError::new_err("no workers to choose from"));
    }
    Ok(states)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<RequestView>()?;
    m.add_class::<WorkerState>()?;
    Ok(())
}
