"""The broker's bookkeeping: where every prompt group is, who may get more work, and what is stale.

Pure logic (no sockets, time passed in), so it can be unit-tested exhaustively; the server
(`vime.broker.server`) feeds it decoded messages and sends what it returns. Parts with their own state
and tests: `vime.broker.workers` (the workers, their credits and leases) and
`vime.broker.dynamic_sampling` (the filter's decisions and the keep rate admission uses). The design
(a group's life, the staleness gate and admission, dynamic sampling, eval, leases, durability and the
loss/duplication ledgers): docs/broker.md.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from vime.data.prompts import PromptCursor
from vime.eval import EvalSet, EvalTracker
from vime.broker.journal import (
    JournalAdmit, JournalBatch, JournalBuffered, JournalCheckpoint, JournalDropped, JournalFinished, JournalPublished,
    JournalRecord, JournalStepDone,
)
from vime.broker.dynamic_sampling import DynamicSampling, GroupFilter
from vime.broker.workers import WorkerInfo, WorkerRegistry
from vime.protocol.codec import ERROR_CANNOT_RESUME, ProtocolError
from vime.protocol.messages import (
    DispatchGroups,
    EvalResult,
    Group,
    GroupScores,
    JobInfo,
    Message,
    ScoreGroups,
    ScoringGroup,
    Shutdown,
    TrainBatch,
    WeightVersionAnnounce,
)

if TYPE_CHECKING:
    from vime.config import VimeConfig

Outgoing = list[tuple[bytes, Message]]


@dataclass
class BrokerSettings:
    rollout_batch_size: int
    n_samples_per_prompt: int
    max_staleness: int
    update_weights_interval: int
    num_rollout: int
    worker_timeout_s: float
    sampling: dict[str, Any]
    rm_type: str = "arithmetic"
    # Dynamic sampling: prompts dispatched per step when the filter drops groups (None: no over-sampling).
    over_sampling_batch_size: int | None = None
    # Eval: every `eval_interval` steps (None: never), on `eval_sampling`, `n_samples_per_eval_prompt` each.
    eval_interval: int | None = None
    eval_before_train: bool = True
    n_samples_per_eval_prompt: int = 1
    eval_sampling: dict[str, Any] = field(default_factory=dict)
    eval_pass_threshold: float = 1.0
    # Keep trained batches replayable until a trainer checkpoint covers them (the job saves checkpoints).
    retain_until_checkpoint: bool = False

    @classmethod
    def from_config(cls, cfg: VimeConfig) -> BrokerSettings:
        return cls(
            rollout_batch_size=cfg.rollout_batch_size,
            n_samples_per_prompt=cfg.n_samples_per_prompt,
            max_staleness=cfg.max_staleness,
            update_weights_interval=cfg.update_weights_interval,
            num_rollout=cfg.num_rollout,
            worker_timeout_s=cfg.worker_timeout_s,
            sampling={
                "temperature": cfg.rollout_temperature,
                "top_p": cfg.rollout_top_p,
                "max_tokens": cfg.rollout_max_response_len,
            },
            rm_type=cfg.rm_type,
            over_sampling_batch_size=cfg.over_sampling_batch_size,
            eval_interval=cfg.eval_interval if cfg.eval_prompt_data else None,
            eval_before_train=not cfg.skip_eval_before_train,
            n_samples_per_eval_prompt=cfg.n_samples_per_eval_prompt,
            eval_sampling=cfg.eval_sampling if cfg.eval_interval else {},
            eval_pass_threshold=cfg.eval_pass_threshold,
            retain_until_checkpoint=cfg.save_interval is not None,
        )

    @property
    def groups_per_version(self) -> int:
        return self.rollout_batch_size * self.update_weights_interval

    @property
    def lookahead_steps(self) -> int:
        """Training steps admission runs ahead of the published weights."""
        return (self.max_staleness + 1) * self.update_weights_interval

    @property
    def over_sampling_extra(self) -> int:
        """Extra prompts per step that over-sampling may dispatch (0 without it)."""
        return max(0, (self.over_sampling_batch_size or self.rollout_batch_size) - self.rollout_batch_size)


@dataclass
class PendingBatch:
    identity: bytes
    step: int
    n_groups: int
    policy_version: int
    since: float


class JournalSink(Protocol):
    def append(self, record: JournalRecord) -> None: ...


class CannotServeStep(ProtocolError):
    """The trainer asked for a step whose batch is gone (before the last checkpoint) or not reachable."""

    def __init__(self, detail: str) -> None:
        super().__init__(ERROR_CANNOT_RESUME, detail)




class BrokerState:
    def __init__(
        self, settings: BrokerSettings, cursor: PromptCursor, *, group_filter: GroupFilter | None = None,
        eval_sets: Sequence[EvalSet] = (),
    ) -> None:  # fmt: skip
        self.settings = settings
        self.cursor = cursor
        self.evals: EvalTracker | None = None
        if settings.eval_interval is not None and eval_sets:
            self.evals = EvalTracker(
                eval_sets, n_samples=settings.n_samples_per_eval_prompt, interval=settings.eval_interval,
                before_train=settings.eval_before_train, threshold=settings.eval_pass_threshold,
                num_rollout=settings.num_rollout,
            )  # fmt: skip
        self.eval_queue: deque[Group] = deque()
        self._eval_active: set[str] = set()  # eval groups generating, waiting for or being scored
        self.eval_outbox: list[EvalResult] = []
        self.training_done = False
        self.registry = WorkerRegistry()
        self.retry_queue: deque[Group] = deque()
        self.generating: dict[str, tuple[Group, bytes]] = {}
        self.to_score: deque[Group] = deque()
        self.scoring: dict[str, tuple[Group, bytes]] = {}
        self.buffer: OrderedDict[str, Group] = OrderedDict()
        self.training: dict[str, Group] = {}
        # Per step (from the last trainer checkpoint on): the group ids of its batch, and the payloads of
        # trained groups still replayable by a trainer that resumes from that checkpoint.
        self.step_batches: dict[int, list[str]] = {}
        self.retained: dict[str, Group] = {}
        self.checkpoint_steps = 0
        # Ledgers for the loss/duplication checks (group ids are small; one entry per admitted group).
        self.admitted_ids: set[str] = set()
        self.trained_in_step: dict[str, int] = {}
        self.dropped: dict[str, str] = {}
        self.journal: JournalSink | None = None
        self.dispatch_seq: dict[str, int] = {}
        self.pending_batch: PendingBatch | None = None
        self.published_version = 0
        self.weight_endpoint: str | None = None
        self.trained_steps = 0
        self.finished = False
        self._next_seq = 0
        self.counters: dict[str, int] = {
            "groups_dispatched": 0,
            "groups_generated": 0,
            "groups_scored": 0,
            "groups_trained": 0,
            "groups_dropped_stale": 0,
            "groups_failed": 0,
            "groups_admitted": 0,
            "groups_filtered": 0,
            "groups_filter_kept": 0,
            "filter_errors": 0,
            "eval_runs_started": 0,
            "eval_runs_done": 0,
            "eval_groups_dispatched": 0,
            "eval_groups_scored": 0,
            "groups_requeued": 0,
            "samples_failed": 0,
            "late_results_dropped": 0,
            "bad_messages": 0,
            "unknown_peer_messages": 0,
            "groups_trained_twice": 0,
            "steps_replayed": 0,
            "batches_resent": 0,
            "broker_restarts": 0,
        }
        # The filter's keep-rate window is four admission windows long: short enough to follow a rate
        # that drifts as the policy learns, long enough that chance runs of drops do not make admission
        # over-generate.
        self.dynamic = DynamicSampling(
            group_filter, self.counters, rollout_batch_size=settings.rollout_batch_size,
            over_sampling_extra=settings.over_sampling_extra,
            window=4 * settings.lookahead_steps * (settings.over_sampling_batch_size or settings.rollout_batch_size),
        )  # fmt: skip

    # --- workers -----------------------------------------------------------------------------

    @property
    def workers(self) -> dict[bytes, WorkerInfo]:
        """The registered workers by ZeroMQ identity (`registry.workers`)."""
        return self.registry.workers

    def register(self, identity: bytes, worker_id: str, role: str, now: float, weight_version: int = -1) -> JobInfo:
        old = self.registry.register(identity, worker_id, role, now, weight_version)
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
        if self.pending_batch is not None and self.pending_batch.identity == identity:
            self.pending_batch = None
        return worker

    def expire_workers(self, now: float) -> list[WorkerInfo]:
        """Drop workers silent for longer than the timeout; their leased groups are re-queued (how
        many: each returned worker's `requeued`)."""
        dead = self.registry.silent(now, self.settings.worker_timeout_s)
        for worker in dead:
            self.remove_worker(worker.identity)
        return dead

    def _release_leases(self, worker: WorkerInfo) -> None:
        """Put the worker's leased groups back in their queues (counted in `worker.requeued`)."""
        requeued = 0
        for group_id in sorted(worker.leased, key=lambda g: (self.dispatch_seq.get(g, 0), g), reverse=True):
            if group_id in self.generating:
                group, _ = self.generating.pop(group_id)
                group.samples = []
                if group_id in self._eval_active:
                    self._eval_active.discard(group_id)
                    self.eval_queue.appendleft(group)
                else:
                    self.retry_queue.appendleft(group)
                requeued += 1
            elif group_id in self.scoring:
                group, _ = self.scoring.pop(group_id)
                self.to_score.appendleft(group)
                requeued += 1
        self.counters["groups_requeued"] += requeued
        worker.requeued += requeued
        worker.leased.clear()

    def add_credit(self, identity: bytes, n: int) -> None:
        self.registry.add_credit(identity, n)

    # --- admission and dispatch ----------------------------------------------------------------

    @property
    def committed(self) -> int:
        """Training groups admitted and not dropped: trained, in training, buffered, or on their way
        there (eval groups are not training work and do not count)."""
        return (
            self.counters["groups_trained"]
            + len(self.training)
            + len(self.buffer)
            + len(self.scoring)
            + len(self.to_score)
            + len(self.generating)
            + len(self.retry_queue)
            - len(self._eval_active)
        )

    @property
    def _base_limit(self) -> int:
        s = self.settings
        by_staleness = (self.published_version + s.max_staleness + 1) * s.groups_per_version
        return min(by_staleness, s.num_rollout * s.rollout_batch_size)

    @property
    def admission_limit(self) -> int:
        """Admit while `committed` is below this (docs/broker.md, "Staleness")."""
        base = self._base_limit
        rate = self.dynamic.expected_keep_rate
        if rate >= 1.0:
            return base
        kept = self.counters["groups_trained"] + len(self.training) + len(self.buffer)
        headroom = max(0, base - kept)
        return kept + math.ceil(headroom / rate - 1e-9)

    @property
    def over_sampling_margin(self) -> int:
        """Groups admitted beyond the staleness limit because the filter is expected to drop them."""
        return max(0, self.admission_limit - self._base_limit)

    def dispatch(self) -> Outgoing:
        """Hand groups to rollout workers with credits: eval groups first, then training groups as far
        as admission allows (none once every training step is done)."""
        if self.finished:
            return []
        batches = self.registry.lease_out("rollout", self._next_rollout_group, self.generating)
        return [(identity, DispatchGroups(groups=groups)) for identity, groups in batches.items()]

    def _next_rollout_group(self) -> Group | None:
        """The next group to generate, or None when admission (or the end of training) says wait."""
        if self.eval_queue:
            # Eval first: the sooner it starts, the likelier workers still hold the run's version.
            group = self.eval_queue.popleft()
            self._eval_active.add(group.group_id)
            self.counters["eval_groups_dispatched"] += 1
            return group
        if self.training_done:
            return None
        if self.retry_queue:
            group = self.retry_queue.popleft()
        elif self.committed < self.admission_limit:
            group = self._new_group()
        else:
            return None
        group.min_weight_version = self.published_version
        self.counters["groups_dispatched"] += 1
        return group

    def _new_group(self) -> Group:
        epoch, prompt = self.cursor.next()
        group = self.group_for(epoch, prompt.index)
        seq = self._next_seq
        self._next_seq += 1
        self.dispatch_seq[group.group_id] = seq
        self.admitted_ids.add(group.group_id)
        self.counters["groups_admitted"] += 1
        self._record(JournalAdmit(
            group_id=group.group_id, epoch=epoch, prompt_index=prompt.index, seq=seq,
            cursor_epoch=self.cursor.epoch, cursor_position=self.cursor.position,
        ))  # fmt: skip
        return group

    def group_for(self, epoch: int, prompt_index: int) -> Group:
        """A fresh (ungenerated) training group for a prompt of the dataset."""
        prompt = self.cursor.prompt(prompt_index)
        return Group(
            group_id=f"e{epoch}-p{prompt.index}",
            prompt_index=prompt.index,
            epoch=epoch,
            prompt_tokens=prompt.tokens,
            prompt_text=prompt.text,
            label=prompt.label,
            metadata=prompt.metadata,
            n_samples=self.settings.n_samples_per_prompt,
        )

    def _record(self, record: JournalRecord) -> None:
        if self.journal is not None:
            self.journal.append(record)

    # --- results -------------------------------------------------------------------------------

    def on_generated(self, identity: bytes, groups: list[Group]) -> list[str]:
        """Accept generated groups leased to this worker; others are late duplicates and dropped."""
        accepted = []
        worker = self.registry.get(identity)
        for group in groups:
            lease = self.generating.get(group.group_id)
            if lease is None or lease[1] != identity:
                self.counters["late_results_dropped"] += 1
                continue
            del self.generating[group.group_id]
            if worker is not None:
                worker.leased.discard(group.group_id)
            # The broker's own record decides what the group is for, not the worker's copy of it.
            group.kind = "eval" if group.group_id in self._eval_active else "train"
            group.min_weight_version = lease[0].min_weight_version
            self.to_score.append(group)
            if group.kind == "train":
                self.counters["groups_generated"] += 1
            accepted.append(group.group_id)
        return accepted

    def dispatch_scoring(self) -> Outgoing:
        """Hand generated groups to reward workers with credits, as `ScoringGroup`s (texts only)."""
        batches = self.registry.lease_out("reward", lambda: self.to_score.popleft() if self.to_score else None, self.scoring)
        return [(identity, ScoreGroups(groups=[ScoringGroup.of(g) for g in groups])) for identity, groups in batches.items()]

    def on_scored(self, identity: bytes, scores: list[GroupScores], now: float = 0.0) -> list[str]:
        accepted = []
        worker = self.registry.get(identity)
        for score in scores:
            lease = self.scoring.get(score.group_id)
            if lease is None or lease[1] != identity:
                self.counters["late_results_dropped"] += 1
                continue
            group = lease[0]
            if len(score.rewards) != len(group.samples):
                # Wrong shape: leave the lease alone so it is re-scored after the worker's timeout.
                self.counters["bad_messages"] += 1
                continue
            del self.scoring[score.group_id]
            if worker is not None:
                worker.leased.discard(score.group_id)
            self._attach_scores(group, score, now)
            accepted.append(score.group_id)
        return accepted

    def _attach_scores(self, group: Group, score: GroupScores, now: float) -> None:
        kept = []
        for sample, reward, failed, reason, extra in zip(
            group.samples, score.rewards, score.failed, score.reasons, score.extras or [{}] * len(score.rewards)
        ):
            if failed:
                sample.status = "failed"
                sample.failure_reason = reason or "reward failed"
                if group.kind == "train":
                    self.counters["samples_failed"] += 1
                continue
            sample.reward = float(reward)
            sample.reward_extra = extra
            kept.append(sample)
        if group.kind == "eval":
            # Eval samples end here: pass@k counts the failed ones separately, nothing is trained.
            self._eval_active.discard(group.group_id)
            self.counters["eval_groups_scored"] += 1
            if self.evals is not None:
                self.evals.record(group, now)
            return
        self.counters["groups_scored"] += 1
        if not kept:
            self.counters["groups_failed"] += 1
            self._drop(group.group_id, "failed")
            return
        group.samples = kept
        if not self.dynamic.keeps(group):
            self._drop(group.group_id, "filtered")
            return
        self.buffer[group.group_id] = group
        self._record(JournalBuffered(group=group))

    def _drop(self, group_id: str, reason: str) -> None:
        """A training group leaves without being trained (counted by the caller); the reason is kept."""
        self.dropped[group_id] = reason
        self._record(JournalDropped(group_id=group_id, reason=reason))  # type: ignore[arg-type]

    # --- training ------------------------------------------------------------------------------

    def request_batch(self, identity: bytes, step: int, n_groups: int, policy_version: int, now: float) -> Outgoing:
        """Record the trainer's request for step `step`; a step that already has a batch gets the same
        groups again at once (a lost reply, a restarted broker, or a trainer resumed from a checkpoint).

        Raises CannotServeStep for a finished step whose batch was released (it is before the last
        checkpoint the trainer reported): the trainer resumed from the wrong place.
        """
        self.pending_batch = None
        if step in self.step_batches:
            return self._resend_batch(identity, step, policy_version)
        if step < self.trained_steps:
            raise CannotServeStep(
                f"the trainer asked for step {step}, but the job has trained {self.trained_steps} steps and released "
                f"the batches before step {self.checkpoint_steps} when the trainer reported a checkpoint there: resume "
                "the trainer from that checkpoint or a later one (--load latest)"
            )  # fmt: skip
        self.pending_batch = PendingBatch(identity, step, n_groups, policy_version, now)
        return []

    def _resend_batch(self, identity: bytes, step: int, policy_version: int) -> Outgoing:
        ids = self.step_batches[step]
        groups = [self.training[g] if g in self.training else self.retained[g] for g in ids]
        if step < self.trained_steps:
            self.counters["steps_replayed"] += 1  # a resumed trainer catching up to the job's step
        else:
            self.counters["batches_resent"] += 1
        staleness = [policy_version - g.oldest_version for g in groups]
        stats = {"staleness_mean": float(np.mean(staleness)), "staleness_max": float(np.max(staleness)), "batch_wait_s": 0.0}
        replayed = step < self.trained_steps
        return [(identity, TrainBatch(step=step, groups=groups, stats=stats, replayed=replayed))]

    def try_fill_batch(self, now: float) -> Outgoing:
        """Answer the trainer's pending request if enough trainable groups are buffered."""
        pending = self.pending_batch
        if pending is None:
            return []
        limit = self.settings.max_staleness
        for group_id in [g for g, grp in self.buffer.items() if pending.policy_version - grp.oldest_version > limit]:
            del self.buffer[group_id]
            self.counters["groups_dropped_stale"] += 1
            self._drop(group_id, "stale")
        if len(self.buffer) < pending.n_groups:
            return []
        by_deadline = sorted(self.buffer, key=lambda g: (self.buffer[g].oldest_version, self.dispatch_seq.get(g, 0)))
        ordered = by_deadline[: pending.n_groups]
        if self._would_strand_unfinished(pending, by_deadline[pending.n_groups :]):
            return []
        groups = [self.buffer.pop(g) for g in ordered]
        for group in groups:
            self.training[group.group_id] = group
        self.step_batches[pending.step] = list(ordered)
        self._record(JournalBatch(step=pending.step, group_ids=list(ordered), policy_version=pending.policy_version))
        staleness = [pending.policy_version - g.oldest_version for g in groups]
        stats = {
            "staleness_mean": float(np.mean(staleness)),
            "staleness_max": float(np.max(staleness)),
            "batch_wait_s": now - pending.since,
            # Cumulative busy seconds reported by the workers' heartbeats: the trainer logs them so
            # engine idle time can be computed over any window of steps.
            "rollout_busy_s": self.registry.sum_stat("rollout", "busy_s"),
            "rollout_update_s": self.registry.sum_stat("rollout", "update_s"),
            # The weight update's parts inside the engines, and what they generated (cumulative).
            "rollout_fetch_s": self.registry.sum_stat("rollout", "fetch_s"),
            "rollout_load_s": self.registry.sum_stat("rollout", "load_s"),
            "rollout_paused_s": self.registry.sum_stat("rollout", "paused_s"),
            "rollout_update_bytes": self.registry.sum_stat("rollout", "update_bytes"),
            "rollout_updates": self.registry.sum_stat("rollout", "updates"),
            "rollout_tokens": self.registry.sum_stat("rollout", "tokens"),
            "reward_busy_s": self.registry.sum_stat("reward", "busy_s"),
        }
        if self.dynamic.active:
            stats.update(self.dynamic.batch_stats(self.over_sampling_margin))
        self.pending_batch = None
        return [(pending.identity, TrainBatch(step=pending.step, groups=groups, stats=stats))]

    def _would_strand_unfinished(self, pending: PendingBatch, left_buffered: list[str]) -> bool:
        """True if sending this batch now would leave a group still generating or scoring with no step
        left to train it before it turns stale, where waiting for it would not (docs/broker.md).

        Every training group has a deadline: the last policy version that may train it (its oldest token
        version + max_staleness; for an unfinished group the version it was dispatched with, a lower
        bound, so the check errs toward waiting). The steps after this one offer `n_groups` slots each at
        known policy versions. The left-behind groups fit if, for every deadline v, no more of them are due
        by v than there are slots by v (earliest deadline first). Waiting is only worth it when the
        unfinished groups are what breaks that; if the buffered ones alone do not fit, they cannot be
        helped and the batch goes now.
        """
        s = self.settings
        limit = s.max_staleness
        left = [self.buffer[g].oldest_version + limit for g in left_buffered]
        if not self._fits(left, pending):
            return False
        unfinished = [g.min_weight_version for g, _ in self.generating.values() if g.group_id not in self._eval_active]
        unfinished += [g.oldest_version if g.samples else g.min_weight_version for g in self.to_score if g.group_id not in self._eval_active]
        unfinished += [g.oldest_version for g, _ in self.scoring.values() if g.group_id not in self._eval_active]
        if not unfinished:
            return False
        # With a dynamic sampling filter only a fraction of them will be kept: count that many of the most urgent.
        # Those already past their deadline are lost to the gate whatever happens: no reason to wait.
        savable = sorted(d for d in (v + limit for v in unfinished) if d >= pending.policy_version)
        expected = math.ceil(len(savable) * self.dynamic.expected_keep_rate - 1e-9)
        deadlines = savable[:expected]
        return not self._fits(left + deadlines, pending)

    def _fits(self, deadlines: list[int], pending: PendingBatch) -> bool:
        """Can groups with these deadlines all be trained by later steps (each `n_groups` slots)? Groups
        beyond the job's last step count as fitting: they would be surplus anyway."""
        if not deadlines:
            return True
        u = self.settings.update_weights_interval
        due = sorted(deadlines)
        slots = 0
        step = pending.step + 1
        i = 0
        while i < len(due):
            if step >= self.settings.num_rollout:
                return True  # the rest would go unused even with more slots: surplus, not stranded
            version = pending.policy_version + (step // u - pending.step // u)
            while i < len(due) and due[i] < version:
                if i >= slots:
                    return False
                i += 1
            slots += pending.n_groups
            step += 1
        return True

    def on_step_done(self, step: int, group_ids: list[str]) -> Outgoing:
        """The trainer finished `step`. Idempotent: a repeated report (after a reconnect, or of a
        replayed step) changes nothing. The broker's record of the step's batch decides which groups
        were trained; a report naming other groups is counted as a bad message."""
        ids = self.step_batches.get(step)
        if ids is None:
            if step >= self.trained_steps:
                self.counters["bad_messages"] += 1  # a step that never had a batch
            return []
        if sorted(group_ids) != sorted(ids):
            self.counters["bad_messages"] += 1
        newly_done = step >= self.trained_steps or any(g in self.training for g in ids)
        self.apply_step_done(step)
        if newly_done:
            self._record(JournalStepDone(step=step, counters=dict(self.counters)))
        return self._maybe_finish()

    def apply_step_done(self, step: int) -> None:
        """Move step `step`'s groups from training to trained (also used when replaying the journal)."""
        for group_id in self.step_batches.get(step, []):
            group = self.training.pop(group_id, None)
            if group is not None and self.settings.retain_until_checkpoint:
                self.retained[group_id] = group
            first = self.trained_in_step.setdefault(group_id, step)
            if first != step:
                self.counters["groups_trained_twice"] += 1
            elif group is not None:
                self.counters["groups_trained"] += 1
        self.trained_steps = max(self.trained_steps, step + 1)
        if not self.settings.retain_until_checkpoint:
            self.release_batches_before(self.trained_steps)
        if self.trained_steps >= self.settings.num_rollout:
            self.training_done = True

    def on_checkpoint(self, steps_done: int) -> None:
        """The trainer saved a resumable checkpoint after `steps_done` steps: it will never ask for an
        earlier step again, so those batches are released."""
        if steps_done <= self.checkpoint_steps:
            return
        self.release_batches_before(steps_done)
        self._record(JournalCheckpoint(steps_done=steps_done))

    def release_batches_before(self, steps_done: int) -> None:
        self.checkpoint_steps = max(self.checkpoint_steps, min(steps_done, self.trained_steps))
        for step in [s for s in self.step_batches if s < self.checkpoint_steps]:
            for group_id in self.step_batches.pop(step):
                self.retained.pop(group_id, None)

    def _maybe_finish(self) -> Outgoing:
        """Finish (tell every worker to shut down) once training is done and no eval is outstanding."""
        if self.finished or not self.training_done:
            return []
        if self.eval_outbox or (self.evals is not None and self.evals.busy):
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
        if step is not None and self.evals is not None and self.evals.is_due(step):
            groups = self.evals.start(step, version, now)
            self.eval_queue.extend(groups)
            self.counters["eval_runs_started"] += 1
        return out

    def poll_evals(self) -> Outgoing:
        """Send finished eval runs to the trainer (kept until one is connected), then finish if due."""
        if self.evals is not None:
            finished = self.evals.pop_finished()
            self.counters["eval_runs_done"] += len(finished)
            self.eval_outbox.extend(finished)
        out: Outgoing = []
        trainers = self.registry.of_role("trainer")
        if self.eval_outbox and trainers:
            out = [(t.identity, result) for result in self.eval_outbox for t in trainers]
            self.eval_outbox = []
        return out + self._maybe_finish()

    # --- status --------------------------------------------------------------------------------

    @property
    def groups_lost(self) -> int:
        """Admitted training groups that are nowhere: not trained, not dropped for a recorded reason,
        not in any queue. Must be 0; computed from the ledgers, not from the counters."""
        placed = set(self.trained_in_step) | set(self.dropped) | set(self.buffer) | set(self.training)
        placed |= {g.group_id for g in self.retry_queue} | set(self.generating) | set(self.scoring)
        placed |= {g.group_id for g in self.to_score}
        return len(self.admitted_ids - placed)

    def status(self, now: float) -> dict[str, Any]:
        return {
            "weight_version": self.published_version,
            "step": self.trained_steps,
            "finished": self.finished,
            "groups_lost": self.groups_lost,
            "groups_trained_twice": self.counters["groups_trained_twice"],
            "checkpoint_steps": self.checkpoint_steps,
            "admission_limit": self.admission_limit,
            "committed": self.committed,
            "queues": {
                "eval": len(self.eval_queue),
                "retry": len(self.retry_queue),
                "generating": len(self.generating),
                "to_score": len(self.to_score),
                "scoring": len(self.scoring),
                "buffered": len(self.buffer),
                "training": len(self.training),
            },
            "counters": dict(self.counters),
            "dynamic_sampling": self.dynamic.status(self.settings.over_sampling_batch_size, self.over_sampling_margin),
            "eval": self.evals.status() if self.evals is not None else None,
            "workers": [
                {
                    "worker_id": w.worker_id,
                    "role": w.role,
                    "credits": w.credits,
                    "leased": len(w.leased),
                    "weight_version": w.weight_version,
                    "seconds_since_seen": round(now - w.last_seen, 3),
                    "stats": w.stats,
                }
                for w in self.workers.values()
            ],
        }
