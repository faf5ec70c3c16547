"""A trace through the simulator: every request at its own arrival time (open loop) on
simulated workers behind a policy, with the engine model's cache and its cost model's time.

Each request's prompt is the trace's synthesized tokens (equal hash ids, equal tokens), sent
at ``arrival_s / time_scale``; a request whose prompt and output do not fit the workers'
``max_model_len`` is refused as vLLM refuses it, and counted, never silently dropped. There is
no warmup: a trace starts from empty caches, as the analysis of ``kvroute predict --trace``
does.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from kvroute import _native
from kvroute.records import RequestRecord, TrialStats, summarize
from kvroute.routing.policies import Policy, make_policy, policy_parameters
from kvroute.sim import Simulation, WorkerConfig, trial_seed
from kvroute.trace.format import Trace


@dataclass
class TraceRun:
    """One policy's replay of a trace.

    Attributes:
        records: the requests simulated, in arrival order (``index`` is the position in the
            trace).
        refused: requests longer than ``max_model_len`` (not sent).
        duration_s: first send to last completion, simulated seconds.
    """

    records: list[RequestRecord]
    refused: int
    duration_s: float
    #: Retention's refreshes: requests, engine seconds they added.
    refreshes: int = 0
    refresh_engine_s: float = 0.0

    def stats(self) -> TrialStats:
        stats = summarize(self.records, self.duration_s, None)
        stats.refreshes = self.refreshes
        stats.refresh_engine_s = self.refresh_engine_s
        return stats


def trace_policy(name: str, seed: int, block_size: int, options: dict | None = None) -> Policy:
    """The policy ``name`` as a trace replay runs it: seeded as the simulator's first trial
    (the seed a Service balancer is reseeded with for that trial), with the workers' block
    size where the policy hashes blocks (as ``kvroute serve`` sets it)."""
    opts = dict(options or {})
    if "block_size" in policy_parameters(name):
        opts.setdefault("block_size", block_size)
    return make_policy(name, rng=random.Random(trial_seed(seed, 0)), **opts)


@dataclass
class TraceInputs:
    """A trace's requests as the simulator takes them, built once and shared by every
    policy's replay of it: the prompts live in a native table (synthesized there for a
    Mooncake trace) that each replay holds by reference instead of copying.

    Attributes:
        prompts: the prompts sent, in arrival order.
        indices: each sent request's position in the trace.
        output_tokens: each sent request's output length (uint32).
        send_times: their send times (seconds, time-scaled).
        refused: requests longer than ``max_model_len`` (not sent).
        output: the tokens every request generates (the first ``output_tokens`` of them).
    """

    prompts: _native.PromptTable
    indices: list[int]
    output_tokens: np.ndarray
    send_times: list[float]
    refused: int
    output: np.ndarray


def trace_inputs(trace: Trace, max_model_len: int, time_scale: float = 1.0) -> TraceInputs:
    """``trace``'s requests for :func:`simulate_trace`; a request whose prompt and output do
    not fit ``max_model_len`` is refused (counted, not sent)."""
    sent = [
        (i, r) for i, r in enumerate(trace.requests)
        if r.input_length + r.output_length <= max_model_len and r.output_length >= 1
    ]
    requests = [r for _, r in sent]
    if all(r.prompt_ids is None and r.hash_ids is not None for r in requests):
        chains = [r.hash_ids for r in requests]
        offsets = np.zeros(len(chains) + 1, dtype=np.uint64)
        np.cumsum(np.fromiter(map(len, chains), dtype=np.uint64, count=len(chains)), out=offsets[1:])
        prompts = _native.PromptTable.from_trace(
            np.fromiter((h for chain in chains for h in chain), dtype=np.uint64, count=int(offsets[-1])),
            offsets, np.fromiter((r.input_length for r in requests), dtype=np.uint64, count=len(requests)),
            np.asarray(trace.vocab, dtype=np.uint32), trace.seed,
        )
    else:  # a kvroute trace's own token ids (or a text prompt: refused there with its line)
        prompts = _native.PromptTable([trace.prompt_tokens(r) for r in requests])
    output_tokens = np.fromiter((r.output_length for r in requests), dtype=np.uint32, count=len(requests))
    output = np.resize(trace.vocab, int(output_tokens.max(initial=1))).astype(np.uint32)
    return TraceInputs(prompts, [i for i, _ in sent], output_tokens,
                       [r.arrival_s / time_scale for r in requests], len(trace.requests) - len(sent), output)


def simulate_trace(
    trace: Trace, workers: int, config: WorkerConfig, policy: Policy, max_model_len: int,
    time_scale: float = 1.0, inputs: TraceInputs | None = None, retention: str = "off",
) -> TraceRun:
    """Replay ``trace`` open loop on ``workers`` simulated workers behind ``policy`` (with
    ``retention``: see ``kvroute.sim.Simulation``; its refreshes in ``TraceRun.refreshes``;
    ``inputs``: the trace's ``trace_inputs`` for these ``max_model_len`` and
    ``time_scale``, when several replays share them). The native run lets go of the
    interpreter, so replays in other threads run meanwhile."""
    if inputs is None:
        inputs = trace_inputs(trace, max_model_len, time_scale)
    if not inputs.indices:
        return TraceRun([], inputs.refused, 0.0)
    sim = Simulation(workers, config, policy, retention=retention)
    records = sim.replay(inputs.prompts, inputs.indices, inputs.output_tokens, inputs.output, inputs.send_times)
    return TraceRun(records, inputs.refused, sim.now - inputs.send_times[0],
                    sim.refresh_stats["requests"], sim.refresh_stats["engine_s"])
