"""The routing step the simulator and the live router share (``kvroute_core``'s
``RoutingStep``): the prefill it charges and how it treats candidates and leaving workers.

That the router's glue around it adds nothing the simulator lacks is checked in Rust, where
the glue is: ``crates/kvroute-serve/tests/routing_parity.rs`` replays the simulator's journal
through the native router's ``Fleet``."""


import pytest

from kvroute.blocks import BlockHasher
from kvroute.routing import KvIndex, RoutingStep
from kvroute.routing.policies import WorkerState, make_policy


def test_the_step_charges_the_prefill_after_the_overlap_for_every_policy():
    """The figure that drifted between the two copies of the step: a non-kv-aware policy's
    choice is charged its prompt minus the overlap the index credits, as kv-aware's is."""
    hasher = BlockHasher(16)
    index = KvIndex(hasher)
    step = RoutingStep(make_policy("round-robin"), index, 16)
    for name in ("a", "b"):
        step.add_worker(name)
    hashes = hasher.hash_blocks(list(range(100)))
    assert step.route(hashes, 100, 0.0) == (0, 0, 100)
    assert step.route(hashes, 100, 0.1) == (1, 0, 100)
    assert step.route(hashes, 100, 0.2) == (0, 6, 4)  # the prediction credits a with 6 blocks
    assert step.state(0) == WorkerState("a", 2, 104, 0)
    step.first_token(0, 4)
    step.finished(0)
    assert step.state(0) == WorkerState("a", 1, 100, 0)


def test_candidates_and_leaving_workers():
    step = RoutingStep(make_policy("round-robin"), None, 16)
    a, b, c = (step.add_worker(n) for n in "abc")
    assert step.route([], 5, 0.0, [c]) == (c, 0, 5)
    step.remove_worker("b")
    assert step.slots() == [a, c]
    step.finished(b)  # a late finish of a leaving worker's request is harmless
    assert step.add_worker("b") not in (a, b, c)  # back with a fresh slot: no stale load
    with pytest.raises(ValueError):
        step.route([], 5, 0.0, [])


def test_the_journal_keeps_every_field_of_the_events_it_was_given():
    """The step takes events from Python through the codec's lossless conversion: LoRA ids,
    names and ``extra_keys`` (a tuple per block, as vLLM types them) come back out of the
    journal as they went in."""
    from kvroute.engine.events import BlockRemoved, BlockStored

    hasher = BlockHasher(4)
    step = RoutingStep(make_policy("kv-aware"), KvIndex(hasher), 4)
    step.add_worker("a")
    step.start_journal()
    tokens = list(range(8))
    stored = BlockStored(hasher.hash_blocks(tokens), None, tokens, 4, lora_id=7, lora_name="ada",
                         extra_keys=[("salt", 3), None], group_idx=1)
    events = [stored, BlockRemoved([stored.block_hashes[1]], medium="CPU")]
    step.apply(0, events, 0.0)
    assert step.journal() == [("events", 0, events, 0.0)]
