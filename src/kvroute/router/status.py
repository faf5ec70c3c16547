"""What a running router shows about itself: each worker's state (:class:`WorkerStatus`) and
any metric's value read from its ``/metrics`` text (:func:`metric_value`). Tests, benchmarks
and the soak run read the router through these."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    """One worker as the router sees it now.

    Attributes:
        name: its name (the URL unless discovery knows better).
        ready: discovery says it takes new requests.
        healthy: passed its last health check and accepted its last connection.
        available: may take a new request (ready, healthy and not ejected).
        in_flight: requests routed to it and not finished.
        in_flight_tokens: their prompt tokens still to prefill.
        consecutive_failures: failed requests since its last success (0 where not tracked).
    """

    name: str
    ready: bool
    healthy: bool
    available: bool
    in_flight: int
    in_flight_tokens: int
    consecutive_failures: int = 0


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of sample ``name`` (as exposed: ``kvroute_router_retries_total``) with exactly
    ``labels`` in the Prometheus ``text``; 0 when it has no such sample (a counter not yet
    incremented)."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return 0.0
