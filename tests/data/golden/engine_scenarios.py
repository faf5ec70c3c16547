"""Golden traces of the engine model: the scenarios, the driver, and the recorder.

The traces in ``engine_*.json`` were recorded from the pure-Python engine (``BlockPool`` and the
scheduler of ``kvroute.engine`` before they moved to ``kvroute-core``) and
``tests/unit/test_engine_golden.py`` (through the Python bindings) and
``crates/kvroute-sim/tests/engine_golden`` (the Rust engine, with this driver and the workload
generator ported) replay them against today's engine, requiring exact equality.
So this file must keep driving an engine exactly as it did when the traces were recorded:
change a scenario or the driver and the traces mean nothing.

The scenarios are the entries of ``engine_scenarios.json``. Each drives ONE engine
(``emit_events=True``) with a seeded workload from
``concurrency`` closed-loop clients: a client adds its next request the moment its previous one
finishes (or is aborted), at the end of that step. Optional turns: warmup requests one at a
time first, a prefix-cache reset between warmup and the measured requests, aborts of a random
in-flight request every few steps, multi-turn sessions (a client's next prompt is its previous
prompt + output + new tokens), and per-request output lengths. Recorded per request: cached
tokens, first-token and finish time, preemptions, tokens generated; per step: prefill tokens,
decoding sequences and a digest of the KV events (type, block hashes, parent, token count and
token digest of every event); at the end the engine's counters and the cached hashes.

Re-recorded once, from the native engine, when the model's free order changed deliberately to
vLLM 0.32's (a freed block that holds no hash goes to the head of the free queue;
tests/vllm/test_engine_parity.py then agreed with real vLLM request for request). Re-record
only for such a change, with its reason in the commit:

    python tests/data/golden/engine_scenarios.py
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvroute.blocks import BlockHasher
from kvroute.engine import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CostModel,
    Engine,
    EngineRequest,
)
from kvroute.workload import LengthDist, WorkloadSpec, generate

HERE = Path(__file__).parent


@dataclass(frozen=True)
class Scenario:
    """One scenario of ``engine_scenarios.json`` (its ``defaults`` fill what an entry leaves
    out; ``crates/kvroute-sim/tests/engine_golden`` reads the same file)."""

    name: str
    seed: int
    prefixes: int
    num_blocks: int
    concurrency: int
    prefix_tokens: str
    suffix_tokens: str
    output_tokens: int
    #: Each request generates a seeded number of tokens in [1, output_tokens].
    vary_output: bool
    requests: int
    zipf_alpha: float
    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    enable_caching: bool
    #: Send the warmup (one request per prefix) one at a time first.
    warmup: bool
    #: Reset the prefix cache between warmup and measured requests (the engine is idle then).
    reset_after_warmup: bool
    #: Abort a random in-flight request every this many steps (0: never).
    abort_every: int
    #: Try a prefix-cache reset every this many steps (refused while requests hold blocks).
    reset_every: int
    #: A client's next prompt continues its last one (prompt + output + a new suffix).
    multi_turn: bool
    step_base_s: float
    prefill_token_s: float
    decode_seq_s: float


def _load_scenarios() -> list[Scenario]:
    table = json.loads((HERE / "engine_scenarios.json").read_text())
    return [Scenario(**{**table["defaults"], **entry}) for entry in table["scenarios"]]


#: The reference shapes (2,032-token prefixes, 339-token suffixes, 64 output tokens); a small
#: KV cache (eviction and preemption); Zipf popularity and mixed lengths with chunked prefill
#: through a small token budget; aborts and resets; multi-turn sessions (generated tokens
#: become later prompts' cached prefix); block size 4 without caching, and short everything.
SCENARIOS = _load_scenarios()


def _digest(values) -> str:
    return hashlib.sha1(np.asarray(values, dtype=np.uint64).tobytes()).hexdigest()[:16]


def _event_digest(events) -> tuple[int, int, str]:
    """(blocks stored, blocks removed, digest of every event's type, hashes, parent, tokens)."""
    h = hashlib.sha1()
    stored = removed = 0
    for e in events:
        if isinstance(e, BlockStored):
            stored += len(e.block_hashes)
            parent = -1 if e.parent_block_hash is None else e.parent_block_hash
            h.update(f"S{_digest(e.block_hashes)}:{parent}:{len(e.token_ids)}:"
                     f"{_digest(e.token_ids)}:{e.block_size};".encode())
        elif isinstance(e, BlockRemoved):
            removed += len(e.block_hashes)
            h.update(f"R{_digest(e.block_hashes)};".encode())
        elif isinstance(e, AllBlocksCleared):
            h.update(b"C;")
        else:
            raise TypeError(f"unexpected event {e!r}")
    return stored, removed, h.hexdigest()[:16] if events else ""


def run(s: Scenario) -> dict:
    """Drive one engine through scenario ``s``; return its trace (JSON-ready)."""
    spec = WorkloadSpec(
        prefixes=s.prefixes,
        prefix_tokens=LengthDist.parse(s.prefix_tokens),
        suffix_tokens=LengthDist.parse(s.suffix_tokens),
        output_tokens=s.output_tokens,
        requests=s.requests,
        zipf_alpha=s.zipf_alpha,
        seed=s.seed,
    )
    work = generate(spec)
    rng = random.Random(s.seed)
    cost = CostModel("golden", s.step_base_s, s.prefill_token_s, s.decode_seq_s, 0.0,
                     max_num_batched_tokens=s.max_num_batched_tokens, max_num_seqs=s.max_num_seqs)
    engine = Engine(s.num_blocks, s.block_size, cost, BlockHasher(s.block_size),
                    enable_caching=s.enable_caching, emit_events=True)
    vocab = work.vocab
    steps: list[list] = []
    records: dict[str, list] = {}
    resets: list[list] = []
    now = 0.0
    # Clients' last prompt + output, for multi-turn.
    history: dict[int, np.ndarray] = {}
    in_flight: dict[str, tuple[EngineRequest, int]] = {}

    def make(i: int, spec_, client: int) -> EngineRequest:
        n_out = rng.randint(1, s.output_tokens) if s.vary_output else s.output_tokens
        out = vocab[rng.randrange(len(vocab) - n_out):][:n_out]
        prompt = spec_.prompt_token_ids
        if s.multi_turn and client in history:
            prompt = np.concatenate((history[client], spec_.suffix))
            if len(prompt) + n_out > (s.num_blocks - 1) * s.block_size:
                prompt = spec_.prompt_token_ids  # the session would no longer fit: a new one
        req = EngineRequest(str(i), prompt, out, now)
        return req

    def drain_one_at_a_time(specs) -> None:
        nonlocal now
        for k, sp in enumerate(specs):
            req = make(-1 - k, sp, -1)
            req.request_id = f"w{k}"
            engine.add_request(req)
            while engine.has_work:
                step_once()

    def step_once() -> list[EngineRequest]:
        nonlocal now
        result = engine.step(now)
        events = result.events.events if result.events is not None else []
        assert result.events is None or result.events.ts == result.end
        steps.append([result.prefill_tokens, result.decode_seqs, *_event_digest(events)])
        now = result.end
        done = []
        for o in result.outputs:
            if o.finished:
                r = o.request
                records[r.request_id] = [r.num_cached_tokens, r.first_token_time, r.finish_time,
                                         r.num_preemptions, r.num_output, len(r.prompt_token_ids)]
                done.append(r)
        return done

    if s.warmup:
        drain_one_at_a_time(work.warmup)
    if s.reset_after_warmup:
        resets.append([len(steps), engine.reset_prefix_cache()])
    pending = list(enumerate(work.requests))
    pending.reverse()

    def send(client: int) -> None:
        if not pending:
            return
        i, sp = pending.pop()
        req = make(i, sp, client)
        engine.add_request(req)
        in_flight[req.request_id] = (req, client)

    for c in range(s.concurrency):
        send(c)
    guard = 0
    while engine.has_work:
        guard += 1
        assert guard < 200_000, "stalled"
        for r in step_once():
            _, client = in_flight.pop(r.request_id)
            if s.multi_turn:
                history[client] = np.concatenate((r.prompt_token_ids, r.output_token_ids[: r.num_output]))
            send(client)
        if s.abort_every and len(steps) % s.abort_every == 0 and in_flight:
            rid = rng.choice(sorted(in_flight, key=lambda x: int(x)))
            req, client = in_flight.pop(rid)
            assert engine.abort_request(rid)
            records[rid] = ["aborted", req.num_cached_tokens, req.num_preemptions, req.num_output]
            send(client)
        if s.reset_every and len(steps) % s.reset_every == 0:
            resets.append([len(steps), engine.reset_prefix_cache()])
    st = engine.stats
    return {
        "scenario": s.name,
        "records": records,
        "steps": steps,
        "resets": resets,
        "stats": [st.requests, st.queries, st.hits, st.preempted_requests, st.preempted_queries,
                  st.preempted_hits],
        "totals": [engine.num_preemptions, engine.prompt_tokens_total, engine.generation_tokens_total],
        "free_blocks": engine.pool.num_free_blocks,
    }


def path_of(s: Scenario) -> Path:
    return HERE / f"engine_{s.name}.json"


def main(names: list[str]) -> None:
    for s in SCENARIOS:
        if names and s.name not in names:
            continue
        trace = run(s)
        path_of(s).write_text(json.dumps(trace, separators=(",", ":")) + "\n")
        pre = sum(r[3] for r in trace["records"].values() if r[0] != "aborted")
        print(f"{s.name}: {len(trace['records'])} requests, {len(trace['steps'])} steps, "
              f"{pre} preemptions, hits {trace['stats'][2]}/{trace['stats'][1]}, "
              f"resets {trace['resets'][:3]}, {path_of(s).stat().st_size} bytes")


if __name__ == "__main__":
    main(sys.argv[1:])
