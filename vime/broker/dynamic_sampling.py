"""The broker's side of dynamic sampling: the filter's decisions on scored groups, and the keep rate
admission sizes over-sampling with (the rule itself: docs/broker.md, "Dynamic sampling").

Owns the filter, a window of recent keep/drop decisions, the drop reasons (bounded), the run of drops
in a row (a filter that keeps nothing stalls training; the server warns), and the per-batch metrics.
Decisions are counted in the broker's shared `counters` (`groups_filtered`, `groups_filter_kept`,
`filter_errors`), which the journal carries across a restart; the window starts empty again.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from typing import Any

from vime.filters import FilterDecision
from vime.protocol.messages import Group

GroupFilter = Callable[[Group], FilterDecision]
# Distinct filter drop reasons kept in the status; more are counted under "other" (a filter that puts
# a group id in its reason must not grow the status without bound).
MAX_FILTER_REASONS = 32


class DynamicSampling:
    def __init__(self, group_filter: GroupFilter | None, counters: dict[str, int], *, rollout_batch_size: int,
                 over_sampling_extra: int, window: int) -> None:  # fmt: skip
        self.group_filter = group_filter
        self.counters = counters
        self.rollout_batch_size = rollout_batch_size
        self.over_sampling_extra = over_sampling_extra
        # Keep/drop decisions of the most recent scored groups: the keep rate that sizes over-sampling.
        self.window: deque[bool] = deque(maxlen=max(window, rollout_batch_size))
        self.reasons: Counter[str] = Counter()
        self.streak = 0  # groups dropped in a row
        self._at_last_batch = (0, 0)

    @property
    def active(self) -> bool:
        return self.group_filter is not None

    def keeps(self, group: Group) -> bool:
        """Run the filter on a scored group (True without a filter) and count the decision."""
        if self.group_filter is None:
            return True
        decision = self.group_filter(group)
        self.window.append(decision.keep)
        if decision.error:
            self.counters["filter_errors"] += 1
        if decision.keep:
            self.counters["groups_filter_kept"] += 1
            self.streak = 0
            return True
        self.counters["groups_filtered"] += 1
        self.streak += 1
        reason = (decision.reason or "dropped")[:80]
        if reason not in self.reasons and len(self.reasons) >= MAX_FILTER_REASONS:
            reason = "other"
        self.reasons[reason] += 1
        return False

    @property
    def keep_rate(self) -> float | None:
        """Fraction of recently scored groups the filter kept; None until a batch's worth was seen."""
        if self.group_filter is None or len(self.window) < self.rollout_batch_size:
            return None
        return sum(self.window) / len(self.window)

    @property
    def expected_keep_rate(self) -> float:
        """The fraction of unscored groups admission expects the filter to keep: the recent keep rate,
        floored at rollout_batch_size / over_sampling_batch_size (1.0 without over-sampling)."""
        if self.group_filter is None or self.over_sampling_extra == 0:
            return 1.0
        floor = self.rollout_batch_size / (self.rollout_batch_size + self.over_sampling_extra)
        recent = self.keep_rate
        return floor if recent is None else max(recent, floor)

    def batch_stats(self, over_sampling_margin: int) -> dict[str, float]:
        """Metrics for the trainer's log ("rollout/..." keys are logged as they are): groups dropped and
        kept since the previous batch, the cumulative drop ratio, and the admission margin."""
        dropped, kept = self.counters["groups_filtered"], self.counters["groups_filter_kept"]
        last_dropped, last_kept = self._at_last_batch
        self._at_last_batch = (dropped, kept)
        return {
            "rollout/dynamic_filter_dropped": float(dropped - last_dropped),
            "rollout/dynamic_filter_kept": float(kept - last_kept),
            "rollout/dynamic_filter_drop_ratio": dropped / max(1, dropped + kept),
            "rollout/over_sampling_margin": float(over_sampling_margin),
        }

    def status(self, over_sampling_batch_size: int | None, over_sampling_margin: int) -> dict[str, Any] | None:
        if self.group_filter is None:
            return None
        dropped, kept = self.counters["groups_filtered"], self.counters["groups_filter_kept"]
        return {
            "dropped": dropped,
            "kept": kept,
            "drop_ratio": round(dropped / max(1, dropped + kept), 4),
            "recent_keep_rate": self.keep_rate,
            "over_sampling_batch_size": over_sampling_batch_size,
            "over_sampling_margin": over_sampling_margin,
            "dropped_in_a_row": self.streak,
            "errors": self.counters["filter_errors"],
            "reasons": dict(self.reasons),
        }
