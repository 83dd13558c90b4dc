"""The reward worker's client for remote reward servers (`--rm-type remote_rm --rm-url URL[,URL...]`).

`RemoteReward.score_batch(items)` returns exactly one `RewardResult` per item, in order, always: a
sample whose reward cannot be had is a *failed* result whose reason names the server and the problem
(it is left out of training by the broker and counted), never a silent 0 and never an exception.

How a request is made (see `docs/reward-servers.md` for the outcome table):
- Samples go out one per request (slime) or in batches of `batch_size` (openrlhf, vime) over one pooled
  aiohttp session; at most `concurrency` requests are in flight, each bounded by `timeout_s`.
- Several URLs share the load: each request goes to the healthy server with the fewest requests in
  flight, and a retry prefers a different server than the one that just failed.
- Timeouts, dropped connections, HTTP 408/429/5xx and malformed JSON are retried `retries` times with
  exponential backoff and jitter (tenacity). HTTP 401/403 (token), other 4xx and replies of the wrong
  shape are not retried: they will not get better by asking again.
- Each URL has a circuit breaker (purgatory): after `breaker_failures` consecutive failed requests it
  opens for `breaker_reset_s` seconds, during which no request goes to that server; when every server's
  circuit is open, samples fail at once with reason "circuit open" instead of waiting on a dead server.
  After the pause requests go through again: the first failure reopens the circuit, a success closes it.

Counters for the worker's heartbeat (`stats()`): requests, retries, circuits opened, and failed samples
by kind (timeout, connection, http_5xx, http_408, http_429, malformed, auth, rejected, bad_reply,
circuit_open, internal; `unscorable` when the server answered but gave that sample no usable reward).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp
from purgatory import AsyncCircuitBreakerFactory
from purgatory.domain.model import OpenedState
from pydantic import BaseModel, ConfigDict, Field, SecretStr
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from vime.logging import get_logger
from vime.rewards.types import RewardResult
from vime.rewards.wire import (
    FORMATS,
    TOKEN_ENV,
    ReplyError,
    ScoreItem,
    WireFormat,
    decode_reply,
    encode_request,
    is_batched,
)

log = get_logger(__name__)

# A reply body larger than this is a broken server, not a reward (64 MiB covers huge batches of extras).
MAX_REPLY_BYTES = 64 * 1024 * 1024
_ERROR_TEXT_CHARS = 300


class RemoteRewardSettings(BaseModel):
    """Everything the client needs; `from_config` maps the job's `--rm-*` flags onto it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    urls: list[str] = Field(min_length=1)
    fmt: WireFormat = "slime"
    reward_key: str | None = None
    timeout_s: float = Field(120.0, gt=0.0)
    retries: int = Field(3, ge=0)
    concurrency: int = Field(64, ge=1)
    batch_size: int = Field(64, ge=1)
    breaker_failures: int = Field(5, ge=1)
    breaker_reset_s: float = Field(30.0, gt=0.0)
    backoff_initial_s: float = Field(0.5, gt=0.0)
    backoff_max_s: float = Field(10.0, gt=0.0)
    token: SecretStr | None = None

    @classmethod
    def from_config(cls, cfg: Any, environ: Mapping[str, str] | None = None) -> RemoteRewardSettings:
        """Settings from a `VimeConfig`; the bearer token comes from `$VIME_RM_TOKEN` if set."""
        env = os.environ if environ is None else environ
        token = env.get(TOKEN_ENV) or None
        return cls(
            urls=list(cfg.rm_url),
            fmt=cfg.rm_format,
            reward_key=cfg.reward_key,
            timeout_s=cfg.rm_timeout_s,
            retries=cfg.rm_retries,
            concurrency=cfg.rm_concurrency,
            batch_size=cfg.rm_batch_size,
            breaker_failures=cfg.rm_breaker_failures,
            breaker_reset_s=cfg.rm_breaker_reset_s,
            token=SecretStr(token) if token else None,
        )


class RewardServerError(Exception):
    """One failed request: `kind` classifies it for metrics, `retryable` says whether asking again can help."""

    def __init__(self, kind: str, message: str, *, retryable: bool, url: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.retryable = retryable
        self.url = url


def _is_retryable(exc: BaseException) -> bool:
    return isinstance(exc, RewardServerError) and exc.retryable


class RemoteReward:
    """Async client for one job's reward servers; use as `async with RemoteReward(settings) as rm`.

    Also a `RewardFn` (`await rm(prompt, response, label, metadata)`) for code that scores one sample.
    Create and use it inside one event loop (the aiohttp session belongs to the loop that opened it).
    """

    def __init__(self, settings: RemoteRewardSettings) -> None:
        if settings.fmt not in FORMATS:
            raise ValueError(f"unknown reward wire format {settings.fmt!r}; known: {', '.join(FORMATS)}")
        self.settings = settings
        self._session: aiohttp.ClientSession | None = None
        self._limit = asyncio.Semaphore(settings.concurrency)
        self._in_flight: dict[str, int] = dict.fromkeys(settings.urls, 0)
        self._last_error: dict[str, str] = {}
        # A random start spreads several reward workers over the URLs from their first request on.
        self._turn = itertools.count(random.randrange(len(settings.urls)))
        self._breakers = AsyncCircuitBreakerFactory(
            default_threshold=settings.breaker_failures, default_ttl=settings.breaker_reset_s
        )
        self._breakers.add_listener(self._on_breaker_event)
        self._ids = itertools.count()
        self.counts: Counter[str] = Counter()

    # -- lifecycle ---------------------------------------------------------------------------------

    async def __aenter__(self) -> RemoteReward:
        self._open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            headers = {"Content-Type": "application/json", "Accept": "application/json"}
            if self.settings.token is not None:
                headers["Authorization"] = f"Bearer {self.settings.token.get_secret_value()}"
            connector = aiohttp.TCPConnector(limit=self.settings.concurrency, limit_per_host=0, ttl_dns_cache=300)
            self._session = aiohttp.ClientSession(
                connector=connector,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=self.settings.timeout_s),
                raise_for_status=False,
            )
        return self._session

    async def aclose(self) -> None:
        """Close the pooled connections; the client reopens them if used again."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    # -- scoring -----------------------------------------------------------------------------------

    async def __call__(
        self, prompt: str, response: str, label: str | None, metadata: Mapping[str, Any]
    ) -> RewardResult:
        item = ScoreItem(str(next(self._ids)), prompt, response, label, dict(metadata))
        return (await self.score_batch([item]))[0]

    async def score_batch(self, items: Sequence[ScoreItem]) -> list[RewardResult]:
        """One result per item, in order; failures are failed results (see the module docstring)."""
        if not items:
            return []
        size = self.settings.batch_size if is_batched(self.settings.fmt) else 1
        chunks = [items[i : i + size] for i in range(0, len(items), size)]
        scored = await asyncio.gather(*(self._score_chunk(chunk) for chunk in chunks))
        results = [r for chunk in scored for r in chunk]
        self.counts["samples"] += len(results)
        for r in results:
            if r.failed:
                # Request-level failures carry their kind; the rest are samples the server would not score.
                self.counts["samples_failed"] += 1
                self.counts[f"samples_failed_{r.extra.get('reward_error', 'unscorable')}"] += 1
        return results

    async def _score_chunk(self, items: Sequence[ScoreItem]) -> list[RewardResult]:
        try:
            payload = json.dumps(encode_request(self.settings.fmt, items), ensure_ascii=False, default=str).encode()
            results = await self._request_with_retries(payload, items)
        except RewardServerError as exc:
            log.warning("reward_request_failed", kind=exc.kind, url=exc.url, samples=len(items), error=str(exc))
            return [RewardResult.failure(str(exc), reward_error=exc.kind) for _ in items]
        except Exception as exc:  # a bug here must still give every sample an answer
            log.exception("reward_client_error", samples=len(items))
            reason = f"reward client error: {type(exc).__name__}: {exc}"
            return [RewardResult.failure(reason, reward_error="internal") for _ in items]
        if len(results) != len(items):  # decode_reply guarantees this; keep the promise even if it broke
            reason = f"reward client got {len(results)} results for {len(items)} samples"
            return [RewardResult.failure(reason, reward_error="internal")] * len(items)
        return results

    async def _request_with_retries(self, payload: bytes, items: Sequence[ScoreItem]) -> list[RewardResult]:
        s = self.settings
        last_url: list[str | None] = [None]
        retrying = AsyncRetrying(
            stop=stop_after_attempt(s.retries + 1),
            wait=wait_exponential_jitter(multiplier=s.backoff_initial_s, max=s.backoff_max_s, jitter=s.backoff_initial_s),
            retry=retry_if_exception(_is_retryable),
            before_sleep=self._before_retry,
            reraise=True,
        )
        results: list[RewardResult] = []
        async for attempt in retrying:
            with attempt:
                results = await self._attempt_any_url(payload, items, last_url)
        return results

    async def _attempt_any_url(self, payload: bytes, items: Sequence[ScoreItem], last_url: list[str | None]) -> list[RewardResult]:
        """Send once, to the best URL whose circuit lets it through; raises `RewardServerError`."""
        opened = []
        for url in self._candidates(avoid=last_url[0]):
            breaker = await self._breakers.get_breaker(url)
            try:
                async with breaker:
                    last_url[0] = url
                    return await self._post(url, payload, items)
            except OpenedState:
                opened.append(url)
            except RewardServerError as exc:
                self._last_error[url] = str(exc)
                raise
        last = "; ".join(self._last_error[u] for u in opened if u in self._last_error)
        raise RewardServerError(
            "circuit_open",
            f"circuit open for every reward server ({', '.join(opened)}): each failed "
            f"{self.settings.breaker_failures} requests in a row, next trial within {self.settings.breaker_reset_s}s; "
            f"last error: {last or 'unknown'}",
            retryable=False,
        )

    def _candidates(self, avoid: str | None) -> list[str]:
        """URLs in the order to try: fewest in flight first, round-robin among equals, `avoid` last."""
        urls = self.settings.urls
        start = next(self._turn) % len(urls)
        rotated = urls[start:] + urls[:start]
        return sorted(rotated, key=lambda u: (u == avoid and len(urls) > 1, self._in_flight[u]))

    async def _post(self, url: str, payload: bytes, items: Sequence[ScoreItem]) -> list[RewardResult]:
        session = self._open()
        self._in_flight[url] += 1
        try:
            async with self._limit:
                self.counts["requests"] += 1
                try:
                    async with session.post(url, data=payload) as resp:
                        status = resp.status
                        if (resp.content_length or 0) > MAX_REPLY_BYTES:
                            raise RewardServerError(
                                "bad_reply", f"reward server {url} announced a {resp.content_length}-byte reply "
                                f"(limit {MAX_REPLY_BYTES})", retryable=False, url=url,
                            )
                        body = await resp.read()
                except (asyncio.TimeoutError, aiohttp.ServerTimeoutError) as exc:
                    raise RewardServerError(
                        "timeout", f"reward server {url} did not answer within {self.settings.timeout_s}s",
                        retryable=True, url=url,
                    ) from exc
                except aiohttp.ClientError as exc:
                    raise RewardServerError(
                        "connection", f"reward server {url}: {type(exc).__name__}: {exc or 'connection lost'}",
                        retryable=True, url=url,
                    ) from exc
        finally:
            self._in_flight[url] -= 1
        return self._interpret(url, status, body, items)

    def _interpret(self, url: str, status: int, body: bytes, items: Sequence[ScoreItem]) -> list[RewardResult]:
        """Results from an HTTP reply, or a classified `RewardServerError`."""
        if 200 <= status < 300:
            try:
                parsed = json.loads(body)
            except ValueError as exc:
                # Usually a truncated or garbled reply (a proxy, a crash mid-write): worth another try.
                raise RewardServerError(
                    "malformed", f"reward server {url} sent malformed JSON ({exc}): {_snippet(body)}", retryable=True, url=url
                ) from exc
            try:
                return decode_reply(self.settings.fmt, parsed, items, self.settings.reward_key)
            except ReplyError as exc:
                raise RewardServerError("bad_reply", f"reward server {url}: {exc}", retryable=False, url=url) from exc
        detail = _error_text(body)
        if status == 422 and self.settings.fmt == "slime":
            # The server is fine; it could not score this one sample (slime format's way to say so).
            return [RewardResult.failure(f"reward server could not score the sample: {detail}")]
        if status in (401, 403):
            raise RewardServerError(
                "auth", f"reward server {url} refused the request (HTTP {status}): wrong or missing bearer token "
                f"(set ${TOKEN_ENV}); server said: {detail}", retryable=False, url=url,
            )
        if status in (408, 429) or status >= 500:
            raise RewardServerError("http_5xx" if status >= 500 else f"http_{status}", f"reward server {url} answered HTTP {status}: {detail}", retryable=True, url=url)
        raise RewardServerError("rejected", f"reward server {url} rejected the request (HTTP {status}): {detail}", retryable=False, url=url)

    # -- observability -----------------------------------------------------------------------------

    def _before_retry(self, state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        self.counts["retries"] += 1
        log.info(
            "reward_request_retry",
            attempt=state.attempt_number,
            kind=getattr(exc, "kind", None),
            url=getattr(exc, "url", None),
            error=str(exc),
            wait_s=round(state.upcoming_sleep, 3),
        )

    def _on_breaker_event(self, name: str, event_type: str, event: Any) -> None:
        if event_type != "state_changed":
            return
        state = getattr(event, "state", None)
        if state == "opened":
            self.counts["circuits_opened"] += 1
            log.warning("reward_server_circuit_open", url=name, failures=self.settings.breaker_failures, pause_s=self.settings.breaker_reset_s)
        else:
            log.info("reward_server_circuit_state", url=name, state=state)

    def stats(self) -> dict[str, float]:
        """Cumulative counters for heartbeats, prefixed `rm_`, plus `rm_in_flight`."""
        out = {f"rm_{k}": float(v) for k, v in self.counts.items()}
        out["rm_in_flight"] = float(sum(self._in_flight.values()))
        return out


def _snippet(body: bytes) -> str:
    text = body[:_ERROR_TEXT_CHARS].decode("utf-8", errors="replace")
    return text + ("..." if len(body) > _ERROR_TEXT_CHARS else "")


def _error_text(body: bytes) -> str:
    """The server's explanation: the `error`/`detail` field of a JSON error body, else the raw start."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return _snippet(body) or "(empty body)"
    if isinstance(parsed, Mapping):
        for key in ("error", "detail", "message"):
            if key in parsed:
                return str(parsed[key])[:_ERROR_TEXT_CHARS]
    return _snippet(body)
