//! vLLM's KV-event codec and the subscriber's sequence tracker for Python
//! (`kvroute_core::kvevents`).
//!
//! `kvroute.kvevents.wire` wraps the codec with its Python API (`decode_batch` returns the
//! event dataclasses of `kvroute.engine.events`); `kvroute.kvevents.subscriber` keeps the
//! sockets and asks [`SequenceTracker`] what every message means. [`decode_native`] decodes
//! without creating one Python object per event: the router's index takes the
//! [`NativeEventBatch`] it returns and reads [`NativeEventBatch::events`] in Rust.

use kvroute_core::engine::events::{BlockRemoved, BlockStored, EventBatch, KvCacheEvent};
use kvroute_core::kvevents::codec::{self, DecodedBatch, WireFormat};
use kvroute_core::kvevents::sequence::{self, Action};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple, PyType};

/// The Python classes the codec builds and raises, imported on first use (they live in modules
/// that import this one).
static BLOCK_STORED: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static BLOCK_REMOVED: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static ALL_CLEARED: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static DECODED_BATCH: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static DECODE_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();

const EVENTS: &str = "kvroute.engine.events";
const WIRE: &str = "kvroute.kvevents.wire";

/// The deepest Python value an `extra_keys` entry may be (as the decoder's bound).
const MAX_EXTRA_KEY_DEPTH: usize = codec::MAX_NESTING;

fn decode_error(py: Python<'_>, error: codec::DecodeError) -> PyErr {
    match DECODE_ERROR.import(py, WIRE, "KVEventDecodeError") {
        Ok(class) => PyErr::from_type(class.clone(), error.0),
        Err(e) => e,
    }
}

// --- msgpack values of extra_keys <-> Python ---------------------------------------------------

fn value_to_py(py: Python<'_>, value: &rmpv::Value) -> PyResult<Py<PyAny>> {
    use rmpv::Value as V;
    Ok(match value {
        V::Nil => py.None(),
        V::Boolean(b) => PyBool::new(py, *b).to_owned().into_any().unbind(),
        V::Integer(i) => match (i.as_u64(), i.as_i64()) {
            (Some(u), _) => u.into_pyobject(py)?.into_any().unbind(),
            (None, Some(s)) => s.into_pyobject(py)?.into_any().unbind(),
            _ => unreachable!("a msgpack integer is a u64 or an i64"),
        },
        V::F32(f) => PyFloat::new(py, f64::from(*f)).into_any().unbind(),
        V::F64(f) => PyFloat::new(py, *f).into_any().unbind(),
        V::String(s) => match s.as_str() {
            Some(s) => PyString::new(py, s).into_any().unbind(),
            None => return Err(PyValueError::new_err("invalid UTF-8 in an extra key")),
        },
        V::Binary(b) => PyBytes::new(py, b).into_any().unbind(),
        V::Array(items) => {
            let items: PyResult<Vec<_>> = items.iter().map(|v| value_to_py(py, v)).collect();
            PyList::new(py, items?)?.into_any().unbind()
        }
        V::Map(pairs) => {
            let dict = PyDict::new(py);
            for (k, v) in pairs {
                dict.set_item(value_to_py(py, k)?, value_to_py(py, v)?)?;
            }
            dict.into_any().unbind()
        }
        V::Ext(..) => return Err(PyValueError::new_err("a msgpack extension in an extra key")),
    })
}

/// One `extra_keys` entry as Python: vLLM types them as tuples, msgpack only has arrays.
pub(crate) fn extra_key_to_py(py: Python<'_>, raw: &[u8]) -> PyResult<Py<PyAny>> {
    let value = rmpv::decode::read_value(&mut &raw[..])
        .map_err(|e| PyValueError::new_err(format!("extra key: {e}")))?;
    match &value {
        rmpv::Value::Array(items) => {
            let items: PyResult<Vec<_>> = items.iter().map(|v| value_to_py(py, v)).collect();
            Ok(PyTuple::new(py, items?)?.into_any().unbind())
        }
        other => value_to_py(py, other),
    }
}

fn py_to_value(obj: &Bound<'_, PyAny>, depth: usize) -> PyResult<rmpv::Value> {
    use rmpv::Value as V;
    if depth > MAX_EXTRA_KEY_DEPTH {
        return Err(PyValueError::new_err("extra key nested too deep"));
    }
    if obj.is_none() {
        return Ok(V::Nil);
    }
    if let Ok(b) = obj.cast::<PyBool>() {
        return Ok(V::Boolean(b.is_true()));
    }
    if obj.is_instance_of::<PyInt>()
        || obj.hasattr("__index__")? && !obj.is_instance_of::<PyFloat>()
    {
        let n: i128 = obj.extract()?;
        return if n >= 0 {
            u64::try_from(n)
                .map(V::from)
                .map_err(|_| PyValueError::new_err(format!("{n} does not fit msgpack")))
        } else {
            i64::try_from(n)
                .map(V::from)
                .map_err(|_| PyValueError::new_err(format!("{n} does not fit msgpack")))
        };
    }
    if let Ok(f) = obj.cast::<PyFloat>() {
        return Ok(V::F64(f.value()));
    }
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(V::from(s.to_str()?));
    }
    if let Ok(b) = obj.cast::<PyBytes>() {
        return Ok(V::Binary(b.as_bytes().to_vec()));
    }
    if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() {
        let items: PyResult<Vec<_>> = obj
            .try_iter()?
            .map(|i| py_to_value(&i?, depth + 1))
            .collect();
        return Ok(V::Array(items?));
    }
    if let Ok(d) = obj.cast::<PyDict>() {
        let mut pairs = Vec::with_capacity(d.len());
        for (k, v) in d.iter() {
            pairs.push((py_to_value(&k, depth + 1)?, py_to_value(&v, depth + 1)?));
        }
        return Ok(V::Map(pairs));
    }
    Err(PyTypeError::new_err(format!(
        "cannot encode {} in a KV event",
        obj.get_type().name()?
    )))
}

pub(crate) fn extra_key_from_py(obj: &Bound<'_, PyAny>) -> PyResult<Option<Vec<u8>>> {
    if obj.is_none() {
        return Ok(None);
    }
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &py_to_value(obj, 1)?)
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    Ok(Some(out))
}

// --- events <-> Python dataclasses ------------------------------------------------------------

fn event_to_py(py: Python<'_>, event: &KvCacheEvent) -> PyResult<Py<PyAny>> {
    Ok(match event {
        KvCacheEvent::Stored(e) => {
            let extra_keys = match &e.extra_keys {
                None => py.None(),
                Some(keys) => {
                    let keys: PyResult<Vec<Py<PyAny>>> = keys
                        .iter()
                        .map(|k| match k {
                            None => Ok(py.None()),
                            Some(raw) => extra_key_to_py(py, raw),
                        })
                        .collect();
                    PyList::new(py, keys?)?.into_any().unbind()
                }
            };
            BLOCK_STORED
                .import(py, EVENTS, "BlockStored")?
                .call1((
                    &e.block_hashes,
                    e.parent_block_hash,
                    &e.token_ids,
                    e.block_size,
                    e.lora_id,
                    e.medium.as_deref(),
                    e.lora_name.as_deref(),
                    extra_keys,
                    e.group_idx,
                    e.kv_cache_spec_kind.as_deref(),
                ))?
                .unbind()
        }
        KvCacheEvent::Removed(e) => BLOCK_REMOVED
            .import(py, EVENTS, "BlockRemoved")?
            .call1((&e.block_hashes, e.medium.as_deref(), e.group_idx))?
            .unbind(),
        KvCacheEvent::AllCleared => ALL_CLEARED
            .import(py, EVENTS, "AllBlocksCleared")?
            .call0()?
            .unbind(),
    })
}

fn batch_to_py(py: Python<'_>, batch: &DecodedBatch) -> PyResult<Py<PyAny>> {
    let events: PyResult<Vec<_>> = batch.events.iter().map(|e| event_to_py(py, e)).collect();
    Ok(DECODED_BATCH
        .import(py, WIRE, "DecodedBatch")?
        .call1((
            batch.ts,
            PyList::new(py, events?)?,
            batch.data_parallel_rank,
            batch.unknown_events,
        ))?
        .unbind())
}

fn opt_string(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Option<String>> {
    obj.getattr(name)?.extract()
}

fn u64s(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<u64>> {
    obj.getattr(name)?.extract()
}

fn event_from_py(py: Python<'_>, event: &Bound<'_, PyAny>) -> PyResult<KvCacheEvent> {
    if event.is_instance(BLOCK_REMOVED.import(py, EVENTS, "BlockRemoved")?)? {
        return Ok(KvCacheEvent::Removed(BlockRemoved {
            block_hashes: u64s(event, "block_hashes")?,
            medium: opt_string(event, "medium")?,
            group_idx: event.getattr("group_idx")?.extract()?,
        }));
    }
    if event.is_instance(BLOCK_STORED.import(py, EVENTS, "BlockStored")?)? {
        let extra_keys = event.getattr("extra_keys")?;
        let extra_keys = if extra_keys.is_none() {
            None
        } else {
            let keys: PyResult<Vec<_>> = extra_keys
                .try_iter()?
                .map(|k| extra_key_from_py(&k?))
                .collect();
            Some(keys?)
        };
        return Ok(KvCacheEvent::Stored(BlockStored {
            block_hashes: u64s(event, "block_hashes")?,
            parent_block_hash: event.getattr("parent_block_hash")?.extract()?,
            token_ids: event.getattr("token_ids")?.extract()?,
            block_size: event.getattr("block_size")?.extract()?,
            lora_id: event.getattr("lora_id")?.extract()?,
            medium: opt_string(event, "medium")?,
            lora_name: opt_string(event, "lora_name")?,
            extra_keys,
            group_idx: event.getattr("group_idx")?.extract()?,
            kv_cache_spec_kind: opt_string(event, "kv_cache_spec_kind")?,
        }));
    }
    if event.is_instance(ALL_CLEARED.import(py, EVENTS, "AllBlocksCleared")?)? {
        return Ok(KvCacheEvent::AllCleared);
    }
    Err(PyTypeError::new_err(format!(
        "not a KV cache event: {}",
        event.repr()?
    )))
}

fn wire_format(name: &str) -> PyResult<WireFormat> {
    WireFormat::from_name(name).ok_or_else(|| {
        PyValueError::new_err(format!(
            "wire format must be one of map, array, got {name:?}"
        ))
    })
}

/// The msgpack payload vLLM would publish for ``batch`` (a ``kvroute.engine.events.EventBatch``),
/// in ``wire_format``'s event shape (``"map"`` or ``"array"``).
#[pyfunction]
#[pyo3(signature = (batch, wire_format = "map"))]
fn encode_batch<'py>(
    py: Python<'py>,
    batch: &Bound<'py, PyAny>,
    wire_format: &str,
) -> PyResult<Bound<'py, PyBytes>> {
    let format = self::wire_format(wire_format)?;
    let events: PyResult<Vec<_>> = batch
        .getattr("events")?
        .try_iter()?
        .map(|e| event_from_py(py, &e?))
        .collect();
    let batch = EventBatch {
        ts: batch.getattr("ts")?.extract()?,
        events: events?,
        data_parallel_rank: batch.getattr("data_parallel_rank")?.extract()?,
    };
    Ok(PyBytes::new(py, &codec::encode_batch(&batch, format)))
}

/// Decode a published payload into a ``DecodedBatch`` of ``kvroute.engine.events`` objects.
/// Raises ``KVEventDecodeError`` with the reason if it is not a vLLM event batch.
#[pyfunction]
fn decode_batch(py: Python<'_>, payload: &[u8]) -> PyResult<Py<PyAny>> {
    let batch = codec::decode_batch(payload).map_err(|e| decode_error(py, e))?;
    batch_to_py(py, &batch)
}

/// Decode a published payload into a [`NativeEventBatch`], without a Python object per event
/// (the router's path: the index applies it in Rust). Raises ``KVEventDecodeError``.
#[pyfunction]
fn decode_native(py: Python<'_>, payload: &[u8]) -> PyResult<NativeEventBatch> {
    codec::decode_batch(payload)
        .map(|batch| NativeEventBatch { batch })
        .map_err(|e| decode_error(py, e))
}

/// A decoded event batch held in Rust (``decode_native``). The index binding reads it with
/// [`NativeEventBatch::events`] (`KvIndex::apply(worker, batch.events())`); Python sees its
/// envelope and, on demand, its events as dataclasses.
#[pyclass(module = "kvroute._native", frozen)]
pub struct NativeEventBatch {
    /// The decoded payload.
    pub batch: DecodedBatch,
}

impl NativeEventBatch {
    /// The batch's events of known types, in order.
    pub fn events(&self) -> &[KvCacheEvent] {
        &self.batch.events
    }
}

#[pymethods]
impl NativeEventBatch {
    /// The engine step's time, seconds.
    #[getter]
    fn ts(&self) -> f64 {
        self.batch.ts
    }

    /// The engine's data-parallel rank, or None.
    #[getter]
    fn data_parallel_rank(&self) -> Option<i64> {
        self.batch.data_parallel_rank
    }

    /// Events of unknown types that were skipped.
    #[getter]
    fn unknown_events(&self) -> usize {
        self.batch.unknown_events
    }

    /// The events as ``kvroute.engine.events`` objects (built on each call).
    #[getter(events)]
    fn py_events(&self, py: Python<'_>) -> PyResult<Py<PyList>> {
        let events: PyResult<Vec<_>> = self
            .batch
            .events
            .iter()
            .map(|e| event_to_py(py, e))
            .collect();
        Ok(PyList::new(py, events?)?.unbind())
    }

    /// The same batch as a ``kvroute.kvevents.wire.DecodedBatch``.
    fn to_python(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        batch_to_py(py, &self.batch)
    }

    fn __len__(&self) -> usize {
        self.batch.events.len()
    }

    fn __repr__(&self) -> String {
        format!(
            "NativeEventBatch(ts={}, events={}, data_parallel_rank={:?}, unknown_events={})",
            self.batch.ts,
            self.batch.events.len(),
            self.batch.data_parallel_rank,
            self.batch.unknown_events
        )
    }
}

// --- the sequence tracker ---------------------------------------------------------------------

/// What one live message or replay answer means, for the subscriber: a list of tuples, in
/// order, each one of
/// ``("batch", seq, payload, replayed)``, ``("gap", expected, got)``, ``("replay", from_seq)``,
/// ``("replay_failed", expected, got, reason)``, ``("restarted", last_seq, new_seq)``,
/// ``("malformed", frame_lengths)``. After ``("replay", n)`` the subscriber asks the replay
/// socket and calls ``replay_done`` before feeding anything else.
#[pyclass(module = "kvroute._native")]
pub struct SequenceTracker {
    inner: sequence::SequenceTracker,
    /// The live payload that showed a gap, handed over when the replay's answer comes.
    held: Option<Py<PyAny>>,
    actions: Vec<Action>,
}

/// A replay answer as the tracker takes it (`(seq, payload bytes)`), and its payloads as the
/// Python objects to hand over.
type Answer<'py> = (Vec<(u64, Vec<u8>)>, Vec<Bound<'py, PyAny>>);

impl SequenceTracker {
    /// Turn the tracker's actions into tuples; `live` is the live payload just fed (or held),
    /// `replayed` the replay answer's payloads.
    fn emit<'py>(
        &mut self,
        py: Python<'py>,
        live: Option<&Py<PyAny>>,
        replayed: &[Bound<'py, PyAny>],
    ) -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        for action in self.actions.drain(..) {
            let item = match action {
                Action::Live { seq } => {
                    let payload = live.expect("a live action has its payload");
                    ("batch", seq, payload.clone_ref(py), false).into_pyobject(py)?
                }
                Action::Replayed { seq, index } => {
                    ("batch", seq, replayed[index].clone(), true).into_pyobject(py)?
                }
                Action::Gap { expected, got } => ("gap", expected, got).into_pyobject(py)?,
                Action::Replay { from } => ("replay", from).into_pyobject(py)?,
                Action::ReplayFailed {
                    expected,
                    got,
                    reason,
                } => ("replay_failed", expected, got, reason).into_pyobject(py)?,
                Action::Restarted { last_seq, new_seq } => {
                    ("restarted", last_seq, new_seq).into_pyobject(py)?
                }
                Action::MalformedFrames { frame_lengths } => {
                    ("malformed", frame_lengths).into_pyobject(py)?
                }
            };
            out.append(item)?;
        }
        Ok(out)
    }

    /// `(seq, payload)` pairs of a replay answer: the seqs, and the payloads as bytes.
    fn answer<'py>(replayed: &Bound<'py, PyList>) -> PyResult<Answer<'py>> {
        let mut pairs = Vec::with_capacity(replayed.len());
        let mut payloads = Vec::with_capacity(replayed.len());
        for item in replayed.iter() {
            let (seq, payload): (u64, Bound<'py, PyAny>) = item.extract()?;
            // The digest needs the bytes; a copy per replayed batch (replays are rare).
            pairs.push((seq, payload.cast::<PyBytes>()?.as_bytes().to_vec()));
            payloads.push(payload);
        }
        Ok((pairs, payloads))
    }
}

#[pymethods]
impl SequenceTracker {
    #[new]
    fn new() -> Self {
        Self {
            inner: sequence::SequenceTracker::new(),
            held: None,
            actions: Vec::new(),
        }
    }

    /// The seq of the last batch handed over, None before the first.
    #[getter]
    fn last_seq(&self) -> Option<u64> {
        self.inner.last_seq()
    }

    /// The fast path: the seq of a live ``[topic, seq, payload]`` message that simply follows
    /// the last batch (taken: hand over its payload as live), else None (nothing changed; give
    /// the frames to ``live``).
    fn in_order(&mut self, frames: &Bound<'_, PyList>) -> PyResult<Option<u64>> {
        if frames.len() != 3 {
            return Ok(None);
        }
        let seq_frame = frames.get_item(1)?;
        let Ok(seq_bytes) = seq_frame.cast::<PyBytes>() else {
            return Ok(None);
        };
        match sequence::parse_seq(seq_bytes.as_bytes()) {
            Some(seq) if self.inner.in_order(seq) => Ok(Some(seq)),
            _ => Ok(None),
        }
    }

    /// Any live message (a list of frames): what it means.
    fn live<'py>(
        &mut self,
        py: Python<'py>,
        frames: &Bound<'py, PyList>,
    ) -> PyResult<Bound<'py, PyList>> {
        if self.inner.awaiting_replay() {
            return Err(PyValueError::new_err("a replay's answer is awaited"));
        }
        let items: Vec<Bound<'py, PyAny>> = frames.iter().collect();
        let mut views = Vec::with_capacity(items.len());
        for item in &items {
            views.push(item.cast::<PyBytes>()?.as_bytes());
        }
        self.inner.live_message(&views, &mut self.actions);
        let payload = items.get(2).map(|p| p.clone().unbind());
        if self.inner.awaiting_replay() {
            self.held = payload.as_ref().map(|p| p.clone_ref(py));
        }
        self.emit(py, payload.as_ref(), &[])
    }

    /// The replay's answer for the gap just reported: a list of ``(seq, payload)`` and why it
    /// stopped early (None if it ended normally).
    #[pyo3(signature = (replayed, failure = None))]
    fn replay_done<'py>(
        &mut self,
        py: Python<'py>,
        replayed: &Bound<'py, PyList>,
        failure: Option<String>,
    ) -> PyResult<Bound<'py, PyList>> {
        if !self.inner.awaiting_replay() {
            return Err(PyValueError::new_err("no replay was asked for"));
        }
        let (pairs, payloads) = Self::answer(replayed)?;
        self.inner.replay_done(&pairs, failure, &mut self.actions);
        let held = self.held.take();
        self.emit(py, held.as_ref(), &payloads)
    }

    /// The catch-up replay's answer (asked from 0 on subscribing): a list of ``(seq,
    /// payload)``.
    fn catch_up_done<'py>(
        &mut self,
        py: Python<'py>,
        replayed: &Bound<'py, PyList>,
    ) -> PyResult<Bound<'py, PyList>> {
        let (pairs, payloads) = Self::answer(replayed)?;
        self.inner.catch_up_done(&pairs, &mut self.actions);
        self.emit(py, None, &payloads)
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(encode_batch, m)?)?;
    m.add_function(wrap_pyfunction!(decode_batch, m)?)?;
    m.add_function(wrap_pyfunction!(decode_native, m)?)?;
    m.add_class::<NativeEventBatch>()?;
    m.add_class::<SequenceTracker>()?;
    Ok(())
}
