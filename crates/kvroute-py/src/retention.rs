//! Retention for Python: `Retention`, the router refreshing the prefixes each worker's LRU
//! would otherwise evict.

use kvroute_core::retention;
use kvroute_io::lock_index;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::routing::RoutingStep;

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
///     capacity_blocks: usable KV blocks per worker (``num_gpu_blocks`` − 1); the other knobs
///         are ``RetentionConfig``'s defaults (``kvroute_core::retention``).
#[pyclass(module = "kvroute._native", name = "Retention")]
pub struct PyRetention {
    pub(crate) inner: retention::Retention,
}

#[pymethods]
impl PyRetention {
    #[new]
    fn new(mode: &str, block_size: usize, capacity_blocks: usize) -> PyResult<Self> {
        let mode: retention::RetentionMode = mode.parse().map_err(PyValueError::new_err)?;
        if block_size == 0 {
            return Err(PyValueError::new_err("block size must be positive, got 0"));
        }
        let config = retention::RetentionConfig::new(mode, block_size, capacity_blocks);
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
    fn routed(
        &mut self,
        slot: usize,
        block_hashes: Vec<u64>,
        prompt: &Bound<'_, PyAny>,
        overlap: usize,
        output_tokens: usize,
        now: f64,
    ) -> PyResult<()> {
        let tokens = crate::tokens::extract_tokens(prompt.py(), prompt)?;
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
    /// ``RoutingStep.route_to``. ``adapter``: the prompt's LoRA adapter (its name), which
    /// breaks ties toward a worker holding it.
    #[pyo3(signature = (routing, slots, block_hashes, now, adapter = None))]
    fn room_for(
        &self,
        py: Python<'_>,
        routing: &Bound<'_, RoutingStep>,
        slots: Vec<usize>,
        block_hashes: Vec<u64>,
        now: f64,
        adapter: Option<&str>,
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
            adapter.map(kvroute_core::policies::adapter_id),
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
    m.add_class::<PyRetention>()?;
    let modes: Vec<&str> = retention::RetentionMode::ALL
        .map(retention::RetentionMode::name)
        .to_vec();
    m.add("RETENTION_MODES", modes)?;
    Ok(())
}
