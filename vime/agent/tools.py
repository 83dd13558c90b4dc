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
import time
from collections.abc import Callable, Mapping
from typing import Any

from vime.agent.http_json import JsonClient, ServiceUnavailable
from vime.agent.trajectory import Trajectory
from vime.plugins import load_function, split_named_specs

FLAG = "--tool"


class ToolCallError(RuntimeError):
    """The call was wrong or the tool refused it; the message is fit to show the model."""


class ToolUnavailable(RuntimeError):
    """The tool server gave no answer after its retries; the trajectory cannot go on honestly."""


def load_local_tools(specs: list[str]) -> dict[str, Callable[..., Any]]:
    """`NAME=path.py:fn` / `NAME=module:fn` specs as a name -> function map; raises PluginLoadError."""
    return {name: load_function(spec, FLAG, what="tool file") for name, spec in split_named_specs(specs, FLAG)}


class RemoteTools:
    """Client of one tool server (`vime.agent.http_json`: timeouts, retries with backoff); a 4xx
    answer is the call's own fault (`ToolCallError`), no answer at all is `ToolUnavailable`."""

    def __init__(self, url: str, *, timeout_s: float = 30.0, retries: int = 2, backoff_s: float = 0.2) -> None:
        self._client = JsonClient(url, timeout_s=timeout_s, retries=retries, backoff_s=backoff_s)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def call(self, name: str, arguments: Mapping[str, Any]) -> str:
        try:
            status, payload = await self._client.post(f"/tools/{name}", {"arguments": dict(arguments)})
        except ServiceUnavailable as exc:
            raise ToolUnavailable(f"tool server gave no answer for tool {name!r}: {exc}") from None
        except ValueError as exc:
            raise ToolCallError(str(exc)) from None
        if status >= 400 or "error" in payload:
            raise ToolCallError(str(payload.get("error") or f"HTTP {status}"))
        if "result" not in payload:
            raise ToolCallError(f"tool server answer has no 'result': {str(payload)[:200]}")
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
            return await self.run(name, arguments)
        except (ToolCallError, ToolUnavailable):
            sample.count("tool_errors")
            raise
        finally:
            sample.count("env_s", time.perf_counter() - started)

    async def run(self, name: str, arguments: Mapping[str, Any]) -> str:
        """The tool's result text, counted nowhere (the tool server's own route); errors as `call`'s.
        Sync functions run in a thread, so a slow tool does not stop the event loop."""
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
            raise ToolCallError(f"bad arguments for tool {name!r}: TypeError: {exc}") from None
        except Exception as exc:
            raise ToolCallError(f"tool {name!r} failed: {type(exc).__name__}: {exc}") from None
        return str(result)

    async def aclose(self) -> None:
        if self.remote is not None:
            await self.remote.aclose()
