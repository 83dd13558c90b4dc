"""Groups between admission and the buffer, in the order they move: to generate again, generating
(leased to a rollout worker), waiting for a reward worker, scoring (leased to a reward worker).

A lease is (group, the worker's identity): a result counts only from the worker that holds the lease,
so a late duplicate (a worker that was presumed dead, then answered) is told apart and dropped by the
caller. Not journaled: after a restart these groups are rebuilt from the admission ledger (recovery).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator

from vime.protocol.messages import Group

Lease = tuple[Group, bytes]


class GroupsInFlight:
    def __init__(self) -> None:
        self.retry: deque[Group] = deque()  # generated again first (a lease given back), before new admissions
        self.generating: dict[str, Lease] = {}
        self.to_score: deque[Group] = deque()
        self.scoring: dict[str, Lease] = {}

    def generated(self, identity: bytes, group_id: str) -> Group | None:
        """End the generation lease of `group_id` held by `identity`; the group as leased, or None when
        `identity` does not hold it (a late duplicate)."""
        lease = self.generating.get(group_id)
        if lease is None or lease[1] != identity:
            return None
        del self.generating[group_id]
        return lease[0]

    def scoring_lease(self, identity: bytes, group_id: str) -> Group | None:
        """The group `identity` is scoring under `group_id` (lease kept), or None when it holds no such lease."""
        lease = self.scoring.get(group_id)
        return None if lease is None or lease[1] != identity else lease[0]

    def release(self, group_ids: Iterable[str]) -> tuple[list[Group], int]:
        """Take back the leases of `group_ids` (a worker gone), in the order given: groups being scored go
        back to the front of the scoring queue; groups being generated are returned, emptied, for the caller
        to queue again. Returns those and how many leases were taken back."""
        regenerate, released = [], 0
        for group_id in group_ids:
            if group_id in self.generating:
                group, _ = self.generating.pop(group_id)
                group.samples = []
                regenerate.append(group)
                released += 1
            elif group_id in self.scoring:
                group, _ = self.scoring.pop(group_id)
                self.to_score.appendleft(group)
                released += 1
        return regenerate, released

    def groups(self) -> Iterator[Group]:
        """Every group in flight."""
        yield from self.retry
        yield from (group for group, _ in self.generating.values())
        yield from self.to_score
        yield from (group for group, _ in self.scoring.values())

    def ids(self) -> set[str]:
        return {group.group_id for group in self.groups()}

    def sizes(self) -> dict[str, int]:
        return {"retry": len(self.retry), "generating": len(self.generating), "to_score": len(self.to_score),
                "scoring": len(self.scoring)}  # fmt: skip
