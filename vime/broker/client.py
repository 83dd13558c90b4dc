"""A worker's connection to the broker: one asyncio DEALER socket, typed send/receive, heartbeats.

Rollout, reward and trainer workers share this; their main loops stay short. Received messages are
decoded and validated; an `ErrorReply` from the broker is logged (it means this worker sent something
wrong) and a malformed reply is logged and skipped, so a bad frame never kills a worker. If the broker
stops answering heartbeats for `broker_timeout_s`, `BrokerGone` is raised so the worker can exit
instead of hanging forever.

Broker restarts: a restarted broker (it resumes from its journal) does not know this worker and
answers with ErrorReply `unknown_peer`; `recv` then sets `rejoin_needed`, and the worker's loop calls
`rejoin()` (Hello again) and re-offers its free capacity. Replies to messages sent before the new Hello
arrive before the Welcome (one connection keeps order), so a rejoin is not triggered twice by them.

Security: the socket is secured by a `vime.security.ClientGuard` (CURVE with this role's key pair when
keys are configured, else plaintext to loopback only). A broker that refuses the handshake (wrong or
missing key) is reported at once as `BrokerGone` with the reason, not after the Hello timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import zmq
import zmq.asyncio

from vime.logging import get_logger
from vime.protocol.codec import ERROR_CANNOT_RESUME, ERROR_UNKNOWN_PEER, ERROR_WRONG_JOB, ProtocolError, decode, encode
from vime.protocol.messages import Bye, ErrorReply, Heartbeat, HeartbeatAck, Hello, JobInfo, Message, StatusReply, StatusRequest, Welcome
from vime.security import ClientGuard, HandshakeRejected, Security
from vime.transport import make_dealer

log = get_logger(__name__)


class BrokerGone(RuntimeError):
    """The broker did not answer for longer than the timeout."""


class BrokerRefused(BrokerGone):
    """The broker cannot continue this worker's work (e.g. a trainer resumed from the wrong step)."""


def new_worker_id(role: str) -> str:
    return f"{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class BrokerClient:
    def __init__(
        self,
        address: str,
        role: str,
        worker_id: str | None = None,
        *,
        broker_timeout_s: float = 120.0,
        security: Security | None = None,
        job_name: str = "",
    ) -> None:
        self.address = address
        self.role = role
        self.job_name = job_name  # said in Hello: a broker of another job refuses this worker
        self.worker_id = worker_id or new_worker_id(role)
        # Raises SecurityError (missing keys, plaintext to a network address) before any socket exists.
        self.guard = ClientGuard(security, role=role, name=f"{role} broker client", endpoint=address)
        self.context = zmq.asyncio.Context()
        self.socket = make_dealer(self.context, address, identity=self.worker_id.encode(), guard=self.guard)
        self.broker_timeout_s = broker_timeout_s
        self.last_heard = time.monotonic()
        self.job: JobInfo | None = None
        self.rejoin_needed = False
        self.rejoins = 0
        self.metrics_url: str | None = None  # this worker's Prometheus /metrics, said in every Hello

    async def send(self, msg: Message, timeout_s: float | None = None) -> None:
        """Queue `msg` for the broker; BrokerGone if that is impossible for `timeout_s` (default
        `broker_timeout_s`). With IMMEDIATE=1 nothing is queued while no connection is up, so without
        this bound a vanished broker (or one refusing our key) would block the caller forever."""
        timeout = self.broker_timeout_s if timeout_s is None else timeout_s
        sending = self.socket.send_multipart(encode(msg), copy=False)
        if sending.done():  # pyzmq sends at once when nothing is queued before it: no timer needed
            sending.result()
            return
        try:
            await asyncio.wait_for(sending, timeout)
        except asyncio.TimeoutError:
            why = f"; last handshake failure: {self.guard.rejection}" if self.guard.rejection else ""
            raise BrokerGone(
                f"could not send {type(msg).__name__} to the broker at {self.address} for {timeout:g} s "
                f"(no connection){why}"
            ) from None

    async def recv(self, timeout_s: float | None = None) -> Message | None:
        """The next valid message, or None on timeout. Invalid input is logged and skipped."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if remaining is not None and not await self.socket.poll(int(remaining * 1000)):
                return None
            frames = await self.socket.recv_multipart(copy=False)
            self.last_heard = time.monotonic()
            try:
                msg = decode(frames)
            except ProtocolError as exc:
                log.warning("bad_message_from_broker", code=exc.code, detail=exc.detail[:500])
                continue
            if isinstance(msg, ErrorReply):
                if msg.code == ERROR_UNKNOWN_PEER:
                    if not self.rejoin_needed:
                        log.warning("broker_does_not_know_us", detail=msg.detail[:200], hint="the broker restarted; saying Hello again")
                    self.rejoin_needed = True
                    continue
                if msg.code in (ERROR_CANNOT_RESUME, ERROR_WRONG_JOB):
                    raise BrokerRefused(msg.detail)
                log.error("broker_rejected_message", code=msg.code, detail=msg.detail[:500])
                continue
            return msg

    async def hello(self, weight_version: int = -1, info: dict[str, Any] | None = None, timeout_s: float = 300.0) -> JobInfo:
        """Introduce this worker; retries until the broker answers (it may start after us)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._raise_if_rejected()
            try:
                await self.send(
                    Hello(role=self.role, worker_id=self.worker_id, host=socket.gethostname(), pid=os.getpid(),
                          weight_version=weight_version, info=info or {}, metrics_url=self.metrics_url,
                          job=self.job_name),  # type: ignore[arg-type]
                    timeout_s=max(0.1, min(1.0, deadline - time.monotonic())),
                )
            except BrokerGone:
                continue  # not connected (yet): the broker may start after us
            msg = await self.recv(timeout_s=5.0)
            if isinstance(msg, Welcome):
                self.job = msg.job
                self.rejoin_needed = False
                return msg.job
            if msg is not None:
                log.warning("unexpected_before_welcome", message=type(msg).__name__)
        self._raise_if_rejected()
        raise BrokerGone(f"broker at {self.address} did not answer Hello within {timeout_s:.0f} s")

    async def rejoin(self, weight_version: int = -1, info: dict[str, Any] | None = None) -> JobInfo:
        """Say Hello to a broker that lost our session (it restarted); returns the job as it is now."""
        self.rejoins += 1
        job = await self.hello(weight_version=weight_version, info=info, timeout_s=self.broker_timeout_s)
        log.info("rejoined_broker", weight_version=job.weight_version, rejoins=self.rejoins)
        return job

    def _raise_if_rejected(self) -> None:
        try:
            self.guard.raise_if_rejected()
        except HandshakeRejected as exc:
            raise BrokerGone(str(exc)) from None

    async def heartbeat_loop(self, interval_s: float, state: Callable[[], Heartbeat]) -> None:
        """Send heartbeats forever; raise BrokerGone when the broker has been silent too long.

        Silence is the broker's only while this process could hear it. A worker busy for minutes (a
        trainer's first step compiling on a slow machine) reads nothing meanwhile: the broker's answers
        wait in the socket, unread, and count as heard; and when that work held the event loop itself,
        nothing was even sent, so the count starts again at the heartbeat sent on waking."""
        alive_at = time.monotonic()  # the last moment the broker is known to have been there
        while True:
            await self.send(state())
            asleep = time.monotonic()
            await asyncio.sleep(interval_s)
            now = time.monotonic()
            held = now - asleep > 2 * interval_s  # the loop was held far past the nap: deaf, not ignored
            if held or self.socket.get(zmq.EVENTS) & zmq.POLLIN:  # or it spoke, and this worker has not read it yet
                alive_at = now
            if now - max(self.last_heard, alive_at) > self.broker_timeout_s:
                raise BrokerGone(f"no message from broker at {self.address} for {self.broker_timeout_s:.0f} s")

    async def bye(self, reason: str, timeout_s: float = 1.0) -> None:
        """Tell the broker we are leaving so it re-dispatches our leases now, not after a timeout."""
        try:
            await asyncio.wait_for(self.send(Bye(reason=reason)), timeout_s)
        except (asyncio.TimeoutError, zmq.ZMQError):
            log.warning("bye_not_sent", reason=reason)

    async def run_session(self, session: Awaitable[int]) -> int:
        """Run a worker's main loop and close the connection after it.

        Returns its exit code; a silent broker (`BrokerGone`) is exit code 1. Any other failure says
        Bye first, so the broker re-dispatches this worker's leases at once, then propagates.
        SIGTERM (scancel, `kill`, a launcher's teardown) means "leave the job": the session is
        cancelled, Bye gives the leases back, and the exit code is 0, since workers may leave a
        running job at any time. (Only where asyncio can take signals: the main thread.)
        """
        task = asyncio.ensure_future(session)
        leaving = _leave_on_sigterm(task)
        try:
            return await task
        except BrokerGone as exc:
            log.error("broker_gone", error=str(exc))
            return 1
        except BaseException as exc:
            if leaving.is_set() and isinstance(exc, asyncio.CancelledError):
                log.info("worker_leaving", reason="SIGTERM")
                await self.bye("SIGTERM: leaving the job")
                return 0
            await self.bye(f"worker failed: {exc!r}")
            raise
        finally:
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                asyncio.get_running_loop().remove_signal_handler(signal.SIGTERM)
            self.close()

    def close(self) -> None:
        self.socket.close(linger=500)
        self.context.term()


def _leave_on_sigterm(task: asyncio.Future[int]) -> asyncio.Event:
    """Cancel `task` on SIGTERM; the returned event tells a requested leave from other cancellations."""
    leaving = asyncio.Event()

    def on_sigterm() -> None:
        leaving.set()
        task.cancel()

    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not the main thread
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, on_sigterm)
    return leaving


def query_status(address: str, timeout_s: float = 5.0, *, security: Security | None = None) -> dict[str, Any]:
    """Ask a broker for its status (blocking), as client "status" under CURVE.

    Raises TimeoutError if it does not answer, HandshakeRejected (a SecurityError) at once if it
    refuses our key, SecurityError for missing keys or plaintext to a network address.
    """
    guard = ClientGuard(security, role="status", name="status client", endpoint=address)
    context = zmq.Context()
    sock = make_dealer(context, address, identity=f"status-{uuid.uuid4().hex[:8]}".encode(), guard=guard)
    try:
        deadline = time.monotonic() + timeout_s
        while True:  # in slices, so a refused handshake is reported at once rather than as a timeout
            guard.raise_if_rejected()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"broker at {address} is not reachable")
            try:
                sock.send_multipart(encode(StatusRequest()), flags=zmq.NOBLOCK, copy=False)
                break
            except zmq.Again:
                sock.poll(int(min(remaining, 0.1) * 1000) + 1, zmq.POLLOUT)
        while not sock.poll(int(min(max(deadline - time.monotonic(), 0), 0.1) * 1000)):
            guard.raise_if_rejected()
            if time.monotonic() >= deadline:
                raise TimeoutError(f"broker at {address} did not answer within {timeout_s} s")
        msg = decode(sock.recv_multipart(copy=False), (StatusReply,))
        assert isinstance(msg, StatusReply)
        return msg.status
    finally:
        sock.close(linger=0)
        context.term()


__all__ = ["BrokerClient", "BrokerGone", "BrokerRefused", "HeartbeatAck", "new_worker_id", "query_status"]
