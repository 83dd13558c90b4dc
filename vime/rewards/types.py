"""The reward contract shared by built-in, custom and (later) remote reward functions.

A reward function is an async callable `fn(prompt, response, label, metadata) -> RewardResult`. User
functions may return a bare number or a dict; `coerce_result` turns either into a `RewardResult` and
turns anything unusable (NaN, a string, a dict without a score) into a *failed* result instead of an
exception, so one bad sample never takes a reward worker down.

`failed` means the scorer could not judge the sample (timeout, exception, missing label); a wrong
answer is not a failure, it is a normal low reward. `reason` explains either case for logs.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

# Keys that carry the scalar reward in a dict result, in priority order (slime uses "score").
SCORE_KEYS: tuple[str, ...] = ("score", "reward")


@dataclass(frozen=True)
class RewardResult:
    """One sample's reward: the scalar, extra fields to log (e.g. `acc`, `pred`), and failure info."""

    reward: float
    extra: dict[str, Any] = field(default_factory=dict)
    failed: bool = False
    reason: str | None = None

    @classmethod
    def failure(cls, reason: str, reward: float = 0.0, **extra: Any) -> RewardResult:
        """A result for a sample the scorer could not judge; `reward` is what training will use."""
        return cls(reward=reward, extra=dict(extra), failed=True, reason=reason)


class RewardFn(Protocol):
    """What `build_reward_fn` returns: score one sample, never raise for bad input."""

    async def __call__(
        self, prompt: str, response: str, label: str | None, metadata: Mapping[str, Any]
    ) -> RewardResult: ...


def coerce_result(value: Any) -> RewardResult:
    """Turn a user function's return value into a `RewardResult`.

    Accepts a `RewardResult`, a real number (bool counts as 0/1), or a dict with a numeric "score" or
    "reward" key (other keys become `extra`). Anything else, or a non-finite number, gives a failed
    result with reward 0 and a reason naming the problem.
    """
    if isinstance(value, RewardResult):
        return value
    if isinstance(value, bool):
        return RewardResult(reward=float(value))
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            return RewardResult.failure(f"reward is not finite: {value!r}")
        return RewardResult(reward=float(value))
    if isinstance(value, Mapping):
        for key in SCORE_KEYS:
            if key in value:
                inner = coerce_result(value[key])
                extra = {k: v for k, v in value.items() if k != key}
                if inner.failed:
                    return RewardResult.failure(f"{key!r} in reward dict: {inner.reason}", **extra)
                return RewardResult(reward=inner.reward, extra=extra)
        return RewardResult.failure(
            f"reward dict has no {' or '.join(repr(k) for k in SCORE_KEYS)} key (keys: {sorted(map(str, value))})"
        )
    # Numeric types such as numpy scalars or 0-d tensors expose __float__.
    if hasattr(value, "__float__") and not isinstance(value, (str, bytes)):
        try:
            return coerce_result(float(value))
        except (TypeError, ValueError):
            pass
    return RewardResult.failure(f"reward must be a number or a dict with a score, got {type(value).__name__}")


def score_sync(
    fn: RewardFn, prompt: str, response: str, label: str | None, metadata: Mapping[str, Any] | None = None
) -> RewardResult:
    """Run an async reward function from synchronous code (scripts, tests).

    Raises RuntimeError when called from inside a running event loop; await `fn(...)` there instead.
    """
    return asyncio.run(_call(fn, prompt, response, label, dict(metadata or {})))


async def _call(fn: RewardFn, prompt: str, response: str, label: str | None, metadata: dict[str, Any]) -> RewardResult:
    return await fn(prompt, response, label, metadata)
