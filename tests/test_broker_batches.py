"""Batch planning on its own: the gate, earliest-deadline batches, waiting for stranded groups, step
batches kept until a checkpoint, and its journal replay."""

from __future__ import annotations

import numpy as np
import pytest

from vime.broker.batches import BatchPlanner, CannotServeStep
from vime.broker.journal import JournalBatch, JournalBuffered, JournalCheckpoint, JournalRecord, JournalStepDone
from vime.broker.settings import BrokerSettings
from vime.protocol.messages import Group, Sample, TrainBatch

TRAINER = b"t0"
COUNTERS = ("groups_trained", "groups_dropped_stale", "groups_trained_twice", "bad_messages", "steps_replayed", "batches_resent")


class FakeLedger:
    """The admission ledger as the planner sees it: dispatch order by group number, every group open
    until dropped or released."""

    def __init__(self) -> None:
        self.dropped: dict[str, str] = {}
        self.released: list[str] = []

    def order(self, group_id: str) -> int:
        return int(group_id[1:])

    def is_open(self, group_id: str) -> bool:
        return group_id not in self.dropped and group_id not in self.released

    def drop(self, group_id: str, reason: str) -> None:
        self.dropped[group_id] = reason

    def release_trained(self, group_id: str) -> None:
        self.released.append(group_id)


class Harness:
    """A planner with a recording journal and a fake admission ledger."""

    def __init__(self, *, staleness: int = 1, batch: int = 2, num_rollout: int = 10, retain: bool = False) -> None:
        self.settings = BrokerSettings(
            rollout_batch_size=batch, n_samples_per_prompt=1, max_staleness=staleness, update_weights_interval=1,
            num_rollout=num_rollout, worker_timeout_s=10.0, sampling={}, retain_until_checkpoint=retain,
        )  # fmt: skip
        self.records: list[JournalRecord] = []
        self.ledger = FakeLedger()
        self.planner = self.new_planner(self.ledger)

    def new_planner(self, ledger: FakeLedger) -> BatchPlanner:
        counters = dict.fromkeys(COUNTERS, 0)
        return BatchPlanner(self.settings, counters, ledger=ledger, record=self.records.append)


def group(number: int, version: int) -> Group:
    sample = Sample(
        index=0, response_tokens=np.ones(2, dtype=np.int32), rollout_logprobs=np.zeros(2, dtype=np.float32),
        loss_mask=np.ones(2, dtype=np.uint8), token_versions=np.full(2, version, dtype=np.int32), finish_reason="stop",
    )  # fmt: skip
    return Group(group_id=f"g{number}", prompt_index=number, epoch=0, prompt_tokens=np.array([1], dtype=np.int32),
                 prompt_text="", label="", n_samples=1, samples=[sample])  # fmt: skip


def batch_of(filled: tuple[bytes, TrainBatch] | None) -> list[str]:
    assert filled is not None
    identity, batch = filled
    assert identity == TRAINER
    return [g.group_id for g in batch.groups]


def test_a_request_waits_for_enough_groups_then_takes_the_earliest_deadlines() -> None:
    h = Harness(staleness=2, batch=2)
    p = h.planner
    assert p.request(TRAINER, step=0, n_groups=2, policy_version=2, now=1.0) is None
    p.add(group(0, version=2))
    assert p.fill(1.5, 1.0) is None, "one group is not a batch of two"
    p.add(group(1, version=1))
    p.add(group(2, version=1))
    filled = p.fill(4.0, 1.0)
    assert batch_of(filled) == ["g1", "g2"], "version 1 is due before version 2; ties go by dispatch order"
    assert filled[1].stats["batch_wait_s"] == 3.0 and filled[1].stats["staleness_max"] == 1.0
    assert list(p.buffer) == ["g0"] and set(p.training) == {"g1", "g2"} and p.pending is None
    assert isinstance(h.records[-1], JournalBatch) and h.records[-1].group_ids == ["g1", "g2"]
    assert sum(isinstance(r, JournalBuffered) for r in h.records) == 3


def test_the_gate_drops_groups_older_than_max_staleness() -> None:
    h = Harness(staleness=1, batch=1)
    p = h.planner
    p.add(group(0, version=0))
    p.add(group(1, version=2))
    p.request(TRAINER, step=0, n_groups=1, policy_version=2, now=0.0)
    assert batch_of(p.fill(0.0, 1.0)) == ["g1"]
    assert h.ledger.dropped == {"g0": "stale"} and p.counters["groups_dropped_stale"] == 1


def test_a_batch_waits_rather_than_strand_a_group_still_generating() -> None:
    h = Harness(staleness=1, batch=1, num_rollout=10)
    p = h.planner
    p.add(group(1, version=1))
    p.add(group(2, version=1))
    p.request(TRAINER, step=1, n_groups=1, policy_version=1, now=0.0)
    # One step at version 1 (this one) and one at version 2 are left for deadline-2 groups: both buffered
    # ones fit, but a third group dispatched at version 1 and still generating would not.
    p.track_in_flight("g3", version=1)
    assert p.fill(0.0, 1.0) is None, "waits for the unfinished group"
    assert p.fill(0.0, 0.0) is None, "nothing changed since: not looked at again"
    p.track_in_flight("g4", version=5)  # in the broker, the keep rate changes only as groups move
    assert p.fill(0.0, 0.0) is not None, "a filter expected to drop them: nothing to wait for"


def test_a_batch_goes_once_the_group_it_waited_for_is_no_longer_in_flight() -> None:
    h = Harness(staleness=1, batch=1, num_rollout=10)
    p = h.planner
    p.add(group(1, version=1))
    p.add(group(2, version=1))
    p.track_in_flight("g3", version=1)
    p.request(TRAINER, step=1, n_groups=1, policy_version=1, now=0.0)
    assert p.fill(0.0, 1.0) is None
    p.untrack_in_flight("g3")  # scored and dropped by the filter, say
    assert batch_of(p.fill(0.0, 1.0)) == ["g1"]


def test_step_done_is_idempotent_and_checks_the_groups() -> None:
    h = Harness(batch=1)
    p = h.planner
    p.add(group(0, version=0))
    p.request(TRAINER, step=0, n_groups=1, policy_version=0, now=0.0)
    p.fill(0.0, 1.0)
    assert p.step_done(0, ["g0"]) is True
    assert p.step_done(0, ["g0"]) is False, "a repeated report changes nothing"
    assert p.counters["groups_trained"] == 1 and p.trained_steps == 1
    assert not p.trained_in_step and h.ledger.released == ["g0"], "no checkpoints: released at once"
    assert sum(isinstance(r, JournalStepDone) for r in h.records) == 1
    assert p.step_done(5, []) is False and p.counters["bad_messages"] == 1, "a step that never had a batch"


def test_a_group_trained_again_after_its_step_was_released_counts_twice() -> None:
    h = Harness(batch=1)
    p = h.planner
    for step in range(2):
        p.add(group(0, version=step))  # the same group buffered again: a bookkeeping fault upstream
        p.request(TRAINER, step=step, n_groups=1, policy_version=step, now=0.0)
        p.fill(0.0, 1.0)
        p.step_done(step, ["g0"])
    assert p.counters["groups_trained_twice"] == 1 and p.counters["groups_trained"] == 1
    assert h.ledger.released == ["g0"]


def test_batches_stay_replayable_until_a_checkpoint_covers_them() -> None:
    h = Harness(batch=1, retain=True)
    p = h.planner
    for step in range(3):
        p.add(group(step, version=step))
        p.request(TRAINER, step=step, n_groups=1, policy_version=step, now=0.0)
        p.fill(0.0, 1.0)
        p.step_done(step, [f"g{step}"])
    replay = p.request(TRAINER, step=1, n_groups=1, policy_version=1, now=0.0)
    assert replay is not None and replay.replayed and [g.group_id for g in replay.groups] == ["g1"]
    assert p.counters["steps_replayed"] == 1
    assert p.trained_in_step == {"g0": 0, "g1": 1, "g2": 2} and not h.ledger.released
    p.checkpoint(2)
    assert isinstance(h.records[-1], JournalCheckpoint) and set(p.step_batches) == {2} and set(p.retained) == {"g2"}
    assert h.ledger.released == ["g0", "g1"] and p.trained_in_step == {"g2": 2}
    with pytest.raises(CannotServeStep):
        p.request(TRAINER, step=1, n_groups=1, policy_version=1, now=0.0)


def test_replaying_the_journal_rebuilds_the_planner() -> None:
    h = Harness(staleness=1, batch=2, retain=True)
    p = h.planner
    version = 0
    for step in range(4):
        for k in range(3):  # one more group than a batch: the buffer carries groups across steps
            p.add(group(3 * step + k, version=version))
        p.request(TRAINER, step=step, n_groups=2, policy_version=version, now=0.0)
        sent = batch_of(p.fill(0.0, 1.0))
        if step < 3:
            p.step_done(step, sent)  # the last step's batch stays out for training
        if step == 1:
            p.checkpoint(2)
        version += 1
    ledger = FakeLedger()
    restored = h.new_planner(ledger)
    for record in h.records:
        restored.replay(record)
    restored.finish_restore()
    assert list(restored.buffer) == list(p.buffer)
    assert set(restored.training) == set(p.training) and restored.step_batches == p.step_batches
    assert set(restored.retained) == set(p.retained) and restored.trained_in_step == p.trained_in_step
    assert ledger.released == h.ledger.released and ledger.dropped == h.ledger.dropped
    assert (restored.trained_steps, restored.checkpoint_steps) == (p.trained_steps, p.checkpoint_steps)
    again = restored.request(TRAINER, step=3, n_groups=2, policy_version=3, now=0.0)
    assert again is not None and [g.group_id for g in again.groups] == p.step_batches[3], "the batch out for training"
