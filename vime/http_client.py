"""A lean asyncio HTTP/1.1 client for many small POSTs: httptools (llhttp, the parser uvicorn uses) reads
the replies, asyncio streams move the bytes, and connections are kept alive per origin where the server
allows it.

Why not a general client: the reward worker sends one small request per sample, often to a
standard-library server that closes every connection (HTTP/1.0), so each request pays for opening a
connection. aiohttp spends about twice the CPU per such request as this client does, and h11 (pure
Python) more than half again (measured in docs/benchmarks.md); on a busy machine that CPU competes
with generation and training. The request is a fixed template whose header values are checked once.

What it does and does not do:
- `post(url, body)` returns the status and the whole body; redirects, cookies, proxies, compression
  and streaming are not handled (a reward server needs none of them).
- A connection is reused only when both sides finished their message and neither asked to close;
  a reused connection that the server had already closed is opened again once, at once.
- `connect_timeout_s` bounds how long a connection may take to open (`ConnectTimeout`); the caller's
  own timeout (e.g. `asyncio.timeout`) bounds the whole request. A request cancelled half way
  closes its connection rather than return it to the pool.
- Failures are typed: `ConnectTimeout`, `ConnectFailed` (refused, reset or unreachable while
  opening), `ConnectionLost` (dropped or garbled after the connection opened), `ReplyTooLarge`.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools

_READ_CHUNK = 65536


class HttpClientError(Exception):
    """Any failure of a request before a complete reply arrived."""


class ConnectTimeout(HttpClientError):
    """The connection did not open within the connect timeout."""


class ConnectFailed(HttpClientError):
    """The connection could not be opened: refused, reset or unreachable."""


class ConnectionLost(HttpClientError):
    """The connection opened but was dropped, or the reply was not valid HTTP, before a complete reply."""


class ReplyTooLarge(HttpClientError):
    """The reply announced or sent more bytes than the client accepts."""


@dataclass(slots=True)
class RequestTrace:
    """Filled in while a request runs: whether a connection was had (reused or new) and how long
    the newest one took to open (None when a pooled one was reused)."""

    connected: bool = False
    connect_s: float | None = None


@dataclass(frozen=True, slots=True)
class Origin:
    scheme: str
    host: str
    port: int

    @property
    def tls(self) -> bool:
        return self.scheme == "https"


@dataclass(frozen=True, slots=True)
class _Target:
    origin: Origin
    head: bytes  # the request line and Host header


class _Reply:
    """httptools' callbacks for one reply: status, body, and whether it is complete."""

    __slots__ = ("parser", "max_bytes", "body", "size", "complete", "until_close", "keep_alive", "too_large",
                 "_framed")  # fmt: skip

    def __init__(self, max_bytes: int) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.max_bytes = max_bytes
        self.body: list[bytes] = []
        self.size = 0
        self.complete = self.until_close = self.keep_alive = self.too_large = self._framed = False

    def on_header(self, name: bytes, value: bytes) -> None:
        lowered = name.lower()
        if lowered == b"content-length":
            self._framed = True
            if int(value) > self.max_bytes:
                self.too_large = True
        elif lowered == b"transfer-encoding":
            self._framed = True

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:
            return
        # No length and not chunked: the body runs until the server closes (HTTP/1.0 style).
        self.until_close = not self._framed and status not in (204, 304)
        # Asked here: once the message is complete the parser has forgotten its Connection header.
        self.keep_alive = not self.until_close and self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        self.size += len(body)
        if self.size > self.max_bytes:
            self.too_large = True
        else:
            self.body.append(body)

    def on_message_complete(self) -> None:
        if self.parser.get_status_code() < 200:  # 100 Continue and the like: the real reply follows
            self._framed = False
            return
        self.complete = True


class _Connection:
    """One open connection."""

    __slots__ = ("reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @property
    def open(self) -> bool:
        return not self.writer.is_closing() and not self.reader.at_eof()

    def close(self) -> None:
        try:
            self.writer.close()
        except RuntimeError:  # its event loop is closed already; the socket goes with the transport
            pass


class HttpClient:
    """POSTs over pooled HTTP/1.1 connections; use in one event loop, close with `aclose()`.

    `headers` go with every request (Host and Content-Length are added). At most `max_idle_per_origin`
    idle connections are kept per origin; how many requests run at once is the caller's to bound.
    https URLs are verified against `ssl_context` (default: the system's certificate authorities).
    """

    def __init__(
        self, headers: Mapping[str, str] | None = None, *, max_reply_bytes: int = 64 * 1024 * 1024,
        max_idle_per_origin: int = 64, ssl_context: ssl.SSLContext | None = None,
    ) -> None:  # fmt: skip
        self._headers = b"".join(_header_line(k, v) for k, v in (headers or {}).items())
        self.max_reply_bytes = max_reply_bytes
        self.max_idle_per_origin = max_idle_per_origin
        self._idle: dict[Origin, collections.deque[_Connection]] = collections.defaultdict(collections.deque)
        self._targets: dict[str, _Target] = {}
        self._ssl = ssl_context
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop the pooled connections belong to

    async def post(
        self, url: str, body: bytes, *, connect_timeout_s: float | None = None, trace: RequestTrace | None = None
    ) -> tuple[int, bytes]:
        """(status, body) of one POST; raises an `HttpClientError` subclass or `ValueError` for a bad URL."""
        target = self._target(url)
        trace = trace if trace is not None else RequestTrace()
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            await self.aclose()  # connections of another (finished) loop cannot be used in this one
            self._loop = loop
        request = target.head + b"Content-Length: %d\r\n%s\r\n" % (len(body), self._headers) + body
        pooled = self._take_idle(target.origin)
        if pooled is not None:
            trace.connected = True
            try:
                return await self._exchange(pooled, target.origin, request, reused=True)
            except _StaleConnection:
                pass  # the server closed it while idle: nothing was answered, so ask on a new one
        conn = await self._connect(target.origin, connect_timeout_s, trace)
        try:
            return await self._exchange(conn, target.origin, request, reused=False)
        except _StaleConnection as exc:
            raise ConnectionLost(f"{url}: connection closed before any reply") from exc

    async def aclose(self) -> None:
        """Close the idle connections; the client opens new ones if used again."""
        for idle in self._idle.values():
            while idle:
                idle.popleft().close()

    # -- internals ---------------------------------------------------------------------------------

    def _target(self, url: str) -> _Target:
        target = self._targets.get(url)
        if target is None:
            target = self._targets[url] = _parse_target(url)
        return target

    def _take_idle(self, origin: Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        while idle:
            conn = idle.pop()  # the newest: the least likely to have been closed by the server
            if conn.open:
                return conn
            conn.close()
        return None

    def _give_back(self, origin: Origin, conn: _Connection) -> None:
        idle = self._idle[origin]
        if len(idle) >= self.max_idle_per_origin:
            idle.popleft().close()
        idle.append(conn)

    async def _connect(self, origin: Origin, timeout_s: float | None, trace: RequestTrace) -> _Connection:
        tls = self._tls_context() if origin.tls else None
        started = time.monotonic()
        try:
            async with asyncio.timeout(timeout_s):
                reader, writer = await asyncio.open_connection(
                    origin.host, origin.port, ssl=tls, server_hostname=origin.host if tls else None, limit=_READ_CHUNK
                )
        except TimeoutError as exc:
            raise ConnectTimeout(f"{origin.host}:{origin.port}: connection did not open within {timeout_s}s") from exc
        except OSError as exc:
            raise ConnectFailed(f"{origin.host}:{origin.port}: {type(exc).__name__}: {exc}") from exc
        trace.connect_s = time.monotonic() - started
        trace.connected = True
        return _Connection(reader, writer)

    def _tls_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    async def _exchange(self, conn: _Connection, origin: Origin, request: bytes, *, reused: bool) -> tuple[int, bytes]:
        reply = _Reply(self.max_reply_bytes)
        keep = False
        try:
            await self._send_and_read(conn, request, reply, reused=reused)
            keep = reply.keep_alive
            return reply.parser.get_status_code(), b"".join(reply.body)
        finally:
            # Also on cancellation: a connection left half way through a message cannot be reused.
            if keep:
                self._give_back(origin, conn)
            else:
                conn.close()

    @staticmethod
    async def _send_and_read(conn: _Connection, request: bytes, reply: _Reply, *, reused: bool) -> None:
        got_bytes = False
        try:
            conn.writer.write(request)
            while not reply.complete:
                data = await conn.reader.read(_READ_CHUNK)
                if not data:
                    if reply.until_close:
                        return
                    if reused and not got_bytes:
                        raise _StaleConnection
                    raise ConnectionLost("connection closed before the reply was complete")
                got_bytes = True
                reply.parser.feed_data(data)
                if reply.too_large:
                    raise ReplyTooLarge(f"reply longer than {reply.max_bytes} bytes")
        except httptools.HttpParserError as exc:
            raise ConnectionLost(f"reply is not valid HTTP/1.1: {exc}") from exc
        except (ConnectionError, OSError) as exc:
            if reused and not got_bytes:
                raise _StaleConnection from exc
            raise ConnectionLost(f"connection dropped: {type(exc).__name__}: {exc}") from exc


def check_url(url: str) -> None:
    """Raise ValueError, naming the problem, if `post` could not send to `url`."""
    _parse_target(url)


def _parse_target(url: str) -> _Target:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)  # a bad port raises ValueError here
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    if not path.isascii():
        raise ValueError(f"URL path must be ASCII (percent-encode it): {url!r}")
    if any(c in path for c in " \r\n\0"):
        raise ValueError(f"URL path has a space, line break or NUL (percent-encode it): {url!r}")
    host_header = parts.netloc.rpartition("@")[2]
    try:
        host_bytes = host_header.encode("ascii")
    except UnicodeEncodeError:
        host_bytes = host_header.encode("idna")
    head = b"POST %s HTTP/1.1\r\nHost: %s\r\n" % (path.encode("ascii"), host_bytes)
    return _Target(Origin(parts.scheme, parts.hostname, port), head)


class _StaleConnection(Exception):
    """A connection closed before any reply byte (a pooled one the server had closed while idle)."""


def _header_line(name: str, value: str) -> bytes:
    """One `Name: value` line; a name or value that would break the request's framing is refused."""
    if not name.isascii() or not name.replace("-", "").isalnum():
        raise ValueError(f"bad HTTP header name {name!r}")
    if any(c in value for c in "\r\n\0"):
        raise ValueError(f"HTTP header {name!r} has a line break or NUL in its value")
    return f"{name}: {value}\r\n".encode("latin-1")
