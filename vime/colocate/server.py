"""Trainer rank 0's side of colocation: take the GPU from the engines before a step, hand it back after.

A background task receives every message (joins, heartbeats, replies) while the trainer trains on a
thread, so engines that restart are seen at once: one that joins while the trainer holds the GPU is
told to sleep before it can allocate. `take_gpu` and `give_gpu` wait for every live engine's reply,
up to `timeout_s`; an engine that reports an error, or does not answer in time, raises ColocateError
naming it (the caller ends the job: a GPU shared with an engine in an unknown state is not safe to
train on). An engine silent for `engine_timeout_s` is forgotten (its process died; its work is
re-leased by the broker) and no longer waited for; one whose worker says it leaves (EngineLeave, at
the end of the job) is forgotten at once.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from vime.logging import get_logger
from vime.protocol.codec import ProtocolError, decode, encode
from vime.protocol.colocate import (
    MAX_MESSAGE_BYTES,
    SERVER_ACCEPTS,
    EngineAsleep,
    EngineAwake,
    EngineJoin,
    EngineLeave,
    EngineSleep,
    EngineWake,
)
from vime.security import Security, ServerGuard

log = get_logger("vime.colocate.server")


class ColocateError(RuntimeError):
    """An engine could not sleep or wake, or did not answer in time; the message names it."""


@dataclass
class _Engine:
    worker_id: str
    last_seen: float
    reply: asyncio.Future[EngineAsleep | EngineAwake | None] | None = None  # None: it left
    expect: type[EngineAsleep] | type[EngineAwake] | None = None  # the reply the turn in progress waits for
    expect_step: int = -1


@dataclass
class TurnStats:
    """One hand-over: wall seconds and the weight update's parts (the slowest engine's)."""

    engines: int
    seconds: float
    fetch_s: float = 0.0
    load_s: float = 0.0
    nbytes: int = 0
    transports: list[str] = field(default_factory=list)


class ColocateServer:
    """Owns the ROUTER at `address` (an ipc:// or loopback endpoint: colocation is one host)."""

    def __init__(
        self, address: str, *, security: Security | None = None, timeout_s: float = 600.0,
        engine_timeout_s: float = 60.0, sleep_level: int = 2,
    ) -> None:  # fmt: skip
        self.address = address
        self._timeout_s = float(timeout_s)
        self._engine_timeout_s = float(engine_timeout_s)
        self._sleep_level = int(sleep_level)
        self._engines: dict[bytes, _Engine] = {}
        self._trainer_holds_gpu = False
        self._step = -1
        self._joined = asyncio.Event()
        self._ctx = zmq.asyncio.Context()
        self._guard = ServerGuard(self._ctx, security, name="colocate server", endpoint=address)  # type: ignore[arg-type]
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._guard.secure(self._sock)
        self._sock.bind(address)
        self._receiver: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start receiving (call inside the event loop that will call take_gpu/give_gpu)."""
        if self._receiver is None:
            self._receiver = asyncio.create_task(self._receive())

    @property
    def engines(self) -> list[str]:
        return sorted(e.worker_id for e in self._engines.values())

    async def wait_for_engines(self, count: int, timeout_s: float) -> None:
        """Until `count` engines have joined; ColocateError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while len(self._engines) < count:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ColocateError(f"{len(self._engines)} of {count} colocated engines joined {self.address} within "
                                    f"{timeout_s:g} s (joined: {self.engines or 'none'}); are the rollout workers "
                                    "running with --colocate?")  # fmt: skip
            self._joined.clear()
            try:
                await asyncio.wait_for(self._joined.wait(), remaining)
            except TimeoutError:
                continue

    async def take_gpu(self, step: int) -> TurnStats:
        """Every live engine asleep, so training step `step` may use the GPU."""
        self._trainer_holds_gpu = True
        self._step = step
        return await self._turn("sleep", EngineSleep(step=step, level=self._sleep_level))

    async def give_gpu(self, step: int, version: int | None, endpoint: str | None) -> TurnStats:
        """Every live engine awake, on weights >= `version` (loaded from `endpoint`) when given."""
        self._trainer_holds_gpu = False
        return await self._turn("wake", EngineWake(step=step, version=version, endpoint=endpoint))

    async def close(self) -> None:
        if self._receiver is not None:
            self._receiver.cancel()
            await asyncio.gather(self._receiver, return_exceptions=True)
        self._sock.close(linger=0)
        self._guard.close()
        self._ctx.term()

    # --- internals ---------------------------------------------------------------------------------

    async def _turn(self, what: str, command: EngineSleep | EngineWake) -> TurnStats:
        started = time.perf_counter()
        self._forget_silent()
        loop = asyncio.get_running_loop()
        waiting = {}
        for identity, engine in list(self._engines.items()):
            engine.reply = loop.create_future()
            engine.expect = EngineAsleep if isinstance(command, EngineSleep) else EngineAwake
            engine.expect_step = command.step
            if await self._send(identity, command):
                waiting[identity] = engine
            else:  # its process is gone (e.g. it exited at the end of the job): nothing to wait for
                del self._engines[identity]
                log.warning("colocated_engine_gone", engine=engine.worker_id, step=command.step)
        stats = TurnStats(engines=len(waiting), seconds=0.0)
        for identity, engine in waiting.items():
            reply = await self._reply_of(engine, what, command.step, started)
            if reply is None:
                stats.engines -= 1
                continue
            if reply.error is not None:
                raise ColocateError(f"colocated engine {engine.worker_id} could not {what}: {reply.error}")
            if isinstance(reply, EngineAwake):
                stats.fetch_s = max(stats.fetch_s, reply.fetch_s)
                stats.load_s = max(stats.load_s, reply.load_s)
                stats.nbytes = max(stats.nbytes, reply.nbytes)
                if reply.transport:
                    stats.transports.append(reply.transport)
        stats.seconds = time.perf_counter() - started
        log.info(f"engines_{'asleep' if what == 'sleep' else 'awake'}", step=command.step, engines=stats.engines,
                 seconds=round(stats.seconds, 4), transports=stats.transports or None)  # fmt: skip
        return stats

    async def _reply_of(self, engine: _Engine, what: str, step: int, started: float) -> EngineAsleep | EngineAwake | None:
        """The engine's reply; None if it left or fell silent meanwhile (died: no heartbeat for
        engine_timeout_s)."""
        assert engine.reply is not None
        while True:
            remaining = self._timeout_s - (time.perf_counter() - started)
            if remaining <= 0:
                raise ColocateError(f"colocated engine {engine.worker_id} did not {what} within {self._timeout_s:g} s "
                                    f"(step {step})")  # fmt: skip
            try:
                return await asyncio.wait_for(asyncio.shield(engine.reply), min(remaining, 1.0))
            except TimeoutError:
                if time.monotonic() - engine.last_seen > self._engine_timeout_s:
                    self._forget_silent()
                    return None

    def _forget_silent(self) -> None:
        now = time.monotonic()
        for identity, engine in list(self._engines.items()):
            if now - engine.last_seen > self._engine_timeout_s:
                del self._engines[identity]
                log.error("colocated_engine_lost", engine=engine.worker_id, silent_s=round(now - engine.last_seen, 1))

    async def _send(self, identity: bytes, message: EngineSleep | EngineWake) -> bool:
        """False when the engine's connection is gone (ROUTER_MANDATORY makes that an error)."""
        try:
            await self._sock.send_multipart([identity, *encode(message)])
        except zmq.ZMQError as exc:
            log.warning("colocate_send_failed", error=str(exc))
            return False
        return True

    async def _receive(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            identity, body = frames[0], frames[1:]
            try:
                message = decode(body, expect=SERVER_ACCEPTS, max_header_bytes=MAX_MESSAGE_BYTES)
            except ProtocolError as exc:
                log.warning("bad_colocate_message", code=exc.code, detail=exc.detail[:200])
                continue
            engine = self._engines.get(identity)
            if isinstance(message, EngineJoin):
                if engine is None:
                    engine = self._engines[identity] = _Engine(message.worker_id, time.monotonic())
                    log.info("colocated_engine_joined", engine=message.worker_id, asleep=message.asleep,
                             engine_weight_version=message.weight_version)  # fmt: skip
                    self._joined.set()
                    if self._trainer_holds_gpu and not message.asleep:
                        # It (re)started while the trainer holds the GPU: it must not allocate now.
                        await self._send(identity, EngineSleep(step=self._step, level=self._sleep_level))
                engine.last_seen = time.monotonic()
                continue
            if isinstance(message, EngineLeave):
                if engine is not None:
                    del self._engines[identity]
                    log.info("colocated_engine_left", engine=engine.worker_id)
                    if engine.reply is not None and not engine.reply.done():
                        engine.reply.set_result(None)
                continue
            if engine is None:
                log.warning("colocate_reply_from_unknown_engine", message=type(message).__name__)
                continue
            engine.last_seen = time.monotonic()
            wanted = engine.expect is not None and isinstance(message, engine.expect) and message.step == engine.expect_step
            if wanted and engine.reply is not None and not engine.reply.done():
                engine.reply.set_result(message)
            elif not wanted:  # e.g. the answer to a sleep sent at a restart, or one that came too late
                log.debug("colocate_reply_not_awaited", engine=engine.worker_id, message=type(message).__name__)
