"""The broker's durable journal: file format, crash recovery at any point, replay of steps, compaction.

The central test drives a `BrokerState` through a random job (workers generating, failing and dying,
a dynamic-sampling filter dropping groups, a trainer that saves checkpoints and is resumed) with the
journal written to a real file, "kills" the broker at random points (a new state restored from the file,
the old one thrown away with everything in flight), and checks at the end that every prompt was trained
exactly once, `groups_lost` and `groups_trained_twice` are 0, and each step's batch is the same however
often it was asked for.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest

from vime.broker.journal import JournalError, JournalWriter, encode_record, read_journal
from vime.broker.recovery import compacted, header_for, restore, steps_recorded
from vime.broker.batches import CannotServeStep
from vime.broker.settings import BrokerSettings
from vime.broker.state import BrokerState
from vime.data.prompts import Prompt, PromptCursor
from vime.filters import FilterDecision
from vime.protocol.messages import DispatchGroups, Group, GroupScores, Sample, ScoreGroups, TrainBatch

ROLLOUT, REWARD, TRAINER = b"r1", b"w1", b"t0"
N_PROMPTS = 48


def make_state(*, batch: int = 4, staleness: int = 1, num_rollout: int = 12, retain: bool = True,
               prompts: int = N_PROMPTS, with_filter: bool = False) -> BrokerState:  # fmt: skip
    rows = [Prompt(i, f"{i}+1=", np.array([i, 10], dtype=np.int32), str(i + 1)) for i in range(prompts)]
    settings = BrokerSettings(
        rollout_batch_size=batch, n_samples_per_prompt=2, max_staleness=staleness, update_weights_interval=1,
        num_rollout=num_rollout, worker_timeout_s=10.0, sampling={"temperature": 1.0, "top_p": 1.0, "max_tokens": 4},
        retain_until_checkpoint=retain,
    )  # fmt: skip

    def drop_every_seventh(group: Group) -> FilterDecision:
        keep = group.prompt_index % 7 != 3
        return FilterDecision(keep=keep, reason=None if keep else "seventh")

    return BrokerState(settings, PromptCursor(rows, shuffle=True, seed=5), group_filter=drop_every_seventh if with_filter else None)


def connect(state: BrokerState, credits: int = 6) -> None:
    state.register(ROLLOUT, "rollout-1", "rollout", now=0.0)
    state.register(REWARD, "reward-1", "reward", now=0.0)
    state.register(TRAINER, "trainer-0", "trainer", now=0.0)
    state.add_credit(ROLLOUT, credits)
    state.add_credit(REWARD, credits)


def generated(group: Group, version: int, rng: random.Random) -> Group:
    length = rng.randint(1, 5)
    group.samples = [
        Sample(
            index=i, response_tokens=np.arange(length, dtype=np.int32), rollout_logprobs=np.full(length, -0.5, dtype=np.float32),
            loss_mask=np.ones(length, dtype=np.uint8), token_versions=np.full(length, version, dtype=np.int32), finish_reason="stop",
        )  # fmt: skip
        for i in range(group.n_samples)
    ]
    return group


class Journaled:
    """A BrokerState whose journal goes to a real file, with a `crash()` that restores from it."""

    def __init__(self, path: Path, **kwargs: object) -> None:
        self.path, self.kwargs = path, kwargs
        self.state = make_state(**kwargs)  # type: ignore[arg-type]
        self.writer = JournalWriter(path, fsync="never")
        self.writer.append(header_for(self.state))
        self.state.journal = self.writer
        self.crashes = 0

    def flush(self) -> None:
        self.writer.flush()

    def crash(self, compact: bool = False) -> None:
        """The broker dies: everything not in the file is gone; a new one restores and workers rejoin."""
        self.flush()
        self.writer.close()
        records, intact = read_journal(self.path)
        self.state = make_state(**self.kwargs)  # type: ignore[arg-type]
        restore(self.state, records)
        self.writer = JournalWriter(self.path, fsync="never", truncate_to=intact)
        if compact:
            self.writer.rewrite(compacted(self.state))
        self.state.journal = self.writer
        connect(self.state)
        self.crashes += 1


def test_journal_file_round_trip_torn_tail_and_damage(tmp_path: Path) -> None:
    state = make_state()
    writer = JournalWriter(tmp_path / "j", fsync="always")
    writer.append(header_for(state))
    group = generated(state.admission.group_for(0, 3), version=2, rng=random.Random(0))
    from vime.broker.journal import JournalBuffered, JournalStepDone

    writer.append(JournalBuffered(group=group))
    writer.append(JournalStepDone(step=4, counters={"groups_trained": 7}))
    writer.flush()
    writer.close()
    records, intact = read_journal(tmp_path / "j")
    assert [type(r).__name__ for r in records] == ["JournalHeader", "JournalBuffered", "JournalStepDone"]
    back = records[1].group  # type: ignore[attr-defined]
    assert back.group_id == group.group_id
    assert np.array_equal(back.samples[1].token_versions, group.samples[1].token_versions)
    assert steps_recorded(records) == 5
    data = (tmp_path / "j").read_bytes()
    assert intact == len(data)

    # The broker died in the middle of writing a record: the torn record is dropped, the rest kept.
    torn = data + encode_record(JournalStepDone(step=5))[:-3]
    (tmp_path / "j").write_bytes(torn)
    records, intact = read_journal(tmp_path / "j")
    assert len(records) == 3 and intact == len(data)

    # A flipped byte inside an earlier record is damage, reported with its offset, never skipped.
    damaged = bytearray(data + encode_record(JournalStepDone(step=5)))
    damaged[len(data) // 2] ^= 0xFF
    (tmp_path / "j").write_bytes(bytes(damaged))
    with pytest.raises(JournalError, match="at byte"):
        read_journal(tmp_path / "j")


def test_journal_of_another_dataset_is_refused(tmp_path: Path) -> None:
    state = make_state()
    records = [header_for(state)]
    other = make_state(prompts=N_PROMPTS + 1)
    with pytest.raises(JournalError, match="different job.*dataset"):
        restore(other, records)


def drive(job: Journaled, rng: random.Random, *, crash_p: float, trainer_resume_p: float) -> dict[int, list[str]]:
    """Run the job to the end with random event order, worker deaths, broker crashes and trainer resumes.
    Returns the batch the trainer trained for each step (the last time it trained that step)."""
    trained: dict[int, list[str]] = {}
    step, version = 0, 0
    saved = 0  # the trainer's last resumable checkpoint (steps done)
    current: list[str] | None = None  # the batch the trainer holds for `step`
    generating: list[Group] = []
    scoring: list[Group] = []
    connect(job.state)
    job.state.on_weights_published(0, "tcp://w:1")
    for _ in range(20_000):
        state = job.state
        if state.training_done and step >= state.settings.num_rollout:
            break
        event = rng.random()
        if event < crash_p:
            job.crash(compact=rng.random() < 0.5)
            generating, scoring = [], []  # their late results would be dropped: unknown peers
            job.state.on_weights_published(version, "tcp://w:1")  # the trainer re-sends if unacked; idempotent
            continue
        if event < crash_p + trainer_resume_p and saved < step:
            step, current = saved, None  # the trainer is killed and resumed from its checkpoint
            continue
        generating += [g for _, m in state.dispatch() if isinstance(m, DispatchGroups) for g in m.groups]
        if generating and rng.random() < 0.5:
            group = generating.pop(rng.randrange(len(generating)))
            state.on_generated(ROLLOUT, [generated(group, state.published_version, rng)])
            state.add_credit(ROLLOUT, 1)
        scoring += [g for _, m in state.dispatch_scoring() if isinstance(m, ScoreGroups) for g in m.groups]
        if scoring and rng.random() < 0.5:
            group = scoring.pop(rng.randrange(len(scoring)))
            failed = [rng.random() < 0.1] * len(group.samples)  # now and then a whole group fails
            rewards = [float(rng.random()) for _ in group.samples]
            state.on_scored(REWARD, [GroupScores(group_id=group.group_id, rewards=rewards, failed=failed, reasons=[None] * len(rewards))])
            state.add_credit(REWARD, 1)
        # The trainer asks (again, if its batch is still out: a lost reply or a restarted broker) ...
        out = state.request_batch(TRAINER, step, state.settings.rollout_batch_size, version, now=0.0) or state.try_fill_batch(now=0.0)
        batches = [m for _, m in out if isinstance(m, TrainBatch)]
        if batches:
            assert batches[0].step == step
            ids = [g.group_id for g in batches[0].groups]
            if step in trained and step < state.trained_steps:
                assert ids == trained[step], "a replayed step must get exactly the groups it had"
            if current is not None:
                assert ids == current, "a batch asked for again must be the same"
            current = ids
        # ... and finishes the step only some of the time, so crashes also hit steps in training.
        if current is not None and rng.random() < 0.5:
            ids, current = current, None
            trained[step] = ids
            state.on_step_done(step, ids)
            step += 1
            version += 1
            state.on_weights_published(version, "tcp://w:1")
            if step % 3 == 0:
                saved = step
                state.on_checkpoint(saved)
        job.flush()
    else:
        raise AssertionError("the simulated job did not finish")
    return trained


@pytest.mark.parametrize("seed", range(6))
def test_random_crashes_lose_nothing_and_train_nothing_twice(tmp_path: Path, seed: int) -> None:
    job = Journaled(tmp_path / "broker.journal", with_filter=seed % 2 == 1)
    trained = drive(job, random.Random(seed), crash_p=0.01, trainer_resume_p=0.004)
    state = job.state
    assert job.crashes > 0
    ids = [g for step in sorted(trained) for g in trained[step]]
    assert sorted(trained) == list(range(state.settings.num_rollout))
    assert len(ids) == len(set(ids)), "a group was trained in two steps"
    assert state.groups_lost == 0
    assert state.counters["groups_trained_twice"] == 0
    assert state.counters["broker_restarts"] == job.crashes
    # Every admitted group (epoch, prompt) is trained once, dropped for a recorded reason, or still in the
    # pipeline (admission runs ahead of the last step); none is two of these.
    in_pipeline = {g.group_id for g in state.in_flight.retry} | set(state.batches.buffer) | set(state.in_flight.generating) | set(state.in_flight.scoring)
    in_pipeline |= {g.group_id for g in state.in_flight.to_score}
    live_trained = set(state.batches.trained_in_step)
    assert set(state.admission.open) == in_pipeline | live_trained
    assert not in_pipeline & set(ids) and live_trained <= set(ids)
    finished = state.admission.finished
    assert finished.counts["trained"] + len(live_trained) == len(ids)
    assert finished.total + len(in_pipeline) + len(live_trained) == state.counters["groups_admitted"]
    assert sum(finished.counts[r] for r in ("failed", "filtered", "stale")) == sum(
        state.counters[k] for k in ("groups_failed", "groups_filtered", "groups_dropped_stale")
    )


def test_restored_state_matches_the_live_one(tmp_path: Path) -> None:
    """Restore at many points of a run and compare every durable part with the live state."""
    rng = random.Random(11)
    job = Journaled(tmp_path / "broker.journal")
    connect(job.state)
    state = job.state
    state.on_weights_published(0, "tcp://w:1")
    in_flight: list[Group] = []
    step = 0
    for i in range(400):
        in_flight += [g for _, m in state.dispatch() if isinstance(m, DispatchGroups) for g in m.groups]
        if in_flight and rng.random() < 0.6:
            group = in_flight.pop(0)
            state.on_generated(ROLLOUT, [generated(group, state.published_version, rng)])
            state.add_credit(ROLLOUT, 1)
        for _, msg in state.dispatch_scoring():
            assert isinstance(msg, ScoreGroups)
            scores = [GroupScores(group_id=g.group_id, rewards=[1.0, 0.0], failed=[False, False], reasons=[None, None]) for g in msg.groups]
            state.on_scored(REWARD, scores)
            state.add_credit(REWARD, len(scores))
        out = state.request_batch(TRAINER, step, 4, step, now=0.0) or state.try_fill_batch(now=0.0)
        if out and not state.training_done:
            state.on_step_done(step, [g.group_id for g in out[0][1].groups])  # type: ignore[attr-defined]
            step += 1
            state.on_weights_published(step, "tcp://w:1")
            if step % 2 == 0:
                state.on_checkpoint(step)
        if i % 37 == 0:
            job.flush()
            records, _ = read_journal(job.path)
            for source in (records, compacted(state)):
                restored = make_state()
                restore(restored, list(source))
                assert list(restored.batches.buffer) == list(state.batches.buffer)
                assert set(restored.batches.training) == set(state.batches.training)
                assert restored.batches.step_batches == state.batches.step_batches
                assert set(restored.batches.retained) == set(state.batches.retained)
                assert set(restored.batches.trained_in_step) == set(state.batches.trained_in_step)
                assert restored.admission.open == state.admission.open
                assert restored.admission.finished.counts == state.admission.finished.counts
                assert (restored.trained_steps, restored.batches.checkpoint_steps) == (state.trained_steps, state.batches.checkpoint_steps)
                assert restored.published_version == state.published_version
                assert restored.weight_endpoint is None, "a restored broker must not send workers to a dead publisher"
                assert (restored.admission.cursor.epoch, restored.admission.cursor.position) == (state.admission.cursor.epoch, state.admission.cursor.position)
                unfinished = [g.group_id for g in state.in_flight.retry] + list(state.in_flight.generating) + list(state.in_flight.scoring)
                unfinished += [g.group_id for g in state.in_flight.to_score]
                assert sorted(g.group_id for g in restored.in_flight.retry) == sorted(unfinished)
                for key in ("groups_admitted", "groups_trained", "groups_failed", "groups_dropped_stale"):
                    assert restored.counters[key] == state.counters[key], key
                assert restored.groups_lost == 0
    assert step > 4


def _buffer_everything_dispatched(state: BrokerState) -> None:
    """Connect the workers, publish version 0, then generate and score every group dispatched."""
    connect(state, credits=20)
    state.on_weights_published(0, "tcp://w:1")
    rng = random.Random(0)
    for group in [g for _, m in state.dispatch() if isinstance(m, DispatchGroups) for g in m.groups]:
        state.on_generated(ROLLOUT, [generated(group, 0, rng)])
    for _, msg in state.dispatch_scoring():
        scores = [GroupScores(group_id=g.group_id, rewards=[1.0, 0.5], failed=[False] * 2, reasons=[None] * 2) for g in msg.groups]  # type: ignore[attr-defined]
        state.on_scored(REWARD, scores)


def test_trainer_resume_replays_kept_steps_and_refuses_released_ones() -> None:
    state = make_state(batch=2, staleness=3, num_rollout=10)
    _buffer_everything_dispatched(state)
    batches = {}
    for step in range(4):
        out = state.request_batch(TRAINER, step, 2, 0, now=0.0) or state.try_fill_batch(now=0.0)
        batches[step] = [g.group_id for g in out[0][1].groups]  # type: ignore[attr-defined]
        state.on_step_done(step, batches[step])
        if step == 1:
            state.on_checkpoint(2)
    # A trainer resumed from the checkpoint after step 2 gets steps 2 and 3 again, the same groups.
    for step in (2, 3):
        out = state.request_batch(TRAINER, step, 2, 5, now=0.0)
        assert [g.group_id for g in out[0][1].groups] == batches[step]  # type: ignore[attr-defined]
        state.on_step_done(step, batches[step])
    assert state.counters["steps_replayed"] == 2
    assert state.counters["groups_trained"] == 8 and state.counters["groups_trained_twice"] == 0
    # Steps before the checkpoint were released: asking for them is an error that says what to do.
    with pytest.raises(CannotServeStep, match="--load latest"):
        state.request_batch(TRAINER, 1, 2, 5, now=0.0)


def test_broker_restarts_counts_every_restart_and_counters_survive_them(tmp_path: Path) -> None:
    """Issue 15: two restarts read `broker_restarts == 1`. A restart rewrites the journal (as
    `vime/workers/broker.py:open_journal` does) as a snapshot followed by the replayable steps' records, and
    restoring those used to replace the snapshot's counters by the steps' empty ones."""
    job = Journaled(tmp_path / "broker.journal", batch=2, staleness=3, num_rollout=10, retain=True)
    state = job.state
    _buffer_everything_dispatched(state)
    for step in range(2):  # two steps done, no checkpoint: both stay replayable
        out = state.request_batch(TRAINER, step, 2, 0, now=0.0) or state.try_fill_batch(now=0.0)
        state.on_step_done(step, [g.group_id for g in out[0][1].groups])  # type: ignore[attr-defined]
    dispatched = state.counters["groups_dispatched"]
    assert dispatched > 0
    for restarts in (1, 2, 3):  # back to back: nothing happens between the restarts
        job.crash(compact=True)
        assert job.state.counters["broker_restarts"] == restarts
        assert job.state.counters["groups_dispatched"] >= dispatched, "the counters went back to zero"


def test_a_broker_killed_after_the_last_step_finishes_the_job_and_a_finished_job_starts_anew(tmp_path: Path) -> None:
    """A journal that recorded every step but not the finish (the broker died while the job wound down)
    resumes and finishes; one that recorded the finish is moved aside and a new job starts. Before, both
    started a new job, which waited for a trainer that had already trained everything."""
    from types import SimpleNamespace

    from vime.broker.journal import JournalFinished, journal_file
    from vime.broker.recovery import job_finished
    from vime.protocol.messages import Shutdown
    from vime.workers.broker import open_journal

    path = journal_file(tmp_path)
    job = Journaled(path, batch=2, staleness=3, num_rollout=2)
    _buffer_everything_dispatched(job.state)
    for step in range(2):
        out = job.state.request_batch(TRAINER, step, 2, 0, now=0.0) or job.state.try_fill_batch(now=0.0)
        job.state.on_step_done(step, [g.group_id for g in out[0][1].groups])  # type: ignore[attr-defined]
    assert job.state.finished
    job.writer.close()
    records, _ = read_journal(path)
    assert job_finished(records) and steps_recorded(records) == 2
    cfg = SimpleNamespace(run_dir=tmp_path, journal_fsync="never", journal_fsync_interval_s=1.0, num_rollout=2)

    path.write_bytes(b"".join(encode_record(r) for r in records if not isinstance(r, JournalFinished)))
    resumed = make_state(batch=2, staleness=3, num_rollout=2)
    open_journal(cfg, resumed).close()  # type: ignore[arg-type]
    assert resumed.training_done and not resumed.finished and resumed.counters["broker_restarts"] == 1
    assert not list(tmp_path.glob("broker.journal.done-*"))
    connect(resumed)
    assert any(isinstance(msg, Shutdown) for _, msg in resumed.poll_evals()) and resumed.finished

    path.write_bytes(b"".join(encode_record(r) for r in records))
    fresh = make_state(batch=2, staleness=3, num_rollout=2)
    open_journal(cfg, fresh).close()  # type: ignore[arg-type]
    assert fresh.trained_steps == 0 and not fresh.training_done
    assert len(list(tmp_path.glob("broker.journal.done-*"))) == 1


def test_pieces_are_written_in_order_past_the_kernels_iovec_limit(tmp_path: Path) -> None:
    from vime.broker.journal import _IOV_MAX, _write_all

    pieces = [bytes([i % 251]) * (i % 7) for i in range(3 * _IOV_MAX + 5)]  # empty pieces among them
    path = tmp_path / "pieces"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        written = _write_all(fd, [memoryview(p) if i % 2 else p for i, p in enumerate(pieces)])
    finally:
        os.close(fd)
    assert path.read_bytes() == b"".join(pieces) and written == sum(map(len, pieces))
