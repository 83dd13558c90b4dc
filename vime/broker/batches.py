"""Batch planning: the scored-group buffer, the staleness gate, and each training step's batch.

Owns the buffer of trainable groups, the trainer's pending request, the groups out for training, each
step's batch (kept until the trainer's checkpoint covers it, so a resumed trainer gets the same groups
again) and the trained groups of those steps. A batch takes the earliest deadlines first and waits
rather than strand a group still on its way (docs/broker.md, "Staleness"). Writes the journal records
of its decisions (`JournalBuffered`, `JournalBatch`, `JournalStepDone`, `JournalCheckpoint`) and replays
them. Groups leave through the admission ledger (`GroupLedger`): too stale to train, or trained and
released once no trainer can ask for their step again.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from vime.broker.journal import (
    JournalBatch, JournalBuffered, JournalCheckpoint, JournalDropped, JournalError, JournalRecord, JournalSnapshot,
    JournalStepDone,
)
from vime.broker.settings import BrokerSettings
from vime.broker.staleness import staleness_stats
from vime.protocol.codec import ERROR_CANNOT_RESUME, ProtocolError
from vime.protocol.messages import Group, TrainBatch


class CannotServeStep(ProtocolError):
    """The trainer asked for a step whose batch is gone (before the last checkpoint) or not reachable."""

    def __init__(self, detail: str) -> None:
        super().__init__(ERROR_CANNOT_RESUME, detail)


class GroupLedger(Protocol):
    """What the planner asks of the ledger of admitted groups (`vime.broker.admission.Admission`)."""

    def order(self, group_id: str) -> int: ...
    def is_open(self, group_id: str) -> bool: ...
    def drop(self, group_id: str, reason: str) -> None: ...
    def release_trained(self, group_id: str) -> None: ...


@dataclass
class PendingBatch:
    identity: bytes
    step: int
    n_groups: int
    policy_version: int
    since: float


class BatchPlanner:
    def __init__(
        self, settings: BrokerSettings, counters: dict[str, int], *, ledger: GroupLedger,
        record: Callable[[JournalRecord], None],
    ) -> None:  # fmt: skip
        self.settings = settings
        self.counters = counters
        self._ledger = ledger
        self._record = record
        self.buffer: OrderedDict[str, Group] = OrderedDict()
        self.training: dict[str, Group] = {}
        # Per step (from the last trainer checkpoint on): the group ids of its batch, the payloads of
        # trained groups still replayable by a trainer that resumes from that checkpoint, and the step
        # each of those trained in (a group released with its step is the ledger's).
        self.step_batches: dict[int, list[str]] = {}
        self.retained: dict[str, Group] = {}
        self.trained_in_step: dict[str, int] = {}
        self.trained_steps = 0
        self.checkpoint_steps = 0
        self.pending: PendingBatch | None = None
        # Each buffered group's oldest token version (its deadline is that + max_staleness), read once;
        # and for training groups still generating or scoring, the version their deadline counts from,
        # with how many count from each (what `_would_strand` weighs).
        self._oldest: dict[str, int] = {}
        self._in_flight: dict[str, int] = {}
        self._in_flight_versions: Counter[int] = Counter()
        # The oldest token version in the buffer (None: recompute), so the gate scans the buffer only
        # when some group may have turned stale rather than on every event.
        self._oldest_buffered: int | None = None
        # A request that had to wait is looked at again only once something it depends on changed (the
        # buffer, the groups in flight, the request): the server asks after every burst of messages.
        self._changes = 0
        self._waited_at = -1

    @property
    def done(self) -> bool:
        """Every training step of the job is trained."""
        return self.trained_steps >= self.settings.num_rollout

    @property
    def kept(self) -> int:
        """Groups kept for training and not released: buffered, out for training, or trained in a step
        a trainer may still ask for."""
        return len(self.trained_in_step) + len(self.training) + len(self.buffer)

    def add(self, group: Group) -> None:
        """A scored, kept training group becomes trainable (journaled with its samples)."""
        self._buffer(group)
        self._record(JournalBuffered(group=group))

    def _buffer(self, group: Group) -> None:
        oldest = group.oldest_version
        self.buffer[group.group_id] = group
        self._oldest[group.group_id] = oldest
        if self._oldest_buffered is not None:
            self._oldest_buffered = min(self._oldest_buffered, oldest)
        self._changes += 1

    def _unbuffer(self, group_id: str) -> Group:
        self._oldest.pop(group_id, None)
        self._oldest_buffered = None
        self._changes += 1
        return self.buffer.pop(group_id)

    def track_in_flight(self, group_id: str, version: int) -> None:
        """A training group is generating or scoring; its deadline counts from `version` (its oldest
        token's once generated, else the version it was dispatched with: a lower bound)."""
        self.untrack_in_flight(group_id)
        self._in_flight[group_id] = version
        self._in_flight_versions[version] += 1
        self._changes += 1

    def untrack_in_flight(self, group_id: str) -> None:
        """A training group stopped generating or scoring (scored, or back in the retry queue)."""
        version = self._in_flight.pop(group_id, None)
        if version is not None:
            self._in_flight_versions[version] -= 1
            if not self._in_flight_versions[version]:
                del self._in_flight_versions[version]
            self._changes += 1

    def forget_trainer(self, identity: bytes) -> None:
        """The trainer left: its pending request goes with it."""
        if self.pending is not None and self.pending.identity == identity:
            self.pending = None

    # --- requests and batches ------------------------------------------------------------------

    def request(self, identity: bytes, step: int, n_groups: int, policy_version: int, now: float) -> TrainBatch | None:
        """Record the trainer's request for step `step`; a step that already has a batch gets the same
        groups again at once (a lost reply, a restarted broker, or a trainer resumed from a checkpoint).

        Raises CannotServeStep for a finished step whose batch was released (it is before the last
        checkpoint the trainer reported): the trainer resumed from the wrong place.
        """
        self.pending = None
        self._changes += 1
        if step in self.step_batches:
            return self._resend(step, policy_version)
        if step < self.trained_steps:
            raise CannotServeStep(
                f"the trainer asked for step {step}, but the job has trained {self.trained_steps} steps and released "
                f"the batches before step {self.checkpoint_steps} when the trainer reported a checkpoint there: resume "
                "the trainer from that checkpoint or a later one (--load latest)"
            )  # fmt: skip
        self.pending = PendingBatch(identity, step, n_groups, policy_version, now)
        return None

    def _resend(self, step: int, policy_version: int) -> TrainBatch:
        groups = [self.training[g] if g in self.training else self.retained[g] for g in self.step_batches[step]]
        replayed = step < self.trained_steps
        self.counters["steps_replayed" if replayed else "batches_resent"] += 1
        stats = {**staleness_stats(groups, policy_version), "batch_wait_s": 0.0}
        return TrainBatch(step=step, groups=groups, stats=stats, replayed=replayed)

    def fill(self, now: float, keep_rate: float) -> tuple[bytes, TrainBatch] | None:
        """The pending request's batch if enough trainable groups are buffered, with its recipient.

        `keep_rate`: the fraction of the groups still in flight the filter is expected to keep (see
        `_would_strand`). A request that waits may go after any change to the buffer or the groups in
        flight (a group generated, not only one scored).
        """
        pending = self.pending
        if pending is None or self._changes == self._waited_at:
            return None
        self._drop_stale(pending.policy_version)
        if len(self.buffer) < pending.n_groups:
            self._waited_at = self._changes
            return None
        oldest, order = self._oldest, self._ledger.order
        by_deadline = sorted(self.buffer, key=lambda g: (oldest[g], order(g)))
        ordered = by_deadline[: pending.n_groups]
        if self._would_strand(pending, by_deadline[pending.n_groups :], keep_rate):
            self._waited_at = self._changes
            return None
        groups = [self._unbuffer(g) for g in ordered]
        for group in groups:
            self.training[group.group_id] = group
        self.step_batches[pending.step] = list(ordered)
        self._record(JournalBatch(step=pending.step, group_ids=list(ordered), policy_version=pending.policy_version))
        self.pending = None
        stats = {**staleness_stats(groups, pending.policy_version), "batch_wait_s": now - pending.since}
        return pending.identity, TrainBatch(step=pending.step, groups=groups, stats=stats)

    def _drop_stale(self, policy_version: int) -> None:
        """The gate: buffered groups older than max_staleness versions at `policy_version` leave."""
        limit = self.settings.max_staleness
        if self._oldest_buffered is None:
            self._oldest_buffered = min(self._oldest.values(), default=policy_version)
        if policy_version - self._oldest_buffered <= limit:
            return
        for group_id in [g for g, oldest in self._oldest.items() if policy_version - oldest > limit]:
            self._unbuffer(group_id)
            self.counters["groups_dropped_stale"] += 1
            self._ledger.drop(group_id, "stale")

    def _would_strand(self, pending: PendingBatch, left_buffered: list[str], keep_rate: float) -> bool:
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
        limit = self.settings.max_staleness
        left = Counter(self._oldest[g] + limit for g in left_buffered)
        if not self._fits(left, pending):
            return False
        versions = self._in_flight_versions
        if not versions:
            return False
        # With a dynamic sampling filter only a fraction of them will be kept: count that many of the most urgent.
        # Those already past their deadline are lost to the gate whatever happens: no reason to wait.
        savable = sorted((v + limit, n) for v, n in versions.items() if v + limit >= pending.policy_version)
        expected = math.ceil(sum(n for _, n in savable) * keep_rate - 1e-9)
        due = left.copy()
        for deadline, n in savable:
            if expected <= 0:
                break
            due[deadline] += min(n, expected)
            expected -= n
        return not self._fits(due, pending)

    def _fits(self, deadlines: Counter[int], pending: PendingBatch) -> bool:
        """Can groups with these deadlines (deadline -> how many) all be trained by later steps, each
        `n_groups` slots, earliest deadline first? Groups beyond the job's last step count as fitting:
        they would be surplus anyway."""
        total = sum(deadlines.values())
        if not total:
            return True
        u = self.settings.update_weights_interval
        due = sorted(deadlines.items())
        placed = 0  # groups due before the current step's version
        i = 0
        slots = 0
        step = pending.step + 1
        while placed < total:
            if step >= self.settings.num_rollout:
                return True  # the rest would go unused even with more slots: surplus, not stranded
            version = pending.policy_version + (step // u - pending.step // u)
            while i < len(due) and due[i][0] < version:
                placed += due[i][1]
                i += 1
            if placed > slots:
                return False
            slots += pending.n_groups
            step += 1
        return True

    # --- finished steps and checkpoints --------------------------------------------------------

    def step_done(self, step: int, group_ids: list[str]) -> bool:
        """The trainer finished `step`; True if that is news (journaled then). Idempotent: a repeated
        report (after a reconnect, or of a replayed step) changes nothing. The broker's record of the
        step's batch decides which groups were trained; a report naming other groups, or a step that never
        had a batch, is counted as a bad message."""
        ids = self.step_batches.get(step)
        if ids is None:
            if step >= self.trained_steps:
                self.counters["bad_messages"] += 1
            return False
        if sorted(group_ids) != sorted(ids):
            self.counters["bad_messages"] += 1
        newly_done = step >= self.trained_steps or any(g in self.training for g in ids)
        self._apply_step_done(step)
        if newly_done:
            self._record(JournalStepDone(step=step, counters=dict(self.counters)))
        return newly_done

    def _apply_step_done(self, step: int) -> None:
        """Move step `step`'s groups from training to trained."""
        for group_id in self.step_batches.get(step, []):
            group = self.training.pop(group_id, None)
            if group is not None and self.settings.retain_until_checkpoint:
                self.retained[group_id] = group
            first = self.trained_in_step.get(group_id)
            if first not in (None, step) or (first is None and not self._ledger.is_open(group_id)):
                self.counters["groups_trained_twice"] += 1  # in another step, or in one already released
            elif first is None:
                self.trained_in_step[group_id] = step
                if group is not None:
                    self.counters["groups_trained"] += 1
        self.trained_steps = max(self.trained_steps, step + 1)
        if not self.settings.retain_until_checkpoint:
            self._release_before(self.trained_steps)

    def checkpoint(self, steps_done: int) -> None:
        """The trainer saved a resumable checkpoint after `steps_done` steps: it will never ask for an
        earlier step again, so those batches are released."""
        if steps_done <= self.checkpoint_steps:
            return
        self._release_before(steps_done)
        self._record(JournalCheckpoint(steps_done=steps_done))

    def _release_before(self, steps_done: int) -> None:
        self.checkpoint_steps = max(self.checkpoint_steps, min(steps_done, self.trained_steps))
        for step in [s for s in self.step_batches if s < self.checkpoint_steps]:
            for group_id in self.step_batches.pop(step):
                self.retained.pop(group_id, None)
                if self.trained_in_step.pop(group_id, None) is not None:
                    self._ledger.release_trained(group_id)

    # --- restore -------------------------------------------------------------------------------

    def replay(self, record: JournalRecord) -> None:
        """Apply one of this part's journal records (others are ignored). Raises JournalError when the
        journal contradicts itself."""
        if isinstance(record, JournalBuffered):
            group_id = record.group.group_id
            if group_id in self.buffer or group_id in self.training or group_id in self.trained_in_step:
                raise JournalError(f"journal: group {group_id} buffered twice")
            self._buffer(record.group)
        elif isinstance(record, JournalDropped):
            if record.group_id in self.buffer:
                self._unbuffer(record.group_id)
        elif isinstance(record, JournalBatch):
            missing = [g for g in record.group_ids if g not in self.buffer]
            if missing:
                raise JournalError(f"journal: step {record.step}'s batch names groups not in the buffer: {missing[:5]}")
            for group_id in record.group_ids:
                self.training[group_id] = self._unbuffer(group_id)
            self.step_batches[record.step] = list(record.group_ids)
        elif isinstance(record, JournalStepDone):
            self._apply_step_done(record.step)
        elif isinstance(record, JournalCheckpoint):
            self._release_before(record.steps_done)

    def restore_snapshot(self, snap: JournalSnapshot) -> None:
        """A compacted journal's snapshot: the steps done and the checkpoint (the finished groups are the
        ledger's)."""
        self.trained_steps = snap.trained_steps
        self.checkpoint_steps = snap.checkpoint_steps
        self.trained_in_step = {}

    def finish_restore(self) -> None:
        """After the replay: the buffer in dispatch order, as it was built live."""
        self.buffer = OrderedDict(sorted(self.buffer.items(), key=lambda kv: self._ledger.order(kv[0])))
