"""The broker's worker registry: credits, liveness and the one lease loop of rollout and reward work."""

from __future__ import annotations

from collections import deque

import numpy as np

from vime.broker.workers import WorkerRegistry
from vime.protocol.messages import Group


def groups(n: int) -> deque[Group]:
    return deque(Group(f"g{i}", i, 0, np.arange(2, dtype=np.int32), "p", 2) for i in range(n))


def test_lease_out_spreads_work_over_workers_one_credit_a_group() -> None:
    registry = WorkerRegistry()
    for identity in (b"a", b"b"):
        registry.register(identity, identity.decode(), "rollout", now=0.0)
    registry.register(b"w", "w", "reward", now=0.0)
    registry.add_credit(b"a", 3)
    registry.add_credit(b"b", 1)
    registry.add_credit(b"w", 5)  # another role's credit is not used
    queue, leases = groups(10), {}
    batches = registry.lease_out("rollout", lambda: queue.popleft() if queue else None, leases)
    assert {k: [g.group_id for g in v] for k, v in batches.items()} == {b"a": ["g0", "g2", "g3"], b"b": ["g1"]}
    assert {g: owner for g, (_, owner) in leases.items()} == {"g0": b"a", "g1": b"b", "g2": b"a", "g3": b"a"}
    assert registry.get(b"a").leased == {"g0", "g2", "g3"} and registry.get(b"a").credits == 0  # type: ignore[union-attr]
    assert len(queue) == 6  # nothing taken that no worker could hold


def test_lease_out_stops_when_there_is_nothing_to_take_and_keeps_the_credits() -> None:
    registry = WorkerRegistry()
    registry.register(b"w", "w", "reward", now=0.0)
    registry.add_credit(b"w", 4)
    queue, leases = groups(1), {}
    registry.lease_out("reward", lambda: queue.popleft() if queue else None, leases)
    assert list(leases) == ["g0"] and registry.get(b"w").credits == 3  # type: ignore[union-attr]


def test_liveness_reregistration_and_stats() -> None:
    registry = WorkerRegistry()
    assert registry.register(b"r", "r-1", "rollout", now=0.0) is None
    assert not registry.touch(b"x", now=1.0)  # unknown: must say Hello again
    assert registry.touch(b"r", now=5.0, weight_version=3, stats={"busy_s": 2.0})
    registry.register(b"r2", "r-2", "rollout", now=0.0)
    registry.touch(b"r2", now=0.0, stats={"busy_s": 1.5})
    assert [w.worker_id for w in registry.silent(now=12.0, timeout_s=10.0)] == ["r-2"]
    assert registry.sum_stat("rollout", "busy_s") == 3.5 and registry.sum_stat("reward", "busy_s") == 0.0
    old = registry.register(b"r", "r-1b", "rollout", now=6.0)  # a restarted worker under the same identity
    assert old is not None and old.worker_id == "r-1" and old.weight_version == 3
    assert registry.get(b"r").worker_id == "r-1b"  # type: ignore[union-attr]
