"""Reward functions: built-in rule rewards, the demo task's reward, and user functions.

`build_reward_fn(rm_type, custom_rm_path)` is the one entry point the reward worker needs. Every
reward function is an async callable `fn(prompt, response, label, metadata) -> RewardResult` that
does not raise for bad input (see `vime.rewards.types`).

rm_type      scoring
-----------  ------------------------------------------------------------------------------
math         math-verify on the boxed / "Answer:" / "####" answer, else the whole response; 1/0
gsm8k        math-verify on the answer after "####"; 1/0
dapo         math-verify on the last "Answer: ..." line; 1/-1 (DAPO/slime convention)
boxed_math   math-verify on the last \\boxed{...}; 1/0
arithmetic   the CPU demo task: exact match of the sum; 1/0
custom       the function named by --custom-rm-path
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vime.logging import get_logger
from vime.rewards.types import RewardFn, RewardResult, coerce_result, score_sync

log = get_logger(__name__)

KNOWN_RM_TYPES: tuple[str, ...] = ("math", "dapo", "gsm8k", "boxed_math", "arithmetic", "custom")

__all__ = [
    "KNOWN_RM_TYPES",
    "ArithmeticReward",
    "RewardFn",
    "RewardResult",
    "build_reward_fn",
    "coerce_result",
    "score_sync",
]


class ArithmeticReward:
    """`RewardFn` for the CPU demo task (`vime.demo.arithmetic.arithmetic_reward`)."""

    async def __call__(
        self, prompt: str, response: str, label: str | None, metadata: Mapping[str, Any]
    ) -> RewardResult:
        from vime.demo.arithmetic import arithmetic_reward

        if label is None or not str(label).strip():
            return RewardResult.failure("no label to check against")
        return RewardResult(reward=arithmetic_reward(response, str(label)))


def build_reward_fn(
    rm_type: str | None,
    custom_rm_path: str | None = None,
    *,
    math_timeout_s: float | None = None,
    math_workers: int | None = None,
) -> RewardFn:
    """The reward function for `--rm-type` / `--custom-rm-path`.

    As in slime, a `custom_rm_path` wins over `rm_type` (a differing rm_type is logged and ignored).
    Raises ValueError for an unknown rm_type (listing the known ones) or `custom` without a path, and
    `CustomRewardLoadError` (a ValueError) when the custom function cannot be loaded. Math styles
    share the process-wide math-verify pool unless `math_timeout_s`/`math_workers` ask for their own.
    """
    kind = (rm_type or "").strip()
    if custom_rm_path:
        from vime.rewards.custom import load_custom_reward

        if kind and kind != "custom":
            log.warning("rm_type_ignored", rm_type=kind, custom_rm_path=custom_rm_path)
        return load_custom_reward(custom_rm_path)
    if kind not in KNOWN_RM_TYPES:
        shown = repr(rm_type) if rm_type else "no rm_type"
        raise ValueError(f"unknown reward type {shown}; known: {', '.join(KNOWN_RM_TYPES)}")
    if kind == "custom":
        raise ValueError("--rm-type custom needs --custom-rm-path ('path/to/file.py:function' or 'module:function')")
    if kind == "arithmetic":
        return ArithmeticReward()
    from vime.rewards.math import DEFAULT_TIMEOUT_S, MathReward, MathVerifier

    verifier = None
    if math_timeout_s is not None or math_workers is not None:
        verifier = MathVerifier(timeout_s=math_timeout_s or DEFAULT_TIMEOUT_S, num_workers=math_workers)
    return MathReward(kind, verifier)
