"""Broker logic: admission control, staleness gate, ordering, leases, failures, finishing."""

from __future__ import annotations

import numpy as np
import pytest

from vime.broker.settings import BrokerSettings
from vime.broker.state import BrokerState
from vime.data.prompts import Prompt, PromptCursor
from vime.filters import FilterDecision, check_reward_nonzero_std, filter_samples
from vime.protocol.messages import DispatchGroups, Group, GroupScores, Sample, ScoreGroups, Shutdown, TrainBatch, WeightVersionAnnounce

ROLLOUT, ROLLOUT2, REWARD, TRAINER = b"r1", b"r2", b"w1", b"t0"


def make_state(batch: int = 2, staleness: int = 0, interval: int = 1, num_rollout: int = 100, n: int = 2) -> BrokerState:
    prompts = [Prompt(i, f"{i}+1=", np.array([i, 10], dtype=np.int32), str(i + 1)) for i in range(50)]
    settings = BrokerSettings(
        rollout_batch_size=batch,
        n_samples_per_prompt=n,
        max_staleness=staleness,
        update_weights_interval=interval,
        num_rollout=num_rollout,
        worker_timeout_s=10.0,
        sampling={"temperature": 1.0, "top_p": 1.0, "max_tokens": 4},
    )
    state = BrokerState(settings, PromptCursor(prompts, shuffle=False, seed=0))
    state.register(ROLLOUT, "rollout-1", "rollout", now=0.0)
    state.register(REWARD, "reward-1", "reward", now=0.0)
    state.register(TRAINER, "trainer-0", "trainer", now=0.0)
    state.add_credit(REWARD, 100)
    return state


def generate(group: Group, version: int, length: int = 3) -> Group:
    group.samples = [
        Sample(
            index=i,
            response_tokens=np.ones(length, dtype=np.int32),
            rollout_logprobs=np.zeros(length, dtype=np.float32),
            loss_mask=np.ones(length, dtype=np.uint8),
            token_versions=np.full(length, version, dtype=np.int32),
            finish_reason="stop",
        )
        for i in range(group.n_samples)
    ]
    return group


def dispatched(out: list) -> list[Group]:
    return [g for _, msg in out if isinstance(msg, DispatchGroups) for g in msg.groups]


def score_all(state: BrokerState, reward: float = 1.0) -> list[str]:
    groups = [g for _, msg in state.dispatch_scoring() if isinstance(msg, ScoreGroups) for g in msg.groups]
    scores = [GroupScores(group_id=g.group_id, rewards=[reward] * len(g.samples), failed=[False] * len(g.samples), reasons=[None] * len(g.samples)) for g in groups]
    return state.on_scored(REWARD, scores)


def run_group_through(state: BrokerState, group: Group, version: int) -> None:
    assert state.on_generated(ROLLOUT, [generate(group, version)]) == [group.group_id]


def test_synchronous_mode_admits_one_batch_per_version() -> None:
    state = make_state(batch=2, staleness=0)
    state.add_credit(ROLLOUT, 10)
    first = dispatched(state.dispatch())
    assert len(first) == 2, "max_staleness=0 admits exactly one batch before the first update"
    assert all(g.min_weight_version == 0 for g in first)
    assert dispatched(state.dispatch()) == []
    for g in first:
        run_group_through(state, g, version=0)
    score_all(state)
    state.request_batch(TRAINER, step=0, n_groups=2, policy_version=0, now=1.0)
    out = state.try_fill_batch(now=2.0)
    assert isinstance(out[0][1], TrainBatch) and len(out[0][1].groups) == 2
    assert dispatched(state.dispatch()) == [], "no new work until the trainer publishes v1"
    state.on_step_done(0, [g.group_id for g in first])
    announces = state.on_weights_published(1, "tcp://127.0.0.1:9")
    assert [(i, m.version) for i, m in announces if isinstance(m, WeightVersionAnnounce)] == [(ROLLOUT, 1)]
    second = dispatched(state.dispatch())
    assert len(second) == 2 and all(g.min_weight_version == 1 for g in second)


def test_async_mode_admits_staleness_plus_one_batches() -> None:
    state = make_state(batch=2, staleness=2)
    state.add_credit(ROLLOUT, 100)
    assert len(dispatched(state.dispatch())) == 2 * 3
    assert state.admission_limit == 6


def test_update_interval_scales_admission_by_steps_per_version() -> None:
    state = make_state(batch=2, staleness=0, interval=3)
    state.add_credit(ROLLOUT, 100)
    assert len(dispatched(state.dispatch())) == 6


def test_dispatch_never_exceeds_num_rollout_batches() -> None:
    state = make_state(batch=2, staleness=5, num_rollout=2)
    state.add_credit(ROLLOUT, 100)
    assert len(dispatched(state.dispatch())) == 4


def test_dispatch_respects_credits() -> None:
    state = make_state(batch=4, staleness=1)
    state.add_credit(ROLLOUT, 3)
    assert len(dispatched(state.dispatch())) == 3
    assert dispatched(state.dispatch()) == []
    state.add_credit(ROLLOUT, 1)
    assert len(dispatched(state.dispatch())) == 1


def test_staleness_gate_drops_too_old_groups_and_frees_their_slot() -> None:
    state = make_state(batch=1, staleness=1)
    state.add_credit(ROLLOUT, 10)
    groups = dispatched(state.dispatch())
    run_group_through(state, groups[0], version=0)
    run_group_through(state, groups[1], version=2)
    score_all(state)
    committed_before = state.committed
    state.request_batch(TRAINER, step=2, n_groups=1, policy_version=2, now=0.0)
    out = state.try_fill_batch(now=0.0)
    batch = out[0][1]
    assert [g.group_id for g in batch.groups] == [groups[1].group_id]
    assert state.counters["groups_dropped_stale"] == 1
    assert state.committed == committed_before - 1
    assert batch.stats["staleness_max"] == 0.0


def test_batches_take_earliest_dispatched_groups_first() -> None:
    state = make_state(batch=2, staleness=1)
    state.add_credit(ROLLOUT, 10)
    groups = dispatched(state.dispatch())
    for g in reversed(groups):  # later groups finish first (short responses)
        run_group_through(state, g, version=0)
    score_all(state)
    state.request_batch(TRAINER, step=0, n_groups=2, policy_version=0, now=0.0)
    batch = state.try_fill_batch(now=0.0)[0][1]
    assert [g.group_id for g in batch.groups] == [groups[0].group_id, groups[1].group_id]


def test_batch_waits_until_enough_groups_are_buffered() -> None:
    state = make_state(batch=2, staleness=0)
    state.add_credit(ROLLOUT, 10)
    groups = dispatched(state.dispatch())
    run_group_through(state, groups[0], version=0)
    score_all(state)
    state.request_batch(TRAINER, step=0, n_groups=2, policy_version=0, now=0.0)
    assert state.try_fill_batch(now=1.0) == []
    run_group_through(state, groups[1], version=0)
    score_all(state)
    out = state.try_fill_batch(now=3.0)
    assert len(out[0][1].groups) == 2 and out[0][1].stats["batch_wait_s"] == 3.0


def test_dead_worker_leases_are_redispatched_and_its_late_results_dropped() -> None:
    state = make_state(batch=2, staleness=0)
    state.add_credit(ROLLOUT, 10)
    groups = dispatched(state.dispatch())
    state.register(ROLLOUT2, "rollout-2", "rollout", now=5.0)
    state.add_credit(ROLLOUT2, 10)
    state.touch(REWARD, 15.0)
    state.touch(TRAINER, 15.0)
    state.touch(ROLLOUT2, 15.0)
    dead = state.expire_workers(now=15.0)
    assert [w.worker_id for w in dead] == ["rollout-1"]
    assert state.counters["groups_requeued"] == 2
    again = dispatched(state.dispatch())
    assert sorted(g.group_id for g in again) == sorted(g.group_id for g in groups)
    assert all(g.samples == [] for g in again)
    assert state.on_generated(ROLLOUT, [generate(groups[0], 0)]) == []
    assert state.counters["late_results_dropped"] == 1
    assert state.on_generated(ROLLOUT2, [generate(again[0], 0)]) == [again[0].group_id]
    assert state.committed == 2, "nothing lost, nothing duplicated"


def test_dead_reward_worker_returns_groups_to_the_scoring_queue() -> None:
    state = make_state(batch=1, staleness=0)
    state.add_credit(ROLLOUT, 10)
    group = dispatched(state.dispatch())[0]
    run_group_through(state, group, version=0)
    assert len(state.dispatch_scoring()) == 1
    state.remove_worker(REWARD)
    assert [g.group_id for g in state.in_flight.to_score] == [group.group_id]


def test_failed_rewards_are_excluded_not_zeroed() -> None:
    state = make_state(batch=2, staleness=0, n=2)
    state.add_credit(ROLLOUT, 10)
    a, b = dispatched(state.dispatch())
    run_group_through(state, a, 0)
    run_group_through(state, b, 0)
    [(_, msg)] = state.dispatch_scoring()
    scores = [
        GroupScores(group_id=a.group_id, rewards=[1.0, 0.0], failed=[False, True], reasons=[None, "timeout"]),
        GroupScores(group_id=b.group_id, rewards=[0.0, 0.0], failed=[True, True], reasons=["boom", "boom"]),
    ]
    assert state.on_scored(REWARD, scores) == [a.group_id, b.group_id]
    assert state.counters["samples_failed"] == 3
    assert state.counters["groups_failed"] == 1
    assert [s.reward for s in state.batches.buffer[a.group_id].samples] == [1.0]
    assert b.group_id not in state.batches.buffer
    assert state.committed == 1, "the failed group's slot is free for a new prompt"


def test_scores_of_the_wrong_length_are_refused() -> None:
    state = make_state(batch=1, staleness=0, n=2)
    state.add_credit(ROLLOUT, 10)
    group = dispatched(state.dispatch())[0]
    run_group_through(state, group, 0)
    state.dispatch_scoring()
    bad = GroupScores(group_id=group.group_id, rewards=[1.0], failed=[False], reasons=[None])
    assert state.on_scored(REWARD, [bad]) == []
    assert group.group_id in state.in_flight.scoring


def test_finishing_tells_every_worker_to_shut_down() -> None:
    state = make_state(batch=1, staleness=0, num_rollout=1)
    state.add_credit(ROLLOUT, 10)
    group = dispatched(state.dispatch())[0]
    run_group_through(state, group, 0)
    score_all(state)
    state.request_batch(TRAINER, 0, 1, 0, 0.0)
    state.try_fill_batch(0.0)
    out = state.on_step_done(0, [group.group_id])
    assert {identity for identity, msg in out if isinstance(msg, Shutdown)} == {ROLLOUT, REWARD, TRAINER}
    assert state.finished and state.counters["groups_trained"] == 1
    state.add_credit(ROLLOUT, 5)
    assert state.dispatch() == []


def test_group_ids_are_unique_across_epochs() -> None:
    state = make_state(batch=40, staleness=1)
    state.add_credit(ROLLOUT, 100)
    ids = [g.group_id for g in dispatched(state.dispatch())]
    assert len(ids) == 80 and len(set(ids)) == 80
    assert any(i.startswith("e1-") for i in ids)


def test_status_reports_queues_counters_and_workers() -> None:
    state = make_state(batch=2, staleness=0)
    state.add_credit(ROLLOUT, 10)
    state.dispatch()
    status = state.status(now=1.0)
    assert status["queues"]["generating"] == 2
    assert status["counters"]["groups_dispatched"] == 2
    assert {w["role"] for w in status["workers"]} == {"rollout", "reward", "trainer"}


@pytest.mark.parametrize("staleness", [0, 1, 3])
def test_simulated_run_never_trains_stale_groups_and_loses_nothing(staleness: int) -> None:
    """Drive the state like a real job (random completion order, lagging workers) for 20 steps."""
    rng = np.random.default_rng(staleness)
    state = make_state(batch=3, staleness=staleness, num_rollout=20)
    state.add_credit(ROLLOUT, 6)
    worker_version = 0
    generating: list[Group] = []
    trained: list[str] = []
    for step in range(20):
        state.request_batch(TRAINER, step, 3, policy_version=step, now=float(step))
        while True:
            generating += dispatched(state.dispatch())
            out = state.try_fill_batch(float(step))
            if out:
                break
            # Finish a random in-flight group with the worker's (possibly lagging) version.
            assert generating, "deadlock: nothing in flight and no batch"
            group = generating.pop(int(rng.integers(len(generating))))
            assert group.min_weight_version <= state.published_version
            worker_version = max(worker_version, group.min_weight_version)
            run_group_through(state, group, worker_version)
            state.add_credit(ROLLOUT, 1)
            score_all(state)
        batch = out[0][1]
        assert batch.stats["staleness_max"] <= staleness
        trained += [g.group_id for g in batch.groups]
        state.on_step_done(step, [g.group_id for g in batch.groups])
        state.on_weights_published(step + 1, "tcp://x:1")
    assert len(trained) == len(set(trained)) == 60
    assert state.counters["groups_dropped_stale"] == 0


# --- dynamic sampling ----------------------------------------------------------------------------


def zero_std_filter(group: Group) -> FilterDecision:
    return check_reward_nonzero_std(None, filter_samples(group))


def make_filtered_state(batch: int = 2, staleness: int = 0, over_sampling: int | None = None, num_rollout: int = 100, n: int = 2) -> BrokerState:
    state = make_state(batch=batch, staleness=staleness, num_rollout=num_rollout, n=n)
    state.settings.over_sampling_batch_size = over_sampling
    return _rebuild(state, zero_std_filter)


def _rebuild(old: BrokerState, group_filter) -> BrokerState:
    state = BrokerState(old.settings, old.admission.cursor, group_filter=group_filter)
    for identity, worker in old.workers.items():
        state.register(identity, worker.worker_id, worker.role, now=0.0)
    state.add_credit(REWARD, 100)
    return state


def score_with(state: BrokerState, rewards_of: dict[str, list[float]] | None = None, default: list[float] | None = None) -> list[str]:
    """Score every group waiting for a reward worker with per-group reward lists."""
    groups = [g for _, msg in state.dispatch_scoring() if isinstance(msg, ScoreGroups) for g in msg.groups]
    scores = []
    for g in groups:
        rewards = (rewards_of or {}).get(g.group_id, default or [1.0, 0.0])
        scores.append(GroupScores(group_id=g.group_id, rewards=rewards, failed=[False] * len(rewards), reasons=[None] * len(rewards)))
    state.add_credit(REWARD, len(groups))  # as a reward worker does after answering
    return state.on_scored(REWARD, scores)


def test_zero_std_groups_are_filtered_counted_and_their_slots_refilled() -> None:
    state = make_filtered_state(batch=2, staleness=0)
    state.add_credit(ROLLOUT, 10)
    a, b = dispatched(state.dispatch())
    run_group_through(state, a, 0)
    run_group_through(state, b, 0)
    assert score_with(state, {a.group_id: [1.0, 1.0], b.group_id: [1.0, 0.0]}) == [a.group_id, b.group_id]
    assert list(state.batches.buffer) == [b.group_id], "the all-correct group never enters the buffer"
    assert state.counters["groups_filtered"] == 1 and state.counters["groups_filter_kept"] == 1
    assert state.dynamic.reasons == {"zero_std_1.0": 1}
    assert state.committed == 1, "the filtered group is accounted as filtered, not committed"
    [refill] = dispatched(state.dispatch())
    assert refill.group_id not in (a.group_id, b.group_id), "its slot goes to a fresh prompt"
    run_group_through(state, refill, 0)
    score_with(state, {refill.group_id: [0.0, 1.0]})
    state.request_batch(TRAINER, step=0, n_groups=2, policy_version=0, now=0.0)
    batch = state.try_fill_batch(now=1.0)[0][1]
    assert [g.group_id for g in batch.groups] == [b.group_id, refill.group_id]
    assert batch.stats["rollout/dynamic_filter_dropped"] == 1.0
    assert batch.stats["rollout/dynamic_filter_kept"] == 2.0
    assert batch.stats["rollout/dynamic_filter_drop_ratio"] == pytest.approx(1 / 3)
    ds = state.status(now=1.0)["dynamic_sampling"]
    assert ds["dropped"] == 1 and ds["kept"] == 2 and ds["reasons"] == {"zero_std_1.0": 1}
    assert state.counters["groups_admitted"] == state.committed + state.counters["groups_filtered"]


def test_failed_samples_are_left_out_before_the_filter_sees_the_group() -> None:
    state = make_filtered_state(batch=1, staleness=0, n=3)
    state.add_credit(ROLLOUT, 10)
    group = dispatched(state.dispatch())[0]
    run_group_through(state, group, 0)
    [(_, msg)] = state.dispatch_scoring()
    # The one sample that differs failed to score: the rest are all 1.0, so the group carries no signal.
    score = GroupScores(group_id=group.group_id, rewards=[1.0, 0.0, 1.0], failed=[False, True, False], reasons=[None, "timeout", None])
    state.on_scored(REWARD, [score])
    assert group.group_id not in state.batches.buffer and state.counters["groups_filtered"] == 1


def test_a_filter_error_keeps_the_group_and_is_counted() -> None:
    def broken(group: Group) -> FilterDecision:
        return FilterDecision(keep=True, reason="filter_error:ZeroDivisionError", error=True)

    state = _rebuild(make_state(batch=1, staleness=0), broken)
    state.add_credit(ROLLOUT, 10)
    group = dispatched(state.dispatch())[0]
    run_group_through(state, group, 0)
    score_with(state, default=[1.0, 1.0])
    assert group.group_id in state.batches.buffer
    assert state.counters["filter_errors"] == 1 and state.counters["groups_filtered"] == 0


def test_over_sampling_admits_for_the_expected_keep_rate_up_to_the_user_cap() -> None:
    state = make_filtered_state(batch=4, staleness=1, over_sampling=6)
    # Staleness allows 2 steps x 4 groups; nothing kept yet, so 8 groups must still be found.
    assert state.dynamic.expected_keep_rate == pytest.approx(4 / 6), "before any decision: the user's N/B"
    assert state.admission_limit == 12 and state.over_sampling_margin == 4
    state.dynamic.window.extend([True] * 4)
    assert state.dynamic.expected_keep_rate == 1.0 and state.over_sampling_margin == 0, "a filter that drops nothing costs nothing"
    state.dynamic.window.clear()
    state.dynamic.window.extend([True, True, True, False] * 2)  # keep rate 3/4: ceil(8 / 0.75) = 11 in flight
    assert state.admission_limit == 11 and state.over_sampling_margin == 3
    state.dynamic.window.extend([False] * 12)  # keep rate 0.3: floored at 4/6
    assert state.admission_limit == 12
    # Kept groups need no margin: with 6 of the 8 found, 2 more are needed -> ceil(2 / (4/6)) = 3 in flight.
    state.add_credit(ROLLOUT, 6)
    for g in dispatched(state.dispatch())[:6]:
        run_group_through(state, g, 0)
    score_with(state, default=[1.0, 0.0])
    assert len(state.batches.buffer) == 6 and state.dynamic.keep_rate == pytest.approx(12 / 26)
    assert state.admission_limit == 6 + 3 and state.over_sampling_margin == 1
    no_filter = make_state(batch=4, staleness=1)
    no_filter.settings.over_sampling_batch_size = 6
    assert no_filter.over_sampling_margin == 0 and no_filter.admission_limit == 8


def test_over_sampling_dispatches_ahead_so_a_drop_needs_no_extra_round_trip() -> None:
    state = make_filtered_state(batch=2, staleness=0, over_sampling=4)
    state.add_credit(ROLLOUT, 10)
    groups = dispatched(state.dispatch())
    assert len(groups) == 4, "rollout_batch_size + (over_sampling - rollout_batch_size) * window"
    for g in groups:
        run_group_through(state, g, 0)
    rewards = {groups[0].group_id: [0.0, 0.0], groups[2].group_id: [1.0, 1.0]}
    score_with(state, rewards)
    state.request_batch(TRAINER, step=0, n_groups=2, policy_version=0, now=0.0)
    batch = state.try_fill_batch(now=0.0)[0][1]
    assert [g.group_id for g in batch.groups] == [groups[1].group_id, groups[3].group_id]


@pytest.mark.parametrize("staleness,over_sampling", [(0, None), (0, 5), (1, 6), (2, 4)])
def test_simulated_run_with_dynamic_sampling_trains_only_kept_groups_and_loses_nothing(staleness: int, over_sampling: int | None) -> None:
    """Like the run above, with rewards drawn so about 40 % of groups have zero std."""
    rng = np.random.default_rng(100 + staleness)
    batch_size, steps = 3, 25
    state = make_filtered_state(batch=batch_size, staleness=staleness, over_sampling=over_sampling, num_rollout=steps, n=2)
    state.add_credit(ROLLOUT, 8)
    worker_version = 0
    generating: list[Group] = []
    trained: list[str] = []
    filtered: set[str] = set()
    for step in range(steps):
        state.request_batch(TRAINER, step, batch_size, policy_version=step, now=float(step))
        while True:
            generating += dispatched(state.dispatch())
            out = state.try_fill_batch(float(step))
            if out:
                break
            assert generating, "deadlock: nothing in flight and no batch"
            group = generating.pop(int(rng.integers(len(generating))))
            worker_version = max(worker_version, group.min_weight_version)
            run_group_through(state, group, worker_version)
            state.add_credit(ROLLOUT, 1)
            rewards = [float(r) for r in rng.integers(0, 2, size=2)] if rng.random() < 0.75 else [1.0, 1.0]
            before = state.counters["groups_filtered"]
            score_with(state, {group.group_id: rewards})
            if state.counters["groups_filtered"] > before:
                filtered.add(group.group_id)
        batch = out[0][1]
        assert len(batch.groups) == batch_size, "every step gets its batch"
        assert batch.stats["staleness_max"] <= staleness
        for g in batch.groups:
            assert len({s.reward for s in g.samples}) > 1, "a zero-std group reached the trainer"
        trained += [g.group_id for g in batch.groups]
        state.on_step_done(step, [g.group_id for g in batch.groups])
        state.on_weights_published(step + 1, "tcp://x:1")
    assert len(trained) == len(set(trained)) == steps * batch_size, "nothing trained twice"
    assert not filtered & set(trained)
    assert state.counters["groups_filtered"] == len(filtered) > 0
    c = state.counters
    assert c["groups_admitted"] == state.committed + c["groups_filtered"] + c["groups_failed"] + c["groups_dropped_stale"], "nothing lost"
    assert state.finished


def test_reward_workers_get_the_texts_label_and_metadata_but_no_token_arrays() -> None:
    """Issue 18: ScoreGroups carried whole groups (tokens, logprobs, versions, R3 traces) to reward
    workers that read only the texts; now one header frame of texts per message, and the broker keeps
    the arrays for the trainer."""
    from vime.protocol.codec import encode
    from vime.protocol.messages import ScoringGroup

    state = make_state(batch=2, staleness=0)
    state.add_credit(ROLLOUT, 10)
    groups = dispatched(state.dispatch())
    for g in groups:
        generated = generate(g, version=0, length=400)  # arrays well over the inline limit
        generated.samples[0].status, generated.samples[0].failure_reason = "failed", "tool server down"
        state.on_generated(ROLLOUT, [generated])
    [(identity, msg)] = state.dispatch_scoring()
    assert identity == REWARD and isinstance(msg, ScoreGroups)
    assert all(isinstance(g, ScoringGroup) for g in msg.groups)
    assert len(encode(msg)) == 1  # no array frames at all
    sent = msg.groups[0]
    assert (sent.group_id, sent.prompt_text, sent.label) == (groups[0].group_id, groups[0].prompt_text, groups[0].label)
    assert [s.response_text for s in sent.samples] == [s.response_text for s in state.in_flight.scoring[sent.group_id][0].samples]
    assert (sent.samples[0].status, sent.samples[0].failure_reason) == ("failed", "tool server down")
    assert len(state.in_flight.scoring[sent.group_id][0].samples[0].response_tokens) == 400  # the broker keeps the arrays
