"""kvroute bench against in-process emulated workers (instant timing) and a local balancer."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from kvroute.bench import (
    BenchOptions,
    BenchRunner,
    BenchTarget,
    PromptEncoder,
    SessionSpec,
    reference_workload,
    run_sweep,
    session_workload,
    trace_workload,
)
from kvroute.bench.client import StreamResult, read_sse
from kvroute.bench.prompts import poisson_schedule
from kvroute.bench.runner import TrialSink, discover_model, simulate_points
from kvroute.bench.scrape import metrics_endpoint, parse_metrics, window_token_hit_rate
from kvroute.bench.writer import ResultsWriter
from kvroute.emulator import EmulatorConfig, start_workers
from kvroute.errors import UserError
from kvroute.router import RouterConfig, start_router
from kvroute.service import TcpBalancer
from kvroute.tokens import SyntheticTokenizer, safe_vocabulary
from kvroute.workload import LengthDist, WorkloadSpec

MODEL = "Qwen/Qwen3-0.6B"


def emulator_config(details: bool = True, **overrides) -> EmulatorConfig:
    return EmulatorConfig.for_model("qwen3-0.6b", timing="instant", enable_prompt_tokens_details=details, **overrides)


@pytest.fixture
async def six_workers():
    workers = await start_workers(emulator_config(), n=6)
    yield workers
    for w in workers:
        await w.close()


@pytest.fixture
async def one_worker():
    [worker] = await start_workers(emulator_config(), n=1)
    yield worker
    await worker.close()


def small_spec(k: int, **kw) -> WorkloadSpec:
    # Short prompts keep the tests fast; the hit logic does not depend on length.
    defaults = dict(prefix_tokens=LengthDist.fixed(256), suffix_tokens=LengthDist.fixed(40), output_tokens=4, requests=40)
    defaults.update(kw)
    return WorkloadSpec(prefixes=k, **defaults)


# -- streaming and parsing ---------------------------------------------------------------------


class _Pieces:
    """Stands in for aiohttp's StreamReader: returns the given reads, then EOF."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = list(pieces)

    async def readany(self) -> bytes:
        return self.pieces.pop(0) if self.pieces else b""


async def test_sse_parser_handles_split_lines_crlf_and_usage():
    events = (
        b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\r\n\r\n'
        b'data: {"choices":[{"index":0,"delta":{"content":"ab"}}]}\n\n'
        b'data: {"choices":[{"index":0,"delta":{"content":"cd"}}]}\n\n'
        b'data: {"choices":[],"usage":{"prompt_tokens":40,"completion_tokens":2,'
        b'"prompt_tokens_details":{"cached_tokens":32}}}\n\ndata: [DONE]\n\n'
    )
    # Cut the body at awkward places: inside a line, between \r and \n.
    cuts = [7, 60, 61, 150, len(events) - 3]
    pieces = [events[a:b] for a, b in zip([0, *cuts], [*cuts, len(events)])]
    result = StreamResult()
    await read_sse(_Pieces(pieces), result)
    assert result.done and result.error is None
    assert len(result.content_times) == 2  # the empty role chunk is not content
    assert result.usage.prompt_tokens == 40
    assert result.usage.prompt_tokens_details.cached_tokens == 32


async def test_stream_error_event_is_recorded():
    result = StreamResult()
    await read_sse(_Pieces([b'data: {"error":{"message":"boom","code":500}}\n\n']), result)
    assert result.error == "boom"
    assert not result.done


def test_parse_metrics_sums_label_sets_and_reads_cache_config():
    text = (
        "# TYPE vllm:prefix_cache_hits counter\n"
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 100.0\n'
        'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 28.0\n'
        "# TYPE vllm:prefix_cache_queries counter\n"
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 400.0\n'
        'vllm:prefix_cache_queries_total{engine="1",model_name="m"} 112.0\n'
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="585",engine="0"} 1.0\n'
    )
    sample = parse_metrics("u", text)
    assert (sample.hits, sample.queries) == (128.0, 512.0)
    assert (sample.num_gpu_blocks, sample.block_size) == (585, 16)


def test_metrics_endpoint_normalizes_urls():
    assert metrics_endpoint("http://h:1") == ("http://h:1", "http://h:1/metrics")
    assert metrics_endpoint("h:1/custom") == ("http://h:1", "http://h:1/custom")
    with pytest.raises(UserError):
        metrics_endpoint("ftp://h:1")


# -- request construction ----------------------------------------------------------------------


def test_seeded_requests_are_identical_across_builds():
    enc = PromptEncoder("ids", MODEL)
    a = reference_workload(small_spec(5, seed=7), enc)
    b = reference_workload(small_spec(5, seed=7), enc)
    c = reference_workload(small_spec(5, seed=8), enc)
    assert [r.body for r in a.requests] == [r.body for r in b.requests]
    assert [r.body for r in a.requests] != [r.body for r in c.requests]
    assert np.array_equal(poisson_schedule(50, 10.0, 3), poisson_schedule(50, 10.0, 3))


def test_text_prompts_retokenize_to_exactly_the_intended_ids():
    tok = SyntheticTokenizer()
    enc = PromptEncoder("text", MODEL, tok)
    wl = reference_workload(small_spec(3), enc, safe_vocabulary(tok))
    src = wl.source.requests[0]
    body = json.loads(wl.requests[0].body)
    assert tok.encode(body["prompt"]) == src.prompt_token_ids.tolist()
    assert wl.requests[0].prompt_tokens == src.prompt_tokens


def test_sessions_extend_the_previous_turn_in_order():
    enc = PromptEncoder("ids", MODEL)
    wl = session_workload(small_spec(2), SessionSpec(sessions=3, turns=3, turn_tokens=LengthDist.fixed(8)), enc)
    assert len(wl.requests) == 9
    by_session: dict[str, list] = {}
    for r in wl.requests:
        by_session.setdefault(r.session_id, []).append(r)
    for turns in by_session.values():
        assert turns[0].after is None
        for prev, cur in zip(turns, turns[1:]):
            assert cur.after == prev.index
            p, c = json.loads(prev.body)["prompt"], json.loads(cur.body)["prompt"]
            assert c[: len(p)] == p and len(c) == len(p) + 4 + 8  # + seeded reply + new message


# -- against the emulator ----------------------------------------------------------------------


async def test_discover_model_and_unreachable_url(one_worker):
    assert await discover_model(one_worker.url) == MODEL
    with pytest.raises(UserError, match="cannot reach"):
        await discover_model("http://127.0.0.1:9", timeout_s=2)


async def test_one_new_connection_per_request_unless_keep_alive(one_worker):
    wl = reference_workload(small_spec(3, requests=30), PromptEncoder("ids", MODEL))
    counts = {}
    for keep_alive in (False, True):
        balancer = TcpBalancer([("127.0.0.1", one_worker.port)])
        await balancer.start()
        target = BenchTarget(f"http://127.0.0.1:{balancer.port}", (one_worker.url,), MODEL)
        [point] = await run_sweep(target, [wl], BenchOptions(concurrency=(4,), keep_alive=keep_alive))
        await balancer.close()
        assert point.trials[0].failed == 0
        counts[keep_alive] = balancer.accepted
    # Every warmup and measured request: its own connection; and one read of the target's
    # /metrics, which tells the bench it is no kvroute router (whose refreshes it would count).
    assert counts[False] == 3 + 30 + 1
    assert counts[True] <= 4 + 1 + 1  # a pool: at most one per concurrent client (+ the warmup's)


async def test_seeded_order_is_identical_across_runs(one_worker):
    """The server receives the same prompts in the same order on every run and trial."""
    wl = reference_workload(small_spec(4, requests=24), PromptEncoder("ids", MODEL))
    target = BenchTarget(one_worker.url, (one_worker.url,), MODEL)
    orders = []
    for _ in range(2):
        runner = BenchRunner(target, BenchOptions(concurrency=(1,), trials=2))
        sink = _Collect()
        runner.sink = sink
        await runner.run([wl])
        for result in sink.results:
            orders.append([(r.prefix_id, r.index) for r in sorted(result.records, key=lambda r: r.send_time)])
    assert len(orders) == 4 and all(o == orders[0] for o in orders)
    assert [p for p, _ in orders[0]] == [r.prefix_id for r in wl.requests]


class _Collect:
    def __init__(self) -> None:
        self.results = []

    def trial_done(self, result) -> None:
        self.results.append(result)


async def test_hit_rates_agree_with_the_simulator(six_workers, tmp_path):
    """W=6, K in {2, 12}, c=8 through the balancer: the measured request hit rate is within
    3 points of `kvroute sim` for the same configuration, and the per-request and the
    Prometheus token hit ratios agree to 0.001."""
    enc = PromptEncoder("ids", MODEL)
    config = emulator_config()
    measured, workloads = [], []
    for k in (2, 12):
        wl = reference_workload(WorkloadSpec(prefixes=k, seed=1), enc)  # the reference lengths
        workloads.append(wl)
        # Trial 0 of the simulator's point draws from Random(seed * 1_000_003), one draw per
        # request; so does the balancer, one draw per connection.
        rng = random.Random(1 * 1_000_003)
        balancer = TcpBalancer([("127.0.0.1", w.port) for w in six_workers], rng=rng)
        await balancer.start()
        target = BenchTarget(f"http://127.0.0.1:{balancer.port}", tuple(w.url for w in six_workers), MODEL, "service")
        measured += await run_sweep(target, [wl], BenchOptions(concurrency=(8,), seed=1), sink=ResultsWriter(tmp_path))
        await balancer.close()
    predicted = simulate_points(measured, workloads, config.num_gpu_blocks, config.block_size, "instant", 1, 1)
    assert len(predicted) == 2
    for m, p in zip(measured, predicted):
        t = m.trials[0]
        assert t.failed == 0 and t.requests == max(200, 20 * m.prefixes)
        assert abs(t.request_hit_rate - p.trials[0].request_hit_rate) <= 0.03
        assert abs(t.metrics_token_hit_rate - t.token_hit_rate) <= 0.001
    assert measured[0].trials[0].hits == 190  # K=2: the W·K − K = 10 first contacts miss
    lines = (tmp_path / "records.jsonl").read_text().splitlines()
    assert len(lines) == 2 + 200 + 12 + 240


async def test_hit_measures_agree_exactly_through_a_router_that_refreshes():
    """The workers' counters count a retention router's refreshes too; the bench takes out
    what the router says its refreshes were (prompt and cached tokens, from their answers),
    read once the refreshes settled: the two measures then agree exactly, as they do without
    a router."""
    workers = await start_workers(emulator_config(num_gpu_blocks_override=65, max_model_len=1024), n=2)
    config = RouterConfig(workers=[w.url for w in workers], retention="on", kv_capacity_blocks=64,
                          health_interval_s=0)
    windows = []

    class Windows(TrialSink):
        def trial_done(self, result):
            windows.append(result.window)

    try:
        async with start_router(config) as router:
            wl = reference_workload(small_spec(8, prefix_tokens=LengthDist.fixed(160), requests=60),
                                    PromptEncoder("ids", MODEL))
            target = BenchTarget(router.url, tuple(w.url for w in workers), MODEL, "router")
            (point,) = await run_sweep(target, [wl], BenchOptions(concurrency=(4,), seed=1), sink=Windows())
    finally:
        for w in workers:
            await w.close()
    (t,) = point.trials
    assert t.failed == 0 and t.refreshes > 0
    assert t.metrics_token_hit_rate == pytest.approx(t.token_hit_rate, abs=1e-12)
    # Counted with the refreshes, the counters would say otherwise.
    assert abs(window_token_hit_rate(windows[0]) - t.token_hit_rate) > 0.01


async def test_missing_cached_tokens_is_detected_with_metrics():
    workers = await start_workers(emulator_config(details=False), n=1)
    try:
        url = workers[0].url
        wl = reference_workload(small_spec(2, requests=10), PromptEncoder("ids", MODEL))
        with pytest.raises(UserError, match="--enable-prompt-tokens-details"):
            await run_sweep(BenchTarget(url, (url,), MODEL), [wl], BenchOptions(concurrency=(2,)))
        with pytest.raises(UserError, match="--allow-missing-cached-tokens"):
            await run_sweep(BenchTarget(url, (), MODEL), [wl], BenchOptions(concurrency=(2,)))
        [point] = await run_sweep(
            BenchTarget(url, (url,), MODEL), [wl], BenchOptions(concurrency=(2,), allow_missing_cached_tokens=True)
        )
        t = point.trials[0]
        assert t.hits == 0 and t.metrics_token_hit_rate > 0.5  # the counters still see the hits
    finally:
        for w in workers:
            await w.close()


async def test_failed_requests_stay_in_the_denominator(one_worker):
    """Requests that the server rejects count as failed misses; all failing stops the run."""
    enc = PromptEncoder("ids", MODEL)
    wl = reference_workload(small_spec(2, requests=10), enc)
    bad = reference_workload(small_spec(2, requests=10, prefix_tokens=LengthDist.fixed(5000)), enc)
    wl.requests[3] = bad.requests[3]  # longer than max-model-len: HTTP 400
    [point] = await run_sweep(BenchTarget(one_worker.url, (one_worker.url,), MODEL), [wl], BenchOptions(concurrency=(2,)))
    t = point.trials[0]
    assert (t.requests, t.failed) == (10, 1)
    wrong_model = reference_workload(small_spec(2, requests=10), PromptEncoder("ids", "no-such-model"))
    with pytest.raises(UserError, match="every warmup request failed.*no-such-model"):
        await run_sweep(BenchTarget(one_worker.url, (), "no-such-model"), [wrong_model], BenchOptions(reset=False))


async def test_chat_sessions_reuse_the_previous_turn(one_worker):
    tok = SyntheticTokenizer()
    enc = PromptEncoder("chat", MODEL, tok)
    wl = session_workload(small_spec(2, output_tokens=8), SessionSpec(3, 3, LengthDist.fixed(20)), enc, safe_vocabulary(tok))
    sink = _Collect()
    await BenchRunner(BenchTarget(one_worker.url, (one_worker.url,), MODEL), BenchOptions(concurrency=(3,)), sink).run([wl])
    records = sink.results[0].records
    sent = {r.index: r for r in wl.requests}
    for r in records:
        assert r.ok and r.prompt_tokens == sent[r.index].prompt_tokens  # the template counts exactly
        if sent[r.index].after is not None:
            prev = sent[sent[r.index].after]
            assert r.cached_tokens >= (prev.prompt_tokens // 16 - 1) * 16


async def test_trace_replay_keeps_timestamps_and_session_order(one_worker, tmp_path):
    path = tmp_path / "trace.jsonl"
    lines = [
        {"timestamp": 100.0, "prompt_token_ids": list(range(1000, 1100)), "output_tokens": 3, "session_id": "a"},
        {"timestamp": 100.05, "prompt": "hello there, general", "max_tokens": 2},
        {"timestamp": 100.1, "prompt": list(range(1000, 1150)), "output_tokens": 3, "session_id": "a"},
        {"timestamp": 100.3, "token_ids": list(range(2000, 2040)), "session_id": "b"},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    wl = trace_workload(path, PromptEncoder("ids", MODEL), default_output_tokens=5)
    assert [r.after for r in wl.requests] == [None, None, 0, None]
    sink = _Collect()
    await BenchRunner(BenchTarget(one_worker.url, (one_worker.url,), MODEL), BenchOptions(), sink).run([wl])
    records = sorted(sink.results[0].records, key=lambda r: r.index)
    assert all(r.ok for r in records)
    for r, expected in zip(records, (0.0, 0.05, 0.1, 0.3)):
        assert expected <= r.send_time < expected + 0.05
    assert [r.output_tokens for r in records] == [3, 2, 3, 5]
    assert records[2].cached_tokens == 96  # the first line's 6 full blocks
    assert records[1].prompt_tokens > 0  # a text prompt's length comes from the usage
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 1, "prompt": "x"}\n{"prompt": "no time"}\n')
    with pytest.raises(UserError, match="bad.jsonl:2"):
        trace_workload(bad, PromptEncoder("ids", MODEL))
    bad.write_bytes(b'{"timestamp": 1, "prompt": "\x80"}\n')  # text that is not UTF-8
    with pytest.raises(UserError, match="bad.jsonl:1"):
        trace_workload(bad, PromptEncoder("ids", MODEL))


async def test_open_loop_follows_the_poisson_schedule(one_worker):
    wl = reference_workload(small_spec(2, requests=30), PromptEncoder("ids", MODEL))
    sink = _Collect()
    options = BenchOptions(rate=200.0, seed=5)
    [point] = await BenchRunner(BenchTarget(one_worker.url, (one_worker.url,), MODEL), options, sink).run([wl])
    assert point.concurrency == 0
    offsets = poisson_schedule(30, 200.0, 5)
    records = sorted(sink.results[0].records, key=lambda r: r.index)
    lateness = [r.send_time - o for r, o in zip(records, offsets)]
    assert min(lateness) >= -1e-3 and float(np.median(lateness)) < 0.01
