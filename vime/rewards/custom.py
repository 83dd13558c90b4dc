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

import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from vime.logging import get_logger
from vime.rewards.types import RewardResult, coerce_result

log = get_logger(__name__)


class CustomRewardLoadError(ValueError):
    """`--custom-rm-path` does not name a usable function; the message says why."""


def _split_spec(spec: str) -> tuple[str, str]:
    spec = spec.strip()
    if not spec:
        raise CustomRewardLoadError("--custom-rm-path is empty; expected 'path/to/file.py:function' or 'module:function'")
    if ":" in spec:
        target, _, attr = spec.rpartition(":")
    else:
        target, _, attr = spec.rpartition(".")
        if spec.endswith(".py") or not target:
            # "file.py" with no function, or a bare name: we cannot guess the function.
            raise CustomRewardLoadError(
                f"--custom-rm-path {spec!r} names no function; expected 'path/to/file.py:function' or 'module:function'"
            )
    if not target or not attr:
        raise CustomRewardLoadError(
            f"--custom-rm-path {spec!r} must look like 'path/to/file.py:function' or 'module:function'"
        )
    return target, attr


def _load_file(path_text: str, spec: str) -> Any:
    path = Path(path_text).expanduser()
    if not path.is_file():
        where = f" (resolved to {path.resolve()})" if not path.is_absolute() else ""
        raise CustomRewardLoadError(f"custom reward file not found: {path_text}{where}, from --custom-rm-path {spec!r}")
    resolved = path.resolve()
    # A unique, stable module name per file so two files called reward.py do not collide.
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:10]
    module_name = f"vime_custom_rm_{resolved.stem}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    module_spec = importlib.util.spec_from_file_location(module_name, resolved)
    if module_spec is None or module_spec.loader is None:
        raise CustomRewardLoadError(f"cannot import {resolved} as Python (from --custom-rm-path {spec!r})")
    module = importlib.util.module_from_spec(module_spec)
    # Registered before exec so dataclasses/typing inside the file can find their module.
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise CustomRewardLoadError(
            f"error while importing custom reward file {resolved}: {type(exc).__name__}: {exc}"
        ) from exc
    return module


def _load_module(name: str, spec: str) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        raise CustomRewardLoadError(
            f"cannot import module {name!r} from --custom-rm-path {spec!r}: {exc} "
            "(for a file, write 'path/to/file.py:function')"
        ) from exc
    except Exception as exc:
        raise CustomRewardLoadError(
            f"error while importing module {name!r} from --custom-rm-path {spec!r}: {type(exc).__name__}: {exc}"
        ) from exc


def load_function(spec: str) -> Callable[..., Any]:
    """Import and return the function named by `spec`; raises `CustomRewardLoadError` naming the problem
    (file missing, module not importable, error during import, no such attribute, not callable)."""
    target, attr = _split_spec(spec)
    is_file = target.endswith(".py") or "/" in target or "\\" in target
    module = _load_file(target, spec) if is_file else _load_module(target, spec)
    if not hasattr(module, attr):
        available = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise CustomRewardLoadError(
            f"{target} has no function {attr!r} (from --custom-rm-path {spec!r}); callables there: {available}"
        )
    fn = getattr(module, attr)
    if not callable(fn):
        raise CustomRewardLoadError(f"{target}:{attr} is a {type(fn).__name__}, not a callable (from --custom-rm-path {spec!r})")
    return fn


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
