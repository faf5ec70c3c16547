"""kvroute_core::pyrandom draws what CPython's random.Random draws, for many seeds (the
policies' seeded choices depend on it)."""

import random

import pytest

from kvroute._native import NativeRandom

SEEDS = [0, 1, 2, 7, -5, 12345, 2**31 - 1, 2**32, 2**32 + 1, 2**64 - 1, 2**70 + 3, -(2**100), 10**30]
SEEDS += [s * 1_000_003 + t for s in range(5) for t in range(4)]


@pytest.mark.parametrize("seed", SEEDS)
def test_draws_equal_cpythons(seed):
    ours, theirs = NativeRandom(seed), random.Random(seed)
    for i in range(700):  # beyond one 624-word twist
        n = 1 + (i * 37) % 97
        assert ours.randrange(n) == theirs.randrange(n)
        assert ours.random() == theirs.random()
        k = 1 + i % 64
        assert ours.getrandbits(k) == theirs.getrandbits(k)


def test_a_copied_state_continues_the_python_sequence():
    theirs = random.Random(99)
    theirs.random()
    ours = NativeRandom.from_random(theirs)
    assert [ours.random() for _ in range(10)] == [theirs.random() for _ in range(10)]
