"""Piecewise text tokenization (kvroute.proxy.chunks) must give exactly the whole encode's ids."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tokenizers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.blocks import BlockHasher
from kvroute.proxy.chunks import CUT_ONE_IN, cut_points, text_chunker
from kvroute.proxy.prompts import PromptHasher
from kvroute.tinymodel import train_tokenizer
from kvroute.tokens import HFTokenizer, SyntheticTokenizer, safe_vocabulary

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@pytest.fixture(scope="module")
def qwen_like() -> HFTokenizer:
    """The tiny model's tokenizer (``kvroute make-tiny-model``, seed 0): Qwen's layout."""
    return HFTokenizer(train_tokenizer(8192, 0), "tiny-qwen3")


def _variant(base: HFTokenizer, edit) -> HFTokenizer:
    spec = json.loads(base._tokenizer.to_str())
    edit(spec)
    return HFTokenizer(tokenizers.Tokenizer.from_str(json.dumps(spec)), "variant")


@pytest.fixture(scope="module")
def llama_like(qwen_like: HFTokenizer) -> HFTokenizer:
    """Llama 3's layout: no normalizer, digits in threes, a BOS added by a template."""

    def edit(spec: dict) -> None:
        spec["normalizer"] = None
        spec["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = LLAMA3_PATTERN
        spec["post_processor"] = {
            "type": "Sequence",
            "processors": [
                {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
                {
                    "type": "TemplateProcessing",
                    "single": [
                        {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                        {"Sequence": {"id": "A", "type_id": 0}},
                    ],
                    "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                    "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0], "tokens": ["<|endoftext|>"]}},
                },
            ],
        }

    return _variant(qwen_like, edit)


_chunkers: dict[tuple[int, int], object] = {}


def _chunker(tokenizer: HFTokenizer, one_in: int):
    """One chunker per tokenizer and cut rate (building one runs its self-check)."""
    key = (id(tokenizer), one_in)
    if key not in _chunkers:
        _chunkers[key] = text_chunker(tokenizer, cut_one_in=one_in)
    chunker = _chunkers[key]
    assert chunker is not None
    return chunker


# Words and separators chosen to sit on every edge of the cut argument: contractions, runs of
# spaces and newlines, non-breaking and ideographic spaces, digits, accents composed and not
# (NFC), combining marks after a space, CJK, emoji, special tokens and their fragments.
_PIECES = st.sampled_from(
    [
        "a", "the", "Word", "QUICK", "fox", "x", "it's", "'s", "'LL", "'ve", "'", "\"",
        " ", " ", " ", "  ", "   ", "\t", "\n", "\r\n", "\n\n", " \n", "\u00a0", "\u3000",
        ".", ",", "!?", "...", "«", "-", "(", ")", "0", "7", "123", "2026", "1,000",
        "é", "e\u0301", "\u0301", " \u0301", "ß", "Ωmega", "日本語", "한국어", "🙂",
        "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_", "|>",
        # ASCII controls: \x0b and \x0c are whitespace to the tokenizer, \x1c-\x1f are not
        # (Python's str.isspace says they are).
        "\x0b", "\x0c", "\x1c", "\x1f", "\r", "\x00", "\x7f", "'S", "'Ll", "A1b2", "\t\n",
    ]
)
_TEXTS = (
    st.lists(_PIECES, min_size=0, max_size=120).map("".join)
    | st.text(max_size=300)
    | st.text(st.characters(max_codepoint=127), max_size=300)
)


@pytest.mark.parametrize("one_in", [1, CUT_ONE_IN])
@given(text=_TEXTS)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_pieces_encode_exactly_like_the_whole_text(qwen_like: HFTokenizer, one_in: int, text: str) -> None:
    # one_in=1 cuts at every candidate: the strongest test of the cut argument.
    chunker = _chunker(qwen_like, one_in)
    assert chunker.encode(text).tolist() == qwen_like.encode(text, add_special_tokens=True)


@given(text=_TEXTS)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_llama_layout_with_bos_encodes_exactly(llama_like: HFTokenizer, text: str) -> None:
    chunker = _chunker(llama_like, 1)
    assert chunker.encode(text).tolist() == llama_like.encode(text, add_special_tokens=True)
    assert chunker.encode(text)[0] == 0  # the template's BOS
    assert chunker.encode(text, False).tolist() == llama_like.encode(text, add_special_tokens=False)


@given(words=st.lists(st.sampled_from(["alpha", "beta", "Gamma", "it's", "x1", "é"]), min_size=1, max_size=60),
       shared=st.integers(0, 60))
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_cached_pieces_stay_exact_across_prompts_sharing_a_prefix(
    qwen_like: HFTokenizer, words: list[str], shared: int
) -> None:
    chunker = _chunker(qwen_like, 2)
    first = " ".join(words)
    second = " ".join(words[:shared] + ["omega"] + words[shared:])
    for text in (first, second, first):
        assert chunker.encode(text).tolist() == qwen_like.encode(text)


def test_a_shared_prefix_is_tokenized_once(qwen_like: HFTokenizer) -> None:
    vocab = safe_vocabulary(qwen_like)
    rng = np.random.default_rng(0)
    prefix = [int(i) for i in rng.choice(vocab, 2000)]
    chunker = text_chunker(qwen_like)
    chunker.encode(qwen_like.decode(prefix + [int(i) for i in rng.choice(vocab, 300)]))
    misses = chunker.misses
    text = qwen_like.decode(prefix + [int(i) for i in rng.choice(vocab, 300)])
    assert chunker.encode(text).tolist() == qwen_like.encode(text)
    pieces = len(cut_points(text.encode())) + 1
    assert pieces > 20
    # Only the pieces from the divergence on are encoded again: the 300 new tokens are
    # about an eighth of the prompt.
    assert chunker.misses - misses <= pieces // 4


def test_cuts_depend_only_on_nearby_text() -> None:
    rng = np.random.default_rng(1)
    words = ["".join(rng.choice(list("abcdefghij"), 5)) for _ in range(3000)]
    a = " ".join(words).encode()
    b = " ".join(["zzz", *words]).encode()  # the same text shifted by 4 bytes
    cuts_a, cuts_b = cut_points(a), cut_points(b)
    assert 3000 / CUT_ONE_IN / 2 < len(cuts_a) < 3000 / CUT_ONE_IN * 2
    assert cuts_b.tolist() == [c + 4 for c in cuts_a.tolist()]
    for c in cuts_a:
        assert a[c : c + 1] == b" " and a[c - 1 : c].isalpha() and a[c + 1 : c + 2].isalpha()


@pytest.mark.parametrize(
    "edit",
    [
        lambda s: s.update(normalizer={"type": "NFKC"}),
        lambda s: s["pre_tokenizer"]["pretokenizers"][0]["pattern"].update(Regex=r"\w+|\s+"),
        lambda s: s["pre_tokenizer"]["pretokenizers"][1].update(add_prefix_space=True),
        lambda s: s["model"].update(dropout=0.1),
        lambda s: s.update(truncation={"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}),
        lambda s: s["added_tokens"][1].update(rstrip=True),
        lambda s: s["added_tokens"][1].update(content="<im start>"),
        lambda s: s.update(post_processor={"type": "BertProcessing", "sep": ["<|im_end|>", 2], "cls": ["<|im_start|>", 1]}),
    ],
    ids=["nfkc", "other-regex", "prefix-space", "dropout", "truncation", "rstrip-token",
         "spaced-token", "bert-post"],
)
def test_tokenizers_outside_the_argument_are_encoded_whole(qwen_like: HFTokenizer, edit) -> None:
    assert text_chunker(_variant(qwen_like, edit)) is None


def test_synthetic_tokenizer_has_no_chunker_and_prompt_hasher_still_works(qwen_like: HFTokenizer) -> None:
    assert text_chunker(SyntheticTokenizer()) is None
    hasher = BlockHasher(16)
    text = " ".join(["lorem ipsum dolor"] * 200)
    for tokenizer in (SyntheticTokenizer(), qwen_like):
        prompt = PromptHasher(tokenizer, hasher).text(text)
        ids = tokenizer.encode(text, add_special_tokens=True)
        assert prompt.num_tokens == len(ids)
        assert prompt.block_hashes == hasher.hash_blocks(ids)


def test_the_piece_cache_stays_within_its_byte_budget(qwen_like: HFTokenizer) -> None:
    chunker = text_chunker(qwen_like, cut_one_in=4, max_bytes=4096)
    rng = np.random.default_rng(2)
    for n in range(20):
        # A long word-less run is one piece; the words around it are many small ones.
        text = " ".join("".join(rng.choice(list("abcde"), 6)) for _ in range(200)) + " " + "x" * 3000 * (n % 2)
        assert chunker.encode(text).tolist() == qwen_like.encode(text)
        assert chunker.nbytes <= 4096
    assert chunker.evictions > 0
    # A piece over an eighth of the budget (the 3,000-letter run) is never cached: encoding
    # it again misses.
    misses = chunker.misses
    chunker.encode("x" * 3000)
    chunker.encode("x" * 3000)
    assert chunker.misses == misses + 2
