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

from kvroute.records import RequestRecord, TrialStats, summarize
from kvroute.routing.policies import Policy, make_policy, policy_parameters
from kvroute.sim import Simulation, WorkerConfig, trial_seed
from kvroute.trace.format import Trace
from kvroute.workload import RequestSpec

_EMPTY = np.zeros(0, dtype=np.uint32)


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


def simulate_trace(
    trace: Trace, workers: int, config: WorkerConfig, policy: Policy, max_model_len: int,
    time_scale: float = 1.0, retention: str = "off",
) -> TraceRun:
    """Replay ``trace`` open loop on ``workers`` simulated workers behind ``policy`` (with
    ``retention``: see ``kvroute.sim.Simulation``; its refreshes in ``TraceRun.refreshes``)."""
    sent: list[RequestSpec] = []
    times: list[float] = []
    refused = 0
    longest_output = 1
    for i, request in enumerate(trace.requests):
        if request.input_length + request.output_length > max_model_len or request.output_length < 1:
            refused += 1
            continue
        prompt = trace.prompt_tokens(request)
        sent.append(RequestSpec(i, 0, _EMPTY, prompt, request.output_length))
        times.append(request.arrival_s / time_scale)
        longest_output = max(longest_output, request.output_length)
    if not sent:
        return TraceRun([], refused, 0.0)
    output = np.resize(trace.vocab, longest_output).astype(np.uint32)
    sim = Simulation(workers, config, policy, retention=retention)
    records = sim.run(sent, 0, output, send_times=times)
    return TraceRun(records, refused, sim.now - times[0],
                    sim.refresh_stats["requests"], sim.refresh_stats["engine_s"])
