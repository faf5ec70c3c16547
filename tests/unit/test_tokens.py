"""Tests for kvroute.tokens: the synthetic tokenizer, HF tokenizer directories, chat templates
and the safe vocabulary used to build exact-length prompts."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers

from kvroute._native import ChatTemplate
from kvroute.errors import UserError
from kvroute.tinymodel import TinyModelConfig, build_tiny_model
from kvroute.tokens import (
    CHATML_TEMPLATE,
    ENDOFTEXT,
    IM_END,
    IM_START,
    HFTokenizer,
    SyntheticTokenizer,
    Tokenizer,
    load_tokenizer,
    safe_vocabulary,
)

SYNTHETIC = SyntheticTokenizer()

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello there, how are you?"},
    {"role": "assistant", "content": "Fine!"},
    {"role": "user", "content": "Tell me more."},
]
CONVERSATION_CHATML = (
    "<|im_start|>system\nBe brief.<|im_end|>\n"
    "<|im_start|>user\nHello there, how are you?<|im_end|>\n"
    "<|im_start|>assistant\nFine!<|im_end|>\n"
    "<|im_start|>user\nTell me more.<|im_end|>\n"
)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small tiny-model directory (1024-token vocabulary keeps the build well under 1 s)."""
    path = tmp_path_factory.mktemp("tiny-tokenizer")
    build_tiny_model(path, seed=3, config=TinyModelConfig(vocab_size=1024))
    return path


@pytest.fixture(scope="session")
def hf(tiny_dir: Path) -> HFTokenizer:
    return HFTokenizer.from_dir(tiny_dir)


def _with_config(tmp_path: Path, source: Path, **overrides: object) -> Path:
    """A copy of ``source``'s tokenizer with tokenizer_config.json keys replaced."""
    target = tmp_path / "tok"
    target.mkdir()
    shutil.copy(source / "tokenizer.json", target / "tokenizer.json")
    config = json.loads((source / "tokenizer_config.json").read_text())
    config.update(overrides)
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return target


# --- SyntheticTokenizer -------------------------------------------------------------------


def test_synthetic_words_are_distinct_and_specials_come_first() -> None:
    words = [SYNTHETIC.decode([i]) for i in range(SYNTHETIC.vocab_size)]
    assert len(set(words)) == SYNTHETIC.vocab_size == 32000
    assert words[: SYNTHETIC.num_special] == [ENDOFTEXT, IM_START, IM_END]
    assert SYNTHETIC.eos_token_id == words.index(IM_END)
    assert all(w.isalpha() and w.islower() for w in words[SYNTHETIC.num_special :])


@given(st.lists(st.integers(SYNTHETIC.num_special, SYNTHETIC.vocab_size - 1), max_size=200))
def test_synthetic_round_trips_any_sequence_of_word_ids(ids: list[int]) -> None:
    text = SYNTHETIC.decode(ids)
    assert SYNTHETIC.encode(text) == ids
    assert SYNTHETIC.encode(text, add_special_tokens=False) == ids


@given(st.lists(st.integers(0, 299), max_size=50))
def test_synthetic_round_trips_with_special_tokens_and_small_vocabularies(ids: list[int]) -> None:
    tokenizer = SyntheticTokenizer(vocab_size=300)
    assert tokenizer.encode(tokenizer.decode(ids)) == ids


@given(st.text(max_size=300))
def test_synthetic_tokenizes_any_text_deterministically_into_the_vocabulary(text: str) -> None:
    ids = SYNTHETIC.encode(text)
    assert ids == SyntheticTokenizer().encode(text)
    assert all(0 <= i < SYNTHETIC.vocab_size for i in ids)


def test_synthetic_unknown_words_are_stable_and_distinguished() -> None:
    a = SYNTHETIC.encode("The quick brown fox, again!")
    assert len(a) == 7  # five words, a comma and an exclamation mark
    assert a[1] != a[2] and a[5] != a[6]
    assert SYNTHETIC.encode("quick quick") == [a[1], a[1]]


def test_synthetic_decode_rejects_ids_outside_the_vocabulary() -> None:
    with pytest.raises(ValueError, match="32000"):
        SYNTHETIC.decode([5, 32000])


def test_synthetic_chat_template_matches_the_rendered_chatml_template() -> None:
    template = ChatTemplate(CHATML_TEMPLATE)
    for add_generation_prompt in (True, False):
        expected = template.render(CONVERSATION, add_generation_prompt)
        assert SYNTHETIC.apply_chat_template(CONVERSATION, add_generation_prompt) == expected
    assert expected == CONVERSATION_CHATML


def test_synthetic_chat_prompt_tokenizes_specials_as_single_ids() -> None:
    ids = SYNTHETIC.encode(SYNTHETIC.apply_chat_template(CONVERSATION), add_special_tokens=False)
    im_start, im_end = SYNTHETIC.encode(f"{IM_START}{IM_END}")
    assert ids[0] == im_start
    assert ids.count(im_start) == len(CONVERSATION) + 1
    assert ids.count(im_end) == len(CONVERSATION)
    # A chat's rendered prompt is a prefix of the next turn's (multi-turn cache reuse).
    longer = SYNTHETIC.encode(
        SYNTHETIC.apply_chat_template(CONVERSATION + [{"role": "assistant", "content": "Ok."}])
    )
    assert longer[: len(ids)] == ids


def test_both_tokenizers_satisfy_the_protocol(hf: HFTokenizer) -> None:
    assert isinstance(SYNTHETIC, Tokenizer)
    assert isinstance(hf, Tokenizer)


# --- HFTokenizer --------------------------------------------------------------------------


def test_hf_tokenizer_loads_the_tiny_model_directory(hf: HFTokenizer, tiny_dir: Path) -> None:
    assert hf.vocab_size == 1024
    assert hf.name == str(tiny_dir.resolve())
    assert hf.encode(IM_END, add_special_tokens=False) == [hf.eos_token_id]
    assert hf.special_tokens["pad_token"] == ENDOFTEXT
    assert "bos_token" not in hf.special_tokens


def test_hf_chat_template_renders_chatml_and_encodes_specials(hf: HFTokenizer) -> None:
    text = hf.apply_chat_template(CONVERSATION)
    assert text == CONVERSATION_CHATML + "<|im_start|>assistant\n"
    assert hf.apply_chat_template(CONVERSATION, add_generation_prompt=False) == CONVERSATION_CHATML
    ids = hf.encode(text, add_special_tokens=False)
    im_start = hf.encode(IM_START, add_special_tokens=False)
    assert len(im_start) == 1 and ids[0] == im_start[0]
    assert ids.count(hf.eos_token_id) == len(CONVERSATION)
    assert hf.decode(ids) == text


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=200))
def test_hf_byte_level_tokenizer_is_lossless_and_adds_no_special_tokens(
    hf: HFTokenizer, text: str
) -> None:
    import unicodedata

    ids = hf.encode(text)
    # Qwen-style post-processor: add_special_tokens=True adds nothing (as vLLM sees it).
    assert ids == hf.encode(text, add_special_tokens=False)
    assert hf.encode_batch([text, text]) == [ids, ids]
    assert hf.decode(ids) == unicodedata.normalize("NFC", text)


def test_hf_chat_content_parts_are_joined_with_newlines_like_vllm(hf: HFTokenizer) -> None:
    parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}],
        }
    ]
    assert (
        hf.apply_chat_template(parts)
        == "<|im_start|>user\none\ntwo<|im_end|>\n<|im_start|>assistant\n"
    )
    assert SYNTHETIC.apply_chat_template(parts) == hf.apply_chat_template(parts)
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(UserError, match="image_url"):
        hf.apply_chat_template(image)


def test_hf_template_environment_matches_transformers(tmp_path: Path, tiny_dir: Path) -> None:
    template = (
        "{% for m in messages %}{% generation %}{{ m | tojson }}{% endgeneration %}{% endfor %}"
        "{% if messages | length > 1 %}{{ raise_exception('one message only') }}{% endif %}"
        "{{ eos_token }}{{ flag }}"
    )
    tok = HFTokenizer.from_dir(_with_config(tmp_path, tiny_dir, chat_template=template))
    rendered = tok.apply_chat_template([{"role": "user", "content": "<b>é</b>"}], flag="!")
    # tojson neither escapes HTML nor non-ASCII; special tokens and extra kwargs are variables.
    assert rendered == '{"role": "user", "content": "<b>é</b>"}<|im_end|>!'
    with pytest.raises(UserError, match="one message only"):
        tok.apply_chat_template(CONVERSATION)
    # As in transformers, kwargs override special tokens; the renderer's own variables they
    # may not replace, and text that is not Unicode (a JSON "\ud800") is refused, not a crash.
    one = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(one, eos_token="E", flag="").endswith('"x"}E')
    with pytest.raises(UserError, match="may not set"):
        tok.apply_chat_template(one, tools=[])
    with pytest.raises(UserError, match="lone surrogate"):
        tok.apply_chat_template([{"role": "user", "content": "\ud800"}])


def test_hf_named_templates_and_chat_template_jinja_file(tmp_path: Path, tiny_dir: Path) -> None:
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    assert (
        HFTokenizer.from_dir(
            _with_config(tmp_path, tiny_dir, chat_template=named)
        ).apply_chat_template([])
        == "D"
    )
    directory = tmp_path / "tok"
    config = json.loads((directory / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="no chat template"):
        HFTokenizer.from_dir(directory).apply_chat_template([])
    (directory / "chat_template.jinja").write_text("J{{ messages | length }}")
    assert HFTokenizer.from_dir(directory).apply_chat_template(CONVERSATION) == "J4"


def test_hf_special_tokens_may_be_serialized_added_tokens(tmp_path: Path, tiny_dir: Path) -> None:
    eos = {"__type": "AddedToken", "content": IM_END, "special": True}
    tok = HFTokenizer.from_dir(_with_config(tmp_path, tiny_dir, eos_token=eos))
    assert tok.eos_token_id == tok.encode(IM_END)[0]


def test_from_dir_errors_are_user_errors(tmp_path: Path, tiny_dir: Path) -> None:
    with pytest.raises(UserError, match="does not exist"):
        HFTokenizer.from_dir(tmp_path / "missing")
    with pytest.raises(UserError, match="does not exist"):
        load_tokenizer(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match="no tokenizer.json"):
        HFTokenizer.from_dir(empty)
    shutil.copy(tiny_dir / "tokenizer.json", empty / "tokenizer.json")
    with pytest.raises(UserError, match="no tokenizer_config.json"):
        HFTokenizer.from_dir(empty)
    (empty / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(UserError, match="cannot read"):
        HFTokenizer.from_dir(empty)
    (empty / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for %}"}))
    with pytest.raises(UserError, match="does not parse"):
        HFTokenizer.from_dir(empty)
    (empty / "tokenizer.json").write_text('{"model": 1}')
    with pytest.raises(UserError, match="cannot load"):
        HFTokenizer.from_dir(empty)


def test_load_tokenizer_picks_synthetic_or_directory(tiny_dir: Path) -> None:
    assert isinstance(load_tokenizer(None), SyntheticTokenizer)
    loaded = load_tokenizer(str(tiny_dir))
    assert isinstance(loaded, HFTokenizer) and loaded.vocab_size == 1024


# --- safe_vocabulary ----------------------------------------------------------------------


def test_safe_vocabulary_of_synthetic_is_every_word_id() -> None:
    ids = safe_vocabulary(SYNTHETIC)
    assert ids.tolist() == list(range(SYNTHETIC.num_special, SYNTHETIC.vocab_size))
    assert safe_vocabulary(SYNTHETIC, limit=10).tolist() == ids[:10].tolist()


def test_safe_vocabulary_of_byte_level_bpe_is_leading_space_words(hf: HFTokenizer) -> None:
    ids = safe_vocabulary(hf)
    assert len(ids) > 100
    assert ids.tolist() == sorted(set(ids.tolist()))
    for i in ids.tolist():
        text = hf.decode([i])
        assert text[0] == " " and text[1:].isascii() and text[1:].isalpha()
    assert safe_vocabulary(hf) is ids  # computed once per tokenizer
    assert safe_vocabulary(hf, limit=5).tolist() == ids[:5].tolist()
    with pytest.raises(ValueError):
        ids[0] = 0  # shared across callers, so read-only


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_safe_vocabulary_concatenations_round_trip_exactly(
    hf: HFTokenizer, data: st.DataObject
) -> None:
    ids = safe_vocabulary(hf).tolist()
    picks = st.lists(st.sampled_from(ids), max_size=300)
    prefix, suffix = data.draw(picks), data.draw(picks)
    # Text built from a prefix and a suffix separately must tokenize to exactly both: no
    # merge across the boundary, so prompt lengths are exact.
    text = hf.decode(prefix) + hf.decode(suffix)
    assert hf.encode(text, add_special_tokens=False) == prefix + suffix
    assert hf.encode(hf.decode(prefix + suffix)) == prefix + suffix


def test_safe_vocabulary_long_seeded_prompts_round_trip(hf: HFTokenizer) -> None:
    ids = safe_vocabulary(hf).tolist()
    rng = random.Random(7)
    for _ in range(20):
        prompt = [rng.choice(ids) for _ in range(2000)]
        assert hf.encode(hf.decode(prompt), add_special_tokens=False) == prompt


def _toy_bpe(merges: list[tuple[str, str]]) -> HFTokenizer:
    """A BPE without a splitting pre-tokenizer, so merges can cross word boundaries."""
    vocab = {t: i for i, t in enumerate(["Ġ", "a", "b", "c"])}
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=merges))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    raw.decoder = decoders.ByteLevel()
    return HFTokenizer(raw, name="toy")


def test_safe_vocabulary_drops_tokens_that_merge_with_themselves() -> None:
    toy = _toy_bpe([("Ġ", "a"), ("Ġ", "c"), ("Ġa", "Ġa")])
    # " a" re-encodes alone but " a a" becomes one token; " c" is safe.
    assert [toy.decode([i]) for i in safe_vocabulary(toy).tolist()] == [" c"]


def test_safe_vocabulary_drops_tokens_that_merge_with_neighbours() -> None:
    toy = _toy_bpe([("Ġ", "a"), ("Ġ", "b"), ("Ġa", "Ġb"), ("Ġb", "Ġa")])
    # Each of " a" and " b" is fine alone and doubled, but next to each other they merge.
    with pytest.raises(UserError, match="no word-piece tokens"):
        safe_vocabulary(toy)


def test_safe_vocabulary_ids_build_exact_length_prompts_for_both_tokenizers(
    hf: HFTokenizer,
) -> None:
    rng = np.random.default_rng(0)
    for tokenizer in (SYNTHETIC, hf):
        ids = safe_vocabulary(tokenizer)
        prompt = rng.choice(ids, size=777).tolist()
        assert len(tokenizer.encode(tokenizer.decode(prompt), add_special_tokens=False)) == 777
