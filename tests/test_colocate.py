"""Colocation's turn-taking (`--colocate`): the trainer's ColocateServer and the workers' ColocateClient.

Fake engines record what they were told; the channel is a real ipc:// socket pair."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from helpers_engines import StubEngine
from vime.colocate import ColocateClient, ColocateError, ColocateServer
from vime.rollout.base import WeightUpdateResult


class SleepyEngine(StubEngine):
    """Sleeps and wakes on command; `fail_sleep` / `hang_sleep` make it misbehave."""

    def __init__(self, fail_sleep: bool = False, hang_sleep: bool = False) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.version = 0
        self._asleep = False
        self.fail_sleep = fail_sleep
        self.hang_sleep = hang_sleep

    async def sleep(self, level: int) -> None:
        self.calls.append(("sleep", level))
        if self.fail_sleep:
            raise RuntimeError("no sleep mode on this build")
        if self.hang_sleep:
            await asyncio.Event().wait()
        self._asleep = True

    async def wake_up(self, version: int | None = None, endpoint: str | None = None) -> WeightUpdateResult | None:
        self.calls.append(("wake", version))
        self._asleep = False
        if version is None:
            return None
        self.version = version
        return WeightUpdateResult(version=version, requested_version=version, nbytes=1000, fetch_s=0.01, load_s=0.02,
                                  extra={"transport": "cuda_ipc"})  # fmt: skip

    @property
    def asleep(self) -> bool:
        return self._asleep


async def _with_engines(address: str, engines: dict[str, SleepyEngine], body: Any, **server_args: Any) -> None:
    server = ColocateServer(address, **server_args)
    server.start()
    woke: list[tuple[str, Any]] = []

    def on_awake(name: str) -> Any:
        async def record(result: WeightUpdateResult | None) -> None:
            woke.append((name, None if result is None else result.version))
        return record

    clients = [asyncio.create_task(ColocateClient(address, name, heartbeat_s=0.1).run(e, on_awake(name)))
               for name, e in engines.items()]  # fmt: skip
    try:
        await server.wait_for_engines(len(engines), timeout_s=10)
        await body(server, woke)
    finally:
        for task in clients:
            task.cancel()
        await asyncio.gather(*clients, return_exceptions=True)
        await server.close()


def test_the_trainer_takes_the_gpu_from_every_engine_and_hands_it_back_on_the_new_weights(tmp_path: Path) -> None:
    engines = {"rollout-a": SleepyEngine(), "rollout-b": SleepyEngine()}

    async def body(server: ColocateServer, woke: list[Any]) -> None:
        took = await server.take_gpu(step=0)
        assert took.engines == 2 and all(e.asleep for e in engines.values())
        gave = await server.give_gpu(step=0, version=1, endpoint="tcp://127.0.0.1:1")
        assert not any(e.asleep for e in engines.values())
        assert gave.nbytes == 1000 and gave.transports == ["cuda_ipc", "cuda_ipc"]
        await server.take_gpu(step=1)
        await server.give_gpu(step=1, version=None, endpoint=None)  # a step that published nothing
        await asyncio.sleep(0.2)
        assert sorted(woke, key=str) == [("rollout-a", 1), ("rollout-a", None), ("rollout-b", 1), ("rollout-b", None)]

    asyncio.run(_with_engines(f"ipc://{tmp_path}/turns.sock", engines, body, sleep_level=2))
    for engine in engines.values():
        assert engine.calls == [("sleep", 2), ("wake", 1), ("sleep", 2), ("wake", None)]
        assert engine.version == 1


def test_an_engine_that_cannot_sleep_stops_the_trainer_with_its_name_and_reason(tmp_path: Path) -> None:
    engines = {"rollout-ok": SleepyEngine(), "rollout-bad": SleepyEngine(fail_sleep=True)}

    async def body(server: ColocateServer, woke: list[Any]) -> None:
        with pytest.raises(ColocateError, match="rollout-bad could not sleep: RuntimeError: no sleep mode"):
            await server.take_gpu(step=0)

    asyncio.run(_with_engines(f"ipc://{tmp_path}/turns.sock", engines, body))


def test_an_engine_that_never_falls_asleep_times_out_by_name(tmp_path: Path) -> None:
    engines = {"rollout-stuck": SleepyEngine(hang_sleep=True)}

    async def body(server: ColocateServer, woke: list[Any]) -> None:
        with pytest.raises(ColocateError, match="rollout-stuck did not sleep within 0.5 s"):
            await server.take_gpu(step=3)

    asyncio.run(_with_engines(f"ipc://{tmp_path}/turns.sock", engines, body, timeout_s=0.5))


def test_an_engine_that_joins_while_the_trainer_holds_the_gpu_is_put_to_sleep_at_once(tmp_path: Path) -> None:
    """A restarted rollout worker comes back awake in the middle of a step: it must not allocate then."""
    first, late = SleepyEngine(), SleepyEngine()

    async def body(server: ColocateServer, woke: list[Any]) -> None:
        await server.take_gpu(step=0)
        address = server.address
        task = asyncio.create_task(ColocateClient(address, "rollout-late", heartbeat_s=0.1).run(late, _ignore))
        try:
            for _ in range(100):
                if late.asleep:
                    break
                await asyncio.sleep(0.05)
            assert late.asleep and late.calls == [("sleep", 2)]
            gave = await server.give_gpu(step=0, version=2, endpoint="tcp://127.0.0.1:1")
            assert gave.engines == 2 and late.version == 2 and not late.asleep
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(_with_engines(f"ipc://{tmp_path}/turns.sock", {"rollout-first": first}, body))


async def _ignore(result: WeightUpdateResult | None) -> None:
    return None


def test_too_few_engines_is_an_error_that_says_what_to_check(tmp_path: Path) -> None:
    async def scenario() -> None:
        server = ColocateServer(f"ipc://{tmp_path}/turns.sock")
        server.start()
        try:
            with pytest.raises(ColocateError, match="0 of 1 colocated engines joined .* --colocate"):
                await server.wait_for_engines(1, timeout_s=0.3)
        finally:
            await server.close()

    asyncio.run(scenario())


def test_an_engine_whose_process_has_gone_is_not_waited_for(tmp_path: Path) -> None:
    """At the end of a job the rollout workers exit before the trainer's last hand-back: that must not
    hang the trainer for colocate_timeout_s."""
    import time

    engine = SleepyEngine()

    async def scenario() -> None:
        server = ColocateServer(f"ipc://{tmp_path}/turns.sock", timeout_s=30)
        server.start()
        client = asyncio.create_task(ColocateClient(server.address, "rollout-leaving", heartbeat_s=0.1).run(engine, _ignore))
        try:
            await server.wait_for_engines(1, timeout_s=10)
            await server.take_gpu(step=0)
            client.cancel()
            await asyncio.gather(client, return_exceptions=True)
            await asyncio.sleep(0.3)  # the ROUTER notices the closed connection
            started = time.monotonic()
            gave = await server.give_gpu(step=0, version=1, endpoint="tcp://127.0.0.1:1")
            assert gave.engines == 0 and time.monotonic() - started < 5
            assert server.engines == []
        finally:
            await server.close()

    asyncio.run(scenario())


def test_an_engine_that_says_it_leaves_is_not_waited_for_while_still_connected(tmp_path: Path) -> None:
    """A worker stopping at the end of the job may keep its connection open a while (its engine shuts
    down); the EngineLeave it sends ends the turn's wait at once, not after the engine timeout."""
    import time

    import zmq
    import zmq.asyncio

    from vime.protocol.codec import decode, encode
    from vime.protocol.colocate import CLIENT_ACCEPTS, EngineJoin, EngineLeave, EngineSleep

    async def scenario() -> None:
        server = ColocateServer(f"ipc://{tmp_path}/turns.sock", timeout_s=30, engine_timeout_s=30)
        server.start()
        ctx = zmq.asyncio.Context()
        worker = ctx.socket(zmq.DEALER)
        worker.connect(server.address)
        try:
            await worker.send_multipart(encode(EngineJoin(worker_id="rollout-stopping")))
            await server.wait_for_engines(1, timeout_s=10)
            turn = asyncio.create_task(server.take_gpu(step=3))
            command = decode(await asyncio.wait_for(worker.recv_multipart(), 10), expect=CLIENT_ACCEPTS)
            assert isinstance(command, EngineSleep) and command.step == 3
            started = time.monotonic()
            await worker.send_multipart(encode(EngineLeave(worker_id="rollout-stopping")))  # instead of a reply
            took = await asyncio.wait_for(turn, 10)
            assert took.engines == 0 and time.monotonic() - started < 5
            assert server.engines == []
        finally:
            worker.close(linger=0)
            ctx.term()
            await server.close()

    asyncio.run(scenario())


def test_a_stopping_client_says_it_leaves(tmp_path: Path) -> None:
    from vime.protocol.codec import decode
    from vime.protocol.colocate import SERVER_ACCEPTS, EngineLeave

    import zmq
    import zmq.asyncio

    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        trainer = ctx.socket(zmq.ROUTER)
        trainer.bind(f"ipc://{tmp_path}/turns.sock")
        client = asyncio.create_task(ColocateClient(f"ipc://{tmp_path}/turns.sock", "rollout-z", heartbeat_s=0.1).run(SleepyEngine(), _ignore))
        try:
            await asyncio.wait_for(trainer.recv_multipart(), 10)  # its first join
            client.cancel()
            await asyncio.gather(client, return_exceptions=True)
            while True:
                frames = await asyncio.wait_for(trainer.recv_multipart(), 10)
                message = decode(frames[1:], expect=SERVER_ACCEPTS)
                if isinstance(message, EngineLeave):
                    assert message.worker_id == "rollout-z"
                    break
        finally:
            trainer.close(linger=0)
            ctx.term()

    asyncio.run(scenario())


def test_a_colocate_socket_path_too_long_for_ipc_is_a_config_error_naming_the_fix(tmp_path: Path) -> None:
    from vime.config import ConfigError, load_config

    deep = tmp_path / ("d" * 120)
    with pytest.raises(ConfigError, match="longer than an ipc path may be .* --colocate-address"):
        load_config(None, {"colocate": True, "run_dir": str(deep)})
    cfg = load_config(None, {"colocate": True, "run_dir": str(deep), "colocate_address": f"ipc://{tmp_path}/t.sock"})
    assert cfg.colocate_endpoint() == f"ipc://{tmp_path}/t.sock" and cfg.weight_cuda_ipc_on()
    assert not load_config(None, {"colocate": True, "weight_cuda_ipc": "off"}).weight_cuda_ipc_on()


def test_malformed_turn_messages_are_refused_by_name_and_the_server_keeps_serving(tmp_path: Path) -> None:
    """Garbage and an impossible sleep level sent to the trainer's turn socket: each is logged and dropped;
    the turn that follows still works."""
    import zmq
    import zmq.asyncio

    from vime.protocol.codec import ProtocolError, decode, encode
    from vime.protocol.colocate import CLIENT_ACCEPTS, EngineSleep

    with pytest.raises(ProtocolError, match="sleep level must be 1 or 2"):
        decode(encode(EngineSleep(step=0, level=3)), expect=CLIENT_ACCEPTS)

    engine = SleepyEngine()

    async def body(server: ColocateServer, woke: list[Any]) -> None:
        ctx = zmq.asyncio.Context()
        rogue = ctx.socket(zmq.DEALER)
        rogue.connect(server.address)
        await rogue.send_multipart([b"\x00not msgpack"])
        await rogue.send_multipart(encode(EngineSleep(step=0, level=1)))  # a command type the server does not take
        await asyncio.sleep(0.2)
        rogue.close(linger=0)
        ctx.term()
        assert (await server.take_gpu(step=0)).engines == 1 and engine.asleep

    asyncio.run(_with_engines(f"ipc://{tmp_path}/turns.sock", {"rollout-a": engine}, body))
