"""Dynamic sampling filters (slime's `--dynamic-sampling-filter-path`): keep or drop a scored group.

GRPO learns nothing from a group whose rewards are all equal (all right or all wrong: every advantage
is zero), yet such a group takes a training slot. A filter looks at each group once its rewards are
known, in the broker, before the group enters the trainable buffer. Dropped groups never reach the
trainer; the broker counts them (`groups_filtered`, by reason) and admits a fresh prompt in their
place, ahead of need when `--over-sampling-batch-size` asks for it (`vime.broker.state`).

Filters use slime's signature, so a slime filter ports with at most an import change:

    def my_filter(args, samples, **kwargs) -> bool | <object or dict with `keep` and optional `reason`>

`args` is the job's `VimeConfig`. `samples` are the group's scored samples (failed samples left out)
as read-only `FilterSample`s with `.reward`, `.response`, `.label`, ... and slime's
`get_reward_value(args)`. Filters run inside the broker's loop: keep them fast and free of I/O.

Built-in: `check_reward_nonzero_std`, slime's default (keep a group iff its reward std > 1e-6), also
reachable as `zero_std` and under slime's dotted path so slime configs work unchanged.

Failure modes: a spec that cannot be loaded, or a function that cannot be called as `(args, samples)`,
raises `FilterLoadError` at broker start-up. At run time a filter that raises or returns something
unusable keeps the group (a broken filter must not silently starve training), is logged (rate-limited)
and counted as a filter error.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vime.logging import get_logger
from vime.plugins import PluginLoadError, load_function
from vime.protocol.messages import Group

log = get_logger(__name__)

FLAG = "--dynamic-sampling-filter-path"
# The std below which a group's rewards count as all equal (slime's threshold).
ZERO_STD_EPS = 1e-6
# Names that select the built-in zero-std filter.
ZERO_STD_NAMES = frozenset(
    {
        "check_reward_nonzero_std",
        "zero_std",
        "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std",
        "vime.filters.check_reward_nonzero_std",
        "vime.filters:check_reward_nonzero_std",
    }
)


class FilterLoadError(PluginLoadError):
    """`--dynamic-sampling-filter-path` does not name a usable filter; the message says why."""


@dataclass(frozen=True)
class FilterDecision:
    """What a filter decided for one group. `error` marks a decision forced by a broken filter."""

    keep: bool
    reason: str | None = None
    error: bool = False


@dataclass(frozen=True)
class FilterSample:
    """One scored sample as a filter sees it (slime's `Sample` fields that make sense here)."""

    index: int
    prompt: str
    response: str
    label: str | None
    reward: float
    response_length: int
    status: str
    finish_reason: str
    metadata: Mapping[str, Any] = field(default_factory=dict)
    reward_extra: Mapping[str, Any] = field(default_factory=dict)

    def get_reward_value(self, args: Any = None) -> float:
        """slime's accessor; vime samples carry one scalar reward."""
        return self.reward


def filter_samples(group: Group) -> list[FilterSample]:
    """The scored samples of `group` (failed samples and samples without a reward left out)."""
    return [
        FilterSample(
            index=s.index, prompt=group.prompt_text, response=s.response_text, label=group.label,
            reward=float(s.reward), response_length=len(s.response_tokens), status=s.status,
            finish_reason=s.finish_reason, metadata=group.metadata, reward_extra=s.reward_extra,
        )  # fmt: skip
        for s in group.samples
        if s.reward is not None and s.status != "failed"
    ]


def check_reward_nonzero_std(args: Any, samples: Sequence[FilterSample], **kwargs: Any) -> FilterDecision:
    """Keep a group iff its rewards are not all equal (std > 1e-6); slime's default filter.

    The reason of a drop names the common reward (`zero_std_1.0`: all right, `zero_std_0.0`: all
    wrong), as slime does. A group of one sample always has zero std.
    """
    rewards = np.array([s.get_reward_value(args) for s in samples], dtype=np.float64)
    if rewards.size == 0:
        return FilterDecision(keep=False, reason="no_scored_samples")
    keep = bool(rewards.std() > ZERO_STD_EPS)
    return FilterDecision(keep=keep, reason=None if keep else f"zero_std_{round(float(rewards[0]), 1)}")


def is_zero_std_filter(spec: str | None) -> bool:
    """Whether `spec` selects the built-in zero-std filter."""
    return spec is not None and spec.strip() in ZERO_STD_NAMES


def coerce_decision(value: Any) -> FilterDecision:
    """A filter's return value as a decision: bool-like, or an object/dict with `keep` (+ `reason`).

    Raises TypeError naming the type for anything else (a string, None, a list).
    """
    if isinstance(value, FilterDecision):
        return value
    if isinstance(value, Mapping):
        if "keep" not in value:
            raise TypeError(f"filter returned a dict without a 'keep' key (keys: {sorted(map(str, value))})")
        reason = value.get("reason")
        return FilterDecision(keep=_truth(value["keep"]), reason=None if reason is None else str(reason))
    if hasattr(value, "keep"):  # slime's DynamicFilterOutput and look-alikes
        reason = getattr(value, "reason", None)
        return FilterDecision(keep=_truth(value.keep), reason=None if reason is None else str(reason))
    return FilterDecision(keep=_truth(value))


def _truth(value: Any) -> bool:
    # Plain bools, numpy bools and 0-d arrays/tensors (slime's filter returns `tensor.std() > eps`).
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "ndim", 0) == 0:
        inner = item()
        if isinstance(inner, (bool, int, float)):
            return bool(inner)
    raise TypeError(f"filter must return a bool or an object with `keep`, got {type(value).__name__}")


class GroupFilter:
    """A loaded filter bound to the job's config: call it with a scored `Group`."""

    def __init__(self, fn: Callable[..., Any], args: Any, name: str) -> None:
        self.fn = fn
        self.args = args
        self.name = name
        self.errors = 0

    def __call__(self, group: Group) -> FilterDecision:
        try:
            return coerce_decision(self.fn(self.args, filter_samples(group)))
        except Exception as exc:
            self.errors += 1
            if self.errors <= 3 or self.errors % 100 == 0:  # one broken filter must not flood the log
                log.warning(
                    "dynamic_filter_error", filter=self.name, group=group.group_id, errors=self.errors,
                    error=f"{type(exc).__name__}: {exc}", action="group kept",
                )  # fmt: skip
            return FilterDecision(keep=True, reason=f"filter_error:{type(exc).__name__}", error=True)


def load_group_filter(spec: str, args: Any) -> GroupFilter:
    """The filter `spec` names (a built-in name or a loadable function); raises FilterLoadError."""
    if is_zero_std_filter(spec):
        return GroupFilter(check_reward_nonzero_std, args, "check_reward_nonzero_std")
    try:
        fn = load_function(spec, FLAG)
    except PluginLoadError as exc:
        raise FilterLoadError(str(exc)) from exc
    try:
        inspect.signature(fn).bind(args, [])
    except TypeError as exc:
        raise FilterLoadError(f"filter {spec!r} must accept (args, samples, **kwargs): {exc}") from exc
    except ValueError:
        pass  # no signature to inspect (some builtins): find out at call time
    log.info("dynamic_filter_loaded", spec=spec)
    return GroupFilter(fn, args, spec)


def build_group_filter(cfg: Any) -> GroupFilter | None:
    """The job's filter, or None without `--dynamic-sampling-filter-path`."""
    spec = getattr(cfg, "dynamic_sampling_filter_path", None)
    return load_group_filter(spec, cfg) if spec else None
