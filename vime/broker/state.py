"""The broker's message handler: where every prompt group is between its parts, and what each message does.

Pure logic (no sockets, time passed in), so it can be unit-tested exhaustively; the server
(`vime.broker.server`) feeds it decoded messages and sends what it returns. `BrokerState` composes the
parts, each with its own state, tests and journal replay:
- `workers.WorkerRegistry`: the workers, their credits and leases (one lease loop for both roles);
- `in_flight.GroupsInFlight`: the groups between admission and the buffer, and their leases;
- `admission.Admission`: the prompt cursor, the admitted/dropped ledger and the admission limit;
- `batches.BatchPlanner`: the buffer, the staleness gate, each step's batch and its replay;
- `dynamic_sampling.DynamicSampling`: the filter's decisions and the keep rate admission uses;
- `eval_runs.EvalRuns`: eval groups in the pipeline and results on their way to the trainer.
The design (a group's life, the staleness gate and admission, leases, durability, the ledgers):
docs/broker.md.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any, Protocol

from vime.broker.admission import Admission
from vime.broker.batches import BatchPlanner, CannotServeStep
from vime.broker.dynamic_sampling import DynamicSampling, GroupFilter
from vime.broker.eval_runs import EvalRuns
from vime.broker.in_flight import GroupsInFlight
from vime.broker.journal import JournalBuffered, JournalError, JournalFinished, JournalPublished, JournalRecord
from vime.broker.latency import LatencyHistogram
from vime.broker.scores import apply_scores
from vime.broker.settings import BrokerSettings
from vime.broker.staleness import StalenessHistogram
from vime.broker.status import COUNTERS, broker_status
from vime.broker.workers import WorkerInfo, WorkerRegistry
from vime.data.prompts import PromptCursor
from vime.eval import EvalSet
from vime.protocol.messages import (
    DispatchGroups, Group, GroupScores, JobInfo, Message, ScoreGroups, ScoringGroup, Shutdown, WeightVersionAnnounce,
)

Outgoing = list[tuple[bytes, Message]]


class JournalSink(Protocol):
    def append(self, record: JournalRecord) -> None: ...


class BrokerState:
    def __init__(
        self, settings: BrokerSettings, cursor: PromptCursor, *, group_filter: GroupFilter | None = None,
        eval_sets: Sequence[EvalSet] = (),
    ) -> None:  # fmt: skip
        self.settings = settings
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.journal: JournalSink | None = None
        self.registry = WorkerRegistry()
        self.admission = Admission(settings, cursor, self.counters, self._record)
        self.batches = BatchPlanner(settings, self.counters, ledger=self.admission, record=self._record)
        # The filter's keep-rate window is four admission windows long: short enough to follow a rate
        # that drifts as the policy learns, long enough that chance runs of drops do not make admission
        # over-generate.
        self.dynamic = DynamicSampling(
            group_filter, self.counters, rollout_batch_size=settings.rollout_batch_size,
            over_sampling_extra=settings.over_sampling_extra,
            window=4 * settings.lookahead_steps * (settings.over_sampling_batch_size or settings.rollout_batch_size),
        )  # fmt: skip
        self.evals = EvalRuns(settings, eval_sets, self.counters)
        self.in_flight = GroupsInFlight()
        self.published_version = 0
        self.weight_endpoint: str | None = None
        self.finished = False
        # How long credits wait for a group (fed by the server, which knows when it sent; `latency`).
        self.credit_wait = {"rollout": LatencyHistogram(), "reward": LatencyHistogram()}
        self.staleness = StalenessHistogram()  # of the groups of each fresh batch
        self.received: Counter[str] = Counter()  # messages handled, by type (the server counts them)
        self.metrics_url: str | None = None  # where the broker serves Prometheus /metrics (set by its program)

    def _record(self, record: JournalRecord) -> None:
        if self.journal is not None:
            self.journal.append(record)

    # --- workers -----------------------------------------------------------------------------

    @property
    def workers(self) -> dict[bytes, WorkerInfo]:
        """The registered workers by ZeroMQ identity (`registry.workers`)."""
        return self.registry.workers

    def register(
        self, identity: bytes, worker_id: str, role: str, now: float, weight_version: int = -1, metrics_url: str | None = None
    ) -> JobInfo:
        old = self.registry.register(identity, worker_id, role, now, weight_version, metrics_url)
        if old is not None and old.leased:
            self._release_leases(old)
        return self.job_info()

    def job_info(self) -> JobInfo:
        return JobInfo(
            n_samples_per_prompt=self.settings.n_samples_per_prompt,
            sampling=self.settings.sampling,
            weight_version=self.published_version,
            weight_endpoint=self.weight_endpoint,
            max_staleness=self.settings.max_staleness,
            rm_type=self.settings.rm_type,
            eval_sampling=self.settings.eval_sampling,
        )

    def touch(self, identity: bytes, now: float, weight_version: int | None = None, stats: dict[str, Any] | None = None) -> bool:
        """Record that a worker is alive; False if it is unknown (it must say Hello again)."""
        return self.registry.touch(identity, now, weight_version, stats)

    def remove_worker(self, identity: bytes) -> WorkerInfo | None:
        worker = self.registry.remove(identity)
        if worker is not None:
            self._release_leases(worker)
        self.batches.forget_trainer(identity)
        return worker

    def expire_workers(self, now: float) -> list[WorkerInfo]:
        """Drop workers silent for longer than the timeout; their leased groups are re-queued (how
        many: each returned worker's `requeued`)."""
        dead = self.registry.silent(now, self.settings.worker_timeout_s)
        for worker in dead:
            self.remove_worker(worker.identity)
        return dead

    def _release_leases(self, worker: WorkerInfo) -> None:
        """Put the worker's leased groups back at the front of their queues, in dispatch order (counted
        in `worker.requeued`)."""
        order = sorted(worker.leased, key=lambda g: (self.admission.order(g), g), reverse=True)
        regenerate, requeued = self.in_flight.release(order)
        for group in regenerate:
            if self.evals.is_eval(group.group_id):
                self.evals.requeue(group)
            else:
                self.batches.untrack_in_flight(group.group_id)
                self.in_flight.retry.appendleft(group)
        self.counters["groups_requeued"] += requeued
        worker.requeued += requeued
        worker.leased.clear()

    def add_credit(self, identity: bytes, n: int, now: float = 0.0) -> None:
        self.registry.add_credit(identity, n, now)

    def record_sent(self, now: float) -> None:
        """The groups leased since the last call were sent at `now`: their credits' waits are measured."""
        for role, histogram in self.credit_wait.items():
            for granted_at in self.registry.take_spent_credit_times(role):
                histogram.observe(now - granted_at)

    # --- admission and dispatch ----------------------------------------------------------------

    @property
    def committed(self) -> int:
        """Training groups admitted and not dropped (eval groups are not training work)."""
        return self.admission.committed

    @property
    def admission_limit(self) -> int:
        """Admit while `committed` is below this (docs/broker.md, "Staleness")."""
        kept = self.admission.trained_released + self.batches.kept
        return self.admission.limit(self.published_version, kept, self.dynamic.expected_keep_rate)

    @property
    def over_sampling_margin(self) -> int:
        """Groups admitted beyond the staleness limit because the filter is expected to drop them."""
        return max(0, self.admission_limit - self.admission.base_limit(self.published_version))

    @property
    def trained_steps(self) -> int:
        return self.batches.trained_steps

    @property
    def training_done(self) -> bool:
        return self.batches.done

    def dispatch(self) -> Outgoing:
        """Hand groups to rollout workers with credits: eval groups first, then training groups as far
        as admission allows (none once every training step is done)."""
        if self.finished:
            return []
        batches = self.registry.lease_out("rollout", self._next_rollout_group, self.in_flight.generating)
        return [(identity, DispatchGroups(groups=groups)) for identity, groups in batches.items()]

    def _next_rollout_group(self) -> Group | None:
        """The next group to generate, or None when admission (or the end of training) says wait."""
        # Eval first: the sooner it starts, the likelier workers still hold the run's version.
        group = self.evals.next_group()
        if group is not None:
            return group
        if self.batches.done:
            return None
        if self.in_flight.retry:
            group = self.in_flight.retry.popleft()
        elif self.committed < self.admission_limit:
            group = self.admission.admit()
        else:
            return None
        group.min_weight_version = self.published_version
        self.batches.track_in_flight(group.group_id, group.min_weight_version)
        self.counters["groups_dispatched"] += 1
        return group

    # --- results -------------------------------------------------------------------------------

    def on_generated(self, identity: bytes, groups: list[Group]) -> list[str]:
        """Accept generated groups leased to this worker; others are late duplicates and dropped."""
        accepted = []
        for group in groups:
            leased = self.in_flight.generated(identity, group.group_id)
            if leased is None:
                self.counters["late_results_dropped"] += 1
                continue
            self.registry.end_lease(identity, group.group_id)
            # The broker's own record decides what the group is for, not the worker's copy of it.
            group.kind = "eval" if self.evals.is_eval(group.group_id) else "train"
            group.min_weight_version = leased.min_weight_version
            self.in_flight.to_score.append(group)
            if group.kind == "train":
                self.batches.track_in_flight(group.group_id, group.oldest_version if group.samples else group.min_weight_version)
                self.counters["groups_generated"] += 1
            accepted.append(group.group_id)
        return accepted

    def dispatch_scoring(self) -> Outgoing:
        """Hand generated groups to reward workers with credits, as `ScoringGroup`s (texts only)."""
        to_score = self.in_flight.to_score
        batches = self.registry.lease_out("reward", lambda: to_score.popleft() if to_score else None, self.in_flight.scoring)
        return [(identity, ScoreGroups(groups=[ScoringGroup.of(g) for g in groups])) for identity, groups in batches.items()]

    def on_scored(self, identity: bytes, scores: list[GroupScores], now: float = 0.0) -> list[str]:
        accepted = []
        for score in scores:
            group = self.in_flight.scoring_lease(identity, score.group_id)
            if group is None:
                self.counters["late_results_dropped"] += 1
                continue
            if len(score.rewards) != len(group.samples):
                # Wrong shape: leave the lease alone so it is re-scored after the worker's timeout.
                self.counters["bad_messages"] += 1
                continue
            del self.in_flight.scoring[score.group_id]
            self.registry.end_lease(identity, score.group_id)
            self.batches.untrack_in_flight(score.group_id)
            self._attach_scores(group, score, now)
            accepted.append(score.group_id)
        return accepted

    def _attach_scores(self, group: Group, score: GroupScores, now: float) -> None:
        kept, failures = apply_scores(group, score)
        if group.kind == "train":
            self.counters["samples_failed"] += failures
        if group.kind == "eval":
            self.evals.scored(group, now)
            return
        self.counters["groups_scored"] += 1
        if not kept:
            self.counters["groups_failed"] += 1
            self.admission.drop(group.group_id, "failed")
            return
        group.samples = kept
        if not self.dynamic.keeps(group):
            self.admission.drop(group.group_id, "filtered")
            return
        self.batches.add(group)

    # --- training ------------------------------------------------------------------------------

    def request_batch(self, identity: bytes, step: int, n_groups: int, policy_version: int, now: float) -> Outgoing:
        """Record the trainer's request for step `step` (`BatchPlanner.request`); a step that already
        has a batch gets it again at once. Raises CannotServeStep for a released step."""
        batch = self.batches.request(identity, step, n_groups, policy_version, now)
        return [] if batch is None else [(identity, batch)]

    def try_fill_batch(self, now: float) -> Outgoing:
        """Answer the trainer's pending request if enough trainable groups are buffered."""
        pending = self.batches.pending  # the request fill() answers (and clears): its policy version
        filled = self.batches.fill(now, self.dynamic.expected_keep_rate)
        if filled is None:
            return []
        identity, batch = filled
        for group in batch.groups:
            self.staleness.observe(pending.policy_version - group.oldest_version)  # type: ignore[union-attr]
        batch.stats.update(self.registry.batch_stats())
        if self.dynamic.active:
            batch.stats.update(self.dynamic.batch_stats(self.over_sampling_margin))
        return [(identity, batch)]

    def on_step_done(self, step: int, group_ids: list[str]) -> Outgoing:
        """The trainer finished `step` (`BatchPlanner.step_done`: idempotent); finish if it was the last."""
        self.batches.step_done(step, group_ids)
        return self._maybe_finish()

    def on_checkpoint(self, steps_done: int) -> None:
        """The trainer saved a resumable checkpoint after `steps_done` steps: earlier batches are released."""
        self.batches.checkpoint(steps_done)

    def _maybe_finish(self) -> Outgoing:
        """Finish (tell every worker to shut down) once training is done and no eval is outstanding."""
        if self.finished or not self.batches.done or self.evals.outstanding:
            return []
        self.finished = True
        self._record(JournalFinished(trained_steps=self.trained_steps))
        return [(w.identity, Shutdown(reason="training finished")) for w in self.workers.values()]

    def on_weights_published(self, version: int, endpoint: str, step: int | None = None, now: float = 0.0) -> Outgoing:
        """Record and announce a new version; start the eval run of `step` (the trainer step whose
        weights these are, -1 for the initial ones) if one is due."""
        out: Outgoing = []
        if version > self.published_version or self.weight_endpoint != endpoint:
            self.published_version = max(self.published_version, version)
            self.weight_endpoint = endpoint
            self._record(JournalPublished(version=self.published_version, endpoint=endpoint))
            announce = WeightVersionAnnounce(version=self.published_version, endpoint=endpoint)
            out = [(w.identity, announce) for w in self.registry.of_role("rollout")]
        if step is not None:
            self.evals.start_if_due(step, version, now)
        return out

    def poll_evals(self) -> Outgoing:
        """Send finished eval runs to the trainer (kept until one is connected), then finish if due."""
        self.evals.collect()
        out: Outgoing = []
        trainers = self.registry.of_role("trainer")
        if self.evals.outbox and trainers:
            out = [(t.identity, result) for result in self.evals.take_results() for t in trainers]
        return out + self._maybe_finish()

    # --- restore -------------------------------------------------------------------------------

    def replay(self, record: JournalRecord) -> None:
        """Apply one journal record to the parts (restore; `vime.broker.recovery`). Raises JournalError
        when the journal contradicts itself."""
        if isinstance(record, JournalBuffered) and not self.admission.is_open(record.group.group_id):
            raise JournalError(f"journal: group {record.group.group_id} buffered but never admitted")
        self.admission.replay(record)
        self.batches.replay(record)
        if isinstance(record, JournalPublished):
            self.published_version = max(self.published_version, record.version)
            self.weight_endpoint = record.endpoint

    # --- status --------------------------------------------------------------------------------

    def placed_ids(self) -> set[str]:
        """Training groups somewhere: in a queue, or trained in a step a trainer may still ask for."""
        b = self.batches
        return set(b.trained_in_step) | set(b.buffer) | set(b.training) | self.in_flight.ids()

    @property
    def groups_lost(self) -> int:
        """Open training groups (admitted, not finished) that are nowhere: not in any queue, not trained
        in a step still held. Must be 0; computed from the ledgers, not from the counters."""
        return len(self.admission.unplaced(self.placed_ids()))

    def status(self, now: float) -> dict[str, Any]:
        """What `vime status` shows (`vime.broker.status`)."""
        return broker_status(self, now)


__all__ = ["BrokerSettings", "BrokerState", "CannotServeStep", "Outgoing"]
