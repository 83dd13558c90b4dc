"""A reward worker's answer for one group, written into its samples."""

from __future__ import annotations

from vime.protocol.messages import Group, GroupScores, Sample


def apply_scores(group: Group, score: GroupScores) -> tuple[list[Sample], int]:
    """Give each sample of `group` its reward and extras, or mark it failed with the reward worker's
    reason: (the samples that got a reward, in order; how many failed). `group.samples` is left whole."""
    kept, failures = [], 0
    extras = score.extras or [{}] * len(score.rewards)
    for sample, reward, failed, reason, extra in zip(group.samples, score.rewards, score.failed, score.reasons, extras):
        if failed:
            sample.status = "failed"
            sample.failure_reason = reason or "reward failed"
            failures += 1
            continue
        sample.reward = float(reward)
        sample.reward_extra = extra
        kept.append(sample)
    return kept, failures
