"""Tools an environment calls by name: in-process Python functions and tools on a remote tool server.

`await tools.call(sample, name, arguments)` returns the tool's result as text and counts the call on
the trajectory (`tool_calls`, `tool_errors`, `env_s`). Two kinds of failure are kept apart:

- `ToolCallError`: the call itself was wrong or the tool rejected it (unknown tool, bad arguments,
  the function raised). That is the model's doing: the environment usually shows the message to the
  model as the tool's answer, and the trajectory goes on.
- `ToolUnavailable`: the tool server did not answer (connection refused, timeout, 5xx) after the
  retries. That is nobody's answer: the environment must not invent one, and the trajectory fails
  (its group is not trained), exactly as a reward server's outage never becomes a zero reward.

Local tools: `--tool NAME=path/to/file.py:fn` (or `module:fn`); sync functions run in a thread.
Remote tools: `--tool-server-url http://HOST:PORT`, a server speaking `vime.agent.tool_server`'s
routes (`POST /tools/{name}` with `{"arguments": {...}}` -> `{"result": "..."}` or `{"error": "..."}`).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential_jitter

from vime.agent.trajectory import Trajectory
from vime.plugins import PluginLoadError, load_function

FLAG = "--tool"


class ToolCallError(RuntimeError):
    """The call was wrong or the tool refused it; the message is fit to show the model."""


class ToolUnavailable(RuntimeError):
    """The tool server gave no answer after its retries; the trajectory cannot go on honestly."""


class _Retryable(Exception):
    pass


def load_local_tools(specs: list[str]) -> dict[str, Callable[..., Any]]:
    """`NAME=path.py:fn` / `NAME=module:fn` specs as a name -> function map; raises PluginLoadError."""
    tools: dict[str, Callable[..., Any]] = {}
    for spec in specs:
        name, sep, target = spec.partition("=")
        if not sep or not name.strip() or not target.strip():
            raise PluginLoadError(f"{FLAG} {spec!r}: expected NAME=path/to/file.py:function or NAME=module:function")
        if name in tools:
            raise PluginLoadError(f"{FLAG}: the tool name {name!r} is given twice")
        tools[name.strip()] = load_function(target.strip(), FLAG, what="tool file")
    return tools


class RemoteTools:
    """Client of one tool server: bounded timeouts, retries with backoff on connection errors,
    timeouts and 5xx; 4xx answers are the call's own fault (`ToolCallError`), at once."""

    def __init__(self, url: str, *, timeout_s: float = 30.0, retries: int = 2, backoff_s: float = 0.2) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def call(self, name: str, arguments: Mapping[str, Any]) -> str:
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.retries + 1),
            wait=wait_exponential_jitter(multiplier=self.backoff_s, max=5.0, jitter=self.backoff_s),
            retry=retry_if_exception_type(_Retryable),
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    return await self._post(name, arguments)
        except _Retryable as exc:
            raise ToolUnavailable(f"tool server {self.url} gave no answer for tool {name!r} after "
                                  f"{self.retries + 1} attempts: {exc}") from None  # fmt: skip
        raise AssertionError("unreachable")  # pragma: no cover

    async def _post(self, name: str, arguments: Mapping[str, Any]) -> str:
        url = f"{self.url}/tools/{name}"
        try:
            async with self._open().post(url, json={"arguments": dict(arguments)}) as reply:
                body = await reply.read()
                status = reply.status
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise _Retryable(f"{type(exc).__name__}: {exc}") from None
        if status >= 500 or status == 429:
            raise _Retryable(f"HTTP {status}: {body[:200]!r}")
        try:
            payload = json.loads(body)
        except ValueError:
            raise ToolCallError(f"tool server answered HTTP {status} with a body that is not JSON: {body[:200]!r}") from None
        if status >= 400 or "error" in payload:
            raise ToolCallError(str(payload.get("error") or f"HTTP {status}"))
        if "result" not in payload:
            raise ToolCallError(f"tool server answer has no 'result': {body[:200]!r}")
        return str(payload["result"])


class Tools:
    """The tools of one rollout worker, shared by its trajectories."""

    def __init__(self, local: Mapping[str, Callable[..., Any]] | None = None, remote: RemoteTools | None = None) -> None:
        self.local = dict(local or {})
        self.remote = remote

    async def call(self, sample: Trajectory, name: str, arguments: Mapping[str, Any]) -> str:
        """The tool's result text. Raises ToolCallError (show it to the model) or ToolUnavailable
        (fail the trajectory); either way the call is counted on `sample`."""
        sample.count("tool_calls")
        started = time.perf_counter()
        try:
            return await self._dispatch(name, arguments)
        except (ToolCallError, ToolUnavailable):
            sample.count("tool_errors")
            raise
        finally:
            sample.count("env_s", time.perf_counter() - started)

    async def _dispatch(self, name: str, arguments: Mapping[str, Any]) -> str:
        if not isinstance(arguments, Mapping):
            raise ToolCallError(f"arguments of tool {name!r} must be a JSON object, got {type(arguments).__name__}")
        fn = self.local.get(name)
        if fn is None:
            if self.remote is None:
                raise ToolCallError(f"unknown tool {name!r}; tools: {sorted(self.local)}")
            return await self.remote.call(name, arguments)
        try:
            result = fn(**arguments) if inspect.iscoroutinefunction(fn) else await asyncio.to_thread(fn, **arguments)
            if inspect.isawaitable(result):
                result = await result
        except TypeError as exc:
            raise ToolCallError(f"bad arguments for tool {name!r}: {exc}") from None
        except Exception as exc:
            raise ToolCallError(f"tool {name!r} failed: {type(exc).__name__}: {exc}") from None
        return str(result)

    async def aclose(self) -> None:
        if self.remote is not None:
            await self.remote.aclose()
