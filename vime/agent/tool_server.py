"""`vime-tool-server`: tools served over HTTP for multi-turn rollouts (`--tool-server-url`).

    vime-tool-server --port 8100                                  # the built-in calculator only
    vime-tool-server --host 0.0.0.0 --port 8100 --tool search=tools/search.py:search

Routes:
- `POST /tools/{name}` with `{"arguments": {...}}`: `{"result": "..."}`; a call the tool rejects (bad
  arguments, the function raised) is answered 422 `{"error": "..."}`, an unknown tool 404: both are
  the call's own fault, and `vime.agent.tools.RemoteTools` shows them to the model. Anything else
  (5xx, no answer) is retried by the client and, if it lasts, fails the trajectory.
- `GET /tools`: the tools and their parameters. `GET /health`: liveness and call counters.

Sync tool functions run in worker threads, so a slow tool does not stop the server answering.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from vime.agent.calculator import calculator
from vime.agent.tools import load_local_tools
from vime.http_server import serve
from vime.logging import configure_logging, get_logger
from vime.plugins import PluginLoadError

log = get_logger("vime.tool_server")

BUILTIN_TOOLS: dict[str, Callable[..., Any]] = {"calculator": calculator}


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    arguments: dict[str, Any] = Field(default_factory=dict)


def create_app(tools: dict[str, Callable[..., Any]]) -> FastAPI:
    app = FastAPI(title="vime tool server")
    counts: Counter[str] = Counter()

    @app.post("/tools/{name}")
    async def call(name: str, body: ToolCall) -> Any:
        fn = tools.get(name)
        if fn is None:
            counts["unknown_tool"] += 1
            return JSONResponse({"error": f"unknown tool {name!r}; tools: {sorted(tools)}"}, status_code=404)
        counts[f"calls/{name}"] += 1
        try:
            if inspect.iscoroutinefunction(fn):
                result = await fn(**body.arguments)
            else:
                result = await asyncio.to_thread(fn, **body.arguments)
        except Exception as exc:  # the call's fault (bad arguments, a tool error): the model is told
            counts[f"errors/{name}"] += 1
            return JSONResponse({"error": f"{type(exc).__name__}: {exc}"}, status_code=422)
        return {"result": str(result)}

    @app.get("/tools")
    async def listing() -> dict[str, Any]:
        return {"tools": {name: list(inspect.signature(fn).parameters) for name, fn in sorted(tools.items())}}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "tools": sorted(tools), "counts": dict(counts)}

    return app


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vime-tool-server", description="Tools over HTTP for vime's multi-turn rollouts.",
                                allow_abbrev=False)  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for other machines)")
    p.add_argument("--port", type=int, default=8100, help="port; 0 picks a free one (logged as tool_server_listening)")
    p.add_argument("--tool", action="append", default=[], metavar="NAME=SPEC",
                   help="serve path/to/file.py:fn or module:fn as NAME; repeatable")  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> None:
    """Parse flags, load the tools (failing fast on a bad spec), serve until SIGTERM/SIGINT."""
    args = build_parser().parse_args(argv)
    configure_logging()
    try:
        tools = {**BUILTIN_TOOLS, **load_local_tools(args.tool)}
    except PluginLoadError as exc:
        print(f"vime-tool-server: {exc}", file=sys.stderr)
        sys.exit(2)
    serve(create_app(tools), args.host, args.port, listening_event="tool_server_listening", tools=sorted(tools))


if __name__ == "__main__":
    main()
