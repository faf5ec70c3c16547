//! The routing step for Python: `RoutingStep`, what the simulator and the live router both
//! run per request.

use kvroute_core::blocks;
use kvroute_core::policies::{Choose, adapter_id};
use kvroute_core::routing::{self, JournalEntry};
use kvroute_io::lock_index;
use pyo3::exceptions::{PyIndexError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::events::{event_to_py, events_from_py};
use crate::index::PyKvIndex;
use crate::policies::{ForeignPolicy, PyPolicy};
use crate::workers::WorkerState;

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
///     max_loras: the workers' LoRA slots (vLLM's ``--max-loras``): the step models the
///         adapters in each worker's slots as the last this many distinct adapters routed
///         there, for kv-aware's adapter term (None: not modelled, the term is off).
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
    #[pyo3(signature = (policy, index = None, block_size = blocks::GPU_BLOCK_SIZE, kv_capacity_blocks = None, max_loras = None))]
    fn new(
        policy: Bound<'_, PyAny>,
        index: Option<Bound<'_, PyKvIndex>>,
        block_size: usize,
        kv_capacity_blocks: Option<usize>,
        max_loras: Option<usize>,
    ) -> PyResult<Self> {
        if block_size == 0 {
            return Err(PyValueError::new_err("block size must be positive, got 0"));
        }
        if max_loras == Some(0) {
            return Err(PyValueError::new_err("max_loras must be >= 1, got 0"));
        }
        let needs_admission = policy
            .cast::<PyPolicy>()
            .is_ok_and(|p| p.borrow().inner.needs_admission());
        let native = policy.cast::<PyPolicy>().ok().map(|p| p.clone().unbind());
        let mut inner = routing::RoutingStep::new(block_size);
        if let (Some(c), true) = (kv_capacity_blocks, needs_admission) {
            inner.track_admission(Some(c));
        }
        inner.track_adapters(max_loras);
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

    /// Route one request under LoRA ``adapter`` (its name; None: a base model) among
    /// ``candidates`` (slots; None: every worker) at ``now``: returns ``(slot,
    /// overlap_blocks, prefill_tokens)``, already counted in that worker's load until
    /// ``first_token`` / ``finished``.
    #[pyo3(signature = (block_hashes, prompt_tokens, now, candidates = None, adapter = None))]
    fn route(
        &mut self,
        py: Python<'_>,
        block_hashes: Vec<u64>,
        prompt_tokens: usize,
        now: f64,
        candidates: Option<Vec<usize>>,
        adapter: Option<&str>,
    ) -> PyResult<(usize, usize, usize)> {
        let adapter = adapter.map(adapter_id);
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
        let request = routing::Request {
            block_hashes: &block_hashes,
            prompt_tokens,
            adapter,
            ..routing::Request::default()
        };
        let routed = if let Some(native) = &self.native {
            let mut policy = native.borrow_mut(py);
            self.inner
                .route(ix, &mut policy.inner, &request, candidates.as_deref(), now)
        } else {
            let policy = self.policy.bind(py);
            let needs_overlap = policy.getattr("needs_overlap")?.is_truthy()?;
            let mut foreign = ForeignPolicy {
                policy,
                needs_overlap,
                error: None,
            };
            let routed = self
                .inner
                .route(ix, &mut foreign, &request, candidates.as_deref(), now);
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
    #[pyo3(signature = (slot, block_hashes, prompt_tokens, now, adapter = None))]
    fn route_to(
        &mut self,
        py: Python<'_>,
        slot: usize,
        block_hashes: Vec<u64>,
        prompt_tokens: usize,
        now: f64,
        adapter: Option<&str>,
    ) -> PyResult<(usize, usize, usize)> {
        self.check_slot(slot)?;
        let index_ref = self.index.as_ref().map(|i| i.borrow(py));
        let mut index = index_ref.as_ref().map(|i| lock_index(&i.inner));
        let routed = self.inner.route_to(
            index.as_deref_mut(),
            slot,
            &block_hashes,
            prompt_tokens,
            adapter.map(adapter_id),
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
        let events = events_from_py(py, events)?;
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
                    decision: routed,
                    ..
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
    pub(crate) fn check_slot(&self, slot: usize) -> PyResult<()> {
        if slot >= self.inner.slot_count() {
            return Err(PyIndexError::new_err(format!("no worker slot {slot}")));
        }
        Ok(())
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<RoutingStep>()?;
    Ok(())
}
