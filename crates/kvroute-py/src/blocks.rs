//! `BlockHasher` for Python: the chained block hashes of `kvroute_core::blocks`; and the
//! token synthesis of trace hash ids (`kvroute_sim::trace`).

use kvroute_core::blocks::{self, DEFAULT_HASH_SEED};
use kvroute_sim::trace;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyByteArray;

use crate::tokens::extract_tokens;

/// A 64-bit block hash from a Python int: kvroute's hashes are unsigned, but a caller may key
/// blocks by Python's own `hash()` (signed); those are taken modulo 2^64.
pub(crate) fn hash_of(obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    obj.extract::<u64>()
        .or_else(|_| obj.extract::<i64>().map(|v| v as u64))
}

/// A list of block hashes (see `hash_of`).
pub(crate) fn hashes_of(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    if let Ok(v) = obj.extract::<Vec<u64>>() {
        return Ok(v);
    }
    obj.try_iter()?.map(|item| hash_of(&item?)).collect()
}

/// Hashes token sequences into chained per-block hashes.
///
/// Args:
///     block_size: tokens per KV block (vLLM: 16 on GPU, 128 on CPU).
///     seed: root of the chain; two hashers agree only if block size and seed agree.
#[pyclass(module = "kvroute._native", frozen, eq)]
#[derive(Clone, PartialEq)]
pub struct BlockHasher {
    pub inner: blocks::BlockHasher,
}

#[pymethods]
impl BlockHasher {
    #[new]
    #[pyo3(signature = (block_size, seed = DEFAULT_HASH_SEED as i128))]
    fn new(block_size: i64, seed: i128) -> PyResult<Self> {
        if block_size <= 0 {
            return Err(PyValueError::new_err(format!(
                "block size must be positive, got {block_size}"
            )));
        }
        let inner =
            blocks::BlockHasher::new(block_size as usize, (seed & 0xFFFF_FFFF_FFFF_FFFF) as u64)
                .map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(Self { inner })
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }

    #[getter]
    fn seed(&self) -> u64 {
        self.inner.seed()
    }

    /// Hash the full blocks of ``token_ids``.
    ///
    /// Args:
    ///     token_ids: the whole token sequence (from the start of the prompt).
    ///     parent_hash: hash of block ``start_block - 1`` (None at the start of a chain).
    ///     start_block: first block to hash; lets callers extend a chain they already have.
    ///     stop_block: one past the last block to hash (default: every full block).
    ///     lora_name: the LoRA adapter the sequence runs under (keys every block, as vLLM).
    ///     cache_salt: the request's cache salt (keys block 0 only; empty counts as none).
    ///
    /// Returns:
    ///     One hash per full block in ``[start_block, stop_block)``.
    #[pyo3(signature = (
        token_ids, parent_hash = None, start_block = 0, stop_block = None, *, lora_name = None,
        cache_salt = None
    ))]
    fn hash_blocks(
        &self,
        token_ids: &Bound<'_, PyAny>,
        parent_hash: Option<u64>,
        start_block: usize,
        stop_block: Option<usize>,
        lora_name: Option<&str>,
        cache_salt: Option<&str>,
    ) -> PyResult<Vec<u64>> {
        let tokens = extract_tokens(token_ids.py(), token_ids)?;
        let keys = blocks::BlockKeys::new(lora_name, cache_salt);
        Ok(self
            .inner
            .hash_blocks_keyed(&tokens, parent_hash, start_block, stop_block, &keys))
    }

    /// Append to ``hashes`` the hashes of the full blocks of ``token_ids`` it lacks; returns
    /// ``hashes`` (``lora_name`` and ``cache_salt`` as for ``hash_blocks``).
    #[pyo3(signature = (hashes, token_ids, *, lora_name = None, cache_salt = None))]
    fn extend<'py>(
        &self,
        py: Python<'py>,
        hashes: Bound<'py, pyo3::types::PyList>,
        token_ids: &Bound<'py, PyAny>,
        lora_name: Option<&str>,
        cache_salt: Option<&str>,
    ) -> PyResult<Bound<'py, pyo3::types::PyList>> {
        let tokens = extract_tokens(py, token_ids)?;
        let have = hashes.len();
        let parent = if have > 0 {
            Some(hashes.get_item(have - 1)?.extract::<u64>()?)
        } else {
            None
        };
        let keys = blocks::BlockKeys::new(lora_name, cache_salt);
        for h in self
            .inner
            .hash_blocks_keyed(&tokens, parent, have, None, &keys)
        {
            hashes.append(h)?;
        }
        Ok(hashes)
    }

    fn __repr__(&self) -> String {
        format!(
            "BlockHasher(block_size={}, seed={:#x})",
            self.inner.block_size(),
            self.inner.seed()
        )
    }
}

/// The synthesized tokens of trace hash ids (``kvroute_sim::trace``): a ``bytearray`` of
/// ``len(hash_ids) * 512`` native-endian ``uint32`` token ids, block after block, for
/// ``numpy.frombuffer``.
///
/// Args:
///     hash_ids: the ids (each below 2³²).
///     vocab: the token ids to draw from (not empty).
///     seed: the trace's token seed (its low 32 bits count).
#[pyfunction]
fn trace_blocks_tokens<'py>(
    py: Python<'py>,
    hash_ids: Vec<u64>,
    vocab: &Bound<'py, PyAny>,
    seed: u64,
) -> PyResult<Bound<'py, PyByteArray>> {
    let vocab = extract_tokens(py, vocab)?;
    if vocab.is_empty() {
        return Err(PyValueError::new_err("an empty vocabulary"));
    }
    let mut tokens = vec![0u32; hash_ids.len() * trace::TRACE_BLOCK_TOKENS];
    trace::blocks_tokens_into(&hash_ids, &vocab, seed, &mut tokens);
    PyByteArray::new_with(py, tokens.len() * 4, |buf| {
        for (dst, t) in buf.chunks_exact_mut(4).zip(&tokens) {
            dst.copy_from_slice(&t.to_ne_bytes());
        }
        Ok(())
    })
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<BlockHasher>()?;
    m.add_function(wrap_pyfunction!(trace_blocks_tokens, m)?)?;
    m.add("DEFAULT_HASH_SEED", DEFAULT_HASH_SEED)?;
    m.add("GPU_BLOCK_SIZE", blocks::GPU_BLOCK_SIZE)?;
    Ok(())
}
