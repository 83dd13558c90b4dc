"""A wedged rollout engine (requests in flight, no token sampled) ends its worker, whose groups go back
to the broker; a busy, idle, paused or updating engine never counts as wedged."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq

from tests.helpers_engines import StubEngine
from vime.broker.client import BrokerClient
from vime.broker.server import BrokerServer
from vime.broker.settings import BrokerSettings
from vime.broker.state import BrokerState
from vime.config import load_config
from vime.data.prompts import Prompt, PromptCursor
from vime.rollout import GeneratedSample, SamplingConfig
from vime.rollout.base import GenerationProgress
from vime.rollout.stall import EngineStalled, StallWatch
from vime.workers.rollout import RolloutWorker


class Counting(StubEngine):
    """An engine whose requests in flight, token count and pause are set by the test."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.tokens = 0
        self.paused = False

    @property
    def requests_in_flight(self) -> int:
        return self.in_flight

    @property
    def progress(self) -> GenerationProgress:
        return GenerationProgress(tokens=self.tokens)

    @property
    def generation_paused(self) -> bool:
        return self.paused


def test_the_watch_counts_only_time_with_requests_and_no_tokens() -> None:
    engine, watch = Counting(), StallWatch(timeout_s=10.0)
    assert watch.stalled_s(engine, now=0.0) == 0.0  # idle
    engine.in_flight = 3
    assert watch.stalled_s(engine, now=1.0) == 0.0  # work arrived: the clock starts here
    assert watch.stalled_s(engine, now=6.0) == 5.0
    engine.tokens = 7
    assert watch.stalled_s(engine, now=9.0) == 0.0  # a token: progress
    assert watch.stalled_s(engine, now=15.0) == 6.0
    engine.paused = True
    assert watch.stalled_s(engine, now=30.0) == 0.0  # paused (or asleep, or loading weights): not wedged
    engine.paused = False
    assert watch.stalled_s(engine, now=31.0) == 0.0
    assert watch.stalled_s(engine, now=35.0, updating=True) == 0.0
    assert watch.stalled_s(engine, now=36.0) == 0.0
    watch.check(engine, now=46.0)  # exactly the timeout: not yet
    with pytest.raises(EngineStalled, match="no token for 11 s with 3 request"):
        watch.check(engine, now=47.0)
    engine.in_flight = 0
    assert watch.stalled_s(engine, now=100.0) == 0.0
    StallWatch(timeout_s=0.0).check(Counting(), now=1e9)  # 0: never


class Wedged(Counting):
    """Takes every request and never samples a token."""

    async def generate(self, prompt_tokens: list[int], n: int, sampling: SamplingConfig) -> list[GeneratedSample]:
        self.in_flight += 1
        try:
            await asyncio.Event().wait()
        finally:
            self.in_flight -= 1
        raise AssertionError("unreachable")


def test_a_worker_with_a_wedged_engine_leaves_and_its_groups_go_back() -> None:
    prompts = [Prompt(i, "1+1=", np.array([1, 2], dtype=np.int32), "2") for i in range(8)]
    settings = BrokerSettings(2, 2, 0, 1, 10, 30.0, {"temperature": 1.0, "top_p": 1.0, "max_tokens": 4})
    state = BrokerState(settings, PromptCursor(prompts, shuffle=False, seed=0))
    server = BrokerServer(state, "tcp://127.0.0.1:*")
    endpoint = server.socket.getsockopt(zmq.LAST_ENDPOINT).decode()
    broker = threading.Thread(target=server.serve, daemon=True)
    broker.start()
    cfg = load_config(None, {"heartbeat_interval_s": 0.2, "rollout_concurrency": 2, "rollout_stall_timeout_s": 1.5})

    async def session() -> int:
        client = BrokerClient(endpoint, "rollout", "rollout-1", broker_timeout_s=30.0)
        return await client.run_session(RolloutWorker(cfg, Wedged(), client).run())

    try:
        with pytest.raises(EngineStalled, match="2 request"):
            asyncio.run(asyncio.wait_for(session(), 60))
        # it said Bye: the broker took back both leased groups at once, not after a heartbeat timeout
        deadline = time.monotonic() + 10
        while state.counters["groups_requeued"] < 2:
            assert time.monotonic() < deadline, dict(state.counters)
            time.sleep(0.05)
        assert not state.workers  # and it is gone from the broker's registry
    finally:
        server.stop()
        broker.join(timeout=10)


def _descendants(pid: int) -> list[int]:
    kids = [int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]
    return kids + [d for k in kids for d in _descendants(k)]


@pytest.mark.vllm
@pytest.mark.timeout(300)
@pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("VIME_CPU_ENGINE_PROCESS_TESTS") != "1",
    reason="a second vLLM-CPU start costs the suite a minute: runs in the GPU check, and here with "
    "VIME_CPU_ENGINE_PROCESS_TESTS=1",
)  # fmt: skip
def test_a_stopped_vllm_engine_core_is_seen_as_wedged(loop: asyncio.AbstractEventLoop, tmp_path: Path) -> None:
    """vLLM's engine core process SIGSTOPped mid-generation (as a hung kernel leaves it): the front end
    keeps its loop, the requests stay in flight, no token comes, and the watch says so."""
    pytest.importorskip("vllm")
    from helpers_engines import started_vllm_engine, until_started

    from vime.demo.model_factory import make_tiny_qwen3

    model = Path(make_tiny_qwen3(tmp_path / "m", seed=0, max_position_embeddings=2048))
    before = set(_descendants(os.getpid()))
    with started_vllm_engine(loop, model, 2048, engine_core="process") as engine:
        core = [pid for pid in _descendants(os.getpid()) if pid not in before]
        assert core, "the engine core runs in a process of its own"
        sampling = SamplingConfig(temperature=1.0, max_tokens=2000, ignore_eos=True)
        request = loop.create_task(engine.generate([5, 6, 7], n=2, sampling=sampling))
        loop.run_until_complete(until_started(engine, GenerationProgress(), sequences=2))
        watch = StallWatch(timeout_s=2.0)

        async def longest_stall(seconds: float) -> float:
            worst, end = 0.0, time.monotonic() + seconds
            while time.monotonic() < end:
                worst = max(worst, watch.stalled_s(engine, time.monotonic()))
                await asyncio.sleep(0.1)
            return worst

        assert loop.run_until_complete(longest_stall(3.0)) < 1.0  # generating: never near the bound
        for pid in core:
            os.kill(pid, signal.SIGSTOP)
        try:
            async def watch_until_stalled() -> EngineStalled:
                while True:
                    try:
                        watch.check(engine, time.monotonic())
                    except EngineStalled as exc:
                        return exc
                    await asyncio.sleep(0.2)

            stalled = loop.run_until_complete(asyncio.wait_for(watch_until_stalled(), 30))
            assert "1 request(s) in flight" in str(stalled) and not request.done()
        finally:
            for pid in core:
                os.kill(pid, signal.SIGCONT)
            request.cancel()
            loop.run_until_complete(asyncio.gather(request, return_exceptions=True))
