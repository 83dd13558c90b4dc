"""The workers a broker knows: role, liveness, credits, and the groups leased to each.

A worker grants credits (one per group it can take at once); `lease_out` is the one lease loop of
rollout and reward work: the worker with the fewest leases first, one credit per group. Taking leases
back from a worker that left or went silent is its owner's job (`BrokerState`), which knows the queue
each group returns to. Pure bookkeeping: no sockets, time passed in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from vime.protocol.messages import Group


@dataclass
class WorkerInfo:
    identity: bytes
    worker_id: str
    role: str
    last_seen: float
    credits: int = 0
    weight_version: int = -1
    leased: set[str] = field(default_factory=set)
    stats: dict[str, Any] = field(default_factory=dict)
    requeued: int = 0  # leased groups put back in a queue when this registration ended (for the log)


class WorkerRegistry:
    def __init__(self) -> None:
        self.workers: dict[bytes, WorkerInfo] = {}

    def __iter__(self) -> Iterator[WorkerInfo]:
        return iter(list(self.workers.values()))

    def register(self, identity: bytes, worker_id: str, role: str, now: float, weight_version: int = -1) -> WorkerInfo | None:
        """Add (or replace) a registration; returns the one it replaced, whose leases the caller takes back."""
        old = self.workers.get(identity)
        self.workers[identity] = WorkerInfo(identity, worker_id, role, now, weight_version=weight_version)
        return old

    def get(self, identity: bytes) -> WorkerInfo | None:
        return self.workers.get(identity)

    def touch(self, identity: bytes, now: float, weight_version: int | None = None, stats: dict[str, Any] | None = None) -> bool:
        """Record that a worker is alive; False if it is unknown (it must say Hello again)."""
        worker = self.workers.get(identity)
        if worker is None:
            return False
        worker.last_seen = now
        if weight_version is not None and weight_version >= 0:
            worker.weight_version = weight_version
        if stats:
            worker.stats.update(stats)
        return True

    def remove(self, identity: bytes) -> WorkerInfo | None:
        return self.workers.pop(identity, None)

    def silent(self, now: float, timeout_s: float) -> list[WorkerInfo]:
        """Workers not heard from for longer than `timeout_s`."""
        return [w for w in self.workers.values() if now - w.last_seen > timeout_s]

    def add_credit(self, identity: bytes, n: int) -> None:
        self.workers[identity].credits += n

    def of_role(self, role: str) -> list[WorkerInfo]:
        return [w for w in self.workers.values() if w.role == role]

    def sum_stat(self, role: str, key: str) -> float:
        """The sum of one heartbeat stat over the workers of a role."""
        return float(sum(float(w.stats.get(key, 0.0)) for w in self.of_role(role)))

    def with_credit(self, role: str) -> WorkerInfo | None:
        """The `role` worker with credit and the fewest leases (spreads work evenly), or None."""
        candidates = [w for w in self.workers.values() if w.role == role and w.credits > 0]
        if not candidates:
            return None
        return min(candidates, key=lambda w: (len(w.leased), -w.credits))

    def lease_out(
        self, role: str, take: Callable[[], Group | None], leases: dict[str, tuple[Group, bytes]]
    ) -> dict[bytes, list[Group]]:
        """While a `role` worker has credit and `take` gives a group, lease the group to it for one
        credit and record the lease in `leases`. Returns the groups per worker, in order."""
        batches: dict[bytes, list[Group]] = {}
        while (worker := self.with_credit(role)) is not None:
            group = take()
            if group is None:
                break
            worker.credits -= 1
            worker.leased.add(group.group_id)
            leases[group.group_id] = (group, worker.identity)
            batches.setdefault(worker.identity, []).append(group)
        return batches
