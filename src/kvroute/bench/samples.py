"""What a bench run keeps of its requests for the plots: the TTFTs of each point's measured
requests, and an open-loop replay's requests over time."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvroute.records import RequestRecord

#: An open-loop replay's measured requests (its first trial), by (fleet size, topology): what
#: the plots over time draw.
Timelines = dict[tuple[int, str], list[RequestRecord]]


@dataclass
class PointSamples:
    """TTFTs of one point's measured requests (all trials), split by hit and miss, for the
    CDF plot."""

    hit: list[float] = field(default_factory=list)
    miss: list[float] = field(default_factory=list)

    def add(self, records: list[RequestRecord]) -> None:
        """The TTFTs of ``records`` that were answered, each to its side."""
        for r in records:
            if r.ok and r.ttft_s is not None:
                (self.hit if r.hit else self.miss).append(r.ttft_s)
