"""`vime-worker --role reward`: scores generated groups with a built-in, custom or remote reward.

Each sample gets a reward or is marked failed with a reason (an exception in a custom function, a
timeout); a failed sample is never scored 0 silently. Scoring runs off the event loop so heartbeats
and new work keep flowing while slow reward functions run.
"""

from __future__ import annotations

import asyncio

from vime.broker.client import BrokerClient
from vime.config import VimeConfig
from vime.logging import get_logger
from vime.metrics import BusyTimer
from vime.protocol.messages import Ack, Credit, Group, GroupScores, GroupsScored, Heartbeat, HeartbeatAck, ScoreGroups, Shutdown
from vime.rewards import RewardFn, RewardResult, build_reward_fn

log = get_logger("vime.worker.reward")


async def score_sample(reward_fn: RewardFn, group: Group, response: str) -> RewardResult:
    """Reward functions report failures as results; an exception that escapes anyway fails the sample."""
    try:
        return await reward_fn(group.prompt_text, response, group.label, dict(group.metadata))
    except Exception as exc:  # a bug in a user's function must not take the worker down
        return RewardResult.failure(f"{type(exc).__name__}: {exc}")


async def score_group(reward_fn: RewardFn, group: Group) -> GroupScores:
    results = await asyncio.gather(*(score_sample(reward_fn, group, s.response_text) for s in group.samples))
    return GroupScores(
        group_id=group.group_id,
        rewards=[r.reward for r in results],
        failed=[r.failed for r in results],
        reasons=[r.reason for r in results],
        extras=[r.extra for r in results],
    )


class RewardWorker:
    def __init__(self, cfg: VimeConfig, client: BrokerClient) -> None:
        self.cfg = cfg
        self.client = client
        self.reward_fn = build_reward_fn(cfg.rm_type, cfg.custom_rm_path)
        self.tasks: set[asyncio.Task[None]] = set()
        self.stats = {"groups": 0.0, "samples_failed": 0.0, "busy_s": 0.0}
        self.busy = BusyTimer()

    async def run(self) -> int:
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
                if msg is None or isinstance(msg, (Ack, HeartbeatAck)):
                    continue
                if isinstance(msg, ScoreGroups):
                    for group in msg.groups:
                        task = asyncio.create_task(self._score(group))
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

    def _heartbeat(self) -> Heartbeat:
        self.stats["busy_s"] = self.busy.total()
        return Heartbeat(in_flight=len(self.tasks), stats=dict(self.stats))

    async def _score(self, group: Group) -> None:
        self.busy.begin()
        try:
            scores = await score_group(self.reward_fn, group)
        finally:
            self.busy.end()
        failures = sum(scores.failed)
        if failures:
            log.warning("reward_failed", group=group.group_id, failed=failures, reason=next(r for r in scores.reasons if r))
        self.stats["groups"] += 1
        self.stats["samples_failed"] += failures
        await self.client.send(GroupsScored(scores=[scores]))
        await self.client.send(Credit(n=1))


async def run(cfg: VimeConfig, worker_id: str | None = None) -> int:
    client = BrokerClient(cfg.broker_address, "reward", worker_id)
    return await client.run_session(RewardWorker(cfg, client).run())
