"""A rollout worker's side of colocation: put its engine to sleep and wake it when the trainer says.

`ColocateClient.run(engine, on_awake)` joins the trainer's `ColocateServer`, repeats the join as a
heartbeat, and answers every command after carrying it out on the engine. Errors of the engine (it
cannot sleep, the weight fetch at wake-up failed) go back in the reply, so the trainer stops with the
reason; this side keeps running. A trainer that is not there yet (or restarts) is simply waited for:
the DEALER reconnects and the next heartbeat joins again. Stopping says EngineLeave, so a trainer in
the middle of a turn does not wait for an engine that is gone.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio

from vime.logging import get_logger
from vime.protocol.codec import ProtocolError, decode, encode
from vime.protocol.colocate import (
    CLIENT_ACCEPTS,
    MAX_ERROR_CHARS,
    MAX_MESSAGE_BYTES,
    EngineAsleep,
    EngineAwake,
    EngineJoin,
    EngineLeave,
    EngineSleep,
    EngineWake,
)
from vime.rollout.base import RolloutEngine, WeightUpdateResult
from vime.security import ClientGuard, Security

log = get_logger("vime.colocate.client")

LEAVE_LINGER_MS = 500  # how long closing may take to deliver the EngineLeave


class ColocateClient:
    def __init__(self, address: str, worker_id: str, *, security: Security | None = None,
                 heartbeat_s: float = 2.0) -> None:  # fmt: skip
        self.address = address
        self.worker_id = worker_id
        self._heartbeat_s = float(heartbeat_s)
        self._ctx = zmq.asyncio.Context()
        self._guard = ClientGuard(security, role="rollout", name="colocate client", endpoint=address)
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._guard.secure(self._sock)
        self._sock.connect(address)
        self.asleep_s = 0.0  # wall seconds the engine slept, for the worker's stats
        self._asleep_since: float | None = None
        self._tokens_at_sleep = 0

    async def run(
        self, engine: RolloutEngine, on_awake: Callable[[WeightUpdateResult | None], Awaitable[None]]
    ) -> None:
        """Serve commands until cancelled. `on_awake` runs after each wake-up (with its weight update).
        Heartbeats go on while a command runs (falling asleep may wait minutes for requests in flight)."""
        heartbeat = asyncio.create_task(self._heartbeats(engine))
        try:
            while True:
                if heartbeat.done():
                    heartbeat.result()
                if not await self._sock.poll(1000):
                    continue
                frames = await self._sock.recv_multipart()
                try:
                    command = decode(frames, expect=CLIENT_ACCEPTS, max_header_bytes=MAX_MESSAGE_BYTES)
                except ProtocolError as exc:
                    log.warning("bad_colocate_command", code=exc.code, detail=exc.detail[:200])
                    continue
                if isinstance(command, EngineSleep):
                    await self._send(await self._sleep(engine, command))
                elif isinstance(command, EngineWake):
                    reply, result = await self._wake(engine, command)
                    await self._send(reply)
                    if reply.error is None:
                        await on_awake(result)
        finally:
            heartbeat.cancel()
            await asyncio.gather(heartbeat, return_exceptions=True)
            self._say_leaving()
            self._sock.close(linger=LEAVE_LINGER_MS)
            self._ctx.term()

    def _say_leaving(self) -> None:
        """Tell the trainer not to wait for this engine any more (the job ends, or the worker stops):
        otherwise a turn sent meanwhile waits until the heartbeats have been missing for the engine
        timeout. Best effort: a trainer that is gone already needs no word."""
        try:
            self._sock.send_multipart(encode(EngineLeave(worker_id=self.worker_id)), flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("colocate_leave_not_sent", error=str(exc))

    async def _heartbeats(self, engine: RolloutEngine) -> None:
        while True:
            join = EngineJoin(worker_id=self.worker_id, asleep=engine.asleep, weight_version=engine.weight_version)
            await self._sock.send_multipart(encode(join))
            await asyncio.sleep(self._heartbeat_s)

    async def _sleep(self, engine: RolloutEngine, command: EngineSleep) -> EngineAsleep:
        started = time.perf_counter()
        try:
            await engine.sleep(command.level)
        except Exception as exc:  # reported to the trainer, which stops with it
            log.error("engine_sleep_failed", step=command.step, error=repr(exc))
            return EngineAsleep(step=command.step, seconds=time.perf_counter() - started, error=_text(exc))
        self._asleep_since = time.monotonic()
        self._tokens_at_sleep = engine.progress.tokens
        seconds = time.perf_counter() - started
        log.info("engine_asleep", step=command.step, level=command.level, seconds=round(seconds, 4))
        return EngineAsleep(step=command.step, seconds=seconds)

    async def _wake(self, engine: RolloutEngine, command: EngineWake) -> tuple[EngineAwake, WeightUpdateResult | None]:
        started = time.perf_counter()
        # Tokens the engine sampled while it should have slept (its own counter, logged): must be 0.
        sampled_in_sleep = engine.progress.tokens - self._tokens_at_sleep if self._asleep_since is not None else 0
        if sampled_in_sleep:
            log.error("engine_generated_while_asleep", step=command.step, tokens=sampled_in_sleep)
        try:
            result = await engine.wake_up(command.version, command.endpoint)
        except Exception as exc:
            log.error("engine_wake_failed", step=command.step, version=command.version, error=repr(exc))
            reply = EngineAwake(step=command.step, version=engine.weight_version, seconds=time.perf_counter() - started,
                                error=_text(exc))  # fmt: skip
            return reply, None
        if self._asleep_since is not None:
            self.asleep_s += time.monotonic() - self._asleep_since
            self._asleep_since = None
        seconds = time.perf_counter() - started
        reply = EngineAwake(
            step=command.step, version=engine.weight_version, seconds=seconds,
            fetch_s=result.fetch_s if result else 0.0, load_s=result.load_s if result else 0.0,
            nbytes=result.nbytes if result else 0, transport=str(result.extra.get("transport", "chunks")) if result else "",
        )  # fmt: skip
        log.info("engine_awake", step=command.step, weight_version=engine.weight_version, seconds=round(seconds, 4),
                 transport=reply.transport or None, tokens_while_asleep=sampled_in_sleep)  # fmt: skip
        return reply, result

    async def _send(self, message: EngineAsleep | EngineAwake) -> None:
        await self._sock.send_multipart(encode(message))


def _text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
