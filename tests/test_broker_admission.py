"""Admission on its own: the cursor, the ledger of open and finished groups, the limit, and its journal replay."""

from __future__ import annotations

import numpy as np
import pytest

from vime.broker.admission import Admission, UnknownGroup
from vime.broker.journal import JournalAdmit, JournalDropped, JournalError, JournalRecord, JournalSnapshot
from vime.broker.settings import BrokerSettings
from vime.data.prompts import Prompt, PromptCursor


def make_admission(
    records: list[JournalRecord] | None = None, *, batch: int = 4, staleness: int = 1, interval: int = 1,
    num_rollout: int = 100, n_prompts: int = 10,
) -> Admission:  # fmt: skip
    prompts = [Prompt(i, f"{i}+1=", np.array([i, 10], dtype=np.int32), str(i + 1)) for i in range(n_prompts)]
    settings = BrokerSettings(
        rollout_batch_size=batch, n_samples_per_prompt=2, max_staleness=staleness, update_weights_interval=interval,
        num_rollout=num_rollout, worker_timeout_s=10.0, sampling={},
    )  # fmt: skip
    sink = records if records is not None else []
    return Admission(settings, PromptCursor(prompts, shuffle=True, seed=3), {"groups_admitted": 0}, sink.append)


def test_admitted_groups_follow_the_cursor_in_dispatch_order_and_are_journaled() -> None:
    records: list[JournalRecord] = []
    admission = make_admission(records)
    groups = [admission.admit() for _ in range(12)]  # more than the dataset: the cursor wraps into epoch 1
    assert [admission.order(g.group_id) for g in groups] == list(range(12))
    assert {g.epoch for g in groups} == {0, 1} and len({g.group_id for g in groups}) == 12
    assert all(g.n_samples == 2 and g.samples == [] for g in groups)
    assert [r.group_id for r in records if isinstance(r, JournalAdmit)] == [g.group_id for g in groups]
    assert admission.counters["groups_admitted"] == 12 and admission.committed == 12


def test_dropped_groups_leave_committed_and_keep_their_reason() -> None:
    records: list[JournalRecord] = []
    admission = make_admission(records)
    a, b, c = (admission.admit() for _ in range(3))
    admission.drop(a.group_id, "filtered")
    admission.drop(b.group_id, "stale")
    assert admission.committed == 1
    assert admission.finished.outcome(a.epoch, a.prompt_index) == "filtered"
    assert admission.finished.outcome(b.epoch, b.prompt_index) == "stale"
    assert admission.finished.outcome(c.epoch, c.prompt_index) is None and admission.is_open(c.group_id)
    assert records[-1] == JournalDropped(group_id=b.group_id, reason="stale")
    assert admission.unplaced(placed=[]) == [c.group_id], "dropped groups are accounted for"
    assert admission.unplaced(placed=[c.group_id]) == []
    with pytest.raises(UnknownGroup, match=a.group_id):
        admission.drop(a.group_id, "failed")


def test_released_trained_groups_stay_committed_and_leave_the_open_set() -> None:
    admission = make_admission()
    a, b = admission.admit(), admission.admit()
    admission.release_trained(a.group_id)
    assert admission.committed == 2 and admission.trained_released == 1
    assert list(admission.open) == [b.group_id] and admission.order(a.group_id) == 0
    with pytest.raises(UnknownGroup):
        admission.release_trained(a.group_id)


def test_the_ledger_stays_bounded_over_many_epochs() -> None:
    """However many epochs the job runs, the finished groups cost at most one byte per prompt for the
    epochs still finishing and nothing per group: the open set holds only the groups in play."""
    admission = make_admission(n_prompts=10)
    in_play: list[str] = []
    for i in range(1_000):
        in_play.append(admission.admit().group_id)
        if len(in_play) > 15:  # a window of groups in play, finishing in order
            group_id = in_play.pop(0)
            admission.drop(group_id, "stale") if i % 7 == 0 else admission.release_trained(group_id)
    assert len(admission.open) == 15
    assert admission.finished.total == 985 and admission.committed == admission.finished.counts["trained"] + 15
    assert admission.finished.nbytes <= 2 * 10, "only the epochs still finishing keep a byte per prompt"
    assert admission.finished.outcome(0, 3) == "finished", "a whole epoch folds to its number"


def test_the_limit_is_the_staleness_bound_capped_at_the_jobs_total() -> None:
    admission = make_admission(batch=4, staleness=1, interval=2, num_rollout=5)
    # (version + staleness + 1) * batch * interval, but never more than num_rollout * batch.
    assert admission.base_limit(0) == 16
    assert admission.base_limit(1) == 20 and admission.base_limit(7) == 20
    assert admission.limit(0, kept=0, keep_rate=1.0) == 16


@pytest.mark.parametrize(("kept", "keep_rate", "expected"), [(0, 0.5, 16), (4, 0.5, 12), (8, 0.75, 8 + 0), (2, 0.25, 2 + 24)])
def test_over_sampling_widens_the_limit_by_the_expected_drops(kept: int, keep_rate: float, expected: int) -> None:
    admission = make_admission(batch=4, staleness=1, interval=1)  # base limit 8 at version 0
    assert admission.limit(0, kept=kept, keep_rate=keep_rate) == expected


def test_replaying_the_journal_rebuilds_the_ledger_and_the_cursor() -> None:
    records: list[JournalRecord] = []
    live = make_admission(records)
    groups = [live.admit() for _ in range(7)]
    live.drop(groups[2].group_id, "failed")
    restored = make_admission()
    for record in records:
        restored.replay(record)
    assert restored.open == live.open and restored.finished.counts == live.finished.counts
    assert restored.finished.outcome(groups[2].epoch, groups[2].prompt_index) == "failed"
    assert restored.next_seq == live.next_seq and restored.committed == live.committed
    assert (restored.cursor.epoch, restored.cursor.position) == (live.cursor.epoch, live.cursor.position)
    assert restored.admit().group_id == live.admit().group_id, "the next prompt is the same one"


def test_a_snapshot_restores_finished_groups_and_the_cursor() -> None:
    restored = make_admission()
    snap = JournalSnapshot(
        cursor_epoch=1, cursor_position=3, next_seq=14, published_version=4, weight_endpoint=None, trained_steps=3,
        checkpoint_steps=3, finishing={0: np.array([0, 1, 1, 4, 0, 0, 0, 0, 0, 0], dtype=np.uint8)}, folded_below=0, folded_epochs=[],
        finished_counts={"trained": 2, "stale": 1}, counters={},
    )  # fmt: skip
    restored.restore_snapshot(snap)
    assert [restored.finished.outcome(0, i) for i in range(5)] == [None, "trained", "trained", "stale", None]
    assert not restored.open and restored.committed == 2
    assert restored.next_seq == 14 and (restored.cursor.epoch, restored.cursor.position) == (1, 3)
    group = restored.admit()
    assert restored.order(group.group_id) == 14 and group.epoch == 1


def test_a_journal_that_contradicts_the_ledger_is_refused() -> None:
    records: list[JournalRecord] = []
    live = make_admission(records)
    group = live.admit()
    live.drop(group.group_id, "failed")
    restored = make_admission()
    restored.replay(records[0])
    restored.replay(records[1])
    with pytest.raises(JournalError, match="not open"):
        restored.replay(records[1])  # dropped twice
    with pytest.raises(JournalError, match="admitted twice"):
        restored.replay(records[0])
