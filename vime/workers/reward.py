"""`vime-worker --role reward`: scores generated groups with a built-in, custom or remote reward.

Each sample gets a reward or is marked failed with a reason that is the sample's own (an exception in
a custom function, no label, a reward server that answers others but not this one); a failed sample is
never scored 0 silently: the broker leaves it out of training and counts it. A reward server that is
down, overloaded or refusing everyone fails nothing: the groups wait here, still leased, and are scored
once it answers (`reward_server_unavailable` warnings say which URL and for how long; heartbeats carry
`rm_samples_waiting` and `rm_outage_s`). Scoring runs off the event loop so heartbeats and new work keep
flowing while slow reward functions or servers work.

Each `ScoreGroups` message is scored as one batch (so remote batch formats fill their requests) and
answered with one `GroupsScored` plus the credits it used. With `--rm-type remote_rm` the samples go
to the reward servers through `vime.rewards.remote.RemoteReward`; its counters (requests, retries,
failures by kind) and running means of numeric reward extras ride on the heartbeat's stats.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Protocol

from vime.broker.client import BrokerClient
from vime.broker.latency import LatencyHistogram
from vime.config import VimeConfig
from vime.logging import get_logger
from vime.metrics import BusyTimer
from vime.prometheus import WorkerMetrics
from vime.protocol.messages import (
    Ack, Credit, GroupScores, GroupsScored, Heartbeat, HeartbeatAck, ScoreGroups, ScoringGroup, ScoringSample, Shutdown,
)
from vime.rewards import RewardFn, RewardResult, build_reward_fn
from vime.rewards.remote import RemoteReward, RemoteRewardSettings
from vime.rewards.wire import ScoreItem
from vime.security import Security

log = get_logger("vime.worker.reward")


class Scorer(Protocol):
    """Scores a batch: one `RewardResult` per item, in order, and never raises for bad input."""

    async def score_batch(self, items: Sequence[ScoreItem]) -> list[RewardResult]: ...


class LocalScorer:
    """A `RewardFn` (built-in or custom) applied to each item concurrently."""

    def __init__(self, reward_fn: RewardFn) -> None:
        self.reward_fn = reward_fn

    async def score_batch(self, items: Sequence[ScoreItem]) -> list[RewardResult]:
        return list(await asyncio.gather(*(self._one(item) for item in items)))

    async def _one(self, item: ScoreItem) -> RewardResult:
        try:
            return await self.reward_fn(item.prompt, item.response, item.label, dict(item.metadata))
        except Exception as exc:  # a bug in a user's function must not take the worker down
            return RewardResult.failure(f"{type(exc).__name__}: {exc}")


def build_scorer(cfg: VimeConfig) -> Scorer:
    """Remote servers for `--rm-type remote_rm` (unless a `--custom-rm-path` wins, as in slime), else local."""
    if cfg.rm_type == "remote_rm" and not cfg.custom_rm_path:
        settings = RemoteRewardSettings.from_config(cfg)
        log.info(
            "remote_reward", urls=settings.urls, format=settings.fmt, reward_key=settings.reward_key,
            batch_size=settings.batch_size, concurrency=settings.concurrency, auth=settings.token is not None,
        )  # fmt: skip
        return RemoteReward(settings)
    return LocalScorer(build_reward_fn(cfg.rm_type, cfg.custom_rm_path))


def items_of(groups: Sequence[ScoringGroup]) -> list[ScoreItem]:
    """Every sample of `groups` the scorer must judge, in order; ids are `group_id/sample_index` (unique
    within a message). Samples that arrive judged are left out (`settled`)."""
    return [
        ScoreItem(f"{g.group_id}/{s.index}", g.prompt_text, s.response_text, g.label, g.metadata)
        for g in groups
        for s in g.samples
        if settled(s) is None
    ]


def settled(sample: ScoringSample) -> RewardResult | None:
    """The result of a sample that needs no scorer: one that failed during its rollout (a generate
    function or environment error, with its reason), or one its environment already rewarded."""
    if sample.status == "failed":
        return RewardResult.failure(sample.failure_reason or "failed during rollout")
    if sample.reward is not None:
        return RewardResult(reward=float(sample.reward), extra=dict(sample.reward_extra))
    return None


async def score_groups(scorer: Scorer, groups: Sequence[ScoringGroup]) -> list[GroupScores]:
    """Scores for `groups`; if the scorer breaks its promise (raises, wrong count) every sample it was
    given fails."""
    items = items_of(groups)
    try:
        scored = await scorer.score_batch(items) if items else []
        if len(scored) != len(items):
            raise RuntimeError(f"scorer returned {len(scored)} results for {len(items)} samples")
    except Exception as exc:
        log.exception("scorer_error", samples=len(items))
        scored = [RewardResult.failure(f"reward scorer error: {type(exc).__name__}: {exc}")] * len(items)
    from_scorer = iter(scored)
    results = [settled(s) or next(from_scorer) for g in groups for s in g.samples]
    out, i = [], 0
    for group in groups:
        mine = results[i : i + len(group.samples)]
        i += len(group.samples)
        out.append(
            GroupScores(
                group_id=group.group_id,
                rewards=[r.reward for r in mine],
                failed=[r.failed for r in mine],
                reasons=[r.reason for r in mine],
                extras=[r.extra for r in mine],
            )
        )
    return out


class ExtraMeans:
    """Running means of the numeric extras of scored samples (`acc`, a judge's sub-scores, ...)."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def add(self, extras: Sequence[dict]) -> None:
        for extra in extras:
            for key, value in extra.items():
                if isinstance(value, (bool, int, float)):
                    self.sums[key] = self.sums.get(key, 0.0) + float(value)
                    self.counts[key] = self.counts.get(key, 0) + 1

    def stats(self) -> dict[str, float]:
        return {f"extra_mean/{k}": self.sums[k] / self.counts[k] for k in self.sums}


class RewardWorker:
    def __init__(self, cfg: VimeConfig, client: BrokerClient, scorer: Scorer | None = None) -> None:
        self.cfg = cfg
        self.client = client
        self.scorer = scorer or build_scorer(cfg)
        self.tasks: set[asyncio.Task[None]] = set()
        self.stats = {"groups": 0.0, "samples": 0.0, "samples_failed": 0.0, "busy_s": 0.0}
        self.extras = ExtraMeans()
        self.busy = BusyTimer()
        self.groups_in_flight = 0
        self.score_seconds = LatencyHistogram()  # per ScoreGroups message, for /metrics
        self.metrics = WorkerMetrics("reward")  # /metrics, fed at each heartbeat (vime.prometheus)

    async def run(self) -> int:
        with self.metrics.serving(self.cfg, self.client):
            return await self._run()

    async def _run(self) -> int:
        await self.client.hello()
        await self.client.send(Credit(n=self.cfg.reward_concurrency))
        heartbeat = asyncio.create_task(
            self.client.heartbeat_loop(self.cfg.heartbeat_interval_s, self._heartbeat)
        )
        try:
            while True:
                if heartbeat.done():
                    heartbeat.result()
                msg = await self.client.recv(timeout_s=1.0)
                if self.client.rejoin_needed:
                    await self._rejoin()
                if msg is None or isinstance(msg, (Ack, HeartbeatAck)):
                    continue
                if isinstance(msg, ScoreGroups):
                    self.groups_in_flight += len(msg.groups)
                    task = asyncio.create_task(self._score(msg.groups))
                    self.tasks.add(task)
                    task.add_done_callback(self.tasks.discard)
                elif isinstance(msg, Shutdown):
                    log.info("shutdown_requested", reason=msg.reason)
                    return 0
                else:
                    log.warning("unexpected_message", message=type(msg).__name__)
        finally:
            heartbeat.cancel()
            for task in self.tasks:
                task.cancel()
            if isinstance(self.scorer, RemoteReward):
                await self.scorer.aclose()

    async def _rejoin(self) -> None:
        """The broker restarted: register again and offer the slots not taken by groups being scored."""
        await self.client.rejoin()
        free = self.cfg.reward_concurrency - self.groups_in_flight
        if free > 0:
            await self.client.send(Credit(n=free))

    def _heartbeat(self) -> Heartbeat:
        self.stats["busy_s"] = self.busy.total()
        stats = dict(self.stats)
        stats.update(self.extras.stats())
        if isinstance(self.scorer, RemoteReward):
            stats.update(self.scorer.stats())
        self.metrics.publish(-1, len(self.tasks), stats, {"score": self.score_seconds.status()})
        return Heartbeat(in_flight=len(self.tasks), stats=stats)

    async def _score(self, groups: Sequence[ScoringGroup]) -> None:
        self.busy.begin()
        started = time.perf_counter()
        try:
            scores = await score_groups(self.scorer, groups)
        finally:
            self.busy.end()
        self.score_seconds.observe(time.perf_counter() - started)
        failures = sum(sum(s.failed) for s in scores)
        if failures:
            reason = next(r for s in scores for r, f in zip(s.reasons, s.failed) if f)
            log.warning("reward_failed", groups=len(groups), failed=failures, reason=reason)
        for s in scores:
            self.extras.add([e for e, f in zip(s.extras, s.failed) if not f])
        self.stats["groups"] += len(groups)
        self.stats["samples"] += sum(len(s.rewards) for s in scores)
        self.stats["samples_failed"] += failures
        self.groups_in_flight -= len(groups)
        await self.client.send(GroupsScored(scores=scores))
        await self.client.send(Credit(n=len(groups)))


async def run(cfg: VimeConfig, worker_id: str | None = None) -> int:
    client = BrokerClient(cfg.broker_address, "reward", worker_id, security=Security.from_config(cfg), job_name=cfg.job_name)
    return await client.run_session(RewardWorker(cfg, client).run())
