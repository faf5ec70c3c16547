//! The native KV-event consumer for Python (`kvroute_io::consumer`): `KvEventConsumer`.
//!
//! `kvroute serve`'s worker pool makes one, over the router's `KvIndex`, and only adds and
//! removes workers (as discovery reports them), logs the notices it posts and reads its
//! counters for `/metrics`: receiving, the sequence tracker, decoding and the index's apply
//! all run on the consumer's thread, without the GIL. `kvroute.kvevents.KVEventSubscriber` makes
//! one without an index (outbox mode) and hands every item to Python.

use std::time::Duration;

use kvroute_io::{Consumer, Item, Notice, Subscription};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use serde::Deserialize;

use crate::config::read_config;

use crate::index::PyKvIndex;

/// `add_worker`'s keyword options (see there), with their defaults.
#[derive(Deserialize)]
#[serde(default, deny_unknown_fields)]
struct StreamOptions {
    topic: String,
    bind: bool,
    replay_timeout: f64,
    catch_up: bool,
}

impl Default for StreamOptions {
    fn default() -> Self {
        Self {
            topic: String::new(),
            bind: false,
            replay_timeout: 1.0,
            catch_up: true,
        }
    }
}
use crate::kvevents::NativeEventBatch;

/// One thread following workers' KV event streams (``kvroute-io``; what ``kvroute serve`` runs).
///
/// Args:
///     index: the router's ``KvIndex``: batches are applied to it, and only the conditions
///         that reset a worker (replay failed, restart, malformed) are posted as notices.
///         None: every item is posted (``KVEventSubscriber``).
///     coalesce_s: after taking batches, the thread lets the next ones gather this long
///         before it polls again (one wake-up for several engine steps; 0: no wait).
#[pyclass(module = "kvroute._native", frozen)]
pub struct KvEventConsumer {
    inner: Consumer,
}

fn notice_to_py<'py>(py: Python<'py>, notice: Notice) -> PyResult<Bound<'py, PyAny>> {
    let worker = notice.worker;
    Ok(match notice.item {
        Item::Batch {
            seq,
            batch,
            replayed,
        } => (
            "batch",
            worker,
            seq,
            Py::new(py, NativeEventBatch { batch })?,
            replayed,
        )
            .into_pyobject(py)?
            .into_any(),
        Item::Gap { expected, got } => ("gap", worker, expected, got).into_pyobject(py)?.into_any(),
        Item::ReplayFailed {
            expected,
            got,
            reason,
        } => ("replay_failed", worker, expected, got, reason)
            .into_pyobject(py)?
            .into_any(),
        Item::Restarted { last_seq, new_seq } => ("restarted", worker, last_seq, new_seq)
            .into_pyobject(py)?
            .into_any(),
        Item::Malformed { seq, error } => ("malformed", worker, seq, error)
            .into_pyobject(py)?
            .into_any(),
        Item::Crashed { error } => ("crashed", worker, error).into_pyobject(py)?.into_any(),
    })
}

#[pymethods]
impl KvEventConsumer {
    #[new]
    #[pyo3(signature = (index = None, *, coalesce_s = 0.0))]
    fn new(index: Option<PyRef<'_, PyKvIndex>>, coalesce_s: f64) -> PyResult<Self> {
        let coalesce = Duration::try_from_secs_f64(coalesce_s)
            .map_err(|_| PyValueError::new_err(format!("bad coalesce_s {coalesce_s}")))?;
        let inner = Consumer::start(index.map(|i| i.inner.clone()), coalesce).map_err(|e| {
            PyRuntimeError::new_err(format!("cannot start the KV event consumer: {e}"))
        })?;
        Ok(Self { inner })
    }

    /// Follow ``worker``'s stream (replacing one of that name): its PUB ``endpoint`` (bound
    /// instead with ``bind``), its replay ROUTER ``replay_endpoint`` (None: gaps cannot be
    /// repaired), the ``topic`` prefix, ``replay_timeout`` seconds per replayed message, and
    /// ``catch_up``: replay the engine's buffer first. Returns the SUB socket's address (the
    /// bound one when binding); raises ValueError for an address that cannot be followed (not
    /// ``tcp://HOST:PORT`` or ``ipc://PATH``, or a bind that fails).
    #[pyo3(signature = (worker, endpoint, replay_endpoint = None, **options))]
    fn add_worker(
        &self,
        worker: &str,
        endpoint: &str,
        replay_endpoint: Option<String>,
        options: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<String> {
        let options: StreamOptions = match options {
            Some(options) => read_config(options.as_any())?,
            None => StreamOptions::default(),
        };
        let replay_timeout = Duration::try_from_secs_f64(options.replay_timeout).map_err(|_| {
            PyValueError::new_err(format!("bad replay timeout {}", options.replay_timeout))
        })?;
        self.inner
            .add_worker(
                worker,
                Subscription {
                    endpoint: endpoint.to_string(),
                    replay_endpoint,
                    topic: options.topic.into_bytes(),
                    bind: options.bind,
                    replay_timeout,
                    catch_up: options.catch_up,
                },
            )
            .map_err(PyValueError::new_err)
    }

    /// Stop following ``worker`` (with an index: its entries are dropped after its last batch).
    fn remove_worker(&self, worker: &str) {
        self.inner.remove_worker(worker);
    }

    /// Cumulative counts per followed worker: ``{worker: {"batches", "events",
    /// "unknown_events", "malformed", "gaps", "replay_failures", "restarts"}}``.
    fn counters<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        for (worker, c) in self.inner.counters() {
            let d = PyDict::new(py);
            d.set_item("batches", c.batches)?;
            d.set_item("events", c.events)?;
            d.set_item("unknown_events", c.unknown_events)?;
            d.set_item("malformed", c.malformed)?;
            d.set_item("gaps", c.gaps)?;
            d.set_item("replay_failures", c.replay_failures)?;
            d.set_item("restarts", c.restarts)?;
            out.set_item(worker, d)?;
        }
        Ok(out)
    }

    /// A descriptor readable while notices wait (for ``loop.add_reader``).
    #[getter]
    fn notice_fd(&self) -> i32 {
        self.inner.notice_fd()
    }

    /// The notices posted since the last call, oldest first, as tuples:
    /// ``("batch", worker, seq, NativeEventBatch, replayed)`` (outbox mode only),
    /// ``("gap", worker, expected, got)`` (outbox mode only),
    /// ``("replay_failed", worker, expected, got, reason)``,
    /// ``("restarted", worker, last_seq, new_seq)``, ``("malformed", worker, seq, error)``
    /// (``seq`` None for wrong framing) and ``("crashed", "", error)`` (the thread stopped).
    fn take_notices<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        for notice in self.inner.take_notices() {
            out.append(notice_to_py(py, notice)?)?;
        }
        Ok(out)
    }

    /// Stop the thread, closing every socket; waits at most ``timeout`` seconds (the GIL
    /// released). True if it stopped in time. Idempotent.
    #[pyo3(signature = (timeout = 5.0))]
    fn close(&self, py: Python<'_>, timeout: f64) -> bool {
        let timeout = Duration::try_from_secs_f64(timeout).unwrap_or(Duration::ZERO);
        py.detach(|| self.inner.close(timeout))
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<KvEventConsumer>()?;
    m.add("KV_EVENTS_MAX_MESSAGE", kvroute_io::MAX_MESSAGE)?;
    Ok(())
}
