"""How stale the groups the trainer gets are: for each training group in a fresh batch, the weight
versions between its oldest token and the policy that trains it (0: on-policy). `staleness_stats` gives
one batch's mean and max for its metrics; `StalenessHistogram` counts them over the job.

Kept as counts in fixed buckets (`EDGES`: whole versions, as `le` bounds), so `/metrics` can serve it
as a Prometheus histogram whose buckets never change: the staleness gate keeps values at or below
`max_staleness`, and anything larger (a resumed trainer, a group without tokens) lands in the last
buckets rather than growing the set. A batch sent again (lost reply, resumed trainer) is not counted
twice: only `BrokerState.try_fill_batch` observes.
"""

from __future__ import annotations

from vime.broker.latency import BucketCounts
from vime.protocol.messages import Group

EDGES: tuple[int, ...] = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32)


class StalenessHistogram(BucketCounts):
    def __init__(self) -> None:
        super().__init__(EDGES)

    def status(self) -> dict[str, object]:
        return {"edges": list(EDGES), "counts": list(self.counts), "n": sum(self.counts), "sum": self.sum}


def staleness_stats(groups: list[Group], policy_version: int) -> dict[str, float]:
    """How many versions behind `policy_version` a batch's groups are: mean and max."""
    staleness = [policy_version - g.oldest_version for g in groups]
    return {"staleness_mean": float(sum(staleness) / len(staleness)), "staleness_max": float(max(staleness))}
