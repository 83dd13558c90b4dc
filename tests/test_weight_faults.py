"""Weight-sync faults: nothing on the weight channel can hang the trainer or a rollout worker.

Over real sockets on loopback: a publisher that stops sending in the middle of a version, a fetcher
that stops asking (and never says it is done), a rollout engine whose fetch fails, a worker that missed
versions, a broker that vanished under a worker. Each side gives up after its own timeout with an error
that names the version and the peer, and the next version goes through. (Checksums, corrupted and
truncated chunks, dead and silent endpoints: tests/test_weight_channel.py.)
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from helpers_sockets import Recorder, bare_context, dealer, free_port

import vime.weights.publisher as publisher_module
from vime.protocol.codec import decode, encode
from vime.protocol.weights import MIN_CHUNK_BYTES, WeightChunkRequest, WeightFetch, WeightManifest
from vime.rollout import WeightFetchFailed, WeightUpdateError
from vime.rollout.base import WeightUpdateResult
from vime.weights import WeightFetcher, WeightFetchError, WeightPublisher

CHUNK = MIN_CHUNK_BYTES


def state(seed: int, n: int = 200_000) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [("w", torch.randn(n, generator=g)), ("b", torch.randn(33, generator=g).to(torch.bfloat16))]


def same(a: list[tuple[str, torch.Tensor]], b: list[tuple[str, torch.Tensor]]) -> bool:
    return [n for n, _ in a] == [n for n, _ in b] and all(torch.equal(x, y) for (_, x), (_, y) in zip(a, b))


class Stall:
    """A `_chunk_filter` that freezes the publisher's server thread on one version's chunks from
    `index` on, until released: the publisher "stops sending in the middle of a version"."""

    def __init__(self, version: int, index: int) -> None:
        self.version, self.index = version, index
        self.release = threading.Event()
        self.hit = threading.Event()

    def __call__(self, version: int, index: int, data: np.ndarray) -> np.ndarray:
        if version == self.version and index >= self.index:
            self.hit.set()
            self.release.wait(timeout=30)
        return data


@pytest.fixture
def publisher() -> Iterator[WeightPublisher]:
    pub = WeightPublisher(chunk_bytes=CHUNK)
    yield pub
    pub.close()


def test_a_publisher_that_stops_mid_version_fails_the_fetch_by_its_timeout_and_the_next_version_works(
    publisher: WeightPublisher,
) -> None:
    stall = Stall(version=1, index=2)
    publisher._chunk_filter = stall
    publisher.publish(1, state(1))
    with WeightFetcher(publisher.endpoint, timeout_s=2.0) as fetcher:
        with pytest.raises(WeightFetchError) as failure:
            fetcher.fetch()
        message = str(failure.value)
        assert f"no reply from the weight publisher at {publisher.endpoint} within 2 s" in message
        assert "while waiting for chunks of version 1" in message
        assert stall.hit.is_set()

        # The publisher comes back and moves on; the same fetcher gets the next version, intact, and
        # drops the late replies of the abandoned fetch by their fetch id.
        stall.release.set()
        publisher.publish(2, state(2))
        got = fetcher.fetch(min_version=1)
    assert got.version == 2 and same(state(2), got.tensors)


def test_a_fetcher_that_stops_asking_never_blocks_the_trainer_and_is_given_up_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    log = Recorder()
    monkeypatch.setattr(publisher_module, "log", log)
    monkeypatch.setattr(publisher_module, "_HOUSEKEEPING_S", 0.05)
    with WeightPublisher(chunk_bytes=CHUNK, stall_timeout_s=2.0) as pub:
        pub.publish(1, state(1))
        # A fetcher that takes the manifest and three chunks, then goes quiet for good: it neither asks
        # for the rest nor reports WeightFetchDone.
        with bare_context() as ctx:  # destroyed even after a failed assertion: one left to the GC can hang
            stuck = dealer(ctx, pub.endpoint)
            stuck.send_multipart(encode(WeightFetch(fetch_id=77, min_version=1)))
            assert stuck.poll(20_000)
            manifest = decode(stuck.recv_multipart(copy=False))
            assert isinstance(manifest, WeightManifest) and len(manifest.chunk_checksums) > 4
            for index in range(3):
                stuck.send_multipart(encode(WeightChunkRequest(fetch_id=77, version=1, index=index)))
            for _ in range(3):  # served (before any newer version replaces version 1)
                assert stuck.poll(20_000)
                assert type(decode(stuck.recv_multipart(copy=False))).__name__ == "WeightChunk"

            # The trainer keeps publishing (nothing waits on fetchers) and healthy fetchers keep fetching.
            pub.publish(2, state(2))
            pub.publish(3, state(3))
            with WeightFetcher(pub.endpoint, timeout_s=20.0) as healthy:
                got = healthy.fetch()
            assert got.version == 3 and same(state(3), got.tensors)

            def report() -> dict[str, Any] | None:
                found = [e for e in log.events("weight fetch stalled") if e["fetch_id"] == 77]
                return found[-1] if found else None

            deadline = time.monotonic() + 30
            while report() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            stalled = report()
            assert stalled is not None, "the stalled fetch was never reported"
            assert stalled["version"] == 1 and stalled["chunks_served"] == 3 and stalled["peer"] == "127.0.0.1"
            assert "the fetcher at 127.0.0.1 sent no request for version 1 for 2 s" in stalled["detail"]
            assert pub.stalled_fetches >= 1


def test_a_fetch_restarted_on_a_newer_version_is_not_reported_as_stalled(monkeypatch: pytest.MonkeyPatch) -> None:
    log = Recorder()
    monkeypatch.setattr(publisher_module, "log", log)
    monkeypatch.setattr(publisher_module, "_HOUSEKEEPING_S", 0.05)
    # The restart (chunk 0 of version 1, a publish, the manifest of version 2) takes ~10 ms here; a
    # stall timeout of 1 s keeps a loaded machine from looking like a stalled fetcher.
    with WeightPublisher(chunk_bytes=CHUNK, keep=1, stall_timeout_s=1.0) as pub:
        pub.publish(1, state(1))
        with WeightFetcher(pub.endpoint, timeout_s=5.0) as fetcher:
            fetcher._after_chunk = lambda i: pub.publish(2, state(2)) if i == 0 and pub.latest_version == 1 else None
            got = fetcher.fetch()
        assert got.version == 2  # the fetch of version 1 was superseded and restarted on version 2
        time.sleep(2.5)  # past the stall timeout, dozens of checks: the abandoned attempt must not show up
        assert [e for e in log.events("weight fetch stalled") if e["version"] == 1] == []


def test_a_publisher_that_dies_mid_fetch_fails_the_fetch_at_once_not_after_the_timeout() -> None:
    """A trainer killed while a worker fetches from it: its replies will never come, and a restarted
    trainer publishes at another address, so waiting out the 30 s reply timeout would only stall."""
    pub = WeightPublisher(chunk_bytes=CHUNK)
    pub.publish(1, state(1))
    with WeightFetcher(pub.endpoint, timeout_s=30.0) as fetcher:
        fetcher._after_chunk = lambda i: pub.close() if i == 0 else None
        started = time.monotonic()
        with pytest.raises(WeightFetchError, match="closed the connection"):
            fetcher.fetch()
        assert time.monotonic() - started < 5.0


def test_a_worker_that_missed_versions_fetches_only_the_latest(publisher: WeightPublisher) -> None:
    for version in range(1, 6):
        publisher.publish(version, state(version))
    with WeightFetcher(publisher.endpoint, timeout_s=5.0) as fetcher:
        got = fetcher.fetch(min_version=1)  # the worker holds version 0 and asks for anything newer
    assert got.version == 5 and same(state(5), got.tensors)
    assert publisher.completed_fetches(5) == 1
    assert not any(publisher.completed_fetches(v) for v in range(1, 5))


# --- the rollout side ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vime.demo.model_factory import make_tiny_qwen3

    return Path(make_tiny_qwen3(tmp_path_factory.mktemp("faults") / "tiny", seed=0))


def model_weights(model_dir: Path, seed: int) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(seed)
    return [
        (n, (t.float() + 0.01 * torch.randn(t.shape, generator=g)).to(t.dtype))
        for n, t in load_file(str(model_dir / "model.safetensors")).items()
    ]


def test_a_rollout_engine_keeps_generating_through_a_stuck_transfer_and_takes_the_next_version(
    tiny_model: Path,
) -> None:
    from vime.rollout import SamplingConfig
    from vime.rollout.hf_engine import HfRolloutEngine

    loop = asyncio.new_event_loop()
    engine = HfRolloutEngine(str(tiny_model), engine_args={"dtype": "float32"}, fetch_timeout_s=2.0)
    with WeightPublisher(chunk_bytes=CHUNK) as pub:
        stall = Stall(version=1, index=1)
        pub._chunk_filter = stall
        try:
            loop.run_until_complete(engine.start())
            pub.publish(1, model_weights(tiny_model, 1))
            with pytest.raises(WeightFetchFailed) as failure:
                loop.run_until_complete(engine.update_weights(1, pub.endpoint))
            message = str(failure.value)
            assert f"weight fetch from {pub.endpoint} failed (engine keeps its weights)" in message
            assert "chunks of version 1" in message
            assert engine.weight_version == 0
            (sample,) = loop.run_until_complete(engine.generate([5, 6, 7], n=1, sampling=SamplingConfig(max_tokens=3)))
            assert sample.response_length >= 1 and set(sample.token_versions.tolist()) == {0}

            stall.release.set()
            pub.publish(2, model_weights(tiny_model, 2))
            result = loop.run_until_complete(engine.update_weights(1, pub.endpoint))
            assert result.version == 2 and engine.weight_version == 2
        finally:
            stall.release.set()
            loop.run_until_complete(engine.shutdown())
            loop.close()


class FlakyEngine:
    """A rollout engine whose weight updates fail `failures` times, then load the version asked for."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.weight_version = 0
        self.asleep = False
        self.calls: list[int] = []

    async def update_weights(self, version: int, endpoint: str | None = None) -> WeightUpdateResult:
        self.calls.append(version)
        if len(self.calls) <= self.failures:
            raise WeightFetchFailed(f"weight fetch from {endpoint} failed (engine keeps its weights): no reply "
                                    f"within 0.5 s while waiting for chunks of version {version}")  # fmt: skip
        self.weight_version = version
        return WeightUpdateResult(version=version, requested_version=version)


def _worker(engine: FlakyEngine, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    from vime.workers import rollout

    monkeypatch.setattr(rollout, "UPDATE_RETRY_S", 0.05)
    cfg = SimpleNamespace(rollout_concurrency=1, heartbeat_interval_s=1.0, colocate=False, rollout_stall_timeout_s=0.0)
    return rollout.RolloutWorker(cfg, engine, client=None)  # type: ignore[arg-type]


def test_a_rollout_worker_survives_a_failed_update_and_catches_up_to_the_latest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vime.workers import rollout

    log = Recorder()
    monkeypatch.setattr(rollout, "log", log)
    engine = FlakyEngine(failures=1)

    async def scenario() -> None:
        worker = _worker(engine, monkeypatch)
        updater = asyncio.create_task(worker._update_loop())
        worker._note_version(1, "tcp://127.0.0.1:1")
        while not engine.calls:
            await asyncio.sleep(0.01)
        worker._note_version(3, "tcp://127.0.0.1:1")  # versions kept coming while the fetch failed
        await asyncio.wait_for(worker._wait_for_version(3), 10)
        assert not updater.done()
        updater.cancel()

    asyncio.run(scenario())
    assert engine.calls[0] == 1 and engine.calls[-1] == 3 and engine.weight_version == 3
    (failed,) = log.events("weight_update_failed")
    assert (
        failed["version"] == 1
        and failed["endpoint"] == "tcp://127.0.0.1:1"
        and "chunks of version 1" in failed["error"]
    )


def test_a_rollout_worker_whose_updates_keep_failing_stops_instead_of_waiting_forever(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vime.workers import rollout

    engine = FlakyEngine(failures=100)

    async def scenario() -> None:
        worker = _worker(engine, monkeypatch)
        worker._note_version(1, "tcp://127.0.0.1:1")
        await asyncio.wait_for(worker._update_loop(), 10)

    with pytest.raises(WeightFetchFailed, match="chunks of version 1"):
        asyncio.run(scenario())
    assert len(engine.calls) == rollout.MAX_UPDATE_FAILURES


def test_a_rollout_worker_stops_at_once_when_a_load_failed_part_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only failed *fetches* are retried: a load that failed part way may have left the model half
    updated, and WeightUpdateError's contract says the worker must restart then."""

    class HalfLoaded(FlakyEngine):
        async def update_weights(self, version: int, endpoint: str | None = None) -> WeightUpdateResult:
            self.calls.append(version)
            raise WeightUpdateError("loading fetched weights into vLLM failed; the model may be partly updated")

    engine = HalfLoaded(failures=0)

    async def scenario() -> None:
        worker = _worker(engine, monkeypatch)
        worker._note_version(1, "tcp://127.0.0.1:1")
        await asyncio.wait_for(worker._update_loop(), 10)

    with pytest.raises(WeightUpdateError, match="partly updated") as failure:
        asyncio.run(scenario())
    assert not isinstance(failure.value, WeightFetchFailed)
    assert engine.calls == [1]


# --- the broker link the versions are announced on ---------------------------------------------------


def test_a_worker_whose_broker_vanished_raises_broker_gone_instead_of_blocking_on_send() -> None:
    """The DEALER has IMMEDIATE=1: with no connection, a send waits. It must not wait forever, or the
    heartbeat loop (which is what notices a silent broker) would never get to notice."""
    from vime.broker.client import BrokerClient, BrokerGone
    from vime.protocol.messages import Heartbeat

    async def scenario() -> str:
        client = BrokerClient(f"tcp://127.0.0.1:{free_port()}", "rollout", broker_timeout_s=0.5)
        try:
            with pytest.raises(BrokerGone) as gone:
                await client.heartbeat_loop(0.1, lambda: Heartbeat())
            return str(gone.value)
        finally:
            client.close()

    message = asyncio.run(scenario())
    assert "could not send Heartbeat to the broker at tcp://127.0.0.1:" in message and "0.5 s" in message


def test_a_worker_that_held_its_own_loop_is_not_fooled_into_broker_gone() -> None:
    """A worker busy longer than broker_timeout_s (a first compile on a slow machine) is deaf, not
    ignored: answers waiting unread in the socket count as heard, and a step that held the event loop
    itself is followed by a heartbeat the broker answers. A broker that then stops answering is still
    found silent within broker_timeout_s."""
    import zmq

    from vime.broker.client import BrokerClient, BrokerGone
    from vime.protocol.messages import Heartbeat, HeartbeatAck

    port = free_port()
    answering = threading.Event()
    answering.set()
    stop = threading.Event()

    def broker() -> None:
        with bare_context() as ctx:
            router = ctx.socket(zmq.ROUTER)
            router.bind(f"tcp://127.0.0.1:{port}")
            while not stop.is_set():
                if router.poll(50):
                    peer, *frames = router.recv_multipart()
                    if answering.is_set() and isinstance(decode(frames), Heartbeat):
                        router.send_multipart([peer, *encode(HeartbeatAck(weight_version=0, weight_endpoint=None))])
            router.close(linger=0)

    async def scenario() -> float:
        client = BrokerClient(f"tcp://127.0.0.1:{port}", "trainer", broker_timeout_s=0.5)

        async def listen() -> None:
            while True:
                await client.recv()

        beats = asyncio.create_task(client.heartbeat_loop(0.05, lambda: Heartbeat()))
        await asyncio.sleep(1.2)  # busy in a thread for twice broker_timeout_s: the answers wait unread
        assert not beats.done(), "answers waiting unread were taken for a silent broker"
        listener = asyncio.create_task(listen())
        try:
            await asyncio.sleep(0.3)
            time.sleep(1.0)  # the worker's own step holds the loop twice broker_timeout_s
            await asyncio.sleep(0.8)
            assert not beats.done(), "a worker's own stall was taken for a silent broker"
            answering.clear()
            silent_from = time.monotonic()
            with pytest.raises(BrokerGone, match="no message from broker"):
                await asyncio.wait_for(beats, 5)
            return time.monotonic() - silent_from
        finally:
            listener.cancel()
            beats.cancel()
            client.close()

    thread = threading.Thread(target=broker, daemon=True)
    thread.start()
    try:
        noticed_after = asyncio.run(scenario())
    finally:
        stop.set()
        thread.join(5)
    assert noticed_after < 2.0
