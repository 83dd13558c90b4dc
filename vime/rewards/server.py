"""`vime-reward-server`: a reference reward server speaking the slime, OpenRLHF and vime formats.

    vime-reward-server --port 8000                                   # built-in rewards, no token
    VIME_RM_TOKEN=s3cret vime-reward-server --host 0.0.0.0 --port 8000 \\
        --custom-rm-path judge=path/to/judge.py:score --math-workers 4

Routes (formats in `vime.rewards.wire`, user docs in `docs/reward-servers.md`):
- `POST /slime/{reward}`, `POST /openrlhf/{reward}`, `POST /vime/{reward}`: score with the reward named
  `{reward}`: the built-ins `arithmetic` (the CPU demo), `math`, `gsm8k`, `dapo`, `boxed_math`
  (math-verify in a process pool, `vime.rewards.math`), and each `--custom-rm-path NAME=SPEC`
  (`vime.rewards.custom`; a spec without `NAME=` is served as `custom`).
- `GET /health`: liveness, the rewards and formats served, request counters. Never needs the token.

With a token (`$VIME_RM_TOKEN` or `--token-file`), scoring routes need `Authorization: Bearer TOKEN`
and answer 401 without it. Errors are JSON `{"error": "..."}`: 400 for a body that is not valid JSON or
not the route's format, 404 for an unknown reward, 413 for a batch over `--max-batch`. A sample that
cannot be scored is reported per sample (see `vime.rewards.wire`), never turned into a low reward.

Sync custom functions run in worker threads so one slow call does not stop the server answering
(math-verify's signal-based timeouts therefore do not work inside them; use `vime.rewards.math`'s
pool or make the function async). Math checks are limited to twice the pool's workers at once so
queued checks never eat into a running check's deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import os
import secrets
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError
from starlette.exceptions import HTTPException

from vime.http_server import serve as http_serve
from vime.logging import configure_logging, get_logger
from vime.rewards import KNOWN_RM_TYPES, ArithmeticReward, RewardFn, RewardResult
from vime.rewards.custom import CustomReward, load_custom_reward
from vime.rewards.math import STYLES, MathReward, MathVerifier
from vime.rewards.wire import (
    FORMATS,
    REQUEST_MODELS,
    SUPPORTED_VIME_VERSIONS,
    TOKEN_ENV,
    RequestError,
    ScoreItem,
    WireFormat,
    encode_reply,
    items_from_request,
)

log = get_logger("vime.reward_server")

BUILTIN_REWARDS: tuple[str, ...] = tuple(t for t in KNOWN_RM_TYPES if t != "custom")


class ServerSettings(BaseModel):
    """What the server serves and how; `main` fills it from the command line."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    custom: dict[str, str] = Field(default_factory=dict, description="reward name -> --custom-rm-path spec")
    math_workers: int | None = Field(None, ge=1, description="math-verify processes (default: cores / 2, 1..4)")
    math_timeout_s: float = Field(10.0, gt=0.0)
    max_batch: int = Field(4096, ge=1, description="largest batch one request may carry")
    token: SecretStr | None = None
    warm_math: bool = Field(True, description="start the math-verify pool at start-up, in the background")


class Rewards:
    """The named reward functions and the limits they run under."""

    def __init__(self, settings: ServerSettings) -> None:
        # Same default as MathVerifier's, computed here because the gate below is sized from it.
        workers = settings.math_workers or max(1, min(4, (os.cpu_count() or 2) // 2))
        self.verifier = MathVerifier(timeout_s=settings.math_timeout_s, num_workers=workers)
        self.fns: dict[str, RewardFn] = {"arithmetic": ArithmeticReward()}
        for style in STYLES:
            self.fns[style] = MathReward(style, self.verifier)
        for name, spec in settings.custom.items():
            if name in self.fns:
                raise ValueError(f"custom reward name {name!r} clashes with a built-in reward; pick another")
            self.fns[name] = _off_the_loop(load_custom_reward(spec))
        # Only math checks need a gate: they queue on a small process pool whose deadline starts at submit.
        self.math_gate = asyncio.Semaphore(2 * workers)
        self.math_names = frozenset(STYLES)

    async def score(self, name: str, items: Sequence[ScoreItem]) -> list[RewardResult]:
        fn = self.fns[name]
        gate = self.math_gate if name in self.math_names else None

        async def one(item: ScoreItem) -> RewardResult:
            try:
                if gate is None:
                    return await fn(item.prompt, item.response, item.label, item.metadata)
                async with gate:
                    return await fn(item.prompt, item.response, item.label, item.metadata)
            except Exception as exc:  # reward functions should not raise; one that does fails its sample
                log.warning("reward_fn_raised", reward=name, error=f"{type(exc).__name__}: {exc}")
                return RewardResult.failure(f"reward {name} raised {type(exc).__name__}: {exc}")

        return list(await asyncio.gather(*(one(item) for item in items)))

    def close(self) -> None:
        self.verifier.close()


def _off_the_loop(reward: CustomReward) -> CustomReward:
    """A sync custom function runs in a worker thread; async ones stay on the loop."""
    fn = reward.fn
    if inspect.iscoroutinefunction(fn):
        return reward

    async def in_thread(prompt: str, response: str, label: str | None, metadata: dict[str, Any]) -> Any:
        return await asyncio.to_thread(fn, prompt, response, label, metadata)

    return CustomReward(in_thread, reward.name)


def _summarize(exc: ValidationError) -> str:
    """The first few validation problems as `where: what`; a body that is not JSON says so."""
    problems = []
    for err in exc.errors()[:5]:
        if err.get("type") == "json_invalid":
            return f"malformed JSON: {err.get('msg')}"
        where = ".".join(str(p) for p in err.get("loc", ())) or "body"
        problems.append(f"{where}: {err.get('msg')}")
    return "; ".join(problems)


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def create_app(settings: ServerSettings) -> FastAPI:
    """The ASGI app. Reward functions load here, so a bad `--custom-rm-path` fails at start-up."""
    rewards = Rewards(settings)
    counts: Counter[str] = Counter()
    started = time.time()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        warm = asyncio.create_task(_warm(rewards.verifier)) if settings.warm_math else None
        try:
            yield
        finally:
            if warm is not None:
                warm.cancel()
            rewards.close()

    app = FastAPI(title="vime reward server", version="1", lifespan=lifespan)

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail), dict(exc.headers or {}))

    async def require_token(request: Request) -> None:
        if settings.token is None:
            return
        expected = f"Bearer {settings.token.get_secret_value()}".encode()
        given = request.headers.get("authorization", "").encode()
        if not secrets.compare_digest(given, expected):
            counts["unauthorized"] += 1
            raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})

    async def handle(fmt: WireFormat, name: str, request: Request) -> JSONResponse:
        if name not in rewards.fns:
            return _error(404, f"unknown reward {name!r}; this server serves {sorted(rewards.fns)}")
        raw = await request.body()
        try:
            # Parsed whatever the Content-Type says: slime's and OpenRLHF's clients do not all set it.
            body = REQUEST_MODELS[fmt].model_validate_json(raw)
            items = items_from_request(body)
        except ValidationError as exc:
            counts["bad_requests"] += 1
            return _error(400, f"not a valid {fmt} request: {_summarize(exc)}")
        except RequestError as exc:
            counts["bad_requests"] += 1
            return _error(400, f"not a valid {fmt} request: {exc}")
        if len(items) > settings.max_batch:
            return _error(413, f"batch of {len(items)} samples is over this server's --max-batch {settings.max_batch}")
        t0 = time.perf_counter()
        results = await rewards.score(name, items)
        failed = sum(r.failed for r in results)
        counts[f"requests_{fmt}"] += 1
        counts["samples"] += len(items)
        counts["samples_failed"] += failed
        log.debug("scored", format=fmt, reward=name, samples=len(items), failed=failed, ms=round(1e3 * (time.perf_counter() - t0), 2))
        status, reply = encode_reply(fmt, items, results)
        return JSONResponse(reply, status_code=status)

    auth = [Depends(require_token)]

    @app.post("/slime/{reward}", dependencies=auth, summary="slime: one sample; the reply is its reward")
    async def slime(reward: str, request: Request) -> JSONResponse:
        return await handle("slime", reward, request)

    @app.post("/openrlhf/{reward}", dependencies=auth, summary="OpenRLHF: a batch; reply {rewards, scores, extra_logs}")
    async def openrlhf(reward: str, request: Request) -> JSONResponse:
        return await handle("openrlhf", reward, request)

    @app.post("/vime/{reward}", dependencies=auth, summary="vime v1: a batch with ids; per-sample results or errors")
    async def vime(reward: str, request: Request) -> JSONResponse:
        return await handle("vime", reward, request)

    @app.get("/health", summary="liveness, what is served, counters")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "rewards": sorted(rewards.fns),
            "formats": list(FORMATS),
            "vime_versions": list(SUPPORTED_VIME_VERSIONS),
            "auth": settings.token is not None,
            "uptime_s": round(time.time() - started, 3),
            "counters": dict(counts),
            "math_pool_restarts": rewards.verifier.pool.restarts,
        }

    return app


async def _warm(verifier: MathVerifier) -> None:
    """Start the math-verify workers (seconds of sympy import) before the first math request needs them."""
    try:
        outcome = await verifier.acheck("1", "1")
        log.info("math_pool_ready", ok=outcome.get("error") is None)
    except Exception as exc:  # the first real request will try again and report per sample
        log.warning("math_pool_warmup_failed", error=f"{type(exc).__name__}: {exc}")


# ----------------------------------------------------------------------------------- command line


def _parse_custom(specs: Sequence[str]) -> dict[str, str]:
    custom: dict[str, str] = {}
    for spec in specs:
        name, eq, rest = spec.partition("=")
        if not (eq and name.isidentifier()):
            name, rest = "custom", spec
        if name in custom:
            raise ValueError(f"two --custom-rm-path entries are named {name!r}; write NAME=SPEC to tell them apart")
        if not rest:
            raise ValueError(f"--custom-rm-path {spec!r} names no function")
        custom[name] = rest
    return custom


def _read_token(token_file: Path | None) -> SecretStr | None:
    if token_file is not None:
        text = token_file.read_text().strip()
        if not text:
            raise ValueError(f"--token-file {token_file} is empty")
        return SecretStr(text)
    env = os.environ.get(TOKEN_ENV, "").strip()
    return SecretStr(env) if env else None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vime-reward-server",
        description="Reference reward server: slime, OpenRLHF and vime formats at /{format}/{reward}.",
        allow_abbrev=False,
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for other machines)")
    p.add_argument("--port", type=int, default=8000, help="port; 0 picks a free one (logged as reward_server_listening)")
    p.add_argument("--custom-rm-path", action="append", default=[], metavar="[NAME=]SPEC",
                   help="serve a custom reward function (path/to/file.py:fn or module:fn) as NAME (default 'custom'); repeatable")  # fmt: skip
    p.add_argument("--math-workers", type=int, default=None, help="math-verify worker processes")
    p.add_argument("--math-timeout-s", type=float, default=10.0, help="deadline of one math-verify check")
    p.add_argument("--max-batch", type=int, default=4096, help="most samples one request may carry")
    p.add_argument("--token-file", type=Path, default=None, help=f"bearer token file (default: ${TOKEN_ENV}; none: no auth)")
    p.add_argument("--no-warm-math", dest="warm_math", action="store_false", help="start the math pool on first use")
    return p


def main(argv: list[str] | None = None) -> None:
    """Parse flags, load the rewards (failing fast on a bad custom spec), listen, serve until SIGTERM/SIGINT."""
    args = build_parser().parse_args(argv)
    configure_logging()
    try:
        settings = ServerSettings(
            host=args.host, port=args.port, custom=_parse_custom(args.custom_rm_path), math_workers=args.math_workers,
            math_timeout_s=args.math_timeout_s, max_batch=args.max_batch, token=_read_token(args.token_file),
            warm_math=args.warm_math,
        )  # fmt: skip
        app = create_app(settings)
    except (ValueError, OSError) as exc:
        log.error("reward_server_config_error", error=str(exc))
        print(f"vime-reward-server: {exc}", file=sys.stderr)
        sys.exit(2)
    serve(app, settings)


def serve(app: FastAPI, settings: ServerSettings) -> None:
    """Bind, log the real port (so `--port 0` is usable), and run uvicorn until it is stopped."""
    http_serve(
        app, settings.host, settings.port, listening_event="reward_server_listening", auth=settings.token is not None,
        rewards=sorted([*BUILTIN_REWARDS, *settings.custom]),
    )  # fmt: skip


if __name__ == "__main__":
    main()
