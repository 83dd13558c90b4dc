"""`vime-tool-server`: tools and environments served over HTTP for multi-turn rollouts
(`--tool-server-url`, `--environment-url`).

    vime-tool-server --port 8100                                  # the built-in calculator only
    vime-tool-server --host 0.0.0.0 --port 8100 --tool search=tools/search.py:search \
        --environment running_sum=vime.demo.running_sum:make_environment

Routes:
- `POST /tools/{name}` with `{"arguments": {...}}`: `{"result": "..."}`; a call the tool rejects (bad
  arguments, the function raised) is answered 422 `{"error": "..."}`, an unknown tool 404: both are
  the call's own fault, and `vime.agent.tools.RemoteTools` shows them to the model. Anything else
  (5xx, no answer) is retried by the client and, if it lasts, fails the trajectory.
- `GET /tools`: the tools and their parameters. `GET /health`: liveness and call counters.
- `POST /environments/{name}/reset` with `{"prompt", "label", "metadata"}`: `{"session", "observation"}`;
  `POST /environments/{name}/step` with `{"session", "turn", "action"}`: `{"observation", "done",
  "reward", "info", "stats"}` (the same turn asked again gets the same answer: a retried step does not
  act twice); `POST /environments/{name}/close` with `{"session"}`. The environments are the
  `--environment-path` kind (`vime.agent.environment`), one per session, with the server's tools;
  sessions idle for `--session-ttl-s` are dropped. An unknown environment or session is 404, an
  environment that raises 422: the client fails that trajectory.

Tools run as in a rollout worker (`vime.agent.tools.Tools.run`): sync functions in worker threads, so a
slow tool does not stop the server answering.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import secrets
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from vime.agent.calculator import calculator
from vime.agent.environment import EnvContext, load_environment_factory, make_environment
from vime.agent.tools import ToolCallError, Tools, load_local_tools
from vime.agent.trajectory import ModelTurn, Trajectory
from vime.http_server import serve
from vime.logging import configure_logging, get_logger
from vime.plugins import PluginLoadError, split_named_specs

log = get_logger("vime.tool_server")

BUILTIN_TOOLS: dict[str, Callable[..., Any]] = {"calculator": calculator}


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    arguments: dict[str, Any] = Field(default_factory=dict)


class Reset(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str = ""
    label: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)


class Step(BaseModel):
    model_config = ConfigDict(extra="forbid")

    session: str
    turn: int = Field(ge=1)
    action: str


class Close(BaseModel):
    model_config = ConfigDict(extra="forbid")

    session: str


@dataclass
class _Session:
    env: Any
    sample: Trajectory
    last_used: float
    turn: int = 0
    last_reply: dict[str, Any] | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class Sessions:
    """The open environment sessions: one environment and its trajectory's stand-in per session."""

    def __init__(self, factories: dict[str, Callable[..., Any]], tools: Tools, ttl_s: float) -> None:
        self.factories = factories
        self.context = EnvContext(cfg=None, tokenizer=None, tools=tools)
        self.ttl_s = ttl_s
        self.open: dict[str, _Session] = {}

    def sweep(self, now: float) -> None:
        for key in [k for k, s in self.open.items() if now - s.last_used > self.ttl_s]:
            del self.open[key]

    async def reset(self, name: str, body: Reset) -> dict[str, Any]:
        sample = Trajectory(index=0, prompt=body.prompt, tokens=[], label=body.label, metadata=dict(body.metadata))
        env = await make_environment(self.factories[name], sample, self.context)
        observation = await env.reset(sample)
        session = secrets.token_hex(16)
        self.open[f"{name}/{session}"] = _Session(env, sample, time.monotonic())
        return {"session": session, "observation": observation, "stats": sample.stats}

    async def step(self, name: str, body: Step) -> dict[str, Any] | None:
        state = self.open.get(f"{name}/{body.session}")
        if state is None:
            return None
        async with state.lock:
            state.last_used = time.monotonic()
            if body.turn == state.turn and state.last_reply is not None:
                return state.last_reply  # a retry of the step already taken
            if body.turn != state.turn + 1:
                raise ValueError(f"turn {body.turn} out of order: the session is at turn {state.turn}")
            turn = ModelTurn(tokens=[], logprobs=[], versions=[], finish_reason="stop", text=body.action)
            result = await state.env.step(state.sample, turn)
            state.turn, state.last_reply = body.turn, {
                "observation": result.observation, "done": result.done, "reward": result.reward,
                "info": result.info, "stats": dict(state.sample.stats),
            }  # fmt: skip
            return state.last_reply

    async def close(self, name: str, body: Close) -> bool:
        state = self.open.pop(f"{name}/{body.session}", None)
        if state is not None and callable(getattr(state.env, "close", None)):
            await state.env.close()
        return state is not None


def create_app(
    tools: dict[str, Callable[..., Any]], environments: dict[str, Callable[..., Any]] | None = None, session_ttl_s: float = 600.0
) -> FastAPI:
    app = FastAPI(title="vime tool server")
    counts: Counter[str] = Counter()
    sessions = Sessions(environments or {}, Tools(tools), session_ttl_s)

    def env_error(status: int, text: str) -> JSONResponse:
        counts[f"environment_errors/{status}"] += 1
        return JSONResponse({"error": text}, status_code=status)

    @app.post("/environments/{name}/reset")
    async def reset(name: str, body: Reset) -> Any:
        sessions.sweep(time.monotonic())
        if name not in sessions.factories:
            return env_error(404, f"unknown environment {name!r}; environments: {sorted(sessions.factories)}")
        try:
            return await sessions.reset(name, body)
        except Exception as exc:
            return env_error(422, f"{type(exc).__name__}: {exc}")

    @app.post("/environments/{name}/step")
    async def step(name: str, body: Step) -> Any:
        try:
            reply = await sessions.step(name, body)
        except Exception as exc:
            return env_error(422, f"{type(exc).__name__}: {exc}")
        if reply is None:
            return env_error(404, f"no session {body.session!r} of environment {name!r} (closed, or idle too long)")
        counts[f"steps/{name}"] += 1
        return reply

    @app.post("/environments/{name}/close")
    async def close(name: str, body: Close) -> Any:
        return {"closed": await sessions.close(name, body)}

    @app.post("/tools/{name}")
    async def call(name: str, body: ToolCall) -> Any:
        if name not in tools:
            counts["unknown_tool"] += 1
            return JSONResponse({"error": f"unknown tool {name!r}; tools: {sorted(tools)}"}, status_code=404)
        counts[f"calls/{name}"] += 1
        try:
            return {"result": await sessions.context.tools.run(name, body.arguments)}
        except ToolCallError as exc:  # the call's fault (bad arguments, a tool error): the model is told
            counts[f"errors/{name}"] += 1
            return JSONResponse({"error": str(exc)}, status_code=422)

    @app.get("/tools")
    async def listing() -> dict[str, Any]:
        return {"tools": {name: list(inspect.signature(fn).parameters) for name, fn in sorted(tools.items())}}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "tools": sorted(tools), "environments": sorted(sessions.factories),
                "sessions": len(sessions.open), "counts": dict(counts)}

    return app


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vime-tool-server", description="Tools over HTTP for vime's multi-turn rollouts.",
                                allow_abbrev=False)  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for other machines)")
    p.add_argument("--port", type=int, default=8100, help="port; 0 picks a free one (logged as tool_server_listening)")
    p.add_argument("--tool", action="append", default=[], metavar="NAME=SPEC",
                   help="serve path/to/file.py:fn or module:fn as NAME; repeatable")  # fmt: skip
    p.add_argument("--environment", action="append", default=[], metavar="NAME=SPEC",
                   help="serve the environment factory path/to/file.py:fn or module:fn as NAME; repeatable")  # fmt: skip
    p.add_argument("--session-ttl-s", type=float, default=600.0, help="drop environment sessions idle this long")
    return p


def main(argv: list[str] | None = None) -> None:
    """Parse flags, load the tools (failing fast on a bad spec), serve until SIGTERM/SIGINT."""
    args = build_parser().parse_args(argv)
    configure_logging()
    try:
        tools = {**BUILTIN_TOOLS, **load_local_tools(args.tool)}
        environments = {name: load_environment_factory(spec) for name, spec in split_named_specs(args.environment, "--environment")}
    except PluginLoadError as exc:
        print(f"vime-tool-server: {exc}", file=sys.stderr)
        sys.exit(2)
    serve(create_app(tools, environments, args.session_ttl_s), args.host, args.port, listening_event="tool_server_listening",
          tools=sorted(tools), environments=sorted(environments))  # fmt: skip


if __name__ == "__main__":
    main()
