"""vime.http_client against real sockets: servers here are asyncio TCP servers that answer with exact bytes,
so each reply framing (length, chunked, until close, 100 Continue) and each failure is the real thing."""

from __future__ import annotations

import asyncio
import ssl
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from vime.http_client import ConnectFailed, ConnectionLost, ConnectTimeout, HttpClient, ReplyTooLarge, RequestTrace

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, bytes], Awaitable[bool]]


async def read_request(reader: asyncio.StreamReader) -> bytes | None:
    """One request's head and body (by Content-Length), or None at EOF."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
    return head + await reader.readexactly(length)


class Server:
    """Serves `handler(reader, writer, request)` for each request; the handler returns whether to keep the
    connection open for another. Counts connections and keeps the requests it saw."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> Server:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/score?x=1"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while (request := await read_request(reader)) is not None:
                self.requests.append(request)
                if not await self.handler(reader, writer, request):
                    break
        finally:
            writer.close()


def reply(body: bytes, *, status: str = "200 OK", version: str = "HTTP/1.1", extra: str = "") -> bytes:
    return f"{version} {status}\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


def keep_alive(body: bytes) -> Handler:
    async def handler(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _req: bytes) -> bool:
        w.write(reply(body))
        await w.drain()
        return True

    return handler


def run(coro: Awaitable[object]) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]


def post_times(handler: Handler, times: int) -> tuple[list[tuple[int, bytes]], Server]:
    """`times` POSTs through one client to a server running `handler`: the replies, and the server after."""

    async def main() -> tuple[list[tuple[int, bytes]], Server]:
        async with Server(handler) as server:
            client = HttpClient()
            replies = [await client.post(server.url, b"{}") for _ in range(times)]
            await client.aclose()
        return replies, server

    return asyncio.run(main())


def test_keep_alive_server_gets_one_connection_and_the_exact_request() -> None:
    async def main() -> None:
        async with Server(keep_alive(b"0.5")) as server:
            client = HttpClient({"Content-Type": "application/json", "Authorization": "Bearer t"})
            traces = [RequestTrace() for _ in range(3)]
            url = server.url
            for i, trace in enumerate(traces):
                assert await client.post(url, b'{"i": %d}' % i, trace=trace) == (200, b"0.5")
            await client.aclose()
        assert server.connections == 1
        assert traces[0].connect_s is not None and traces[1].connect_s is None and all(t.connected for t in traces)
        port = url.split(":")[2].split("/")[0]
        assert server.requests[1] == (
            f"POST /score?x=1 HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 8\r\n"
            'Content-Type: application/json\r\nAuthorization: Bearer t\r\n\r\n{"i": 1}'
        ).encode()

    run(main())


def test_http_1_0_server_gets_a_connection_per_request() -> None:
    async def handler(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _req: bytes) -> bool:
        w.write(reply(b"1.0", version="HTTP/1.0"))
        return False

    replies, server = post_times(handler, 3)
    assert replies == [(200, b"1.0")] * 3 and server.connections == 3


def test_a_body_without_length_runs_until_the_server_closes() -> None:
    async def handler(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _req: bytes) -> bool:
        w.write(b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n[1, ")
        await w.drain()
        await asyncio.sleep(0.01)
        w.write(b"2]")
        return False

    assert post_times(handler, 1)[0] == [(200, b"[1, 2]")]


def test_chunked_reply_and_a_100_continue_before_it() -> None:
    async def handler(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _req: bytes) -> bool:
        w.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\n0.2\r\n2\r\n50\r\n0\r\n\r\n")
        return True

    replies, server = post_times(handler, 2)
    assert replies == [(200, b"0.250")] * 2 and server.connections == 1


def test_a_pooled_connection_closed_by_the_server_is_replaced_at_once() -> None:
    async def handler(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _req: bytes) -> bool:
        w.write(reply(b"1"))  # says nothing about closing, then closes: the client pools a dead connection
        await w.drain()
        return False

    replies, server = post_times(handler, 2)
    assert replies == [(200, b"1")] * 2 and server.connections == 2 and len(server.requests) == 2


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n0.5", "before the reply was complete"),  # dropped mid-reply
        (b"SSH-2.0-OpenSSH_9.6\r\n\r\n", "not valid HTTP"),  # not HTTP at all
    ],
)
def test_a_reply_cut_short_or_not_http_is_a_lost_connection_not_asked_again(raw: bytes, match: str) -> None:
    async def handler(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _req: bytes) -> bool:
        w.write(raw)
        return False

    async def main() -> None:
        async with Server(handler) as server:
            with pytest.raises(ConnectionLost, match=match):
                await HttpClient().post(server.url, b"{}")
        assert server.connections == 1  # a new connection's failure is the caller's to retry, not the client's

    run(main())


@pytest.mark.parametrize("announced", [True, False])
def test_a_reply_over_the_limit_is_refused(announced: bool) -> None:
    async def handler(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _req: bytes) -> bool:
        if announced:
            w.write(reply(b"x" * 200))
        else:
            w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nc8\r\n" + b"x" * 200 + b"\r\n0\r\n\r\n")
        return True

    async def main() -> None:
        async with Server(handler) as server:
            client = HttpClient(max_reply_bytes=100)
            with pytest.raises(ReplyTooLarge):
                await client.post(server.url, b"{}")
            assert not any(client._idle.values())  # the half-read connection is not pooled

    run(main())


def test_nothing_listening_is_a_failed_connect() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    trace = RequestTrace()
    with pytest.raises(ConnectFailed, match="ConnectionRefusedError"):
        run(HttpClient().post(f"http://127.0.0.1:{port}/", b"{}", trace=trace))
    assert not trace.connected


def test_a_full_listen_queue_is_a_connect_timeout() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    fillers = []
    try:
        for _ in range(64):  # never accepted: once the queue is full the kernel drops the next SYN
            filler = socket.socket()
            filler.settimeout(0.2)
            fillers.append(filler)
            try:
                filler.connect(listener.getsockname())
            except TimeoutError:
                break
        url = "http://127.0.0.1:%d/" % listener.getsockname()[1]
        with pytest.raises(ConnectTimeout):
            run(HttpClient().post(url, b"{}", connect_timeout_s=0.1))
    finally:
        for filler in fillers:
            filler.close()
        listener.close()


def test_a_request_cancelled_half_way_closes_its_connection() -> None:
    async def handler(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _req: bytes) -> bool:
        await asyncio.sleep(10)
        return True

    async def main() -> None:
        async with Server(handler) as server:
            client = HttpClient()
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.1):
                    await client.post(server.url, b"{}")
            assert not any(client._idle.values())

    run(main())


@pytest.mark.parametrize("url", ["ftp://example.com/", "http:///nohost", "http://h/a b", "http://h/caf\u00e9"])
def test_bad_urls_are_refused_by_name(url: str) -> None:
    with pytest.raises(ValueError, match="URL"):
        run(HttpClient().post(url, b"{}"))


def test_header_values_that_would_split_the_request_are_refused() -> None:
    with pytest.raises(ValueError, match="line break"):
        HttpClient({"Authorization": "Bearer x\r\nX-Evil: 1"})
    with pytest.raises(ValueError, match="header name"):
        HttpClient({"Bad Name": "v"})


def test_a_client_used_from_a_new_event_loop_opens_new_connections() -> None:
    """asyncio.run per call (as synchronous callers do): pooled connections of a closed loop are dropped."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, so the first loop leaves a pooled connection behind

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Length", "1")
            self.end_headers()
            self.wfile.write(b"1")

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        client = HttpClient()
        url = f"http://127.0.0.1:{httpd.server_address[1]}/"
        assert run(client.post(url, b"{}")) == (200, b"1")
        assert run(client.post(url, b"{}")) == (200, b"1")
        run(client.aclose())
    finally:
        httpd.shutdown()


def test_reward_settings_refuse_a_url_the_client_cannot_send_to() -> None:
    from pydantic import ValidationError

    from vime.rewards.remote import RemoteRewardSettings

    with pytest.raises(ValidationError, match="percent-encode"):
        RemoteRewardSettings(urls=["http://127.0.0.1:8000/score me"])
    RemoteRewardSettings(urls=["http://127.0.0.1:8000/score", "https://judge.example:443/v1?key=1"])


TLS_CERT = Path(__file__).parent / "data" / "tls-test-cert.pem"  # self-signed for 127.0.0.1, tests only
TLS_KEY = Path(__file__).parent / "data" / "tls-test-key.pem"


def test_https_with_a_trusted_certificate_and_refused_without() -> None:
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(TLS_CERT, TLS_KEY)
    trusting = ssl.create_default_context(cafile=str(TLS_CERT))

    async def main() -> None:
        server = await asyncio.start_server(_tls_keep_alive, "127.0.0.1", 0, ssl=server_tls)
        url = f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}/score"
        try:
            client = HttpClient(ssl_context=trusting)
            assert await client.post(url, b"{}") == (200, b"0.5")
            assert await client.post(url, b"{}") == (200, b"0.5")  # over the kept connection
            await client.aclose()
            with pytest.raises(ConnectFailed, match="CERTIFICATE_VERIFY_FAILED"):
                await HttpClient().post(url, b"{}")  # the system's authorities do not know this certificate
        finally:
            server.close()

    run(main())


async def _tls_keep_alive(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while await read_request(reader) is not None:
            writer.write(reply(b"0.5"))
            await writer.drain()
    except ConnectionError:
        pass  # the refused client's handshake
    finally:
        writer.close()
