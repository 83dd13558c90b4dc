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


def test_lease_out_picks_exactly_what_a_scan_of_every_worker_would() -> None:
    """The registry ranks workers with a heap (a thousand workers made the per-group scan the broker's
    hot spot); under random credits, leases, results (discards outside the registry), departures and
    re-registrations it must choose exactly as the scan did: fewest leases, most credits, earliest
    registered."""
    import random

    rng = random.Random(7)
    registry = WorkerRegistry()
    order: list[bytes] = []  # the scan's order: dict insertion order of registrations

    def scan_choice(role: str) -> bytes | None:
        candidates = [registry.workers[i] for i in order if registry.workers[i].role == role and registry.workers[i].credits > 0]
        return min(candidates, key=lambda w: (len(w.leased), -w.credits)).identity if candidates else None

    next_group = 0
    leases: dict[str, tuple[Group, bytes]] = {}
    for _ in range(3000):
        op = rng.random()
        identity = f"w{rng.randrange(12)}".encode()
        role = rng.choice(["rollout", "reward"])
        if op < 0.1:
            if identity not in registry.workers:
                order.append(identity)
            registry.register(identity, identity.decode(), role, now=0.0)
        elif op < 0.15 and identity in registry.workers:
            registry.remove(identity)
            order.remove(identity)
        elif op < 0.45 and identity in registry.workers:
            registry.add_credit(identity, rng.randint(1, 3))
        elif op < 0.7 and identity in registry.workers and registry.workers[identity].leased:
            registry.end_lease(identity, rng.choice(sorted(registry.workers[identity].leased)))
        else:
            expected = scan_choice(role)
            got = registry.with_credit(role)
            assert (got.identity if got else None) == expected
            queue = groups(rng.randint(0, 3))
            for g in queue:
                g.group_id = f"g{next_group}"
                next_group += 1
            want = []
            while queue and (pick := scan_choice(role)) is not None:
                # What the scan would do, one group at a time, on a copy of the state.
                want.append(pick)
                registry.workers[pick].credits -= 1
                registry.workers[pick].leased.add(queue.popleft().group_id)
            # Undo the simulation, then let lease_out do it for real on the same groups.
            ids = [f"g{i}" for i in range(next_group - len(want) - len(queue), next_group - len(queue))]
            for pick, gid in zip(want, ids):
                registry.workers[pick].credits += 1
                registry.workers[pick].leased.discard(gid)
            real = deque(Group(gid, 0, 0, np.arange(2, dtype=np.int32), "p", 2) for gid in ids)
            batches = registry.lease_out(role, lambda: real.popleft() if real else None, leases)
            got_order = [leases[gid][1] for gid in ids]
            assert got_order == want
            assert sum(len(v) for v in batches.values()) == len(ids)
