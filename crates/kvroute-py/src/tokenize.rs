//! `TextChunker` for Python: exact tokenization of text prompts in cached pieces
//! (`kvroute_tokenize`), which `kvroute.proxy.chunks` wraps for the router's prompt hasher.

use std::str::FromStr;

use kvroute_tokenize::cuts::cut_pieces;
use kvroute_tokenize::{ChunkerConfig, TextChunker as Chunker};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use tokenizers::Tokenizer;

/// Tokenizes text exactly like the tokenizer's whole ``encode(text, add_special_tokens)``,
/// piece by piece with each piece's ids cached (see the ``kvroute_tokenize`` crate docs).
///
/// Args:
///     tokenizer_json: the tokenizer's ``tokenizer.json`` text (``Tokenizer.to_str()``).
///     cut_one_in: keep one candidate cut in this many (a power of two; 1 cuts at every one).
///     piece_cache_bytes / word_cache_bytes: the caches' bounds in bytes.
///
/// Raises:
///     ValueError: the tokenizer's pipeline is outside the cut argument (the reason is the
///         message); the caller encodes whole.
#[pyclass(module = "kvroute._native")]
pub struct TextChunker {
    inner: Chunker,
    out: Vec<u32>,
}

#[pymethods]
impl TextChunker {
    #[new]
    #[pyo3(signature = (tokenizer_json, cut_one_in = 32, piece_cache_bytes = 64 << 20, word_cache_bytes = 8 << 20))]
    fn new(
        tokenizer_json: &str,
        cut_one_in: u64,
        piece_cache_bytes: usize,
        word_cache_bytes: usize,
    ) -> PyResult<Self> {
        let tokenizer = Tokenizer::from_str(tokenizer_json)
            .map_err(|e| PyValueError::new_err(format!("cannot load the tokenizer: {e}")))?;
        let config = ChunkerConfig {
            cut_one_in,
            piece_cache_bytes,
            word_cache_bytes,
        };
        let inner = Chunker::new(tokenizer, config).map_err(|e| PyValueError::new_err(e.0))?;
        Ok(Self {
            inner,
            out: Vec::new(),
        })
    }

    /// The ids of ``encode(text, add_special_tokens)`` as little-endian uint32 bytes (for
    /// ``numpy.frombuffer``).
    #[pyo3(signature = (text, add_special_tokens = true))]
    fn encode<'py>(
        &mut self,
        py: Python<'py>,
        text: &str,
        add_special_tokens: bool,
    ) -> PyResult<Bound<'py, PyBytes>> {
        self.out.clear();
        self.inner
            .encode_into(text, add_special_tokens, &mut self.out)
            .map_err(|e| PyValueError::new_err(e.0))?;
        let ids = &self.out;
        PyBytes::new_with(py, 4 * ids.len(), |buf| {
            for (dst, id) in buf.chunks_exact_mut(4).zip(ids) {
                dst.copy_from_slice(&id.to_le_bytes());
            }
            Ok(())
        })
    }

    /// Pieces found in the cache (cumulative).
    #[getter]
    fn hits(&self) -> u64 {
        self.inner.stats().hits
    }

    /// Pieces tokenized (cumulative).
    #[getter]
    fn misses(&self) -> u64 {
        self.inner.stats().misses
    }

    /// Pieces dropped to stay within the byte bound (cumulative).
    #[getter]
    fn evictions(&self) -> u64 {
        self.inner.stats().evictions
    }

    /// Bytes both caches hold (pieces and words).
    #[getter]
    fn nbytes(&self) -> usize {
        let s = self.inner.stats();
        s.piece_bytes + s.word_bytes
    }

    /// Bytes the piece cache holds.
    #[getter]
    fn piece_nbytes(&self) -> usize {
        self.inner.stats().piece_bytes
    }

    /// Pieces cached.
    fn __len__(&self) -> usize {
        self.inner.stats().pieces
    }
}

/// Byte offsets where ``data`` (UTF-8) is cut, ascending (the text's end not included): each
/// before a space between two ASCII letters whose preceding 8 bytes hash into the kept
/// ``1/one_in`` (a power of two).
#[pyfunction]
#[pyo3(signature = (data, one_in = 32))]
fn cut_points(data: &[u8], one_in: u64) -> PyResult<Vec<usize>> {
    if !one_in.is_power_of_two() {
        return Err(PyValueError::new_err(format!(
            "one_in must be a power of two, got {one_in}"
        )));
    }
    let mut pieces = Vec::new();
    cut_pieces(data, one_in, 0, &mut pieces);
    pieces.pop();
    Ok(pieces.into_iter().map(|p| p.stop).collect())
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<TextChunker>()?;
    m.add_function(wrap_pyfunction!(cut_points, m)?)?;
    Ok(())
}
