"""The broker's side of eval: eval groups on their way through the rollout and reward workers, and the
finished runs' results until a trainer takes them (what is due and the metrics: `vime.eval.EvalTracker`).

Eval groups go to rollout workers ahead of training work and never count against admission; a lease
that ends puts them back at the front of the queue. Runs in progress are not journaled: they are not
training data, and after a broker restart the next due run starts as usual.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

from vime.eval import EvalSet, EvalTracker
from vime.broker.settings import BrokerSettings
from vime.protocol.messages import EvalResult, Group


class EvalRuns:
    def __init__(self, settings: BrokerSettings, eval_sets: Sequence[EvalSet], counters: dict[str, int]) -> None:
        self.tracker: EvalTracker | None = None
        if settings.eval_interval is not None and eval_sets:
            self.tracker = EvalTracker(
                eval_sets, n_samples=settings.n_samples_per_eval_prompt, interval=settings.eval_interval,
                before_train=settings.eval_before_train, threshold=settings.eval_pass_threshold,
                num_rollout=settings.num_rollout,
            )  # fmt: skip
        self.counters = counters
        self.queue: deque[Group] = deque()
        self.active: set[str] = set()  # eval groups generating, waiting for or being scored
        self.outbox: list[EvalResult] = []

    def start_if_due(self, step: int, version: int, now: float) -> None:
        """Queue the run of trainer step `step` (weights `version`) if one is due."""
        if self.tracker is not None and self.tracker.is_due(step):
            self.queue.extend(self.tracker.start(step, version, now))
            self.counters["eval_runs_started"] += 1

    def next_group(self) -> Group | None:
        """The next eval group to generate, or None."""
        if not self.queue:
            return None
        group = self.queue.popleft()
        self.active.add(group.group_id)
        self.counters["eval_groups_dispatched"] += 1
        return group

    def is_eval(self, group_id: str) -> bool:
        """Whether an unscored group in the pipeline is eval work."""
        return group_id in self.active

    def requeue(self, group: Group) -> None:
        """An eval group's generation lease ended before a result: generate it again, first."""
        self.active.discard(group.group_id)
        self.queue.appendleft(group)

    def scored(self, group: Group, now: float) -> None:
        """A scored eval group ends here: pass@k counts its failed samples, nothing is trained."""
        self.active.discard(group.group_id)
        self.counters["eval_groups_scored"] += 1
        if self.tracker is not None:
            self.tracker.record(group, now)

    def collect(self) -> None:
        """Move finished runs' results to the outbox."""
        if self.tracker is not None:
            finished = self.tracker.pop_finished()
            self.counters["eval_runs_done"] += len(finished)
            self.outbox.extend(finished)

    def take_results(self) -> list[EvalResult]:
        results, self.outbox = self.outbox, []
        return results

    @property
    def outstanding(self) -> bool:
        """A run is in flight, still to come, or its result not yet delivered: the job is not finished."""
        return bool(self.outbox) or (self.tracker is not None and self.tracker.busy)

    def status(self) -> dict[str, Any] | None:
        return self.tracker.status() if self.tracker is not None else None
