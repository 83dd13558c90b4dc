"""The workers a broker knows: role, liveness, credits, and the groups leased to each.

A worker grants credits (one per group it can take at once); `lease_out` is the one lease loop of
rollout and reward work: the worker with the fewest leases first (then the most credits, then the
earliest registered), one credit per group. Taking leases back from a worker that left or went silent
is its owner's job (`BrokerState`), which knows the queue each group returns to. Pure bookkeeping: no
sockets, time passed in.

Scale: with a thousand workers, choosing the next worker by scanning them all, once per leased group,
was most of a loaded broker's time (bench/broker_scale.py). Each role keeps a heap of its workers with
credit, keyed (leases, -credits, registration order); an entry is pushed whenever a worker's key
changes and stale entries are skipped when they surface. So a worker's credits and leases change only
through the registry (`add_credit`, `lease_out`, `end_lease`): a change it does not see would leave the
worker ranked by its old key.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from vime.protocol.messages import Group

# Cumulative heartbeat stats summed over the workers of a role and sent with each batch: the trainer
# logs them so engine idle time and the weight update's parts can be computed over any window of steps.
BATCH_WORKER_STATS = {
    "rollout_busy_s": ("rollout", "busy_s"),
    "rollout_update_s": ("rollout", "update_s"),
    "rollout_fetch_s": ("rollout", "fetch_s"),
    "rollout_load_s": ("rollout", "load_s"),
    "rollout_paused_s": ("rollout", "paused_s"),
    "rollout_update_bytes": ("rollout", "update_bytes"),
    "rollout_updates": ("rollout", "updates"),
    "rollout_tokens": ("rollout", "tokens"),
    "reward_busy_s": ("reward", "busy_s"),
}


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
    metrics_url: str | None = None  # where the worker serves Prometheus /metrics (its Hello says)
    requeued: int = 0  # leased groups put back in a queue when this registration ended (for the log)
    # When each unspent credit arrived, oldest first (what the dispatch latency counts from).
    credit_times: deque[float] = field(default_factory=deque, repr=False, compare=False)
    # The registry's ticket for this worker's current heap entry: a key change takes a new ticket.
    ticket: int = field(default=0, repr=False, compare=False)


SPENT_CREDIT_TIMES_KEPT = 1 << 16

# A role's heap entry: (leases, -credits, registration order, ticket, identity).
_Entry = tuple[int, int, int, int, bytes]


class WorkerRegistry:
    def __init__(self) -> None:
        self.workers: dict[bytes, WorkerInfo] = {}
        self._by_role: dict[str, dict[bytes, WorkerInfo]] = {}
        # Registration order (the order of `workers`, which a re-registration keeps): the last tie-break.
        self._order: dict[bytes, int] = {}
        self._next_order = 0
        self._heaps: dict[str, list[_Entry]] = {}
        self._tickets = 0
        # Arrival times of credits spent since the server last took them; bounded, for callers (tests,
        # simulators) that never do.
        self._spent_credit_times: dict[str, deque[float]] = {}

    def __iter__(self) -> Iterator[WorkerInfo]:
        return iter(list(self.workers.values()))

    def register(
        self, identity: bytes, worker_id: str, role: str, now: float, weight_version: int = -1, metrics_url: str | None = None
    ) -> WorkerInfo | None:
        """Add (or replace) a registration; returns the one it replaced, whose leases the caller takes back."""
        old = self.workers.get(identity)
        worker = WorkerInfo(identity, worker_id, role, now, weight_version=weight_version, metrics_url=metrics_url)
        self.workers[identity] = worker
        if identity not in self._order:
            self._order[identity] = self._next_order
            self._next_order += 1
        if old is not None:
            self._detach(old)
            if old.role != role:
                self._by_role[old.role].pop(identity, None)
        members = self._by_role.setdefault(role, {})
        members[identity] = worker
        if old is not None and old.role != role:
            # Keep a role's listing in registration order, as a scan of `workers` would give it.
            self._by_role[role] = dict(sorted(members.items(), key=lambda item: self._order[item[0]]))
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
        worker = self.workers.pop(identity, None)
        if worker is not None:
            self._order.pop(identity, None)
            self._by_role[worker.role].pop(identity, None)
            self._detach(worker)
        return worker

    def _detach(self, worker: WorkerInfo) -> None:
        """A registration that ended: its heap entries go stale."""
        self._tickets += 1
        worker.ticket = self._tickets

    def silent(self, now: float, timeout_s: float) -> list[WorkerInfo]:
        """Workers not heard from for longer than `timeout_s`."""
        return [w for w in self.workers.values() if now - w.last_seen > timeout_s]

    def add_credit(self, identity: bytes, n: int, now: float = 0.0) -> None:
        worker = self.workers[identity]
        worker.credits += n
        worker.credit_times.extend([now] * max(0, n))
        self._rank(worker)

    def take_spent_credit_times(self, role: str) -> list[float]:
        """When the credits spent by `lease_out` since the last call arrived (for the dispatch latency;
        at most the newest SPENT_CREDIT_TIMES_KEPT)."""
        return list(self._spent_credit_times.pop(role, ()))

    def end_lease(self, identity: bytes, group_id: str) -> None:
        """A leased group's result arrived (or the lease was taken back): the worker may rank higher."""
        worker = self.workers.get(identity)
        if worker is not None and group_id in worker.leased:
            worker.leased.discard(group_id)
            self._rank(worker)

    def of_role(self, role: str) -> list[WorkerInfo]:
        return list(self._by_role.get(role, {}).values())

    def sum_stat(self, role: str, key: str) -> float:
        """The sum of one heartbeat stat over the workers of a role."""
        return float(sum(float(w.stats.get(key, 0.0)) for w in self.of_role(role)))

    def batch_stats(self) -> dict[str, float]:
        """`BATCH_WORKER_STATS`, summed over the workers now registered."""
        return {key: self.sum_stat(role, stat) for key, (role, stat) in BATCH_WORKER_STATS.items()}

    def _rank(self, worker: WorkerInfo) -> None:
        """The worker's key changed: its older entries go stale, and it gets a new one if it has credit."""
        self._tickets += 1
        worker.ticket = self._tickets
        if worker.credits > 0 and self.workers.get(worker.identity) is worker:
            heap = self._heaps.setdefault(worker.role, [])
            if len(heap) > 4 * len(self._by_role.get(worker.role, ())) + 64:
                self._rebuild(worker.role)  # stale entries that never surfaced
            heapq.heappush(heap, self._entry(worker))

    def _rebuild(self, role: str) -> None:
        heap = [self._entry(w) for w in self._by_role.get(role, {}).values() if w.credits > 0]
        heapq.heapify(heap)
        self._heaps[role] = heap

    def _entry(self, worker: WorkerInfo) -> _Entry:
        return (len(worker.leased), -worker.credits, self._order[worker.identity], worker.ticket, worker.identity)

    def with_credit(self, role: str) -> WorkerInfo | None:
        """The `role` worker with credit and the fewest leases (spreads work evenly), or None."""
        heap = self._heaps.get(role)
        while heap:
            leases, neg_credits, _, ticket, identity = heap[0]
            worker = self.workers.get(identity)
            if worker is not None and worker.ticket == ticket and worker.role == role:
                if worker.credits > 0 and leases == len(worker.leased) and -neg_credits == worker.credits:
                    return worker
                # Changed behind the registry's back: re-rank (see the module docstring).
                heapq.heappop(heap)
                self._rank(worker)
                continue
            heapq.heappop(heap)
        return None

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
            if worker.credit_times:
                spent = self._spent_credit_times.get(role)
                if spent is None:
                    spent = self._spent_credit_times[role] = deque(maxlen=SPENT_CREDIT_TIMES_KEPT)
                spent.append(worker.credit_times.popleft())
            worker.leased.add(group.group_id)
            self._rank(worker)
            leases[group.group_id] = (group, worker.identity)
            batches.setdefault(worker.identity, []).append(group)
        return batches
