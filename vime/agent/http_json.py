"""JSON over HTTP for the agent's remote services (tool and environment servers), retried like the
remote reward client: each attempt bounded by a timeout, retried with exponential backoff and jitter
on connection errors, timeouts, 5xx and 429; a 4xx answer is returned at once (the request's own fault).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential_jitter

from vime.http_client import HttpClient, HttpClientError, ReplyTooLarge


class ServiceUnavailable(RuntimeError):
    """No answer after every attempt; the message names the URL and the last failure."""


class _Retryable(Exception):
    pass


class JsonClient:
    """POSTs JSON to one server and returns (status, decoded body). Use inside one event loop."""

    def __init__(self, base_url: str, *, timeout_s: float = 30.0, retries: int = 2, backoff_s: float = 0.2) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self._http: HttpClient | None = None

    def _open(self) -> HttpClient:
        if self._http is None:
            # The client's own reply limit (64 MiB): a tool's or an environment's answer beyond it is a broken server.
            self._http = HttpClient({"Content-Type": "application/json", "Accept": "application/json"})
        return self._http

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def post(self, path: str, payload: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """(HTTP status < 500, JSON object). Raises ServiceUnavailable when no attempt got an answer, and
        ValueError for an answer that is not a JSON object."""
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.retries + 1),
            wait=wait_exponential_jitter(multiplier=self.backoff_s, max=5.0, jitter=self.backoff_s),
            retry=retry_if_exception_type(_Retryable),
            reraise=True,
        )
        url = f"{self.base_url}{path}"
        try:
            async for attempt in retrying:
                with attempt:
                    return await self._attempt(url, payload)
        except _Retryable as exc:
            raise ServiceUnavailable(f"{url} gave no answer after {self.retries + 1} attempts: {exc}") from None
        raise AssertionError("unreachable")  # pragma: no cover

    async def _attempt(self, url: str, payload: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        try:
            async with asyncio.timeout(self.timeout_s):
                status, body = await self._open().post(url, json.dumps(payload).encode())
        except ReplyTooLarge as exc:
            raise ValueError(f"{url}: {exc}") from None
        except (HttpClientError, TimeoutError) as exc:
            raise _Retryable(f"{type(exc).__name__}: {exc or f'no answer within {self.timeout_s}s'}") from None
        if status >= 500 or status == 429:
            raise _Retryable(f"HTTP {status}: {body[:200]!r}")
        try:
            decoded = json.loads(body)
        except ValueError:
            raise ValueError(f"{url} answered HTTP {status} with a body that is not JSON: {body[:200]!r}") from None
        if not isinstance(decoded, dict):
            raise ValueError(f"{url} answered HTTP {status} with JSON that is not an object: {body[:200]!r}")
        return status, decoded
