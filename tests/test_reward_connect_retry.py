"""A reward server whose listen queue is full drops the SYNs of new connections; the kernel would send
them again only after a second. The client abandons a connection that does not open within its quick
connect time and opens it again at once (`connect_retry_s`), and its last try waits the whole timeout,
so a server that is merely slow to accept is never failed for it.

The server here is a real listening socket whose accept queue is filled on purpose (Linux drops a SYN
while the queue is full), then served by the standard library's HTTP server once the test says so.
"""

from __future__ import annotations

import asyncio
import json
import select
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from vime.rewards.remote import RemoteReward, RemoteRewardSettings
from vime.rewards.wire import ScoreItem


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # slime format: the reward is the response's length
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        out = json.dumps(float(len(body["response"]))).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args: object) -> None:
        pass


@dataclass
class FullQueueServer:
    """Listens with its accept queue full until `serve()`; then answers every request."""

    listener: socket.socket
    fillers: list[socket.socket] = field(default_factory=list)
    httpd: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        host, port = self.listener.getsockname()
        return f"http://{host}:{port}/slime"

    def fill(self) -> None:
        """Connect until a connection no longer opens: the queue is full, the next SYN is dropped."""
        address = self.listener.getsockname()
        for _ in range(64):
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(address)
            self.fillers.append(filler)
            _, writable, _ = select.select([], [filler], [], 0.3)
            if not writable:
                return
        raise AssertionError("the listen queue never filled")

    def serve(self) -> None:
        """Start accepting: the fillers leave the queue (closed), then requests are answered."""
        for filler in self.fillers:
            filler.close()
        httpd = ThreadingHTTPServer(self.listener.getsockname(), _Handler, bind_and_activate=False)
        httpd.socket.close()
        httpd.socket = self.listener
        httpd.daemon_threads = True
        self.httpd = httpd
        threading.Thread(target=httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        if self.httpd is not None:
            self.httpd.shutdown()
        for filler in self.fillers:
            filler.close()
        self.listener.close()


@pytest.fixture
def full_queue_server() -> Iterator[FullQueueServer]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    server = FullQueueServer(listener)
    server.fill()
    try:
        yield server
    finally:
        server.close()


async def _score_once_serving_when(server: FullQueueServer, settings: RemoteRewardSettings, retries_before_serving: int) -> tuple[float, dict[str, float]]:
    """One sample scored while the server's queue is full; the server starts accepting once the client
    has abandoned `retries_before_serving` connections (and 0.3 s more, so a SYN is waiting)."""
    async with RemoteReward(settings) as client:
        scoring = asyncio.create_task(client.score_batch([ScoreItem(id="0", prompt="p", response="four", label="x")]))
        limit = client.limits[server.url]
        for _ in range(400):  # the request is let through, and its quick retries so far decide when the server accepts
            if limit.in_flight >= 1 and client.counts["connect_retries"] >= retries_before_serving:
                break
            await asyncio.sleep(0.025)
        else:
            raise AssertionError(f"the client made {client.counts['connect_retries']} quick connect retries, expected {retries_before_serving}")
        await asyncio.sleep(0.3)  # the connection now being opened has sent its SYN into the full queue
        server.serve()
        results = await asyncio.wait_for(scoring, 30)
        return results[0].reward, client.stats()


def _settings(server: FullQueueServer, **kw: object) -> RemoteRewardSettings:
    return RemoteRewardSettings(urls=[server.url], fmt="slime", timeout_s=20, retries=0, **kw)


def test_a_dropped_syn_is_answered_by_connecting_again_at_once(full_queue_server: FullQueueServer) -> None:
    reward, stats = asyncio.run(_score_once_serving_when(full_queue_server, _settings(full_queue_server), 1))
    assert reward == 4.0
    assert 1 <= stats["rm_connect_retries"] <= 3
    assert stats["rm_connect_stalls"] == 1  # the limiter hears of it once, as a stall at this level
    assert stats.get("rm_samples_failed", 0.0) == 0.0


def test_after_the_quick_retries_the_last_try_waits_the_whole_timeout(full_queue_server: FullQueueServer) -> None:
    """A server that takes longer than every quick try to accept is still answered, not failed."""
    reward, stats = asyncio.run(_score_once_serving_when(full_queue_server, _settings(full_queue_server, connect_retries=2), 2))
    assert reward == 4.0
    assert stats["rm_connect_retries"] == 2
    assert stats.get("rm_samples_failed", 0.0) == 0.0


def test_quick_connect_retries_off(full_queue_server: FullQueueServer) -> None:
    """connect_retry_s 0: the connection waits for the kernel's own SYN retransmit, as before."""
    reward, stats = asyncio.run(_score_once_serving_when(full_queue_server, _settings(full_queue_server, connect_retry_s=0.0), 0))
    assert reward == 4.0
    assert stats.get("rm_connect_retries", 0.0) == 0.0
    assert stats["rm_connect_stalls"] == 1  # the retransmitted SYN made the connection take over a second
