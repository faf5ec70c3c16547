"""Exact tokenization of text prompts in cached pieces: shared prefixes are tokenized once.

A completion prompt given as text has no special tokens to cut at (see
:mod:`kvroute.proxy.prompts`), and tokenizing ~2,400 tokens whole costs milliseconds per
request. But byte-level BPE tokenizers (Qwen, Llama 3 and their kin) work word by word, so
the text can be cut where the pre-tokenizer provably cuts (before a space between two ASCII
letters, content-defined so prompts sharing a prefix cut it alike), each piece encoded on its
own and cached, and the ids concatenated: the same ids as one whole ``encode``. The argument,
the cut rule, the ASCII word scanner and the byte-bounded caches are native, in the
``kvroute-tokenize`` crate (its crate docs hold the proof sketch); this module builds one for
an :class:`~kvroute.tokens.HFTokenizer` when its pipeline qualifies (checked on its
``tokenizer.json`` layout, then against whole encodes), and returns None otherwise so the
caller encodes whole.

Measured on the reference workload (2,371-token prompts, each new, 2,032 tokens shared with
earlier ones), in process: ~100-160 µs per prompt natively (``cargo run --release -p
kvroute-router --example tokenize_speed``), against 6.4 ms for the library's whole encode.
"""

from __future__ import annotations

import numpy as np

from kvroute import _native
from kvroute.tokens import HFTokenizer

#: Keep one candidate cut in this many (on average; a power of two): pieces of ~32 words, so a
#: request pays for re-tokenizing about one piece beyond its new text, and a 2,400-token prompt
#: is a few dozen cache lookups.
CUT_ONE_IN = 32
#: Bytes of pieces' text and ids, and of words' text and ids, the caches may hold together,
#: whatever their entry count: a text without cut candidates is one piece, and a client may send
#: many large ones. A sixteenth of it goes to the word cache.
PIECE_CACHE_BYTES = 64 << 20


def cut_points(data: bytes, one_in: int = CUT_ONE_IN) -> np.ndarray:
    """Byte offsets where ``data`` (UTF-8) is cut, ascending, each before a space that sits
    between two ASCII letters and whose preceding 8 bytes hash into the kept fraction
    (``1/one_in``, a power of two; 1 keeps every candidate)."""
    return np.asarray(_native.cut_points(data, one_in), dtype=np.intp)


class TextChunker:
    """Tokenizes text like ``encode(text, add_special_tokens)`` from cached pieces.

    Build it with :func:`text_chunker`, which checks the tokenizer qualifies.

    Args:
        native: the ``kvroute._native.TextChunker`` doing the work.
        cut_one_in: see :func:`cut_points`.
        max_bytes: the caches' bound in bytes.
    """

    def __init__(self, native: _native.TextChunker, cut_one_in: int, max_bytes: int) -> None:
        self._native = native
        self.cut_one_in = cut_one_in
        self.max_bytes = max_bytes

    def encode(self, text: str, add_special_tokens: bool = True) -> np.ndarray:
        """``encode(text, add_special_tokens)`` as a (read-only) uint32 array."""
        return np.frombuffer(self._native.encode(text, add_special_tokens), dtype=np.uint32)

    @property
    def nbytes(self) -> int:
        """Bytes of text and ids the caches hold."""
        return self._native.nbytes

    @property
    def piece_nbytes(self) -> int:
        """Bytes the piece cache holds."""
        return self._native.piece_nbytes

    @property
    def evictions(self) -> int:
        """Pieces dropped to stay within the bound (cumulative)."""
        return self._native.evictions

    @property
    def hits(self) -> int:
        """Pieces found in the cache (cumulative)."""
        return self._native.hits

    @property
    def misses(self) -> int:
        """Pieces tokenized (cumulative)."""
        return self._native.misses

    def __len__(self) -> int:
        return len(self._native)


def text_chunker(
    tokenizer: object, cut_one_in: int = CUT_ONE_IN, max_bytes: int = PIECE_CACHE_BYTES
) -> TextChunker | None:
    """A :class:`TextChunker` for ``tokenizer`` if its pipeline is one the cut argument covers
    (see the module docstring) and the self-check passes; None otherwise."""
    if not isinstance(tokenizer, HFTokenizer):
        return None
    if cut_one_in < 1 or cut_one_in & (cut_one_in - 1):
        raise ValueError(f"cut_one_in must be a power of two, got {cut_one_in}")
    words = max_bytes // 16
    try:
        native = _native.TextChunker(tokenizer._tokenizer.to_str(), cut_one_in, max_bytes - words, words)
    except ValueError:
        return None
    return TextChunker(native, cut_one_in, max_bytes)
