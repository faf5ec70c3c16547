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


@dataclass
class TraceInputs:
    """A trace's requests as the simulator takes them, built once and shared by every
    policy's replay of it (the synthesized prompts of a long trace are most of a replay's
    Python time): each prompt is its request's own "prefix", so the native engines hold it
    once, by reference, instead of copying it per request.

    Attributes:
        requests: the requests sent, in arrival order.
        send_times: their send times (seconds, time-scaled).
        refused: requests longer than ``max_model_len`` (not sent).
        output: the tokens every request generates (the first ``output_tokens`` of them).
    """

    requests: list[RequestSpec]
    send_times: list[float]
    refused: int
    output: np.ndarray


def trace_inputs(trace: Trace, max_model_len: int, time_scale: float = 1.0) -> TraceInputs:
    """``trace``'s requests for :func:`simulate_trace`; a request whose prompt and output do
    not fit ``max_model_len`` is refused (counted, not sent)."""
    sent: list[RequestSpec] = []
    times: list[float] = []
    refused = 0
    longest_output = 1
    for i, request in enumerate(trace.requests):
        if request.input_length + request.output_length > max_model_len or request.output_length < 1:
            refused += 1
            continue
        prompt = trace.prompt_tokens(request)
        sent.append(RequestSpec(i, len(sent), prompt, _EMPTY, request.output_length))
        times.append(request.arrival_s / time_scale)
        longest_output = max(longest_output, request.output_length)
    output = np.resize(trace.vocab, longest_output).astype(np.uint32)
    return TraceInputs(sent, times, refused, output)


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
    if not inputs.requests:
        return TraceRun([], inputs.refused, 0.0)
    sim = Simulation(workers, config, policy, retention=retention)
    records = sim.run(inputs.requests, 0, inputs.output, send_times=inputs.send_times)
    for record in records:
        record.prefix_id = 0  # a trace has no shared prefix ids (each prompt was its own)
    return TraceRun(records, inputs.refused, sim.now - inputs.send_times[0],
                    sim.refresh_stats["requests"], sim.refresh_stats["engine_s"])
