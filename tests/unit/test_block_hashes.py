"""The native BlockHasher hashes exactly as the Python one it replaced (golden data recorded
from it), for numpy buffers and plain lists alike, and extends chains consistently."""

import json

import numpy as np
import pytest
from support.paths import DATA

from kvroute.blocks import DEFAULT_HASH_SEED, BlockHasher

GOLDEN = json.loads((DATA / "golden" / "block_hashes.json").read_text())


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=lambda c: f"bs{c['block_size']}-n{len(c['tokens'])}")
def test_hashes_equal_the_recorded_python_hashes(case):
    hasher = BlockHasher(case["block_size"], case["seed"])
    assert hasher.hash_blocks(np.asarray(case["tokens"], dtype=np.uint32)) == case["hashes"]
    assert hasher.hash_blocks(case["tokens"]) == case["hashes"]
    assert hasher.hash_blocks(np.asarray(case["tokens"], dtype=np.int64)) == case["hashes"]


def test_partial_chains_extend_to_the_whole_chain():
    hasher = BlockHasher(4)
    tokens = list(range(1000, 1030))
    whole = hasher.hash_blocks(tokens)
    assert len(whole) == 7
    assert hasher.hash_blocks(tokens, parent_hash=whole[2], start_block=3) == whole[3:]
    assert hasher.hash_blocks(tokens, stop_block=2) == whole[:2]
    assert hasher.extend(whole[:3], tokens) == whole
    assert hasher.seed == DEFAULT_HASH_SEED and hasher.block_size == 4


def test_bad_input_is_an_error_not_a_wrong_hash():
    with pytest.raises(ValueError):
        BlockHasher(0)
    with pytest.raises(OverflowError):
        BlockHasher(4).hash_blocks([1, 2, 3, 2**32])
