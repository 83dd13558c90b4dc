"""How long a rollout worker's credit waits in the broker before a group is dispatched on it.

Measured inside the broker: from the loop turn that received the credit to the send of the
DispatchGroups that spends it. Credits that wait because admission (the staleness bound) or the end of
training holds work back count too, so under a saturated bound the figure is the bound's doing, not the
loop's. Kept as a cumulative histogram with log-spaced buckets (four per doubling, 19 % wide, from
0.05 ms to about 30 s): cheap to update per dispatch, bounded in size, and two readings taken apart give
the percentiles of the window between them (bench/broker_scale.py does this).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

_FIRST_EDGE_S = 50e-6
_PER_DOUBLING = 4
_EDGES_S: tuple[float, ...] = tuple(_FIRST_EDGE_S * 2 ** (k / _PER_DOUBLING) for k in range(78))


class BucketCounts:
    """Counts of observed values in fixed buckets and their sum: `counts[i]` holds the values at most
    `edges[i]` (and above the edge before), the last count those above every edge. Fixed buckets keep it
    bounded and cheap per observation; Prometheus histograms carry the same counts and sum."""

    def __init__(self, edges: Sequence[float]) -> None:
        self.edges = tuple(edges)
        self.counts = [0] * (len(self.edges) + 1)
        self.sum: float = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.edges, value)] += 1
        self.sum += value


class LatencyHistogram(BucketCounts):
    def __init__(self) -> None:
        super().__init__(_EDGES_S)

    def status(self) -> dict[str, object]:
        """Cumulative counts (for differences over a window) with the bucket edges, and the percentiles
        since the broker started."""
        return {
            "edges_ms": [round(e * 1e3, 4) for e in _EDGES_S],
            "counts": list(self.counts),
            "n": sum(self.counts),
            "sum_s": self.sum,
            "p50_ms": percentile_ms(self.counts, 0.50),
            "p99_ms": percentile_ms(self.counts, 0.99),
        }


def percentile_ms(counts: Sequence[int], q: float) -> float | None:
    """The upper edge of the bucket holding the q-quantile (an upper bound, within one bucket's 19 %),
    in milliseconds; None for no observations, inf when it lies above the last edge."""
    total = sum(counts)
    if total == 0:
        return None
    rank = q * total
    seen = 0
    for edge, count in zip((*_EDGES_S, float("inf")), counts):
        seen += count
        if seen >= rank:
            return round(edge * 1e3, 4)
    return float("inf")
