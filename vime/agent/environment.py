"""The environment interface of multi-turn rollouts (`--environment-path`).

An environment is built per trajectory by the factory `--environment-path` names
(`make_env(sample, context) -> Environment`, sync or async) and answers each model turn:

    class Environment(Protocol):
        async def reset(self, sample: Trajectory) -> str | None       # optional first observation
        async def step(self, sample: Trajectory, turn: ModelTurn) -> EnvStep
        async def close(self) -> None                                   # optional: the trajectory ended

`EnvStep.observation` (text, tokenized once and appended as a masked environment turn) or
`observation_tokens` (appended as they are) is what the model sees next; `done` ends the trajectory;
`reward`, when set, is the trajectory's reward and the reward worker keeps it (otherwise the job's
reward function scores the final text). Many trajectories are in flight per worker: an environment
must not block the event loop (run blocking work with `asyncio.to_thread`).

Failures: an environment raises `EnvironmentFailure` (or any exception) when it cannot go on: a tool
server that stays unreachable, a malformed state. The trajectory's group then fails with the reason,
is counted and logged, and is never trained with a made-up reward.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Protocol

from vime.agent.tools import Tools
from vime.agent.trajectory import ModelTurn, Trajectory
from vime.plugins import PluginLoadError, load_function

FLAG = "--environment-path"


class EnvironmentFailure(RuntimeError):
    """The environment cannot continue this trajectory; the message says why."""


class EnvironmentLoadError(PluginLoadError):
    """`--environment-path` names no usable factory."""


@dataclass
class EnvStep:
    """The environment's answer to one model turn."""

    observation: str = ""
    observation_tokens: list[int] | None = None
    done: bool = False
    reward: float | None = None
    info: dict[str, Any] = field(default_factory=dict)


class Environment(Protocol):
    async def reset(self, sample: Trajectory) -> str | None: ...

    async def step(self, sample: Trajectory, turn: ModelTurn) -> EnvStep: ...


@dataclass
class EnvContext:
    """What a factory gets besides the sample: the job's config, its tokenizer and its tools."""

    cfg: Any
    tokenizer: Any
    tools: Tools


def load_environment_factory(spec: str) -> Any:
    """The factory `spec` names; raises EnvironmentLoadError."""
    return load_function(spec, FLAG, error=EnvironmentLoadError, what="environment file")


async def make_environment(factory: Any, sample: Trajectory, context: EnvContext) -> Environment:
    """Call the factory (sync or async) and check that what it built has `reset` and `step`."""
    env = factory(sample, context)
    if inspect.isawaitable(env):
        env = await env
    for method in ("reset", "step"):
        if not callable(getattr(env, method, None)):
            raise EnvironmentFailure(f"{FLAG}: the factory returned {type(env).__name__}, which has no {method}() method")
    return env  # type: ignore[no-any-return]
