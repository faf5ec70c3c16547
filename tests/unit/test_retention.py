"""Retention (issue 19): the router refreshing the prefixes each worker's LRU would evict.

On the simulator's reference point (K = 24, W = 6, c = 8) retention lifts the request hit rate
well above kv-aware's alone; off reproduces today's numbers; where everything fits (K = 2)
auto changes nothing; every refresh is counted."""

import random

import numpy as np
import pytest

from kvroute import _native
from kvroute.blocks import BlockHasher
from kvroute.engine import get_preset
from kvroute.errors import UserError
from kvroute.routing import RoutingStep
from kvroute.routing.index import KvIndex
from kvroute.routing.policies import make_policy
from kvroute.sim import Simulation, SweepPoint, WorkerConfig, run_point, run_trial
from kvroute.workload import WorkloadSpec, generate

#: The reference worker: 1 GiB of Qwen3-0.6B bf16 KV in 16-token blocks (null block included).
CONFIG = WorkerConfig(585, 16, get_preset("reference-gpu"))


def trial(k, c, retention, policy="kv-aware", seed=0, workers=6, **options):
    wl = generate(WorkloadSpec(prefixes=k, seed=seed))
    if policy == "kv-aware":
        options.setdefault("block_size", 16)
    p = make_policy(policy, rng=random.Random(seed * 1_000_003), **options)
    return run_trial(wl, workers, c, CONFIG, p, retention=retention).stats()


def test_off_reproduces_todays_reference_point():
    off = trial(24, 8, "off")
    assert off.hits == 422 and off.requests == 480  # 0.879, as before retention existed
    assert off.refreshes == 0 and off.refresh_engine_s == 0.0


def test_on_lifts_the_reference_hit_rate_and_keeps_ttft_p99():
    off = trial(24, 8, "off")
    on = trial(24, 8, "on")
    # Measured 0.879 -> 0.960 (seeds 0-3: 0.958-0.981) with TTFT p99 114 vs 119 ms.
    assert on.request_hit_rate >= 0.95
    assert on.ttft_p99_ms <= off.ttft_p99_ms * 1.1
    # Every refresh is counted, with the engine time it added: a refresh computes one token
    # when its prefix is cached, in the next step of a busy worker, or in a step of its own
    # (6 ms) on an idle one, so it costs far less than the prefills it saves (measured ~1 ms a
    # refresh, most of it those steps of their own).
    assert on.refreshes > on.requests
    assert 0 < on.refresh_engine_s / on.refreshes < 0.002


def test_at_c16_a_prompt_cached_nowhere_goes_where_it_displaces_least_and_p99_holds():
    # At c = 16 the fleet's KV barely holds the 24 prefixes beside the running requests: a
    # prefix recomputed on the least loaded worker pushes out one of that worker's own, whose
    # next request misses in turn. Sent to the worker home to the fewest prefix families it
    # displaces least (measured seeds 0-3: on 0.940-0.971, auto 0.946-0.971, off 0.860-0.896).
    # TTFT p99 stays within off's spread (on 255-361, auto 291-360, off 304-403 ms); on this
    # seed on 361 and auto 330 against off's 316: a refresh ahead of a request to an idle
    # worker makes a step of its own, which on does not avoid and auto rarely meets. (kv-aware's
    # admission guard, off by default, trades some of these hits for the tail: next test.)
    off = trial(24, 16, "off", seed=2)
    for mode in ("on", "auto"):
        kept = trial(24, 16, mode, seed=2)
        assert kept.request_hit_rate >= 0.95, mode
        assert kept.ttft_p99_ms <= 1.2 * off.ttft_p99_ms, mode


def test_at_c16_the_admission_guard_trades_some_hits_for_the_tail():
    # The c = 16 tail is hits waiting for KV blocks on a worker whose running requests pin
    # three other prefixes. Sent elsewhere when the wait would be long, they miss instead
    # (seeds 0-3, auto: hit 0.946-0.971 -> 0.919-0.921, p99 291-360 -> 147-312 ms; off: hit
    # 0.860-0.896 -> 0.863-0.869, p99 304-403 -> 180-188 ms).
    for mode in ("off", "auto"):
        unguarded = trial(24, 16, mode, seed=2)
        guarded = trial(24, 16, mode, seed=2, admission_wait=0.2)
        assert guarded.ttft_p99_ms <= 0.7 * unguarded.ttft_p99_ms, mode
        assert guarded.request_hit_rate >= unguarded.request_hit_rate - 0.06, mode
    assert trial(24, 16, "auto", seed=2, admission_wait=0.2).request_hit_rate >= 0.9


def test_auto_changes_nothing_where_everything_fits():
    off = trial(2, 8, "off")
    auto = trial(2, 8, "auto")
    assert auto.request_hit_rate == off.request_hit_rate
    assert auto.refreshes <= 0.1 * auto.requests


def test_auto_stands_down_where_the_lru_alone_keeps_the_prefixes():
    # W = 3, K = 7: the model puts each worker's 2-3 prefixes near the head of its free queue,
    # but the LRU evicts only requests' own blocks before their next use. Measured against each
    # worker's plain LRU (modelled beside it) the refreshes save nothing, and auto stops once
    # it has seen 32 uses (seed 0: 0.95 refreshes a request before, 0.17 now; hit 0.990 both).
    off = trial(7, 4, "off", workers=3)
    auto = trial(7, 4, "auto", workers=3)
    assert auto.request_hit_rate == off.request_hit_rate
    assert auto.refreshes <= 0.25 * auto.requests


def test_retention_counts_what_its_refreshes_bought():
    # On the reference point the plain LRU would lose prefixes the refreshes keep: the saved
    # blocks (held, where the LRU without refreshes would have evicted them) are counted, and
    # auto goes on refreshing.
    wl = generate(WorkloadSpec(prefixes=24))
    policy = make_policy("kv-aware", rng=random.Random(0), block_size=16)
    sim = Simulation(6, CONFIG, policy, retention="auto")
    output = wl.vocab[: wl.spec.output_tokens]
    sim.run(wl.warmup, 1, output)
    sim.run(wl.requests, 8, output)
    stats = sim.retention.stats()
    assert 0 < stats["saved_blocks"] <= stats["lost_blocks"]
    assert stats["refreshes"] > len(wl.requests)
    assert stats["declined_payoff"] == 0


def test_random_routing_with_retention_gets_an_index():
    # Retention learns prefixes from the overlap, so the simulation builds an index for it even
    # when the policy needs none; the policy still decides, but for prompts cached nowhere,
    # which go where the fewest prefix families live (some move off prefix-hash's owners).
    off = trial(24, 8, "off", policy="prefix-hash")
    on = trial(24, 8, "on", policy="prefix-hash")
    moved = sum(abs(on.worker_requests.get(w, 0) - n) for w, n in off.worker_requests.items()) / 2
    assert 0 < moved <= 0.1 * off.requests
    assert max(on.worker_requests.values()) < max(off.worker_requests.values())
    assert on.refreshes > 0


def test_sweep_points_label_the_mode():
    point = SweepPoint(6, 24, 8, "kv-aware", "auto")
    result = run_point(point, generate(WorkloadSpec(prefixes=24)), CONFIG, 1, 0)
    assert result.policy == "kv-aware+retain-auto"
    assert result.to_json()["refreshes"] == result.trials[0].refreshes > 0


def test_retention_modes_are_checked():
    with pytest.raises(ValueError, match="off, on or auto"):
        _native.Retention("sometimes", 16, 584)
    from kvroute.commands import sim as sim_cmd
    from kvroute.commands._common import name_list

    with pytest.raises(UserError):
        name_list("on,never", list(sim_cmd.RETENTION_MODES), "--retention")


def test_live_api_refreshes_a_prefix_about_to_age_out():
    # The live router's calls: route, tell retention, poll before forwarding.
    hasher = BlockHasher(16)
    index = KvIndex(hasher)
    step = RoutingStep(make_policy("kv-aware", rng=random.Random(0), block_size=16), index, 16)
    slot = step.add_worker("w0")
    retention = _native.Retention("on", 16, 64)
    rng = np.random.default_rng(0)
    prefixes = [rng.integers(1000, 30000, 160, dtype=np.uint32) for _ in range(4)]
    sent = []
    for i in range(40):
        prompt = np.concatenate([prefixes[i % 4], rng.integers(1000, 30000, 40, dtype=np.uint32)])
        hashes = list(hasher.hash_blocks(prompt))
        chosen, overlap, _ = step.route(hashes, len(prompt), 0.01 * i)
        incoming = -(-(len(prompt) + 8) // 16) - overlap
        sent += retention.poll(step, chosen, 0.01 * i, incoming)
        retention.routed(chosen, hashes, prompt, overlap, 8, 0.01 * i)
        step.first_token(chosen, 1)
        step.finished(chosen)
    assert retention.tracked(slot) == 4
    assert sent, "4 prefixes of 10 blocks and their suffixes overflow 64 blocks"
    for prompt, hashes, blocks in sent:
        assert blocks == 10 and len(hashes) == 10 and len(prompt) == 161
        assert any(np.array_equal(prompt[:160], p) for p in prefixes)
    assert retention.stats()["refreshes"] == len(sent)
