"""The simulator and the live router route alike: one native routing step, and the router's
glue around it (candidates, the prefill figure, ``_Load``, the pool's event feed) adds nothing
the simulator lacks.

The simulator records its routing step's inputs (the journal: requests with their time,
first tokens, finishes, each worker's KV events); the same sequence is then replayed through
a ``Router`` (its ``_choose`` and its ``_Load`` accounting, on the replay's clock; each
worker's events encoded as vLLM publishes them, decoded natively and applied to the router's
index, which is what its native event consumer does with every batch it receives), which must
choose every request's worker and charge every prefill as the simulator did, and end with the
same loads and index."""

import random

import pytest

from kvroute.blocks import BlockHasher
from kvroute.engine import REFERENCE_GPU
from kvroute.engine.events import EventBatch
from kvroute.kvevents.wire import decode_native, encode_batch
from kvroute.proxy.app import Router, RouterConfig, _Load
from kvroute.proxy.discovery import Endpoint
from kvroute.proxy.pool import EventsSettings, WorkerPool
from kvroute.proxy.prompts import PromptInfo
from kvroute.routing import KvIndex, RoutingStep
from kvroute.routing.policies import WorkerState, make_policy, policy_parameters
from kvroute.sim import Simulation, WorkerConfig
from kvroute.workload import WorkloadSpec, generate

CONFIG = WorkerConfig(num_blocks=585, block_size=16, cost=REFERENCE_GPU)
WORKERS = 6


def simulate(policy_name: str, seed: int, spec: WorkloadSpec, concurrency: int):
    """Run one trial with an index (so the router, which always has one, sees the same
    events) and return the journal, the final loads and the index."""
    options = {"block_size": 16} if "block_size" in policy_parameters(policy_name) else {}
    policy = make_policy(policy_name, random.Random(seed), **options)
    index = KvIndex(BlockHasher(CONFIG.block_size))
    sim = Simulation(WORKERS, CONFIG, policy, index=index)
    sim.routing.start_journal()
    workload = generate(spec)
    output = workload.vocab[: workload.spec.output_tokens]
    sim.run(workload.warmup, 1, output)
    sim.run(workload.requests, concurrency, output)
    return sim.routing.journal(), sim.states, index, sim.names


def replay_through_router(policy_name: str, seed: int, journal, names):
    """Feed the simulator's journal to a router built as ``kvroute serve`` builds it (TTL
    2 s predictions as with events, no per-worker cap as in the simulator)."""
    router = Router(RouterConfig(
        policy=policy_name, seed=seed, block_size=16, predicted_ttl_s=2.0, predicted_capacity_blocks=10**9,
        health_interval_s=0,
    ))
    pool = WorkerPool(router.index, router.metrics, None, EventsSettings(), router.policy.name,
                      health_interval_s=0, routing=router.routing)
    router.pool = pool
    pool.update([Endpoint(f"http://127.0.0.1:{9000 + i}", name) for i, name in enumerate(names)])
    workers = [pool.workers[n] for n in names]
    pending: list[list[_Load]] = [[] for _ in names]
    chosen = []
    for entry in journal:
        kind = entry[0]
        if kind == "route":
            _, hashes, prompt_tokens, _, now, slot, _, prefill = entry
            router.clock = lambda now=now: now
            worker, charged = router._choose(PromptInfo(prompt_tokens, hashes), pool.available())
            chosen.append((worker.name, charged))
            assert (worker.name, charged) == (names[slot], prefill), f"request {len(chosen) - 1}"
            pending[slot].append(_Load(router.routing, worker, charged))
        elif kind == "first_token":
            _, slot, prefill = entry
            load = next(x for x in pending[slot] if x._tokens == prefill)
            load.prefill_done()
        elif kind == "finished":
            slot = entry[1]
            load = next(x for x in pending[slot] if x._tokens == 0)
            pending[slot].remove(load)
            load.finish()
        else:
            _, slot, events, now = entry
            router.index.apply_native(workers[slot].name, decode_native(encode_batch(EventBatch(now, list(events)))))
    return router, chosen


@pytest.mark.parametrize("policy_name, seed, spec, concurrency", [
    ("kv-aware", 0, WorkloadSpec(prefixes=7, seed=0), 8),
    ("kv-aware", 3, WorkloadSpec(prefixes=64, zipf_alpha=1.2, seed=1), 16),
    ("random", 5, WorkloadSpec(prefixes=7, seed=2), 8),
    ("prefix-hash", 1, WorkloadSpec(prefixes=24, seed=0), 8),
    ("least-loaded", 2, WorkloadSpec(prefixes=12, seed=3), 16),
])
async def test_the_router_routes_a_replayed_sequence_as_the_simulator_did(policy_name, seed, spec, concurrency):
    journal, sim_states, sim_index, names = simulate(policy_name, seed, spec, concurrency)
    routes = [e for e in journal if e[0] == "route"]
    assert len(routes) == spec.num_requests + spec.prefixes
    assert len({e[5] for e in routes}) == WORKERS  # every worker took requests
    router, chosen = replay_through_router(policy_name, seed, journal, names)
    assert len(chosen) == len(routes)
    assert [router.pool.workers[n].state for n in names] == sim_states
    assert all(s == WorkerState(s.name, 0, 0, s.cached_blocks) for s in sim_states)
    assert router.index.stats() == sim_index.stats()
    last = routes[-1]
    assert router.index.overlaps(last[1], names, last[4]) == sim_index.overlaps(last[1], names, last[4])


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
