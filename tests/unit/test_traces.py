"""Trace parsing, windows, token synthesis, and the reuse analysis against a plain LRU replay."""

from __future__ import annotations

import json
from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.blocks import BlockHasher
from kvroute.errors import UserError
from kvroute.trace import BLOCK_TOKENS, block_tokens, parse_trace, reuse


def _lines(objs) -> list[bytes]:
    return [json.dumps(o).encode() + b"\n" for o in objs]


def _mooncake(chains, lengths=None, times=None, outputs=None):
    objs = []
    for i, ids in enumerate(chains):
        n = lengths[i] if lengths else BLOCK_TOKENS * len(ids)
        objs.append({"timestamp": times[i] if times else i * 10, "input_length": n,
                     "output_length": outputs[i] if outputs else 7, "hash_ids": list(ids)})
    return parse_trace(_lines(objs), "t.jsonl")


# --- an independent plain LRU replay -------------------------------------------------------


def lru_replay(trace, capacity: int, assign=None, count_from: int = 0) -> tuple[int, int, int]:
    """(hit tokens, hit blocks, hit full blocks): per worker an OrderedDict of hash id -> size,
    a prompt's hits the leading run of cached blocks, then its blocks touched last to first,
    evicting least recently used blocks until each fits (a block bigger than the cache is not
    kept). Requests before ``count_from`` fill the caches without being counted."""
    caches: dict[int, OrderedDict] = {}
    tokens = blocks = full = 0
    for i, r in enumerate(trace.requests):
        cache = caches.setdefault(0 if assign is None else int(assign[i]), OrderedDict())
        sizes = r.block_sizes()
        for h, size in zip(r.hash_ids, sizes):
            if h not in cache or i < count_from:
                break
            tokens += size
            blocks += 1
            full += size == BLOCK_TOKENS
        for h, size in reversed(list(zip(r.hash_ids, sizes))):
            cache.pop(h, None)
            used = sum(cache.values())
            while cache and used + size > capacity:
                used -= cache.popitem(last=False)[1]
            if size <= capacity:
                cache[h] = size
    return tokens, blocks, full


def _totals(trace):
    acc = reuse.BlockAccesses.of(trace)
    return int(acc.sizes.sum()), len(acc.ids), int(acc.full.sum()), acc


@st.composite
def prefix_traces(draw):
    """Small Mooncake-like traces: prompts that extend, branch from or repeat earlier ones,
    with partial last blocks, ids kept prefix-consistent like Mooncake's."""
    n = draw(st.integers(1, 25))
    chains: list[tuple[int, ...]] = []
    next_id = 0
    lengths = []
    for _ in range(n):
        if chains and draw(st.booleans()):
            base = draw(st.sampled_from(chains))
            keep = draw(st.integers(0, len(base)))
            ids = list(base[:keep])
        else:
            ids = []
        extra = draw(st.integers(0 if ids else 1, 4))
        ids += list(range(next_id, next_id + extra))
        next_id += extra
        # A chain ending in a partial block must not be extended by others: give the partial
        # block its own id, as Mooncake does, by drawing the length only for fresh last ids.
        if extra:
            last = draw(st.integers(1, BLOCK_TOKENS))
        else:
            last = BLOCK_TOKENS
        chains.append(tuple(ids))
        lengths.append(BLOCK_TOKENS * (len(ids) - 1) + last)
    return _mooncake(chains, lengths)


@settings(max_examples=150, deadline=None)
@given(prefix_traces(), st.integers(1, 12), st.integers(1, 4))
def test_stack_distances_match_a_plain_lru_replay(trace, capacity_blocks, workers):
    capacity = capacity_blocks * 300  # not a multiple of 512: partial blocks fill the gaps
    total_tokens, total_blocks, total_full, acc = _totals(trace)
    single = reuse.stack_distances(acc)
    curve = reuse.HitCurve(single, acc)
    tokens, blocks, full = lru_replay(trace, capacity)
    assert curve.token_hit(capacity) == pytest.approx(tokens / total_tokens)
    assert curve.block_hit(capacity) == pytest.approx(blocks / total_blocks)
    assert curve.full_block_hit(capacity) == pytest.approx(full / max(total_full, 1))
    for policy in ("random", "prefix-affine"):
        assigned = reuse.assignments(trace, workers, policy, seed=3)
        fleet_curve = reuse.HitCurve(reuse.fleet_distances(acc, assigned, workers), acc)
        tokens, blocks, _ = lru_replay(trace, capacity, assigned)
        assert fleet_curve.token_hit(capacity) == pytest.approx(tokens / total_tokens)
        assert fleet_curve.block_hit(capacity) == pytest.approx(blocks / total_blocks)
    pooled = reuse.HitCurve(single, acc, capacity_factor=workers)
    tokens, _, _ = lru_replay(trace, capacity * workers)
    assert pooled.token_hit(capacity) == pytest.approx(tokens / total_tokens)


@settings(max_examples=60, deadline=None)
@given(prefix_traces(), st.integers(1, 8), st.integers(0, 20))
def test_a_warmup_fills_the_cache_without_being_counted(trace, capacity_blocks, skip):
    skip = min(skip, len(trace.requests) - 1)
    capacity = capacity_blocks * 400
    warm = trace.requests[skip].arrival_s  # requests are 10 ms apart: the first `skip` warm up
    result = reuse.analyze(trace, [2], capacity, warmup_s=warm)
    acc = reuse.BlockAccesses.of(trace)
    counted = int(acc.sizes[acc.starts[skip]:].sum())
    tokens, _, _ = lru_replay(trace, capacity, count_from=skip)
    assert result.single.token_hit(capacity) == pytest.approx(tokens / counted)
    tokens, _, _ = lru_replay(trace, 10**12, count_from=skip)
    assert result.infinite["token_hit_ratio"] == pytest.approx(tokens / counted)


@settings(max_examples=60, deadline=None)
@given(prefix_traces())
def test_infinite_cache_is_the_lru_curve_at_unbounded_capacity(trace):
    total_tokens, total_blocks, _, acc = _totals(trace)
    tokens, blocks, _ = lru_replay(trace, 10**12)
    inf = reuse.infinite_cache(acc)
    assert inf["token_hit_ratio"] == pytest.approx(tokens / total_tokens)
    assert inf["block_hit_ratio"] == pytest.approx(blocks / total_blocks)
    assert reuse.HitCurve(reuse.stack_distances(acc), acc).at(10**12) == pytest.approx(inf)


def test_lru_evicts_least_recent_and_keeps_a_prompts_head():
    # A = [0, 1], B = [2], then A again: with room for 2 blocks, B evicts A's tail (block 1)
    # first, so A's second visit hits block 0 only.
    trace = _mooncake([(0, 1), (2,), (0, 1)])
    acc = reuse.BlockAccesses.of(trace)
    curve = reuse.HitCurve(reuse.stack_distances(acc), acc)
    assert curve.block_hit(2 * BLOCK_TOKENS) == pytest.approx(1 / 5)
    assert curve.block_hit(3 * BLOCK_TOKENS) == pytest.approx(2 / 5)
    assert lru_replay(trace, 2 * BLOCK_TOKENS)[1] == 1


# --- parsing, sessions, windows -------------------------------------------------------------


def test_mooncake_lines_parse_with_sessions_after_the_common_head():
    trace = _mooncake([(0, 1, 2), (0, 1, 3), (0, 4), (0, 4, 5)], lengths=[1100, 1500, 600, 1025])
    assert trace.format == "mooncake"
    assert trace.common_head == 1  # every request starts with block 0
    assert [r.session for r in trace.requests] == ["1", "1", "4", "4"]
    assert trace.requests[0].block_sizes() == [512, 512, 76]
    assert trace.requests[0].arrival_s == 0.0 and trace.requests[1].arrival_s == pytest.approx(0.01)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"timestamp": 0, "input_length": 2000, "output_length": 1, "hash_ids": [1]}', "do not cover"),
        ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 1]}', "repeats"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": "x"}', "bad Mooncake"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1}', "bad Mooncake"),
        ("not json", "bad Mooncake"),
    ],
)
def test_bad_lines_get_one_line_errors_with_their_line_number(line, message):
    good = '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}'
    with pytest.raises(UserError, match=rf"t\.jsonl:3: .*{message}"):
        parse_trace([good.encode(), b"\n", line.encode()], "t.jsonl")


def test_kvroute_format_is_detected_and_token_prompts_get_chained_hash_ids():
    a = list(range(1000, 2100))  # 1,100 tokens: blocks of 512, 512, 76
    lines = [
        {"timestamp": 5.0, "prompt_token_ids": a, "output_tokens": 3, "session_id": "s"},
        {"timestamp": 5.5, "prompt": a[:1024] + [7] * 10},
        {"timestamp": 6.0, "prompt": "text"},
    ]
    trace = parse_trace(_lines(lines), "k.jsonl", default_output_tokens=9)
    assert trace.format == "kvroute"
    first, second, third = trace.requests
    assert first.hash_ids[:2] == second.hash_ids[:2] and first.hash_ids[2] != second.hash_ids[2]
    assert (first.arrival_s, second.arrival_s, second.output_length) == (0.0, 0.5, 9)
    assert third.hash_ids is None and third.prompt_text == "text"
    np.testing.assert_array_equal(trace.prompt_tokens(first), np.asarray(a, np.uint32))


def test_windows_keep_sessions_whole():
    # Sessions by first id: 1 (t=0, 40), 2 (t=10), 3 (t=20, 30), 4 (t=50).
    trace = _mooncake([(1,), (2,), (3,), (3, 5), (1, 6), (4,)], times=[0, 10000, 20000, 30000, 40000, 50000])
    window = trace.select(start_s=5, duration_s=20)  # sessions 2 and 3 start inside
    assert [r.hash_ids for r in window.requests] == [(2,), (3,), (3, 5)]
    assert [r.arrival_s for r in window.requests] == [0.0, 10.0, 20.0]
    sample = trace.select(max_requests=3)  # session 1 (2 requests), 2 (1); 3 does not fit
    assert [r.hash_ids for r in sample.requests] == [(1,), (2,), (1, 6)]
    cut = trace.select(start_s=5, duration_s=30, max_requests=2, cut_sessions=True)
    assert [r.hash_ids for r in cut.requests] == [(2,), (3,)]
    with pytest.raises(UserError, match="no session starts"):
        trace.select(start_s=100)


# --- token synthesis and replay -------------------------------------------------------------


def test_equal_hash_ids_give_equal_tokens_and_engine_blocks_at_any_block_size_dividing_512():
    trace = _mooncake([(0, 1, 2), (0, 1, 3), (0, 1, 2)], lengths=[1536, 1536, 1100])
    a, b, c = (trace.prompt_tokens(r) for r in trace.requests)
    assert (len(a), len(b), len(c)) == (1536, 1536, 1100)
    np.testing.assert_array_equal(a[:1024], b[:1024])
    np.testing.assert_array_equal(a[:1100], c)  # the last block cut to input_length
    assert not np.array_equal(a[1024:], b[1024:])
    np.testing.assert_array_equal(a[:512], block_tokens(0))
    for block_size in (16, 128, 512):
        ha = BlockHasher(block_size).hash_blocks(a)
        hb = BlockHasher(block_size).hash_blocks(b)
        shared = 1024 // block_size
        assert ha[:shared] == hb[:shared] and ha[shared] != hb[shared]
    assert not np.array_equal(block_tokens(0), block_tokens(0, seed=1))


def test_the_simulators_native_prompts_are_the_traces_own_and_refusals_are_counted():
    from kvroute.trace.simulate import trace_inputs

    trace = _mooncake([(0, 1, 2), (0, 1, 3), (0, 1, 2), (0, 4)], lengths=[1536, 1300, 1100, 600])
    inputs = trace_inputs(trace, max_model_len=1400)  # the first is refused: 1536 + output > 1400
    assert inputs.refused == 1 and inputs.indices == [1, 2, 3] and len(inputs.prompts) == 3
    for i, index in enumerate(inputs.indices):
        assert inputs.prompts.tokens(i) == trace.prompt_tokens(trace.requests[index]).tolist()


def test_replay_scales_arrival_times_and_makes_prompts_on_demand():
    trace = _mooncake([(0,), (1,)], lengths=[100, 600 - 88], times=[1000, 3000], outputs=[4, 5])
    out = list(trace.replay(time_scale=2))
    assert [(r.at_s, r.prompt_tokens, r.output_tokens) for r in out] == [(0.0, 100, 4), (1.0, 512, 5)]
    assert len(out[1].prompt()) == 512
    arrays = _mooncake([(0, 1), (2,), (0, 3)], lengths=[1000, 10, 600]).arrays()
    assert arrays["hash_offsets"].tolist() == [0, 2, 3, 5]
    assert arrays["hash_ids"].tolist() == [0, 1, 2, 0, 3]
    assert arrays["session"].tolist() == [0, 1, 0]
    assert arrays["input_length"].tolist() == [1000, 10, 600]
    with pytest.raises(UserError, match="time-scale"):
        list(trace.replay(time_scale=0))


# --- the command line -----------------------------------------------------------------------


def test_parse_tokens_takes_decimal_suffixes():
    from kvroute.units import parse_tokens

    assert [parse_tokens(t) for t in ("3M", "500k", "1.5G", "4096", 7)] == [3_000_000, 500_000, 1_500_000_000, 4096, 7]
    for bad in ("3MiB", "x", "0", "1.5"):
        with pytest.raises(UserError, match="kv-capacity-tokens"):
            parse_tokens(bad)


def test_predict_trace_prints_writes_json_and_plots(tmp_path, capsys):
    from kvroute.cli import main

    chains = [(0, 1, 2), (0, 1, 2, 3), (4, 5), (0, 1, 6), (4, 5, 7)]
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"".join(_lines(
        {"timestamp": i * 100, "input_length": 512 * len(c), "output_length": 3, "hash_ids": list(c)}
        for i, c in enumerate(chains))))
    out = tmp_path / "out"
    assert main(["predict", "--trace", str(path), "--workers", "2", "--kv-capacity-tokens", "2k",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "5 requests in 2 sessions" in text
    summary = json.loads((out / "summary.json").read_text())
    # 15 blocks, 7 seen before: 0,1,2 / 0,1 / 4,5 (the 2nd, 4th and 5th prompts).
    assert summary["infinite_cache"]["block_hit_ratio"] == pytest.approx(7 / 15)
    assert summary["lru"]["capacity_tokens"] == 2000
    assert summary["fleets"][0]["workers"] == 2
    assert {p.name for p in out.iterdir()} == {"summary.json", "lru_hit_vs_capacity.png", "fleet_hit_vs_capacity.png"}


def test_predict_takes_capacity_in_tokens_without_a_trace(capsys):
    from kvroute.cli import main

    assert main(["predict", "--workers", "1", "--prefixes", "2", "--kv-capacity-tokens", "9344"]) == 0
    assert "585 blocks of 16 tokens (584 usable" in capsys.readouterr().out  # the reference's 1 GiB


# --- kvroute bench --trace ------------------------------------------------------------------


@pytest.fixture
def emulated_worker():
    import asyncio
    import threading

    from kvroute.emulator import EmulatorConfig, start_workers

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    cfg = EmulatorConfig.for_model("qwen3-0.6b", timing="instant", enable_prompt_tokens_details=True)
    workers = asyncio.run_coroutine_threadsafe(start_workers(cfg, n=1), loop).result(30)
    yield workers[0].url

    async def stop():
        for w in workers:
            await w.close()

    asyncio.run_coroutine_threadsafe(stop(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def test_bench_replays_a_mooncake_trace_and_counts_max_model_len_refusals(emulated_worker, tmp_path, capsys):
    from kvroute.cli import main

    # Request 3 (5,000 tokens) is past the emulator's max-model-len of 4,096; request 2 shares
    # request 0's two first blocks (1,024 tokens); request 4 is in a session that starts late.
    chains = [((0, 1, 2), 1300), ((3,), 400), ((0, 1, 4), 1100), (tuple(range(5, 15)), 5000), ((15,), 100)]
    path = tmp_path / "mooncake.jsonl"
    path.write_bytes(b"".join(_lines(
        {"timestamp": 100 * i, "input_length": n, "output_length": 2, "hash_ids": list(ids)}
        for i, (ids, n) in enumerate(chains))))
    out = tmp_path / "out"
    argv = ["bench", "--url", emulated_worker, "--metrics-url", emulated_worker, "--trace", str(path),
            "--trials", "1", "--time-scale", "10", "--duration", "0.35", "--out", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "1 of them refused by the server's max-model-len" in text
    records = sorted((json.loads(line) for line in (out / "records.jsonl").open()), key=lambda r: r["index"])
    assert len(records) == 4  # the window: sessions starting in the first 0.35 s
    assert [r["status"] for r in records] == [200, 200, 200, 400]
    assert "maximum context length" in records[3]["error"]
    assert [r["prompt_tokens"] for r in records[:3]] == [1300, 400, 1100]
    assert records[2]["cached_tokens"] == 1024
    for r, at in zip(records, (0.0, 0.1, 0.2, 0.3)):  # sent 10x faster, reported in trace time
        assert at - 0.02 <= r["send_time"] < at + 0.1  # asyncio may wake ~1 ms (x10) early
    summary = json.loads((out / "summary.json").read_text())
    assert summary["meta"]["refused_max_model_len"] == 1
    assert summary["meta"]["trace"]["format"] == "mooncake"
