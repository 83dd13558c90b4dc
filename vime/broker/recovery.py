"""Rebuild a `BrokerState` from its journal, and write the compacted form of a live state.

Restoring replays the records in order onto a fresh state built from the same flags:
- admitted groups that never reached the buffer (they were generating, waiting for or being scored)
  go back to the retry queue and are generated again: their tokens were not journaled, and the
  worker that held them has lost its lease with the old broker (its late result is dropped by id);
- buffered groups come back with their samples and rewards;
- a step's batch that was out for training stays assigned to that step: the trainer gets the same
  groups when it asks again;
- trained groups the trainer's last checkpoint does not cover stay replayable;
- the published weight version, the trainer's step and the prompt cursor continue where they were;
  the weight endpoint is forgotten until the trainer announces it again (it does so when it rejoins,
  and a resumed trainer when it starts), so no worker is sent to a publisher that died.
Counters that are derived from the records (admitted, trained, failed, filtered, stale) are exact;
the others (dispatched, requeued, ...) continue from the last snapshot in the journal (a compaction's
snapshot, or the last finished step's). `broker_restarts` is exact: every restart compacts the journal
right after restoring it, so its snapshot carries the new count before the broker serves anything.
Eval runs in progress are not journaled: they are not training data, and the next due eval runs as usual.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from vime.broker.journal import (
    JOURNAL_FORMAT, JournalAdmit, JournalBatch, JournalBuffered, JournalError, JournalFinished, JournalHeader,
    JournalRecord, JournalSnapshot, JournalStepDone,
)
from vime.broker.state import BrokerState
from vime.protocol.messages import Group

# Counters recomputed from the records (with groups_admitted and groups_trained); the rest come from the
# newest snapshot of them.
DROP_COUNTERS = {"failed": "groups_failed", "filtered": "groups_filtered", "stale": "groups_dropped_stale"}


def job_fingerprint(state: BrokerState) -> dict[str, Any]:
    """What must not change between a journal and the broker that restores it."""
    s = state.settings
    return {
        "dataset": state.admission.cursor.fingerprint(),
        "rollout_batch_size": s.rollout_batch_size,
        "n_samples_per_prompt": s.n_samples_per_prompt,
    }


def header_for(state: BrokerState) -> JournalHeader:
    return JournalHeader(format=JOURNAL_FORMAT, fingerprint=job_fingerprint(state))


def restore(state: BrokerState, records: list[JournalRecord]) -> None:
    """Replay `records` onto `state` (fresh, built from the job's flags): each part applies its own
    records (`BrokerState.replay`). Raises JournalError when the journal belongs to another job or
    contradicts itself."""
    if not records or not isinstance(records[0], JournalHeader):
        raise JournalError("the journal does not start with a header record")
    _check_header(state, records[0])
    counters: dict[str, int] = {}
    admits: dict[str, JournalAdmit] = {}
    admitted = 0
    for record in records[1:]:
        if isinstance(record, JournalHeader):
            raise JournalError("journal: a second header record (two journals concatenated?)")
        if isinstance(record, JournalSnapshot):
            counters = dict(record.counters)
            admitted = record.counters.get("groups_admitted", 0)
            state.admission.restore_snapshot(record)
            state.batches.restore_snapshot(record)
            state.published_version = record.published_version
            state.weight_endpoint = record.weight_endpoint
            continue
        state.replay(record)
        if isinstance(record, JournalAdmit):
            admits[record.group_id] = record
            admitted += 1
        elif isinstance(record, JournalStepDone) and record.counters:
            counters = dict(record.counters)  # a compacted journal's steps carry none: the snapshot holds them
        # JournalFinished holds nothing to restore: a finished job is restored only when a larger
        # --num-rollout extends it, and then it runs on and records its own finish.
    state.batches.finish_restore()
    state.counters.update({k: v for k, v in counters.items() if k in state.counters})
    state.counters["groups_admitted"] = admitted
    finished = state.admission.finished.counts
    state.counters["groups_trained"] = finished["trained"] + len(state.batches.trained_in_step)
    for reason, key in DROP_COUNTERS.items():
        state.counters[key] = finished[reason]  # type: ignore[index]
    state.counters["broker_restarts"] += 1
    # Groups admitted but never buffered were generating or scoring: their tokens were not journaled.
    unplaced = [admits[group_id] for group_id in state.admission.unplaced(state.placed_ids())]
    state.in_flight.retry = deque(state.admission.group_for(a.epoch, a.prompt_index) for a in unplaced)
    # The trainer that served the journal's endpoint may be gone with this broker: rollout workers that
    # join now would wait on a dead address. The trainer re-announces its endpoint when it says Hello.
    state.weight_endpoint = None


def job_finished(records: list[JournalRecord]) -> bool:
    """Whether the journal's job finished (not merely trained its last step before the broker died)."""
    return any(isinstance(record, JournalFinished) for record in records)


def steps_recorded(records: list[JournalRecord]) -> int:
    """How many training steps the journal says were finished (fewer than --num-rollout: resume)."""
    steps = 0
    for record in records:
        if isinstance(record, JournalSnapshot):
            steps = max(steps, record.trained_steps)
        elif isinstance(record, JournalStepDone):
            steps = max(steps, record.step + 1)
    return steps


def _check_header(state: BrokerState, header: JournalHeader) -> None:
    if header.format != JOURNAL_FORMAT:
        raise JournalError(
            f"journal format {header.format}, this build reads format {JOURNAL_FORMAT}: finish that job with the vime "
            "that started it, or start over with a new --run-dir"
        )
    expected = job_fingerprint(state)
    if header.fingerprint != expected:
        changed = sorted(k for k in expected.keys() | header.fingerprint.keys() if expected.get(k) != header.fingerprint.get(k))
        raise JournalError(
            f"the journal was written for a different job ({', '.join(changed)} differ: journal "
            f"{ {k: header.fingerprint.get(k) for k in changed} }, now { {k: expected.get(k) for k in changed} }); "
            "use a new --run-dir, or move the old journal away to start over"
        )


def compacted(state: BrokerState) -> list[JournalRecord]:
    """The live state as a fresh journal: header, a snapshot of everything finished, then the records
    that rebuild the groups still in play (admitted-unfinished, buffered, in training, replayable)."""
    admission, batches = state.admission, state.batches
    in_play = set(admission.open)
    finishing, folded_below, folded_epochs, finished_counts = admission.finished.snapshot()
    records: list[JournalRecord] = [
        header_for(state),
        JournalSnapshot(
            cursor_epoch=admission.cursor.epoch, cursor_position=admission.cursor.position,
            next_seq=admission.next_seq, published_version=state.published_version,
            weight_endpoint=state.weight_endpoint, trained_steps=batches.trained_steps,
            checkpoint_steps=batches.checkpoint_steps, finishing=finishing, folded_below=folded_below,
            folded_epochs=folded_epochs, finished_counts=finished_counts,
            counters={**state.counters, "groups_admitted": state.counters["groups_admitted"] - len(in_play)},
        ),  # fmt: skip
    ]
    cursor_place = {"cursor_epoch": admission.cursor.epoch, "cursor_position": admission.cursor.position}
    payloads: dict[str, Group] = {**batches.retained, **batches.training, **batches.buffer}
    unscored = tuple(state.in_flight.groups())
    groups = {**{g.group_id: g for g in unscored}, **payloads}
    for group_id in sorted(in_play, key=admission.order):
        group = groups.get(group_id)
        if group is None:
            raise JournalError(f"compaction: group {group_id} is admitted but nowhere in the state")
        records.append(JournalAdmit(
            group_id=group_id, epoch=group.epoch, prompt_index=group.prompt_index, seq=admission.order(group_id),
            **cursor_place,
        ))  # fmt: skip
        if group_id in payloads:
            records.append(JournalBuffered(group=payloads[group_id]))
    for step in sorted(batches.step_batches):
        ids = batches.step_batches[step]
        records.append(JournalBatch(step=step, group_ids=list(ids), policy_version=-1))
        if step < batches.trained_steps and not any(g in batches.training for g in ids):
            records.append(JournalStepDone(step=step, counters={}))
    if state.finished:
        records.append(JournalFinished(trained_steps=batches.trained_steps))
    return records


__all__ = ["restore", "compacted", "header_for", "job_finished", "job_fingerprint", "steps_recorded"]
