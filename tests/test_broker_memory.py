"""The broker's memory is bounded by the groups in play, not by how long the job has run: a long job
through the real `BrokerState` allocates no more at step 1,200 than at step 200 (finished groups fold
into one byte per prompt of the epochs still finishing, `vime.broker.finished`)."""

from __future__ import annotations

import gc
import random
import tracemalloc

from test_broker_journal import REWARD, ROLLOUT, TRAINER, connect, generated, make_state

from vime.protocol.messages import DispatchGroups, GroupScores


# Allocations made by vime or by this test's group builder; not those of pytest's or xdist's own threads,
# which tracemalloc sees too.
_OURS = (tracemalloc.Filter(True, "*/vime/*"), tracemalloc.Filter(True, "*/tests/test_broker_journal.py"))


def held_by_the_broker(snapshot: tracemalloc.Snapshot) -> int:
    return sum(stat.size for stat in snapshot.filter_traces(_OURS).statistics("filename"))


def test_a_long_job_does_not_grow_the_broker() -> None:
    rng = random.Random(0)
    state = make_state(batch=8, staleness=1, num_rollout=10**6, retain=False, prompts=200)
    connect(state, credits=16)
    state.on_weights_published(0, "tcp://w:1")
    traced: dict[int, int] = {}
    step = 0
    tracemalloc.start()
    try:
        while step < 1_200:
            flight = [g for _, m in state.dispatch() if isinstance(m, DispatchGroups) for g in m.groups]
            state.on_generated(ROLLOUT, [generated(g, state.published_version, rng) for g in flight])
            state.add_credit(ROLLOUT, len(flight))
            for _, msg in state.dispatch_scoring():
                failed = [rng.random() < 0.05] * 2  # some groups fail: dropped ones are finished too
                scores = [GroupScores(group_id=g.group_id, rewards=[1.0, 0.0], failed=failed, reasons=["x", "x"]) for g in msg.groups]  # type: ignore[attr-defined]
                state.on_scored(REWARD, scores)
                state.add_credit(REWARD, len(scores))
            state.record_sent(now=0.0)  # as the server does after each dispatch
            out = state.request_batch(TRAINER, step, 8, step, now=0.0) or state.try_fill_batch(now=0.0)
            if out:
                state.on_step_done(step, [g.group_id for g in out[0][1].groups])  # type: ignore[attr-defined]
                step += 1
                state.on_weights_published(step, "tcp://w:1")
                if step in (200, 1_200):
                    assert state.status(0.0)["groups_lost"] == 0
                    gc.collect()
                    traced[step] = held_by_the_broker(tracemalloc.take_snapshot())
    finally:
        tracemalloc.stop()
    assert state.counters["groups_trained"] == 1_200 * 8 and state.counters["groups_failed"] > 0
    # 8,000 more groups went through; a per-group ledger entry of even 100 bytes would be 800 kB.
    assert traced[1_200] - traced[200] < 32 * 1024, traced
