"""The broker's dynamic-sampling part on its own: decisions counted, reasons bounded, the keep rate."""

from __future__ import annotations

import numpy as np

from vime.broker.dynamic_sampling import MAX_FILTER_REASONS, DynamicSampling
from vime.filters import FilterDecision
from vime.protocol.messages import Group


def group(i: int) -> Group:
    return Group(f"g{i}", i, 0, np.arange(2, dtype=np.int32), "p", 2)


def counters() -> dict[str, int]:
    return {"groups_filtered": 0, "groups_filter_kept": 0, "filter_errors": 0}


def test_without_a_filter_everything_is_kept_and_nothing_is_expected_to_drop() -> None:
    dynamic = DynamicSampling(None, counters(), rollout_batch_size=4, over_sampling_extra=2, window=8)
    assert dynamic.keeps(group(0)) and not dynamic.active
    assert dynamic.keep_rate is None and dynamic.expected_keep_rate == 1.0
    assert dynamic.status(6, 0) is None


def test_decisions_are_counted_reasons_bounded_and_the_keep_rate_floored() -> None:
    def every_third(g: Group) -> FilterDecision:
        i = int(g.group_id[1:])
        return FilterDecision(keep=i % 3 == 0, reason=f"drop {i}", error=i == 4)

    shared = counters()
    dynamic = DynamicSampling(every_third, shared, rollout_batch_size=4, over_sampling_extra=4, window=100)
    assert dynamic.expected_keep_rate == 0.5  # before a batch's worth: the user's floor, 4 / (4 + 4)
    kept = [dynamic.keeps(group(i)) for i in range(60)]
    assert sum(kept) == 20 and shared["groups_filter_kept"] == 20 and shared["groups_filtered"] == 40
    assert shared["filter_errors"] == 1
    assert len(dynamic.reasons) == MAX_FILTER_REASONS + 1 and sum(dynamic.reasons.values()) == 40  # the rest under "other"
    assert dynamic.reasons["other"] > 0 and dynamic.streak == 2  # g58, g59 dropped after g57 was kept
    assert dynamic.keep_rate == 20 / 60 and dynamic.expected_keep_rate == 0.5  # floored
    first = dynamic.batch_stats(over_sampling_margin=3)
    assert first["rollout/dynamic_filter_dropped"] == 40 and first["rollout/over_sampling_margin"] == 3
    dynamic.keeps(group(61))
    assert dynamic.batch_stats(over_sampling_margin=3)["rollout/dynamic_filter_dropped"] == 1  # since the last batch
