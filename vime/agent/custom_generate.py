"""`--custom-generate-function-path`: user code that generates one sample, slime's contract.

    async def generate(args, sample, sampling_params) -> sample

- `args`: the job's configuration with slime's flag names (`args.rollout_max_response_len`,
  `args.n_samples_per_prompt`, ...) plus `args.engine` (an `EngineHandle`: token-in/token-out
  `await args.engine.generate(tokens, sampling)`), `args.tokenizer` (the checkpoint's tokenizer) and,
  with `--environment-path`, `args.make_environment(sample)`.
- `sample`: a `Trajectory` holding the prompt (`sample.prompt`, `sample.tokens`), `sample.label`,
  `sample.metadata` and `sample.index`; the function appends turns and sets `sample.status`, and may
  set `sample.reward` itself (an environment that scores the trajectory): the reward worker then
  keeps it.
- `sampling_params`: a dict with slime's keys (`temperature`, `top_p`, `top_k`, `max_new_tokens`).

Each of a group's samples runs its own call, concurrently. If any call raises, or returns a sample that
breaks the trajectory contract, the whole group is failed with the traceback as its reason: it is
counted and logged, never trained, and the worker goes on. A function may be sync or async.
"""

from __future__ import annotations

import asyncio
import inspect
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from vime.agent.engine_handle import EngineHandle
from vime.agent.trajectory import Status, Trajectory, TrajectoryError
from vime.plugins import PluginLoadError, load_function
from vime.rollout.base import GeneratedSample, RolloutEngine, SamplingConfig

FLAG = "--custom-generate-function-path"
# The traceback kept as a failed group's reason: its end names the line that raised.
MAX_REASON_CHARS = 4000

GenerateFunction = Callable[[Any, Trajectory, dict[str, Any]], Awaitable[Trajectory] | Trajectory]


class CustomGenerateError(PluginLoadError):
    """`--custom-generate-function-path` names no usable function."""


def load_generate_function(spec: str) -> GenerateFunction:
    """The function `spec` names (`path/to/file.py:fn`, `module:fn`); raises CustomGenerateError."""
    fn = load_function(spec, FLAG, error=CustomGenerateError, what="custom generate file")
    params = [p for p in inspect.signature(fn).parameters.values() if p.default is inspect.Parameter.empty
              and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]  # fmt: skip
    if len(params) > 3:
        raise CustomGenerateError(f"{FLAG} {spec!r}: the function takes {len(params)} required arguments; slime's "
                                  "contract is generate(args, sample, sampling_params)")  # fmt: skip
    return fn


class GenerateArgs:
    """What a generate function gets as `args`: the job's config fields by name, and the handles."""

    def __init__(self, cfg: Any, engine: EngineHandle, tokenizer: Any, make_environment: Callable[..., Any] | None) -> None:
        self._cfg = cfg
        self.engine = engine
        self.tokenizer = tokenizer
        self.make_environment = make_environment

    def __getattr__(self, name: str) -> Any:
        # Only called for names not set above: the job's configuration, with slime's flag names.
        return getattr(self._cfg, name)


@dataclass
class GroupOutcome:
    """A group's samples, or the reason it failed (then `samples` is empty)."""

    samples: list[GeneratedSample]
    rewards: list[float | None]
    stats: list[dict[str, float]]
    failure: str | None = None


def sampling_params_of(sampling: SamplingConfig) -> dict[str, Any]:
    """slime's sampling dict for `sampling`."""
    params: dict[str, Any] = {"temperature": sampling.temperature, "top_p": sampling.top_p,
                              "top_k": sampling.top_k, "max_new_tokens": sampling.max_tokens}  # fmt: skip
    if sampling.stop_token_ids:
        params["stop_token_ids"] = list(sampling.stop_token_ids)
    return params


async def generate_group(
    fn: GenerateFunction,
    *,
    cfg: Any,
    engine: RolloutEngine,
    tokenizer: Any,
    make_environment: Callable[..., Any] | None,
    prompt_text: str,
    prompt_tokens: list[int],
    label: str | None,
    metadata: dict[str, Any],
    n_samples: int,
    sampling: SamplingConfig,
    max_context_len: int | None,
) -> GroupOutcome:
    """Run `fn` once per sample of a group, concurrently; a failure of any fails the group."""

    async def one(index: int) -> tuple[GeneratedSample, float | None, dict[str, float]]:
        handle = EngineHandle(engine, sampling, max_context_len)
        args = GenerateArgs(cfg, handle, tokenizer, make_environment)
        sample = Trajectory(index=index, prompt=prompt_text, tokens=list(prompt_tokens), label=label, metadata=dict(metadata))
        result = fn(args, sample, sampling_params_of(sampling))
        if inspect.isawaitable(result):
            result = await result
        if not isinstance(result, Trajectory):
            raise TrajectoryError(f"the generate function returned {type(result).__name__}, not the sample it was given")
        if result.status == Status.FAILED:
            raise TrajectoryError(f"sample {index} failed: {result.failure_reason or 'no reason given'}")
        result.stats.setdefault("engine_calls", float(handle.calls))
        return result.finish(handle.record), result.reward, dict(result.stats)

    tasks = [asyncio.ensure_future(one(i)) for i in range(n_samples)]
    try:
        done = await asyncio.gather(*tasks)
    except Exception as exc:  # a cancellation (BaseException) passes through
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return GroupOutcome([], [], [], failure=_reason(exc))
    return GroupOutcome([d[0] for d in done], [d[1] for d in done], [d[2] for d in done])


def _reason(exc: BaseException) -> str:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return text if len(text) <= MAX_REASON_CHARS else "...\n" + text[-MAX_REASON_CHARS:]
