"""Tests for kvroute.tinymodel and ``kvroute make-tiny-model``: the files vLLM loads, their
exact layout, and determinism."""

from __future__ import annotations

import hashlib
import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvroute.cli import main
from kvroute.errors import UserError
from kvroute.tinymodel import (
    MODEL_FILES,
    TinyModelConfig,
    build_tiny_model,
    float32_to_bf16_bits,
)
from kvroute.tokens import (
    CHATML_TEMPLATE,
    ENDOFTEXT,
    IM_END,
    IM_START,
    HFTokenizer,
    safe_vocabulary,
)

SMALL = TinyModelConfig(vocab_size=1024)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny model, as vLLM would serve it."""
    path = tmp_path_factory.mktemp("tiny-model")
    build_tiny_model(path, seed=0)
    return path


def read_safetensors(path: Path) -> tuple[dict, bytes, int]:
    """(header, data section, header length) of a safetensors file, parsed by the spec."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    return header, raw[8 + length :], length


def expected_qwen3_shapes(
    vocab: int, hidden: int, inter: int, layers: int, heads: int, kv_heads: int, head_dim: int
) -> dict[str, tuple[int, ...]]:
    """Checkpoint names and [out, in] shapes that vLLM's Qwen3ForCausalLM loader consumes
    (q/k/v_proj stacked into qkv_proj, gate/up_proj into gate_up_proj, q_norm/k_norm per
    head), written out independently of tinymodel's own table."""
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        a = f"model.layers.{i}.self_attn"
        m = f"model.layers.{i}.mlp"
        shapes |= {
            f"{a}.q_proj.weight": (heads * head_dim, hidden),
            f"{a}.k_proj.weight": (kv_heads * head_dim, hidden),
            f"{a}.v_proj.weight": (kv_heads * head_dim, hidden),
            f"{a}.o_proj.weight": (hidden, heads * head_dim),
            f"{a}.q_norm.weight": (head_dim,),
            f"{a}.k_norm.weight": (head_dim,),
            f"{m}.gate_proj.weight": (inter, hidden),
            f"{m}.up_proj.weight": (inter, hidden),
            f"{m}.down_proj.weight": (hidden, inter),
            f"model.layers.{i}.input_layernorm.weight": (hidden,),
            f"model.layers.{i}.post_attention_layernorm.weight": (hidden,),
        }
    return shapes


def digests(directory: Path) -> dict[str, str]:
    return {
        name: hashlib.sha256((directory / name).read_bytes()).hexdigest() for name in MODEL_FILES
    }


def test_writes_exactly_the_model_files(model_dir: Path) -> None:
    assert sorted(p.name for p in model_dir.iterdir()) == sorted(MODEL_FILES)


def test_config_is_the_documented_qwen3(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["model_type"] == "qwen3"
    assert (config["hidden_size"], config["num_hidden_layers"]) == (128, 2)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (
        4,
        2,
        32,
    )
    assert (config["vocab_size"], config["max_position_embeddings"]) == (8192, 8192)
    assert config["torch_dtype"] == "bfloat16"
    assert config["tie_word_embeddings"] is True
    assert config["attention_bias"] is False
    # KV bytes per token on vLLM's CPU backend (bf16): layers * (K+V) * kv_heads * head_dim * 2.
    kv_bytes = (
        config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * config["head_dim"] * 2
    )
    assert kv_bytes == 512


def test_special_token_ids_agree_across_files(model_dir: Path) -> None:
    tokenizer = HFTokenizer.from_dir(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    generation = json.loads((model_dir / "generation_config.json").read_text())
    im_end = tokenizer.encode(IM_END)
    endoftext = tokenizer.encode(ENDOFTEXT)
    assert [config["eos_token_id"]] == im_end == [tokenizer.eos_token_id]
    assert generation["eos_token_id"] == im_end + endoftext
    assert [generation["pad_token_id"]] == [config["bos_token_id"]] == endoftext
    # Only ids vLLM should know about: nothing that overrides per-request sampling.
    assert set(generation) == {"bos_token_id", "eos_token_id", "pad_token_id"}


def test_safetensors_layout_matches_the_qwen3_loader(model_dir: Path) -> None:
    header, data, length = read_safetensors(model_dir / "model.safetensors")
    assert length % 8 == 0
    assert header.pop("__metadata__") == {"format": "pt"}
    assert {name: tuple(t["shape"]) for name, t in header.items()} == expected_qwen3_shapes(
        vocab=8192, hidden=128, inter=384, layers=2, heads=4, kv_heads=2, head_dim=32
    )
    assert "lm_head.weight" not in header  # tied: vLLM skips lm_head and reuses the embedding
    spans = sorted(tuple(t["data_offsets"]) for t in header.values())
    assert spans[0][0] == 0 and spans[-1][1] == len(data)
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # contiguous, no holes
    for tensor in header.values():
        start, end = tensor["data_offsets"]
        assert tensor["dtype"] == "BF16"
        assert end - start == 2 * math.prod(tensor["shape"])


def _bf16_tensor(header: dict, data: bytes, name: str) -> np.ndarray:
    start, end = header[name]["data_offsets"]
    bits = np.frombuffer(data[start:end], dtype="<u2").astype(np.uint32) << 16
    return bits.view(np.float32).reshape(header[name]["shape"])


def test_weights_are_finite_with_unit_norms_and_small_projections(model_dir: Path) -> None:
    header, data, _ = read_safetensors(model_dir / "model.safetensors")
    header.pop("__metadata__")
    for name in header:
        values = _bf16_tensor(header, data, name)
        assert np.isfinite(values).all()
        if name.endswith("norm.weight"):
            assert (values == 1.0).all(), name
        else:
            assert abs(values.std() - 0.02) < 0.002, name
            assert abs(values.mean()) < 0.002, name


def test_same_seed_is_byte_identical_and_another_seed_differs(tmp_path: Path) -> None:
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    build_tiny_model(a, seed=5, config=SMALL)
    build_tiny_model(b, seed=5, config=SMALL)
    build_tiny_model(c, seed=6, config=SMALL)
    assert digests(a) == digests(b)
    da, dc = digests(a), digests(c)
    assert da["model.safetensors"] != dc["model.safetensors"]
    assert da["tokenizer.json"] != dc["tokenizer.json"]
    assert da["config.json"] == dc["config.json"]
    header, data_a, _ = read_safetensors(a / "model.safetensors")
    _, data_c, _ = read_safetensors(c / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not np.array_equal(
        _bf16_tensor(header, data_a, name), _bf16_tensor(header, data_c, name)
    )


def test_tokenizer_is_chatml_byte_level_bpe_of_the_configured_size(model_dir: Path) -> None:
    tokenizer = HFTokenizer.from_dir(model_dir)
    assert tokenizer.vocab_size == 8192
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHATML_TEMPLATE
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (config["eos_token"], config["pad_token"], config["bos_token"]) == (
        IM_END,
        ENDOFTEXT,
        None,
    )
    for token in (ENDOFTEXT, IM_START, IM_END):
        assert len(tokenizer.encode(token)) == 1
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    # A learned vocabulary: common pseudo-words become single tokens, so a prompt of ordinary
    # text is much shorter in tokens than in bytes, and there are plenty of safe word tokens.
    assert len(safe_vocabulary(tokenizer)) > 1000


@given(st.floats(width=32, allow_nan=False, allow_infinity=False))
def test_bf16_conversion_rounds_to_the_nearest_even(value: float) -> None:
    x = np.array([value], dtype=np.float32)
    bits = int(float32_to_bf16_bits(x)[0])
    truncated = int(x.view(np.uint32)[0]) >> 16
    assert bits in (truncated, truncated + 1)
    as_float = lambda b: float(np.array([b << 16], dtype=np.uint32).view(np.float32)[0])  # noqa: E731
    if truncated + 1 <= 0xFFFF and np.isfinite(as_float(truncated + 1)):
        err_chosen = abs(as_float(bits) - float(x[0]))
        err_other = abs(as_float(truncated + (bits == truncated)) - float(x[0]))
        assert err_chosen < err_other or (err_chosen == err_other and bits % 2 == 0)


def test_bf16_known_values() -> None:
    patterns = np.array(
        [0x3F800000, 0x3F808000, 0x3F818000, 0x3F808001, 0xBF800000], dtype=np.uint32
    )
    got = float32_to_bf16_bits(patterns.view(np.float32)).tolist()
    assert got == [0x3F80, 0x3F80, 0x3F82, 0x3F81, 0xBF80]


def test_refuses_to_overwrite_without_force(tmp_path: Path) -> None:
    target = tmp_path / "model"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="--force"):
        build_tiny_model(target, config=SMALL)
    written = build_tiny_model(target, config=SMALL, force=True)
    assert [p.name for p in written] == list(MODEL_FILES)
    assert (target / "notes.txt").read_text() == "mine"


def test_rejects_bad_targets_and_configurations(tmp_path: Path) -> None:
    afile = tmp_path / "file"
    afile.write_text("x")
    with pytest.raises(UserError, match="not a directory"):
        build_tiny_model(afile, config=SMALL)
    with pytest.raises(UserError, match="vocab size"):
        build_tiny_model(tmp_path / "v", config=TinyModelConfig(vocab_size=300))
    with pytest.raises(UserError, match="seed"):
        build_tiny_model(tmp_path / "s", seed=-1, config=SMALL)
    assert not (tmp_path / "v").exists() and not (tmp_path / "s").exists()


def test_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "cli"
    assert main(["make-tiny-model", str(target), "--seed", "2", "--vocab-size", "1024"]) == 0
    out = capsys.readouterr().out
    for name in MODEL_FILES:
        assert str(target / name) in out
    assert json.loads((target / "config.json").read_text())["vocab_size"] == 1024
    assert main(["make-tiny-model", str(target), "--vocab-size", "1024"]) == 2
    assert "--force" in capsys.readouterr().err
    assert main(["make-tiny-model", str(target), "--vocab-size", "1024", "--force"]) == 0


def test_lora_adapters_are_written_in_pefts_layout(tmp_path: Path) -> None:
    """``--lora-adapters 2``: PEFT's adapter_config.json and lora_A [r, in] / lora_B [out, r]
    for q_proj and v_proj of every layer, under PEFT's ``base_model.model.`` prefix (what
    vLLM's LoRA loader reads); adapters differ, and a seed writes the same bytes again."""
    for out in ("a", "b"):
        assert main(["make-tiny-model", str(tmp_path / out), "--vocab-size", "1024",
                     "--lora-adapters", "2"]) == 0
    root = tmp_path / "a" / "lora"
    assert sorted(p.name for p in root.iterdir()) == ["adapter-0", "adapter-1"]
    config = json.loads((root / "adapter-0" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["target_modules"]) == ("LORA", 8, ["q_proj", "v_proj"])
    assert config["base_model_name_or_path"] == str((tmp_path / "a").resolve())
    header, data, _ = read_safetensors(root / "adapter-0" / "adapter_model.safetensors")
    header.pop("__metadata__")
    want = {}
    for i in range(2):
        a = f"base_model.model.model.layers.{i}.self_attn"
        want |= {
            f"{a}.q_proj.lora_A.weight": (8, 128), f"{a}.q_proj.lora_B.weight": (4 * 32, 8),
            f"{a}.v_proj.lora_A.weight": (8, 128), f"{a}.v_proj.lora_B.weight": (2 * 32, 8),
        }
    assert {name: tuple(t["shape"]) for name, t in header.items()} == want
    weights = _bf16_tensor(header, data, "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight")
    assert np.isfinite(weights).all() and 0.01 < weights.std() < 0.04
    files = [p.relative_to(tmp_path / "a") for p in sorted(root.rglob("*")) if p.is_file()]
    first = {f: (tmp_path / "a" / f).read_bytes() for f in files if f.suffix != ".json"}
    assert first == {f: (tmp_path / "b" / f).read_bytes() for f in first}
    assert first[Path("lora/adapter-0/adapter_model.safetensors")] != first[Path("lora/adapter-1/adapter_model.safetensors")]
