"""Remote rewards against the servers users really run (issue 15, parts 4 and 5).

- A reward-server outage costs time, not data: samples whose request failed for a reason outside the
  sample (nothing listening, circuit open, timeouts, 5xx) wait and are scored once the server is back;
  the broker drops nothing. Only a sample's own fault fails it: the server answers other requests but
  keeps failing this one.
- A twenty-line standard-library server (`bench/stdlib_reward_server.py`: ThreadingHTTPServer, HTTP/1.0,
  listen backlog 5) is not flooded: the client adapts how many requests it keeps in flight (AIMD on
  round-trip times and connect stalls) instead of opening 64 connections at once into a 5-deep queue.

Assertions are about what happened (every sample scored, nothing dropped, the limit went down after
stalls), never about speed; speed is in bench/reward_throughput.py and docs/benchmarks.md.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from vime.broker.settings import BrokerSettings
from vime.broker.state import BrokerState
from vime.config import load_config
from vime.data.prompts import Prompt, PromptCursor
from vime.protocol.messages import GroupsScored, ScoreGroups, Sample
from vime.rewards import outage, remote
from vime.rewards.limit import AdaptiveLimit, Outcome
from vime.rewards.remote import RemoteReward, RemoteRewardSettings
from vime.rewards.wire import ScoreItem

from conftest import REPO, run_env

SERVER = REPO / "bench" / "stdlib_reward_server.py"


def start_server(port: int = 0) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, str(SERVER), str(port)], stdout=subprocess.PIPE, text=True, env=run_env())
    line = proc.stdout.readline()
    if not line:
        proc.wait(timeout=10)
        raise RuntimeError(f"stdlib reward server did not start (exit {proc.returncode})")
    return proc, f"http://127.0.0.1:{int(line)}/slime/arithmetic"


def stop_server(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(timeout=10)


@pytest.fixture(scope="module")
def stdlib_server():
    proc, url = start_server()
    try:
        yield url
    finally:
        stop_server(proc)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def demo_items(n: int) -> list[ScoreItem]:
    """Half right (reward 1), half wrong (reward 0)."""
    return [ScoreItem(f"s{i}", f"{i}+1=", str(i + 1 if i % 2 else i + 2), str(i + 1)) for i in range(n)]


class Recorder:
    """Stands in for a module's structlog logger: keeps (level, event, fields)."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, Any]]] = []

    def __getattr__(self, level: str):
        return lambda event, **fields: self.lines.append((level, event, fields))

    def events(self, level: str | None = None) -> list[str]:
        return [e for lvl, e, _ in self.lines if level is None or lvl == level]


# ------------------------------------------------------------------------------ adaptive concurrency


def test_a_standard_library_server_is_scored_at_default_settings(stdlib_server: str) -> None:
    """Issue 15: 512 samples at the default concurrency of 64 against this server took 28 s: 64
    simultaneous connections overflow its 5-deep listen queue, and each dropped SYN waits 1, 3, 7 s.
    With the defaults now, the first pass finds the server's level (a few stalls at most, each cutting
    the limit) and the second runs below it."""
    batch = demo_items(512)

    async def go():
        async with RemoteReward(RemoteRewardSettings(urls=[stdlib_server])) as rm:
            first = await rm.score_batch(batch)
            learned = rm.stats()
            second = await rm.score_batch(batch)
            return first, learned, second, rm.stats(), rm.limits[stdlib_server]

    first, learned, second, stats, limit = asyncio.run(go())
    for results in (first, second):
        assert not any(r.failed for r in results)
        assert [r.reward for r in results] == [float(i % 2) for i in range(512)]
    assert stats["rm_samples_waiting"] == 0 and stats.get("rm_samples_failed", 0) == 0
    assert limit.peak_in_flight <= limit.max_limit == 64
    if learned["rm_connect_stalls"]:  # every burst of stalls cut the limit, and it stayed below that level
        assert learned["rm_limit_decreases"] >= 1 and limit.ceiling is not None and limit.limit <= limit.ceiling
    # How few stalls the second pass has depends on the machine's speed and load (a loaded CI runner
    # saw 17 and 21 where an idle one sees a handful): that is measured by
    # `bench/reward_throughput.py --only stdlib` (stalls per pass, against the old fixed 64), not here.


def test_the_limit_grows_while_latency_holds_and_halves_on_stalls() -> None:
    """The controller alone, on a scripted clock: slow start doubles it per round trip while latency
    stays near its best; a latency rise ends slow start; a connect stall cuts it once per burst, and
    it then stays below the level that stalled until a probe interval has passed; never above max."""
    now = [0.0]
    lim = AdaptiveLimit(max_limit=64, initial=4, clock=lambda: now[0], probe_interval_s=10.0)

    async def rounds(n: int, latency: float, connect_s: float | None = None, outcome: Outcome = Outcome.OK) -> None:
        for _ in range(n):
            k = int(lim.limit)
            tickets = [await lim.acquire() for _ in range(k)]
            now[0] += latency
            for t in tickets:
                lim.release(t, outcome, latency_s=latency, connect_s=connect_s)

    async def script():
        await rounds(1, 0.010)
        assert lim.limit == 8  # slow start: +1 per completed request while the limit is in use
        await rounds(2, 0.010)
        assert lim.limit == 32
        await rounds(1, 0.030)  # 3x the best round trip: the server is queueing
        assert 32 <= lim.limit <= 36 and not lim.slow_start  # the average needs a few answers to rise
        held = lim.limit
        await rounds(3, 0.030)
        assert lim.limit == held
        await rounds(2, 0.010)
        assert held < lim.limit < held + 2  # congestion avoidance: about +1 per round trip
        before = lim.limit
        await rounds(1, 0.010, connect_s=1.0)  # every request of the round stalled on connect: one cut
        assert lim.limit == pytest.approx(before * 0.7) and lim.ceiling == pytest.approx(before) and lim.decreases == 1
        for _ in range(40):
            await rounds(1, 0.010)
        assert lim.limit <= lim.ceiling - 1  # plateau below the level that stalled
        now[0] += 10.0
        for _ in range(40):
            await rounds(1, 0.010)
        assert lim.limit > before  # probing past it once the interval passed
        for _ in range(200):
            await rounds(1, 0.010)
        assert lim.limit == 64  # bounded by --rm-concurrency
        await rounds(1, 0.010, outcome=Outcome.OVERLOAD)  # 503s, resets: halve
        assert lim.limit == 32
        assert lim.peak_in_flight <= 64

    asyncio.run(script())


def test_a_level_that_keeps_stalling_is_probed_ever_less_often() -> None:
    """Each probe of a small server's level costs a step a second or more (issue 15's demo against the
    standard-library server: 28 stalls in 20 steps, 2x the in-process step time): a probe that stalls
    again within an interval doubles the wait before the next; one that holds that long resets it."""
    now = [0.0]
    lim = AdaptiveLimit(max_limit=64, initial=4, clock=lambda: now[0], probe_interval_s=10.0, max_probe_interval_s=40.0)

    async def rounds(n: int, connect_s: float | None = None) -> None:
        for _ in range(n):
            tickets = [await lim.acquire() for _ in range(int(lim.limit))]
            now[0] += 0.01
            for t in tickets:
                lim.release(t, Outcome.OK, latency_s=0.01, connect_s=connect_s)

    async def probe_that_stalls() -> None:
        level = lim.ceiling
        while lim.limit < level:  # climbs back to the old level, then the server stalls again
            await rounds(1)
        now[0] += 1.0
        await rounds(1, connect_s=1.0)

    async def script():
        await rounds(2)
        await rounds(1, connect_s=1.0)  # the first stall: plateau below it for 10 s
        assert lim.probe_wait_s == 10.0
        waits = []
        for _ in range(3):
            now[0] += lim.probe_wait_s
            await probe_that_stalls()
            waits.append(lim.probe_wait_s)
        assert waits == [20.0, 40.0, 40.0]  # doubling, up to max_probe_interval_s
        now[0] += 39.0
        for _ in range(40):
            await rounds(1)
        assert lim.limit <= lim.ceiling - 1  # 39 s < 40 s: still no probe
        now[0] += 1.0
        for _ in range(40):
            await rounds(1)
        assert lim.ceiling is None  # the probe climbed past the old level
        now[0] += 41.0  # and held it for longer than the interval
        await rounds(1, connect_s=1.0)
        assert lim.probe_wait_s == 10.0  # a stall now is news: back to the first interval

    asyncio.run(script())


def test_a_limit_that_is_not_used_does_not_grow() -> None:
    now = [0.0]
    lim = AdaptiveLimit(max_limit=64, initial=4, clock=lambda: now[0])

    async def script():
        for _ in range(50):
            t = await lim.acquire()  # one request at a time: the limit of 4 is never reached
            now[0] += 0.01
            lim.release(t, Outcome.OK, latency_s=0.01)
        assert lim.limit == 4

    asyncio.run(script())


# ------------------------------------------------------------------------------------ outages


def _broker_with_scoring(n_groups: int, n: int = 4) -> tuple[BrokerState, list]:
    prompts = [Prompt(i, f"{i}+1=", np.array([i, 10], dtype=np.int32), str(i + 1)) for i in range(20)]
    settings = BrokerSettings(
        rollout_batch_size=n_groups, n_samples_per_prompt=n, max_staleness=0, update_weights_interval=1,
        num_rollout=10, worker_timeout_s=600.0, sampling={"temperature": 1.0, "top_p": 1.0, "max_tokens": 4},
    )  # fmt: skip
    state = BrokerState(settings, PromptCursor(prompts, shuffle=False, seed=0))
    state.register(b"r", "rollout-0", "rollout", now=0.0)
    state.register(b"w", "reward-0", "reward", now=0.0)
    state.add_credit(b"r", 100)
    state.add_credit(b"w", 100)
    groups = [g for _, msg in state.dispatch() for g in getattr(msg, "groups", [])]
    for g in groups:
        g.samples = [
            Sample(i, np.ones(2, np.int32), np.zeros(2, np.float32), np.ones(2, np.uint8), np.zeros(2, np.int32), "stop",
                   str(g.prompt_index + 1) if i % 2 else "7")
            for i in range(n)
        ]  # fmt: skip
        assert state.on_generated(b"r", [g]) == [g.group_id]
    scoring = [g for _, msg in state.dispatch_scoring() if isinstance(msg, ScoreGroups) for g in msg.groups]
    assert len(scoring) == n_groups
    return state, scoring


class FakeBroker:
    """What RewardWorker sends to its broker client."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    async def send(self, msg: Any) -> None:
        self.sent.append(msg)


def test_an_outage_costs_time_not_data(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 15: with the server down 40 s, 4,706 groups failed and every epoch-0 prompt was discarded.
    Now: nothing listens for ~2 s, then the server starts; every group is scored, none dropped, and the
    worker said what was going on (which URL, for how long) while it waited."""
    from vime.workers.reward import RewardWorker

    recorder = Recorder()
    monkeypatch.setattr(remote, "log", recorder)
    monkeypatch.setattr(outage, "log", recorder)
    port = free_port()
    url = f"http://127.0.0.1:{port}/slime/arithmetic"
    state, groups = _broker_with_scoring(n_groups=6)
    settings = RemoteRewardSettings(
        urls=[url], retries=1, backoff_initial_s=0.05, backoff_max_s=0.2, breaker_failures=3, breaker_reset_s=0.5,
        warn_interval_s=0.5,
    )  # fmt: skip
    broker = FakeBroker()

    async def go():
        async with RemoteReward(settings) as rm:
            worker = RewardWorker(load_config(None, {}), broker, scorer=rm)  # type: ignore[arg-type]
            tasks = [asyncio.create_task(worker._score(groups[i : i + 2])) for i in range(0, 6, 2)]
            await asyncio.sleep(2.0)
            waiting = rm.stats()
            assert not any(t.done() for t in tasks), "groups were given up while the server was down"
            proc, _ = await asyncio.to_thread(start_server, port)
            try:
                await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
            finally:
                stop_server(proc)
            return waiting, rm.stats(), worker.stats

    waiting, stats, worker_stats = asyncio.run(go())
    assert waiting["rm_samples_waiting"] == 24 and waiting["rm_outage_s"] >= 1.0
    assert stats["rm_samples_waiting"] == 0 and stats.get("rm_samples_failed", 0) == 0
    for msg in [m for m in broker.sent if isinstance(m, GroupsScored)]:
        assert not any(f for s in msg.scores for f in s.failed)
        state.on_scored(b"w", msg.scores)
    assert state.counters["groups_scored"] == 6
    assert state.counters["groups_failed"] == 0 and state.counters["samples_failed"] == 0
    assert len(state.batches.buffer) == 6 and state.admission.finished.total == 0
    assert worker_stats["samples_failed"] == 0
    warnings = [f for lvl, e, f in recorder.lines if e == "reward_server_unavailable"]
    assert warnings and all(w["url"] == url and w["console"] for w in warnings)
    assert max(w["down_s"] for w in warnings) >= 1.0 and warnings[-1]["samples_waiting"] == 24
    assert len(warnings) <= 8, "rate-limited, not one line per failed request"
    back = [f for lvl, e, f in recorder.lines if e == "reward_server_back"]
    assert back and back[0]["url"] == url and back[0]["down_s"] >= 1.0


def test_a_sample_the_server_keeps_failing_while_it_answers_others_fails_alone(stdlib_server: str) -> None:
    """A sample's own fault still fails it (here the server's reward function raises on it: HTTP 500),
    and promptly: it is not held as if the server were down, because the server answers the others."""
    batch = demo_items(40)
    batch[7] = ScoreItem("poison", "7+1=", "poison", "8")
    s = RemoteRewardSettings(urls=[stdlib_server], retries=1, backoff_initial_s=0.02, backoff_max_s=0.1, breaker_failures=1000)

    async def go():
        async with RemoteReward(s) as rm:
            return await asyncio.wait_for(rm.score_batch(batch), timeout=60), rm.stats()

    results, stats = asyncio.run(go())
    assert results[7].failed and results[7].extra["reward_error"] == "http_5xx" and "HTTP 500" in results[7].reason
    assert [r.failed for i, r in enumerate(results) if i != 7] == [False] * 39
    assert stats["rm_samples_failed"] == 1 and stats["rm_samples_waiting"] == 0


def test_max_wait_bounds_the_wait_for_scripts(monkeypatch: pytest.MonkeyPatch) -> None:
    """`max_wait_s` (None in the reward worker: wait until the servers answer) lets a script give up."""
    recorder = Recorder()
    monkeypatch.setattr(remote, "log", recorder)
    monkeypatch.setattr(outage, "log", recorder)
    url = f"http://127.0.0.1:{free_port()}/slime/arithmetic"  # nothing listens
    s = RemoteRewardSettings(urls=[url], retries=1, backoff_initial_s=0.05, backoff_max_s=0.1, max_wait_s=0.6)

    async def go():
        async with RemoteReward(s) as rm:
            t0 = time.monotonic()
            results = await asyncio.wait_for(rm.score_batch(demo_items(3)), timeout=30)
            return results, time.monotonic() - t0

    results, took = asyncio.run(go())
    assert took >= 0.6
    assert all(r.failed and r.extra["reward_error"] in ("connection", "circuit_open") for r in results)
    assert "reward_server_unavailable" in recorder.events("warning")


class _Failure:
    def __init__(self, may_be_the_samples: bool) -> None:
        self.kind = "http_5xx" if may_be_the_samples else "connection"
        self.may_be_the_samples = may_be_the_samples

    def __str__(self) -> str:
        return self.kind


def test_outage_ledger_fails_samples_only_for_their_own_fault_or_past_the_bound() -> None:
    url = "http://r:1/score"
    ledger = outage.OutageLedger([url], warn_interval_s=10.0, max_wait_s=None, sample_fault_rounds=2)
    own, down = outage.ChunkWait(), outage.ChunkWait()
    for _ in range(3):
        ledger.failed(url, own, _Failure(True))
        ledger.succeeded(url)  # the server answers the other requests meanwhile
        ledger.succeeded(url)
    assert [ledger.samples_at_fault(_Failure(True), own) for _ in range(2)] == [False, True]  # two rounds in a row
    for _ in range(5):
        ledger.failed(url, down, _Failure(False))  # never reached
    assert not any(ledger.samples_at_fault(_Failure(False), down) for _ in range(5))
    assert ledger.last_kind[url] == "connection" and ledger.outage_s() > 0.0
    bounded = outage.OutageLedger([url], warn_interval_s=10.0, max_wait_s=0.0, sample_fault_rounds=2)
    chunk = outage.ChunkWait()
    bounded.failed(url, chunk, _Failure(False))
    assert bounded.samples_at_fault(_Failure(False), chunk)  # max_wait_s=0: give up at once
