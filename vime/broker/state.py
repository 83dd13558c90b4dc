"""The broker's bookkeeping: where every prompt group is, who may get more work, and what is stale.

This module is pure logic (no sockets, time passed in) so it can be unit-tested exhaustively. The
server (`vime.broker.server`) feeds it decoded messages and sends what it returns.

A group moves through: retry queue / prompt cursor -> generating (leased to a rollout worker) ->
to_score -> scoring (leased to a reward worker) -> buffer -> training (sent to the trainer) -> trained.

Staleness (weight versions are publication counts; tokens carry the version that produced them):
- Gate: a buffered group is trainable at policy version P iff P - oldest_token_version <= max_staleness.
- Admission (AReaL-style): a group is only dispatched while
  committed < (published_version + max_staleness + 1) * rollout_batch_size * update_weights_interval,
  and is dispatched with `min_weight_version = published_version`, so every admitted group passes the
  gate by construction; nothing is generated only to be thrown away, and long responses are not
  dropped for being slow. `max_staleness = 0` is synchronous on-policy training.
- Batches take the earliest-dispatched trainable groups first, so slow (long) groups are not starved.

Leases: a worker that says Bye or stays silent past its timeout loses its leased groups; generating
groups go back to the retry queue (regenerated from scratch), scoring groups back to the scoring queue.
A late result for a group no longer leased to that worker is dropped by id and counted.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vime.data.prompts import PromptCursor
from vime.protocol.messages import (
    DispatchGroups,
    Group,
    GroupScores,
    JobInfo,
    Message,
    ScoreGroups,
    Shutdown,
    TrainBatch,
    WeightVersionAnnounce,
)

Outgoing = list[tuple[bytes, Message]]


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

    @property
    def groups_per_version(self) -> int:
        return self.rollout_batch_size * self.update_weights_interval


@dataclass
class PendingBatch:
    identity: bytes
    step: int
    n_groups: int
    policy_version: int
    since: float


class BrokerState:
    def __init__(self, settings: BrokerSettings, cursor: PromptCursor) -> None:
        self.settings = settings
        self.cursor = cursor
        self.workers: dict[bytes, WorkerInfo] = {}
        self.retry_queue: deque[Group] = deque()
        self.generating: dict[str, tuple[Group, bytes]] = {}
        self.to_score: deque[Group] = deque()
        self.scoring: dict[str, tuple[Group, bytes]] = {}
        self.buffer: OrderedDict[str, Group] = OrderedDict()
        self.training: dict[str, Group] = {}
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
            "groups_requeued": 0,
            "samples_failed": 0,
            "late_results_dropped": 0,
            "bad_messages": 0,
        }

    # --- workers -----------------------------------------------------------------------------

    def register(self, identity: bytes, worker_id: str, role: str, now: float, weight_version: int = -1) -> JobInfo:
        old = self.workers.get(identity)
        if old is not None and old.leased:
            self._release_leases(old)
        self.workers[identity] = WorkerInfo(identity, worker_id, role, now, weight_version=weight_version)
        return self.job_info()

    def job_info(self) -> JobInfo:
        return JobInfo(
            n_samples_per_prompt=self.settings.n_samples_per_prompt,
            sampling=self.settings.sampling,
            weight_version=self.published_version,
            weight_endpoint=self.weight_endpoint,
            max_staleness=self.settings.max_staleness,
            rm_type=self.settings.rm_type,
        )

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

    def remove_worker(self, identity: bytes) -> WorkerInfo | None:
        worker = self.workers.pop(identity, None)
        if worker is not None:
            self._release_leases(worker)
        if self.pending_batch is not None and self.pending_batch.identity == identity:
            self.pending_batch = None
        return worker

    def expire_workers(self, now: float) -> list[WorkerInfo]:
        """Drop workers silent for longer than the timeout; their leased groups are re-queued."""
        dead = [w for w in self.workers.values() if now - w.last_seen > self.settings.worker_timeout_s]
        for worker in dead:
            self.remove_worker(worker.identity)
        return dead

    def _release_leases(self, worker: WorkerInfo) -> None:
        for group_id in sorted(worker.leased, key=lambda g: self.dispatch_seq.get(g, 0), reverse=True):
            if group_id in self.generating:
                group, _ = self.generating.pop(group_id)
                group.samples = []
                self.retry_queue.appendleft(group)
                self.counters["groups_requeued"] += 1
            elif group_id in self.scoring:
                group, _ = self.scoring.pop(group_id)
                self.to_score.appendleft(group)
                self.counters["groups_requeued"] += 1
        worker.leased.clear()

    def add_credit(self, identity: bytes, n: int) -> None:
        worker = self.workers[identity]
        worker.credits += n

    # --- admission and dispatch ----------------------------------------------------------------

    @property
    def committed(self) -> int:
        """Groups admitted and not dropped: trained, in training, buffered, or on their way there."""
        return (
            self.counters["groups_trained"]
            + len(self.training)
            + len(self.buffer)
            + len(self.scoring)
            + len(self.to_score)
            + len(self.generating)
            + len(self.retry_queue)
        )

    @property
    def admission_limit(self) -> int:
        s = self.settings
        by_staleness = (self.published_version + s.max_staleness + 1) * s.groups_per_version
        return min(by_staleness, s.num_rollout * s.rollout_batch_size)

    def dispatch(self) -> Outgoing:
        """Hand groups to rollout workers with credits, as far as admission allows."""
        if self.finished:
            return []
        out: Outgoing = []
        batches: dict[bytes, list[Group]] = {}
        while True:
            worker = self._worker_with_credit("rollout")
            if worker is None:
                break
            if self.retry_queue:
                group = self.retry_queue.popleft()
            elif self.committed < self.admission_limit:
                group = self._new_group()
            else:
                break
            group.min_weight_version = self.published_version
            worker.credits -= 1
            worker.leased.add(group.group_id)
            self.generating[group.group_id] = (group, worker.identity)
            self.counters["groups_dispatched"] += 1
            batches.setdefault(worker.identity, []).append(group)
        for identity, groups in batches.items():
            out.append((identity, DispatchGroups(groups=groups)))
        return out

    def _new_group(self) -> Group:
        epoch, prompt = self.cursor.next()
        group_id = f"e{epoch}-p{prompt.index}"
        self.dispatch_seq[group_id] = self._next_seq
        self._next_seq += 1
        return Group(
            group_id=group_id,
            prompt_index=prompt.index,
            epoch=epoch,
            prompt_tokens=prompt.tokens,
            prompt_text=prompt.text,
            label=prompt.label,
            metadata=prompt.metadata,
            n_samples=self.settings.n_samples_per_prompt,
        )

    def _worker_with_credit(self, role: str) -> WorkerInfo | None:
        candidates = [w for w in self.workers.values() if w.role == role and w.credits > 0]
        if not candidates:
            return None
        # The worker with the fewest leases first: spreads work evenly over workers.
        return min(candidates, key=lambda w: (len(w.leased), -w.credits))

    # --- results -------------------------------------------------------------------------------

    def on_generated(self, identity: bytes, groups: list[Group]) -> list[str]:
        """Accept generated groups leased to this worker; others are late duplicates and dropped."""
        accepted = []
        worker = self.workers.get(identity)
        for group in groups:
            lease = self.generating.get(group.group_id)
            if lease is None or lease[1] != identity:
                self.counters["late_results_dropped"] += 1
                continue
            del self.generating[group.group_id]
            if worker is not None:
                worker.leased.discard(group.group_id)
            self.to_score.append(group)
            self.counters["groups_generated"] += 1
            accepted.append(group.group_id)
        return accepted

    def dispatch_scoring(self) -> Outgoing:
        out: Outgoing = []
        batches: dict[bytes, list[Group]] = {}
        while self.to_score:
            worker = self._worker_with_credit("reward")
            if worker is None:
                break
            group = self.to_score.popleft()
            worker.credits -= 1
            worker.leased.add(group.group_id)
            self.scoring[group.group_id] = (group, worker.identity)
            batches.setdefault(worker.identity, []).append(group)
        for identity, groups in batches.items():
            out.append((identity, ScoreGroups(groups=groups)))
        return out

    def on_scored(self, identity: bytes, scores: list[GroupScores]) -> list[str]:
        accepted = []
        worker = self.workers.get(identity)
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
            self._attach_scores(group, score)
            accepted.append(score.group_id)
        return accepted

    def _attach_scores(self, group: Group, score: GroupScores) -> None:
        kept = []
        for sample, reward, failed, reason, extra in zip(
            group.samples, score.rewards, score.failed, score.reasons, score.extras or [{}] * len(score.rewards)
        ):
            if failed:
                sample.status = "failed"
                sample.failure_reason = reason or "reward failed"
                self.counters["samples_failed"] += 1
                continue
            sample.reward = float(reward)
            sample.reward_extra = extra
            kept.append(sample)
        self.counters["groups_scored"] += 1
        if not kept:
            self.counters["groups_failed"] += 1
            return
        group.samples = kept
        self.buffer[group.group_id] = group

    # --- training ------------------------------------------------------------------------------

    def request_batch(self, identity: bytes, step: int, n_groups: int, policy_version: int, now: float) -> None:
        self.pending_batch = PendingBatch(identity, step, n_groups, policy_version, now)

    def try_fill_batch(self, now: float) -> Outgoing:
        """Answer the trainer's pending request if enough trainable groups are buffered."""
        pending = self.pending_batch
        if pending is None:
            return []
        limit = self.settings.max_staleness
        for group_id in [g for g, grp in self.buffer.items() if pending.policy_version - grp.oldest_version > limit]:
            del self.buffer[group_id]
            self.counters["groups_dropped_stale"] += 1
        if len(self.buffer) < pending.n_groups:
            return []
        ordered = sorted(self.buffer, key=lambda g: self.dispatch_seq.get(g, 0))[: pending.n_groups]
        groups = [self.buffer.pop(g) for g in ordered]
        for group in groups:
            self.training[group.group_id] = group
        staleness = [pending.policy_version - g.oldest_version for g in groups]
        stats = {
            "staleness_mean": float(np.mean(staleness)),
            "staleness_max": float(np.max(staleness)),
            "batch_wait_s": now - pending.since,
            # Cumulative busy seconds reported by the workers' heartbeats: the trainer logs them so
            # engine idle time can be computed over any window of steps.
            "rollout_busy_s": self._sum_stat("rollout", "busy_s"),
            "rollout_update_s": self._sum_stat("rollout", "update_s"),
            "reward_busy_s": self._sum_stat("reward", "busy_s"),
        }
        self.pending_batch = None
        return [(pending.identity, TrainBatch(step=pending.step, groups=groups, stats=stats))]

    def _sum_stat(self, role: str, key: str) -> float:
        return float(sum(float(w.stats.get(key, 0.0)) for w in self.workers.values() if w.role == role))

    def on_step_done(self, step: int, group_ids: list[str]) -> Outgoing:
        for group_id in group_ids:
            if self.training.pop(group_id, None) is not None:
                self.counters["groups_trained"] += 1
        self.trained_steps = max(self.trained_steps, step + 1)
        if self.trained_steps >= self.settings.num_rollout:
            self.finished = True
            return [(w.identity, Shutdown(reason="training finished")) for w in self.workers.values()]
        return []

    def on_weights_published(self, version: int, endpoint: str) -> Outgoing:
        if version <= self.published_version and self.weight_endpoint == endpoint:
            return []
        self.published_version = max(self.published_version, version)
        self.weight_endpoint = endpoint
        announce = WeightVersionAnnounce(version=self.published_version, endpoint=endpoint)
        return [(w.identity, announce) for w in self.workers.values() if w.role == "rollout"]

    # --- status --------------------------------------------------------------------------------

    def status(self, now: float) -> dict[str, Any]:
        return {
            "weight_version": self.published_version,
            "step": self.trained_steps,
            "finished": self.finished,
            "admission_limit": self.admission_limit,
            "committed": self.committed,
            "queues": {
                "retry": len(self.retry_queue),
                "generating": len(self.generating),
                "to_score": len(self.to_score),
                "scoring": len(self.scoring),
                "buffered": len(self.buffer),
                "training": len(self.training),
            },
            "counters": dict(self.counters),
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
