//! KV events between Python and the core: the one conversion of `kvroute.engine.events`'
//! dataclasses to the core's [`KvCacheEvent`] and back, used by the engine (its published
//! events), the codec (encode, decode) and the routing step (events applied, the journal).
//! Lossless: every field survives both ways, `extra_keys` as their msgpack bytes (vLLM types
//! them as tuples, msgpack only has arrays).

use kvroute_core::kvevents::codec;
use kvroute_core::kvevents::events::{BlockRemoved, BlockStored, KvCacheEvent};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple, PyType};

use crate::blocks::{hash_of, hashes_of};

/// The event classes, imported on first use (their module imports this one).
static BLOCK_STORED: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static BLOCK_REMOVED: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static ALL_CLEARED: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// The Python module of the event classes.
pub(crate) const EVENTS: &str = "kvroute.engine.events";

/// The deepest Python value an `extra_keys` entry may be (as the decoder's bound).
const MAX_EXTRA_KEY_DEPTH: usize = codec::MAX_NESTING;

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
fn extra_key_to_py(py: Python<'_>, raw: &[u8]) -> PyResult<Py<PyAny>> {
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

fn extra_key_from_py(obj: &Bound<'_, PyAny>) -> PyResult<Option<Vec<u8>>> {
    if obj.is_none() {
        return Ok(None);
    }
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &py_to_value(obj, 1)?)
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    Ok(Some(out))
}

/// The core's event as its `kvroute.engine.events` dataclass.
pub(crate) fn event_to_py(py: Python<'_>, event: &KvCacheEvent) -> PyResult<Py<PyAny>> {
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

fn opt_string(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Option<String>> {
    obj.getattr(name)?.extract()
}

/// A `kvroute.engine.events` dataclass as the core's event. Hashes may be signed (a caller
/// may key blocks by Python's own `hash()`: taken modulo 2^64); a token id beyond i64 is no
/// token id, and becomes -1 (the index skips its block).
pub(crate) fn event_from_py(py: Python<'_>, event: &Bound<'_, PyAny>) -> PyResult<KvCacheEvent> {
    if event.is_instance(BLOCK_REMOVED.import(py, EVENTS, "BlockRemoved")?)? {
        return Ok(KvCacheEvent::Removed(BlockRemoved {
            block_hashes: hashes_of(&event.getattr("block_hashes")?)?,
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
        let parent = event.getattr("parent_block_hash")?;
        let tokens = event.getattr("token_ids")?;
        let token_ids: Vec<i64> = match tokens.extract::<Vec<i64>>() {
            Ok(t) => t,
            Err(_) => tokens
                .try_iter()?
                .map(|t| Ok(t?.extract::<i64>().unwrap_or(-1)))
                .collect::<PyResult<_>>()?,
        };
        return Ok(KvCacheEvent::Stored(BlockStored {
            block_hashes: hashes_of(&event.getattr("block_hashes")?)?,
            parent_block_hash: if parent.is_none() {
                None
            } else {
                Some(hash_of(&parent)?)
            },
            token_ids,
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

/// A Python iterable of events as the core's.
pub(crate) fn events_from_py(
    py: Python<'_>,
    events: &Bound<'_, PyAny>,
) -> PyResult<Vec<KvCacheEvent>> {
    events.try_iter()?.map(|e| event_from_py(py, &e?)).collect()
}

/// The core's events as a list of their dataclasses.
pub(crate) fn events_to_py<'py>(
    py: Python<'py>,
    events: &[KvCacheEvent],
) -> PyResult<Bound<'py, PyList>> {
    let events: PyResult<Vec<_>> = events.iter().map(|e| event_to_py(py, e)).collect();
    PyList::new(py, events?)
}
