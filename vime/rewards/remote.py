"""The reward worker's client for remote reward servers (`--rm-type remote_rm --rm-url URL[,URL...]`).

`RemoteReward.score_batch(items)` returns exactly one `RewardResult` per item, in order, always: a
sample whose reward cannot be had *because of the sample* is a failed result whose reason names the
server and the problem (the broker leaves it out of training and counts it), never a silent 0 and never
an exception. Samples whose reward cannot be had *because of the servers* (nothing listening, every
circuit open, overload answers, timeouts while connecting) wait and are asked again with backoff until
the servers answer or `max_wait_s` has passed: an outage costs time, not data (`vime.rewards.outage`).

Per request: slime sends one sample, openrlhf and vime batches of `batch_size`, through
`vime.http_client`; identical samples of a batch go once (`dedupe`); requests in flight per server
adapt to what it sustains (`vime.rewards.limit`); a connection slow to open is opened again at once;
retryable failures are retried with backoff and jitter (tenacity); each URL has a circuit breaker
(purgatory) and the least busy healthy URL gets each request. `docs/reward-servers.md` has the flags,
the outcome table and the metrics that `stats()` reports.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from purgatory import AsyncCircuitBreakerFactory
from purgatory.domain.model import OpenedState
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from vime.http_client import (
    ConnectFailed,
    ConnectionLost,
    ConnectTimeout,
    HttpClient,
    ReplyTooLarge,
    RequestTrace,
    check_url,
)
from vime.logging import get_logger
from vime.rewards.limit import AdaptiveLimit, Outcome
from vime.rewards.outage import ChunkWait, OutageLedger
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
# Statuses with which a server says it cannot take the request now: never a sample's fault.
OVERLOAD_STATUSES = frozenset({408, 429, 502, 503, 504})
# Linux's first SYN retransmit: a quick connect retry later than this gains nothing.
SYN_RETRANSMIT_S = 1.0


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
    # Requests in flight per server start here and adapt up to `concurrency` (False: always `concurrency`).
    initial_concurrency: int = Field(4, ge=1)
    adaptive_concurrency: bool = True
    # How long samples whose request failed for a reason outside them wait for the servers (--rm-max-wait-s);
    # None: until they answer. 0 gives up at once.
    max_wait_s: float | None = Field(None, ge=0.0)
    # Rounds of retries a sample must fail, while the server answers others, to count as its own fault.
    sample_fault_rounds: int = Field(2, ge=1)
    warn_interval_s: float = Field(10.0, gt=0.0)
    # A connection not open after max(this, 4 x the fastest lately) is abandoned and opened again at once,
    # up to `connect_retries` times; the last try waits as long as `timeout_s`. 0: no quick retries.
    connect_retry_s: float = Field(0.05, ge=0.0)
    connect_retries: int = Field(3, ge=0)
    # Identical samples of one `score_batch` (same prompt, response, label, metadata) are sent once (--rm-dedupe).
    dedupe: bool = True

    @field_validator("urls")
    @classmethod
    def _urls_can_be_sent_to(cls, urls: list[str]) -> list[str]:
        for url in urls:
            check_url(url)
        return urls

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
            max_wait_s=cfg.rm_max_wait_s,
            connect_retry_s=cfg.rm_connect_retry_s,
            dedupe=cfg.rm_dedupe,
            token=SecretStr(token) if token else None,
        )


class RewardServerError(Exception):
    """One failed request: `kind` classifies it for metrics, `retryable` says whether asking again at once
    can help, `reached` whether the server was reached at all, `status` its HTTP status if it answered."""

    def __init__(
        self, kind: str, message: str, *, retryable: bool, url: str | None = None, reached: bool = True,
        status: int | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.kind = kind
        self.retryable = retryable
        self.url = url
        self.reached = reached
        self.status = status

    @property
    def may_be_the_samples(self) -> bool:
        """Could the samples have caused this? Not if the server was never reached or said it is busy."""
        return self.reached and self.kind != "circuit_open" and self.status not in OVERLOAD_STATUSES


def _is_retryable(exc: BaseException) -> bool:
    return isinstance(exc, RewardServerError) and exc.retryable


class RemoteReward:
    """Async client for one job's reward servers; use as `async with RemoteReward(settings) as rm`.

    Also a `RewardFn` (`await rm(prompt, response, label, metadata)`) for code that scores one sample.
    Create and use it inside one event loop (its pooled connections belong to the loop that opened them).
    """

    def __init__(self, settings: RemoteRewardSettings) -> None:
        if settings.fmt not in FORMATS:
            raise ValueError(f"unknown reward wire format {settings.fmt!r}; known: {', '.join(FORMATS)}")
        self.settings = settings
        self._http: HttpClient | None = None
        self._cap = asyncio.Semaphore(settings.concurrency)
        self.limits: dict[str, AdaptiveLimit] = {
            url: AdaptiveLimit(
                settings.concurrency,
                settings.initial_concurrency if settings.adaptive_concurrency else settings.concurrency,
                adaptive=settings.adaptive_concurrency,
            )
            for url in settings.urls
        }
        self._in_flight: dict[str, int] = dict.fromkeys(settings.urls, 0)
        self.outages = OutageLedger(settings.urls, warn_interval_s=settings.warn_interval_s,
                                    max_wait_s=settings.max_wait_s, sample_fault_rounds=settings.sample_fault_rounds)  # fmt: skip
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

    def _open(self) -> HttpClient:
        if self._http is None:
            headers = {"Content-Type": "application/json", "Accept": "application/json"}
            if self.settings.token is not None:
                headers["Authorization"] = f"Bearer {self.settings.token.get_secret_value()}"
            self._http = HttpClient(headers, max_reply_bytes=MAX_REPLY_BYTES, max_idle_per_origin=self.settings.concurrency)
        return self._http

    async def aclose(self) -> None:
        """Close the pooled connections; the client reopens them if used again."""
        if self._http is not None:
            await self._http.aclose()
            self._http = None

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
        distinct, twin_of = distinct_items(items) if self.settings.dedupe else (list(items), None)
        copies = [0] * len(distinct)  # how many of `items` each distinct item stands for
        for j in twin_of if twin_of is not None else range(len(distinct)):
            copies[j] += 1
        size = self.settings.batch_size if is_batched(self.settings.fmt) else 1
        starts = range(0, len(distinct), size)
        scored = await asyncio.gather(*(self._score_chunk(distinct[i : i + size], sum(copies[i : i + size])) for i in starts))
        results = [r for chunk in scored for r in chunk]
        if twin_of is not None:
            results = [results[j] for j in twin_of]
            self.counts["samples_deduplicated"] += len(items) - len(distinct)
        self.counts["samples"] += len(results)
        for r in results:
            if r.failed:
                # Request-level failures carry their kind; the rest are samples the server would not score.
                self.counts["samples_failed"] += 1
                self.counts[f"samples_failed_{r.extra.get('reward_error', 'unscorable')}"] += 1
        return results

    async def _score_chunk(self, items: Sequence[ScoreItem], samples: int) -> list[RewardResult]:
        """Results for one request's `items`, which stand for `samples` of the batch (copies included)."""
        chunk = ChunkWait()
        waiting = False
        try:
            payload = json.dumps(encode_request(self.settings.fmt, items), ensure_ascii=False, default=str).encode()
            while True:
                try:
                    results = await self._request_with_retries(payload, items, chunk)
                    break
                except RewardServerError as exc:
                    if self.outages.samples_at_fault(exc, chunk):
                        log.warning("reward_request_failed", kind=exc.kind, url=exc.url, samples=samples, error=str(exc))
                        return [RewardResult.failure(str(exc), reward_error=exc.kind) for _ in items]
                    if not waiting:
                        waiting = True
                        self.outages.samples_waiting += samples
                    self.counts["holds"] += 1
                    self.outages.warn_waiting()
                    await asyncio.sleep(self._hold_delay(chunk.rounds))
        except Exception as exc:  # a bug here must still give every sample an answer
            log.exception("reward_client_error", samples=samples)
            reason = f"reward client error: {type(exc).__name__}: {exc}"
            return [RewardResult.failure(reason, reward_error="internal") for _ in items]
        finally:
            if waiting:
                self.outages.samples_waiting -= samples
        if len(results) != len(items):  # decode_reply guarantees this; keep the promise even if it broke
            reason = f"reward client got {len(results)} results for {len(items)} samples"
            return [RewardResult.failure(reason, reward_error="internal")] * len(items)
        return results

    def _hold_delay(self, rounds: int) -> float:
        s = self.settings
        return min(s.backoff_max_s, s.backoff_initial_s * 2.0 ** min(rounds - 1, 30)) + random.uniform(0.0, s.backoff_initial_s)

    async def _request_with_retries(self, payload: bytes, items: Sequence[ScoreItem], chunk: ChunkWait) -> list[RewardResult]:
        s = self.settings
        last_url: list[str | None] = [None]
        # Most requests succeed at once: that first try runs outside tenacity, whose per-attempt
        # bookkeeping costs about as much CPU as the rest of the client. A retryable failure is handed
        # to tenacity as its first attempt, so backoff, logging and the attempt count stay its own.
        try:
            return await self._attempt_any_url(payload, items, last_url, chunk)
        except RewardServerError as exc:
            if not exc.retryable or s.retries == 0:
                raise
            first_failure: RewardServerError | None = exc
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
                if first_failure is not None:
                    failure, first_failure = first_failure, None
                    raise failure
                results = await self._attempt_any_url(payload, items, last_url, chunk)
        return results

    async def _attempt_any_url(
        self, payload: bytes, items: Sequence[ScoreItem], last_url: list[str | None], chunk: ChunkWait
    ) -> list[RewardResult]:
        """Send once, to the best URL whose circuit lets it through; raises `RewardServerError`."""
        opened = []
        for url in self._candidates(avoid=last_url[0]):
            breaker = await self._breakers.get_breaker(url)
            try:
                async with breaker:
                    last_url[0] = url
                    results = await self._post(url, payload, items)
            except OpenedState:
                opened.append(url)
                continue
            except RewardServerError as exc:
                self.outages.failed(url, chunk, exc)
                raise
            self.outages.succeeded(url)
            return results
        last = "; ".join(self.outages.last_error[u] for u in opened if u in self.outages.last_error)
        self.outages.failed(None, chunk)
        raise RewardServerError(
            "circuit_open",
            f"circuit open for every reward server ({', '.join(opened)}): each failed "
            f"{self.settings.breaker_failures} requests in a row, next trial within {self.settings.breaker_reset_s}s; "
            f"last error: {last or 'unknown'}",
            retryable=False,
            reached=False,
        )

    def _candidates(self, avoid: str | None) -> list[str]:
        """URLs in the order to try: most free room first, round-robin among equals, `avoid` last."""
        urls = self.settings.urls
        start = next(self._turn) % len(urls)
        rotated = urls[start:] + urls[:start]
        return sorted(rotated, key=lambda u: (u == avoid and len(urls) > 1, self._in_flight[u] / self.limits[u].slots))

    async def _post(self, url: str, payload: bytes, items: Sequence[ScoreItem]) -> list[RewardResult]:
        http = self._open()
        limit = self.limits[url]
        trace = RequestTrace()
        quick_retries = 0
        outcome, started = Outcome.NEUTRAL, None
        self._in_flight[url] += 1
        ticket = None
        try:
            ticket = await limit.acquire()
            async with self._cap:
                self.counts["requests"] += 1
                started = time.monotonic()
                try:
                    async with asyncio.timeout(self.settings.timeout_s):
                        status, body, quick_retries = await self._exchange(http, url, payload, trace, limit)
                except TimeoutError as exc:
                    outcome = Outcome.STALL
                    raise RewardServerError(
                        "timeout", f"reward server {url} did not answer within {self.settings.timeout_s}s",
                        retryable=True, url=url, reached=trace.connected,
                    ) from exc
                except ConnectFailed as exc:
                    outcome = Outcome.OVERLOAD  # refused or reset while connecting
                    raise RewardServerError("connection", f"reward server {url}: {exc}", retryable=True, url=url, reached=False) from exc
                except ConnectionLost as exc:
                    raise RewardServerError("connection", f"reward server {url}: {exc}", retryable=True, url=url, reached=True) from exc
                except ReplyTooLarge as exc:
                    raise RewardServerError("bad_reply", f"reward server {url}: {exc}", retryable=False, url=url) from exc
            if status in OVERLOAD_STATUSES:
                outcome = Outcome.OVERLOAD
            elif quick_retries:
                outcome = Outcome.STALL  # answered, but a connection stalled first: this level is too high
            elif 200 <= status < 300 or status == 422:  # 422: slime's "this sample cannot be scored"
                outcome = Outcome.OK

        finally:
            self._in_flight[url] -= 1
            if ticket is not None:
                limit.release(ticket, outcome, 0.0 if started is None else time.monotonic() - started, trace.connect_s)
        return self._interpret(url, status, body, items)

    async def _exchange(
        self, http: HttpClient, url: str, payload: bytes, trace: RequestTrace, limit: AdaptiveLimit
    ) -> tuple[int, bytes, int]:
        """POST `payload` to `url`: (status, body, quick connect retries). A connection that does not open
        within the quick connect time is abandoned and opened again at once (a SYN dropped by a full
        listen queue would otherwise wait a second for the kernel's retransmit); the last try has no
        connect time of its own, only the request's timeout."""
        quick_s = self._quick_connect_s(limit)
        quick_retries = 0
        while True:
            quick = quick_s is not None and quick_retries < self.settings.connect_retries
            try:
                status, body = await http.post(url, payload, connect_timeout_s=quick_s if quick else None, trace=trace)
                return status, body, quick_retries
            except ConnectTimeout:
                quick_retries += 1
                self.counts["connect_retries"] += 1

    def _quick_connect_s(self, limit: AdaptiveLimit) -> float | None:
        """How long a connection may take to open before it is tried again; None: no quick retries (off,
        or the server's connections are so slow to open that the kernel's own 1 s retransmit is sooner)."""
        if self.settings.connect_retry_s <= 0:
            return None
        best = limit.connect_best_s
        quick_s = max(self.settings.connect_retry_s, 4.0 * best) if best is not None else self.settings.connect_retry_s
        return quick_s if quick_s < SYN_RETRANSMIT_S else None

    def _interpret(self, url: str, status: int, body: bytes, items: Sequence[ScoreItem]) -> list[RewardResult]:
        """Results from an HTTP reply, or a classified `RewardServerError`."""
        if 200 <= status < 300:
            try:
                parsed = json.loads(body)
            except ValueError as exc:
                # Usually a truncated or garbled reply (a proxy, a crash mid-write): worth another try.
                raise RewardServerError(
                    "malformed", f"reward server {url} sent malformed JSON ({exc}): {_snippet(body)}", retryable=True, url=url,
                    status=status,
                ) from exc
            try:
                return decode_reply(self.settings.fmt, parsed, items, self.settings.reward_key)
            except ReplyError as exc:
                raise RewardServerError("bad_reply", f"reward server {url}: {exc}", retryable=False, url=url, status=status) from exc
        detail = _error_text(body)
        if status == 422 and self.settings.fmt == "slime":
            # The server is fine; it could not score this one sample (slime format's way to say so).
            return [RewardResult.failure(f"reward server could not score the sample: {detail}")]
        if status in (401, 403):
            raise RewardServerError(
                "auth", f"reward server {url} refused the request (HTTP {status}): wrong or missing bearer token "
                f"(set ${TOKEN_ENV}); server said: {detail}", retryable=False, url=url, status=status,
            )
        if status in (408, 429) or status >= 500:
            raise RewardServerError(
                "http_5xx" if status >= 500 else f"http_{status}", f"reward server {url} answered HTTP {status}: {detail}",
                retryable=True, url=url, status=status,
            )
        raise RewardServerError(
            "rejected", f"reward server {url} rejected the request (HTTP {status}): {detail}", retryable=False, url=url,
            status=status,
        )

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
        """Cumulative counters for heartbeats, prefixed `rm_`, plus the gauges `rm_in_flight`,
        `rm_samples_waiting`, `rm_outage_s` (how long the longest-failing URL has failed) and `rm_limit`
        (the adaptive limits' sum), and the limits' `rm_connect_stalls` and `rm_limit_decreases`."""
        out = {f"rm_{k}": float(v) for k, v in self.counts.items()}
        out["rm_in_flight"] = float(sum(self._in_flight.values()))
        out["rm_samples_waiting"] = float(self.outages.samples_waiting)
        out["rm_outage_s"] = self.outages.outage_s()
        out["rm_limit"] = float(sum(lim.slots for lim in self.limits.values()))
        out["rm_connect_stalls"] = float(sum(lim.stalls for lim in self.limits.values()))
        out["rm_limit_decreases"] = float(sum(lim.decreases for lim in self.limits.values()))
        return out


def distinct_items(items: Sequence[ScoreItem]) -> tuple[list[ScoreItem], list[int]]:
    """The items that differ in what a server scores (prompt, response, label, metadata; not the id), in
    first-seen order, and for each item the index of its twin among them. An item whose metadata cannot
    be written as JSON with sorted keys is kept apart (never wrongly merged)."""
    distinct: list[ScoreItem] = []
    twin_of: list[int] = []
    index: dict[tuple[Any, ...], int] = {}
    for item in items:
        try:
            metadata = json.dumps(item.metadata, sort_keys=True, default=str) if item.metadata else ""
        except (TypeError, ValueError):
            metadata = None
        key = (item.prompt, item.response, item.label, metadata)
        j = index.get(key) if metadata is not None else None
        if j is None:
            j = len(distinct)
            distinct.append(item)
            if metadata is not None:
                index[key] = j
        twin_of.append(j)
    return distinct, twin_of


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
