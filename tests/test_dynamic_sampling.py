"""Dynamic sampling filters: the built-in zero-std filter by hand-computed cases, loading user filters
by path (slime's signature), what happens when a filter misbehaves, and the config checks.

The broker's accounting with a filter (nothing lost, nothing filtered trained, every step gets its
batch) is in tests/test_broker_state.py; the whole pipeline with a filter is in tests/test_eval.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from vime.config import ConfigError, load_config, parse_config
from vime.filters import (
    FilterDecision,
    FilterLoadError,
    FilterSample,
    check_reward_nonzero_std,
    coerce_decision,
    filter_samples,
    load_group_filter,
)
from vime.protocol.messages import Group, Sample


def samples(*rewards: float) -> list[FilterSample]:
    return [FilterSample(i, "1+1=", "2", "2", r, 1, "completed", "stop") for i, r in enumerate(rewards)]


def group(rewards: list[float], failed: tuple[int, ...] = ()) -> Group:
    out = []
    for i, reward in enumerate(rewards):
        sample = Sample(
            index=i, response_tokens=np.ones(2 + i, dtype=np.int32), rollout_logprobs=np.zeros(2 + i, dtype=np.float32),
            loss_mask=np.ones(2 + i, dtype=np.uint8), token_versions=np.zeros(2 + i, dtype=np.int32), finish_reason="stop",
            response_text=f"r{i}", reward=None if i in failed else reward, status="failed" if i in failed else "completed",
        )  # fmt: skip
        out.append(sample)
    return Group(group_id="e0-p0", prompt_index=0, epoch=0, prompt_tokens=np.array([1, 2], dtype=np.int32),
                 prompt_text="1+1=", n_samples=len(rewards), label="2", metadata={"k": 1}, samples=out)  # fmt: skip


@pytest.mark.parametrize(
    "rewards,keep,reason",
    [
        ([1.0, 1.0, 1.0, 1.0], False, "zero_std_1.0"),  # all right: every advantage is 0
        ([0.0, 0.0, 0.0], False, "zero_std_0.0"),  # all wrong
        ([-1.0, -1.0], False, "zero_std_-1.0"),  # dapo's wrong answer
        ([1.0, 0.0, 0.0, 0.0], True, None),  # std = sqrt(3)/4 = 0.433
        ([0.5, 0.5 + 1e-7], False, "zero_std_0.5"),  # std 5e-8 <= 1e-6: equal for GRPO's purposes
        ([0.5, 0.5 + 1e-5], True, None),  # std 5e-6 > 1e-6
        ([1.0], False, "zero_std_1.0"),  # one sample has no spread
    ],
)
def test_zero_std_filter_by_hand(rewards: list[float], keep: bool, reason: str | None) -> None:
    assert check_reward_nonzero_std(None, samples(*rewards)) == FilterDecision(keep=keep, reason=reason)


def test_filter_sees_only_scored_samples_with_their_fields() -> None:
    seen = filter_samples(group([1.0, 0.0, 1.0], failed=(1,)))
    assert [s.index for s in seen] == [0, 2]
    assert [s.reward for s in seen] == [1.0, 1.0]
    assert seen[0].prompt == "1+1=" and seen[0].label == "2" and seen[0].response == "r0" and seen[1].response_length == 4
    assert seen[0].get_reward_value(object()) == 1.0 and seen[0].metadata == {"k": 1}


@dataclass
class DynamicFilterOutput:  # slime's return type, re-created
    keep: object
    reason: str | None = None


def test_return_values_slime_filters_use_are_understood() -> None:
    import torch

    assert coerce_decision(True) == FilterDecision(True)
    assert coerce_decision(np.bool_(False)) == FilterDecision(False)
    assert coerce_decision({"keep": 0, "reason": "short"}) == FilterDecision(False, "short")
    # slime's own filter returns `torch.tensor(rewards).std() > 1e-6` inside DynamicFilterOutput.
    assert coerce_decision(DynamicFilterOutput(keep=torch.tensor(0.4) > 1e-6)) == FilterDecision(True)
    assert coerce_decision(DynamicFilterOutput(keep=False, reason="zero_std_1.0")) == FilterDecision(False, "zero_std_1.0")
    for bad in ("False", None, [True], {"reason": "x"}, 2):
        with pytest.raises(TypeError):
            coerce_decision(bad)


def test_builtin_names_including_slimes_dotted_path() -> None:
    for name in ("check_reward_nonzero_std", "zero_std", "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std"):
        f = load_group_filter(name, args=None)
        assert f(group([1.0, 1.0])).keep is False and f(group([1.0, 0.0])).keep is True


def test_custom_filter_by_path_gets_the_config_and_the_samples(tmp_path: Path) -> None:
    path = tmp_path / "my_filters.py"
    path.write_text(
        "def keep_if_mean_below(args, samples, **kwargs):\n"
        "    mean = sum(s.get_reward_value(args) for s in samples) / len(samples)\n"
        "    return {'keep': mean < args.rollout_batch_size / 10, 'reason': f'mean_{mean:.2f}'}\n"
    )
    cfg = load_config(None, {"rollout_batch_size": 5})
    f = load_group_filter(f"{path}:keep_if_mean_below", cfg)
    assert f(group([0.0, 1.0, 0.0, 0.0])) == FilterDecision(True, "mean_0.25")
    assert f(group([1.0, 1.0, 0.0, 0.0])) == FilterDecision(False, "mean_0.50")


def test_a_filter_that_raises_or_returns_junk_keeps_the_group_and_counts(tmp_path: Path) -> None:
    path = tmp_path / "bad.py"
    path.write_text("def boom(args, samples):\n    return 1 / 0\n\ndef junk(args, samples):\n    return 'yes'\n")
    boom = load_group_filter(f"{path}:boom", None)
    assert boom(group([1.0, 1.0])) == FilterDecision(True, "filter_error:ZeroDivisionError", error=True)
    junk = load_group_filter(f"{path}:junk", None)
    assert junk(group([1.0, 1.0])).error and junk(group([1.0, 1.0])).keep
    assert boom.errors == 1 and junk.errors == 2


def test_unusable_specs_fail_at_load_and_name_the_flag(tmp_path: Path) -> None:
    path = tmp_path / "f.py"
    path.write_text("def one_arg(samples):\n    return True\n\nLIMIT = 3\n")
    cases = {
        f"{tmp_path}/missing.py:fn": "file not found",
        f"{path}:nope": "has no function 'nope'",
        f"{path}:LIMIT": "not a callable",
        f"{path}:one_arg": "must accept (args, samples",
        "no_such_module_xyz:fn": "cannot import module",
        "f.py": "names no function",
    }
    for spec, message in cases.items():
        with pytest.raises(FilterLoadError, match="dynamic-sampling-filter-path|must accept") as info:
            load_group_filter(spec, None)
        assert message in str(info.value), (spec, str(info.value))


def test_config_flags_and_their_checks() -> None:
    cfg, _ = parse_config(["--over-sampling-batch-size", "24", "--dynamic-sampling-filter-path", "check_reward_nonzero_std", "--rollout-batch-size", "16"])
    assert cfg.over_sampling_batch_size == 24 and cfg.dynamic_sampling_filter_path == "check_reward_nonzero_std"
    with pytest.raises(ConfigError, match="below rollout_batch_size"):
        load_config(None, {"rollout_batch_size": 16, "over_sampling_batch_size": 8, "dynamic_sampling_filter_path": "zero_std"})
    with pytest.raises(ConfigError, match="set dynamic_sampling_filter_path"):
        load_config(None, {"over_sampling_batch_size": 32})
    with pytest.raises(ConfigError, match="n_samples_per_prompt must be >= 2"):
        load_config(None, {"n_samples_per_prompt": 1, "dynamic_sampling_filter_path": "zero_std"})
    # A custom filter may make sense for single samples (e.g. drop truncated ones).
    assert load_config(None, {"n_samples_per_prompt": 1, "dynamic_sampling_filter_path": "x.py:f"}).n_samples_per_prompt == 1
