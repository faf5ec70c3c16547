//! Token ids from Python: a `uint32` buffer (numpy, `array.array("I")`) is copied in one
//! `memcpy`; anything else (a list, another dtype) is converted element by element, and an id
//! that does not fit in `u32` is an error. And the synthetic tokenizer's native core.

use kvroute_tokenize::SyntheticTokenizer;
use kvroute_tokenize::synthetic::SPECIAL_TOKENS;
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// `obj` as token ids.
pub fn extract_tokens(py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    if let Ok(buffer) = PyBuffer::<u32>::get(obj)
        && buffer.dimensions() <= 1
    {
        return buffer.to_vec(py);
    }
    obj.extract::<Vec<u32>>()
}

/// The synthetic tokenizer's native core (``kvroute_tokenize::synthetic``), which
/// ``kvroute.tokens.SyntheticTokenizer`` wraps: the one implementation the router, the emulator
/// and the simulator share.
///
/// Args:
///     vocab_size: number of ids, special tokens included.
#[pyclass(module = "kvroute._native", name = "SyntheticTokenizer", frozen)]
pub struct PySyntheticTokenizer {
    inner: SyntheticTokenizer,
}

#[pymethods]
impl PySyntheticTokenizer {
    #[new]
    fn new(vocab_size: i64) -> PyResult<Self> {
        let inner = u32::try_from(vocab_size)
            .ok()
            .and_then(|v| SyntheticTokenizer::new(v).ok())
            .ok_or_else(|| {
                PyValueError::new_err(format!(
                    "vocab_size must exceed {}, got {vocab_size}",
                    SPECIAL_TOKENS.len()
                ))
            })?;
        Ok(Self { inner })
    }

    /// The ids of ``text`` (no special tokens added).
    fn encode(&self, py: Python<'_>, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        py.detach(|| self.inner.encode(text, &mut out));
        out
    }

    /// The text of ``ids``: their words joined by single spaces. Raises ``ValueError`` for an id
    /// outside the vocabulary.
    fn decode(&self, ids: Vec<i64>) -> PyResult<String> {
        let size = self.inner.vocab_size();
        let ids: Vec<u32> = ids
            .into_iter()
            .map(|id| {
                u32::try_from(id).ok().filter(|&i| i < size).ok_or_else(|| {
                    PyValueError::new_err(format!("token id {id} is outside [0, {size})"))
                })
            })
            .collect::<PyResult<_>>()?;
        self.inner
            .decode(&ids)
            .map_err(|e| PyValueError::new_err(e.to_string()))
    }

    /// ChatML text of ``(role, content)`` pairs, then the assistant's header when
    /// ``add_generation_prompt``.
    #[staticmethod]
    fn chat_text(messages: Vec<(String, String)>, add_generation_prompt: bool) -> String {
        SyntheticTokenizer::chat_text(
            messages.iter().map(|(r, c)| (r.as_str(), c.as_str())),
            add_generation_prompt,
        )
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PySyntheticTokenizer>()?;
    Ok(())
}
