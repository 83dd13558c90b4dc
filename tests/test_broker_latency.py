"""The dispatch latency the broker measures: credits timed from arrival to the send that spends them."""

from __future__ import annotations

import math

import numpy as np

from vime.broker.latency import LatencyHistogram, percentile_ms
from vime.broker.workers import WorkerRegistry
from vime.protocol.messages import Group


def test_percentiles_are_the_upper_edge_of_their_bucket() -> None:
    histogram = LatencyHistogram()
    assert percentile_ms(histogram.counts, 0.99) is None
    for ms in [1.0] * 98 + [40.0, 40.0]:
        histogram.observe(ms / 1e3)
    p50, p99 = percentile_ms(histogram.counts, 0.5), percentile_ms(histogram.counts, 0.99)
    assert p50 is not None and 1.0 <= p50 < 1.0 * 2 ** 0.25, "within one bucket above the value"
    assert p99 is not None and 40.0 <= p99 < 40.0 * 2 ** 0.25
    histogram.observe(1e6)  # beyond the last edge
    assert histogram.status()["n"] == 101 and percentile_ms(histogram.counts, 1.0) == math.inf


def test_a_window_is_the_difference_of_two_readings() -> None:
    histogram = LatencyHistogram()
    for _ in range(50):
        histogram.observe(0.2)  # an earlier window of slow dispatches
    before = list(histogram.counts)
    for _ in range(50):
        histogram.observe(0.001)
    window = [b - a for a, b in zip(before, histogram.counts)]
    p99 = percentile_ms(window, 0.99)
    assert p99 is not None and p99 < 2.0


def group(n: int) -> Group:
    return Group(group_id=f"g{n}", prompt_index=n, epoch=0, prompt_tokens=np.array([1], dtype=np.int32), prompt_text="",
                 label="", n_samples=1)  # fmt: skip


def test_each_leased_group_spends_the_oldest_credit_of_its_worker() -> None:
    registry = WorkerRegistry()
    registry.register(b"a", "a", "rollout", now=0.0)
    registry.add_credit(b"a", 2, now=1.0)
    registry.add_credit(b"a", 1, now=3.0)
    queue = [group(i) for i in range(2)]
    leases: dict[str, tuple[Group, bytes]] = {}
    registry.lease_out("rollout", lambda: queue.pop(0) if queue else None, leases)
    assert registry.take_spent_credit_times("rollout") == [1.0, 1.0]
    assert registry.take_spent_credit_times("rollout") == [], "taken once"
    queue.append(group(2))
    registry.lease_out("rollout", lambda: queue.pop(0) if queue else None, leases)
    assert registry.take_spent_credit_times("rollout") == [3.0] and not registry.take_spent_credit_times("reward")
