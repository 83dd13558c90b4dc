"""A reward worker's answer written into a group's samples: rewards and extras where it scored, the
worker's reason where it failed, and the count of failures for the broker's counters."""

from __future__ import annotations

from test_broker_in_flight import group

from vime.broker.scores import apply_scores
from vime.protocol.messages import GroupScores


def test_scored_samples_get_their_rewards_and_failed_ones_the_reason() -> None:
    scored = group("g1", samples=3)
    answer = GroupScores(group_id="g1", rewards=[1.0, 0.0, 0.5], failed=[False, True, False],
                         reasons=[None, "no label", None], extras=[{"acc": 1}, {}, {"acc": 0}])  # fmt: skip
    kept, failures = apply_scores(scored, answer)
    assert [s.index for s in kept] == [0, 2] and failures == 1
    assert [s.reward for s in kept] == [1.0, 0.5] and [s.reward_extra for s in kept] == [{"acc": 1}, {"acc": 0}]
    failed = scored.samples[1]
    assert failed.status == "failed" and failed.failure_reason == "no label" and failed.reward is None
    assert len(scored.samples) == 3  # the caller decides what the group keeps


def test_a_failure_without_a_reason_says_the_reward_failed_and_missing_extras_are_empty() -> None:
    scored = group("g1", samples=2)
    kept, failures = apply_scores(scored, GroupScores(group_id="g1", rewards=[0.0, 1.0], failed=[True, False], reasons=[None, None]))
    assert failures == 1 and scored.samples[0].failure_reason == "reward failed"
    assert [s.reward_extra for s in kept] == [{}]
