"""What a rollout worker sends for each generated response (`vime.workers.rollout.to_sample`)."""

from __future__ import annotations

import numpy as np

from vime.rollout import GeneratedSample
from vime.workers.rollout import to_sample


def generated(logprobs: list[float], mask: list[int], finish: str = "stop") -> GeneratedSample:
    n = len(logprobs)
    return GeneratedSample(
        response_tokens=np.arange(10, 10 + n, dtype=np.int32), rollout_logprobs=np.array(logprobs, dtype=np.float32),
        loss_mask=np.array(mask, dtype=np.uint8), token_versions=np.full(n, 3, dtype=np.int32),
        finish_reason=finish,  # type: ignore[arg-type]
    )  # fmt: skip


def test_a_response_becomes_a_sample_with_its_arrays_and_status() -> None:
    sample = to_sample(2, generated([-0.5, -1.0, -0.1], [1, 1, 1], finish="length"))
    assert sample.index == 2 and sample.status == "truncated" and sample.failure_reason is None
    assert sample.response_tokens.tolist() == [10, 11, 12] and sample.token_versions.tolist() == [3, 3, 3]
    assert sample.rollout_logprobs.tolist() == [-0.5, -1.0, np.float32(-0.1)]


def test_a_non_finite_logprob_on_a_trained_token_fails_the_sample_and_says_where() -> None:
    sample = to_sample(1, generated([-0.5, float("nan"), -0.1], [1, 1, 1]))
    assert sample.status == "failed" and sample.response_tokens.size == 0
    assert sample.failure_reason is not None
    assert "non-finite logprob" in sample.failure_reason and "position 1" in sample.failure_reason


def test_a_non_finite_logprob_on_a_masked_token_is_no_failure() -> None:
    # Tool output or other masked tokens never enter the loss (the trainer zeroes their logprobs).
    sample = to_sample(0, generated([-0.5, float("-inf"), -0.1], [1, 0, 1]))
    assert sample.status == "completed" and sample.response_tokens.size == 3
