//! The prompts of a trace replay, built once in Rust and shared by every replay of it.
//!
//! A Mooncake trace's prompts are ~10⁸ synthesized tokens: built as numpy arrays they were
//! copied again into each simulated replay (random, prefix-hash and kv-aware side by side),
//! and touching that much fresh memory was most of a replay's set-up. A `PromptTable` holds
//! each prompt as the shared slice the simulator's requests keep by reference, so every
//! replay of the table reuses the same memory.

use std::sync::Arc;

use kvroute_sim::trace;
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyIndexError, PyValueError};
use pyo3::prelude::*;

use crate::tokens::extract_tokens;

/// The prompts of a replay, by position: pass it as ``simulate``'s ``prefixes`` (request
/// ``i`` with prefix id ``i`` and no suffix).
///
/// ``PromptTable(prompts)`` copies a list of token arrays; ``PromptTable.from_trace``
/// synthesizes a Mooncake trace's prompts from their hash ids (``kvroute.trace.format``'s
/// formula), without the interpreter.
#[pyclass(frozen, module = "kvroute._native")]
pub struct PromptTable {
    pub prompts: Vec<Arc<[u32]>>,
}

fn u64s(py: Python<'_>, obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u64>> {
    PyBuffer::<u64>::get(obj)
        .and_then(|b| b.to_vec(py))
        .or_else(|_| obj.extract::<Vec<u64>>())
        .map_err(|_| PyValueError::new_err(format!("{what}: expected uint64 values")))
}

#[pymethods]
impl PromptTable {
    #[new]
    fn new(py: Python<'_>, prompts: Vec<Bound<'_, PyAny>>) -> PyResult<Self> {
        let prompts = prompts
            .iter()
            .map(|p| extract_tokens(py, p).map(Arc::from))
            .collect::<PyResult<_>>()?;
        Ok(Self { prompts })
    }

    /// The prompts of trace requests: request ``i`` has the hash ids
    /// ``hash_ids[hash_offsets[i]:hash_offsets[i + 1]]`` (uint64) and its first
    /// ``input_lengths[i]`` tokens (uint64, at most 512 per id), drawn from ``vocab`` under
    /// ``seed`` (its low 32 bits count).
    #[staticmethod]
    fn from_trace(
        py: Python<'_>,
        hash_ids: &Bound<'_, PyAny>,
        hash_offsets: &Bound<'_, PyAny>,
        input_lengths: &Bound<'_, PyAny>,
        vocab: &Bound<'_, PyAny>,
        seed: u64,
    ) -> PyResult<Self> {
        let ids = u64s(py, hash_ids, "hash_ids")?;
        let offsets = u64s(py, hash_offsets, "hash_offsets")?;
        let lengths = u64s(py, input_lengths, "input_lengths")?;
        let vocab = extract_tokens(py, vocab)?;
        if vocab.is_empty() {
            return Err(PyValueError::new_err("an empty vocabulary"));
        }
        if offsets.len() != lengths.len() + 1 {
            return Err(PyValueError::new_err(
                "hash_offsets must have one entry more than input_lengths",
            ));
        }
        let mut spans = Vec::with_capacity(lengths.len());
        for (i, (w, &length)) in offsets.windows(2).zip(&lengths).enumerate() {
            let (start, end, length) = (w[0] as usize, w[1] as usize, length as usize);
            if start > end || end > ids.len() {
                return Err(PyValueError::new_err(format!(
                    "request {i}: hash_offsets out of order or past the ids"
                )));
            }
            if length > (end - start) * trace::TRACE_BLOCK_TOKENS {
                return Err(PyValueError::new_err(format!(
                    "request {i}: {length} tokens need more than {} hash ids",
                    end - start
                )));
            }
            spans.push((start, end, length));
        }
        let seed = seed & 0xFFFF_FFFF;
        let build = |spans: &[(usize, usize, usize)]| -> Vec<Arc<[u32]>> {
            spans
                .iter()
                .map(|&(start, end, length)| {
                    trace::prompt_tokens(&ids[start..end], length, &vocab, seed)
                })
                .collect()
        };
        // On every core: nothing else runs yet, and drawing ~10⁸ tokens into fresh memory
        // takes a second on one.
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let chunk = spans.len().div_ceil(threads).max(1);
        let prompts = py.detach(|| {
            std::thread::scope(|scope| {
                let parts: Vec<_> = spans
                    .chunks(chunk)
                    .map(|part| scope.spawn(move || build(part)))
                    .collect();
                parts
                    .into_iter()
                    .flat_map(|part| part.join().expect("a prompt-building thread panicked"))
                    .collect()
            })
        });
        Ok(Self { prompts })
    }

    fn __len__(&self) -> usize {
        self.prompts.len()
    }

    /// Prompt ``i``'s token ids (a list; for tests and spot checks).
    fn tokens(&self, i: usize) -> PyResult<Vec<u32>> {
        self.prompts
            .get(i)
            .map(|p| p.to_vec())
            .ok_or_else(|| PyIndexError::new_err(format!("no prompt {i}")))
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PromptTable>()
}
