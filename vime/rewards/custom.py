"""User reward functions loaded from `--custom-rm-path`.

Accepted forms:
- `path/to/file.py:function_name` (a file, relative to the working directory or absolute);
- `package.module:function_name`;
- `package.module.function_name` (slime's form, no colon).

The function is called as `fn(prompt, response, label, metadata)` and returns a number or a dict with a
"score"/"reward" key; it may be `async def`. Sync functions run in the caller's thread (so math-verify's
signal-based timeouts keep working inside them when the caller is the main thread): make slow ones
async or offload the work yourself, or they stall the reward worker's loop for their duration.

Loading problems raise `CustomRewardLoadError` with a message naming the spec and what is wrong, at
start-up. At scoring time an exception or an unusable return value from the function becomes a failed
`RewardResult` (logged), so one bad sample never stops the worker.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from vime import plugins
from vime.logging import get_logger
from vime.rewards.types import RewardResult, coerce_result

log = get_logger(__name__)

FLAG = "--custom-rm-path"


class CustomRewardLoadError(plugins.PluginLoadError):
    """`--custom-rm-path` does not name a usable function; the message says why. A ValueError."""


def load_function(spec: str) -> Callable[..., Any]:
    """Import and return the function named by `spec` (the loading rules of `vime.plugins`); raises
    `CustomRewardLoadError` naming the problem (file missing, module not importable, error during import,
    no such attribute, not callable)."""
    return plugins.load_function(spec, FLAG, error=CustomRewardLoadError, what="custom reward file")


def _check_signature(fn: Callable[..., Any], spec: str) -> None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins and some C callables have no signature; find out at call time
    try:
        signature.bind("prompt", "response", "label", {})
    except TypeError as exc:
        raise CustomRewardLoadError(
            f"custom reward function {spec!r} must accept (prompt, response, label, metadata); "
            f"its signature is {signature}: {exc}"
        ) from exc


class CustomReward:
    """`RewardFn` around a user function (sync or async); see the module docstring."""

    def __init__(self, fn: Callable[..., Any], name: str) -> None:
        self.fn = fn
        self.name = name

    async def __call__(
        self, prompt: str, response: str, label: str | None, metadata: Mapping[str, Any]
    ) -> RewardResult:
        try:
            value = self.fn(prompt, response, label, dict(metadata))
            if inspect.isawaitable(value):
                value = await value
        except Exception as exc:
            log.warning("custom_reward_raised", fn=self.name, error=f"{type(exc).__name__}: {exc}")
            return RewardResult.failure(f"custom reward {self.name} raised {type(exc).__name__}: {exc}")
        result = coerce_result(value)
        if result.failed:
            log.warning("custom_reward_bad_value", fn=self.name, reason=result.reason)
        return result


def load_custom_reward(spec: str) -> CustomReward:
    """Load `--custom-rm-path` into a `RewardFn`; raises `CustomRewardLoadError` on any problem."""
    fn = load_function(spec)
    _check_signature(fn, spec)
    log.info("custom_reward_loaded", spec=spec, is_async=inspect.iscoroutinefunction(fn))
    return CustomReward(fn, spec)
