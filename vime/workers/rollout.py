"""`vime-worker --role rollout`: one rollout engine (vLLM by default) serving prompt groups.

Main loop: say Hello, grant the broker `rollout_concurrency` credits, then for each dispatched group
wait until the engine holds the group's minimum weight version, generate n samples, send them back and
grant one more credit. Weight announcements are coalesced: the engine jumps straight to the newest
version (a worker that missed versions just fetches the latest), in flight, while other groups keep
generating.

Eval groups (kind "eval") are sampled with the job's eval sampling parameters. They carry the weight
version of their eval run; while one generates on exactly that version, the worker holds further
weight updates, so the run measures the weights of its step and not a mix; the hold outlasts the
last such group by `EVAL_HOLD_GRACE_S`, because the run's next groups arrive one broker round trip
after a credit frees. The cost is bounded by the eval's generation time on this worker (plus the
grace): training groups that need a newer version wait for it, groups already generating keep going.
If the engine had already moved past the run's version when the group arrived (or an update was
already loading), it generates on the newer one; the tokens' versions say which
(eval/NAME/weight_version_max).
"""

from __future__ import annotations

import asyncio
import os
import time

from typing import TYPE_CHECKING

import numpy as np

from vime.broker.client import BrokerClient
from vime.config import VimeConfig
from vime.logging import bind_progress, get_logger
from vime.metrics import BusyTimer
from vime.prometheus import WorkerMetrics
from vime.protocol.messages import (
    Ack,
    Credit,
    DispatchGroups,
    Group,
    GroupsGenerated,
    Heartbeat,
    HeartbeatAck,
    Sample,
    Shutdown,
    WeightVersionAnnounce,
)
from vime.colocate import ColocateClient
from vime.rollout import GeneratedSample, SamplingConfig, WeightFetchFailed, WeightUpdateResult, build_engine
from vime.rollout.stall import StallWatch
from vime.security import Security

if TYPE_CHECKING:
    from vime.agent.rollout import AgentRollout

log = get_logger("vime.worker.rollout")

# A failed weight update (the fetcher gave up after its timeout) is retried this much later, for the
# latest version then; this many failures in a row end the worker (a broken channel, not a hiccup).
UPDATE_RETRY_S = 5.0
MAX_UPDATE_FAILURES = 3
# Weight updates stay held this long after the last eval group on its run's version finished, so the
# run's next groups (one credit -> dispatch round trip away) still find the weights they measure.
EVAL_HOLD_GRACE_S = 0.25
# A failing generate function logs its full traceback at most this often (a short line otherwise).
FAILURE_LOG_EVERY_S = 10.0


def failed_sample(index: int, reason: str) -> Sample:
    """A sample of a group whose generation failed: no tokens, status failed, the reason kept."""
    empty_int = np.zeros(0, dtype=np.int32)
    return Sample(
        index=index, response_tokens=empty_int, rollout_logprobs=np.zeros(0, dtype=np.float32),
        loss_mask=np.zeros(0, dtype=np.uint8), token_versions=empty_int.copy(), finish_reason="abort",
        status="failed", failure_reason=reason,
    )  # fmt: skip


def to_sample(index: int, generated: GeneratedSample) -> Sample:
    """The wire sample of one generated response; a failed sample (left out of training, the reason
    kept) when the engine gave a trained token a logprob that is not finite: no loss can use it, and a
    trainer given one would refuse the whole batch."""
    status = {"length": "truncated", "abort": "aborted"}.get(generated.finish_reason, "completed")
    logprobs = np.asarray(generated.rollout_logprobs, dtype=np.float32)
    loss_mask = np.asarray(generated.loss_mask, dtype=np.uint8)
    finite = np.isfinite(logprobs)
    if not finite.all():
        bad = np.flatnonzero(~finite & (loss_mask == 1))
        if bad.size:
            log.error("rollout_logprob_not_finite", sample=index, positions=bad[:8].tolist(), value=float(logprobs[bad[0]]))
            return failed_sample(index, f"the rollout engine gave {bad.size} trained token(s) a non-finite logprob "
                                        f"(first at response position {int(bad[0])}: {float(logprobs[bad[0]])})")  # fmt: skip
    return Sample(
        index=index,
        response_tokens=np.asarray(generated.response_tokens, dtype=np.int32),
        rollout_logprobs=logprobs,
        loss_mask=loss_mask,
        token_versions=np.asarray(generated.token_versions, dtype=np.int32),
        finish_reason=generated.finish_reason,
        response_text=generated.response_text,
        status=status,  # type: ignore[arg-type]
        routed_experts=generated.routed_experts,
        num_experts=generated.num_experts,
    )


class RolloutWorker:
    def __init__(self, cfg: VimeConfig, engine, client: BrokerClient, agent: AgentRollout | None = None) -> None:  # type: ignore[no-untyped-def]
        self.cfg = cfg
        self.engine = engine
        self.client = client
        self.target_version = 0
        self.endpoint: str | None = None
        self.version_changed = asyncio.Condition()
        self.update_wanted = asyncio.Event()
        self.busy = BusyTimer()
        self.tasks: set[asyncio.Task[None]] = set()
        self.stats = {
            "busy_s": 0.0, "update_s": 0.0, "updates": 0.0, "fetch_s": 0.0, "load_s": 0.0, "paused_s": 0.0,
            "update_bytes": 0.0, "tokens": 0.0, "groups": 0.0, "eval_groups": 0.0, "groups_failed_in_rollout": 0.0,
            "samples": 0.0,
        }  # fmt: skip
        self.metrics = WorkerMetrics("rollout")  # /metrics, fed at each heartbeat (vime.prometheus)
        self.agent = agent
        self._last_failure_log = float("-inf")
        self.sampling: SamplingConfig | None = None
        self.eval_sampling: SamplingConfig | None = None
        self.eval_pins = 0  # eval groups generating on their run's version: weight updates wait
        self.unpinned = asyncio.Event()
        self.unpinned.set()
        self._hold_token = 0
        self.fatal: BaseException | None = None
        self.update_failures = 0
        self.stall = StallWatch(cfg.rollout_stall_timeout_s)
        self.updating = False  # a weight update is being applied (the engine may rightly sample nothing)
        # --colocate: the trainer puts the engine to sleep for its steps and wakes it on new weights.
        self.colocate = (
            ColocateClient(cfg.colocate_endpoint(), client.worker_id, security=Security.from_config(cfg),
                           heartbeat_s=cfg.heartbeat_interval_s)
            if cfg.colocate else None
        )  # fmt: skip

    async def run(self) -> int:
        with self.metrics.serving(self.cfg, self.client):
            return await self._run()

    async def _run(self) -> int:
        job = await self.client.hello(weight_version=self.engine.weight_version)
        self.sampling = SamplingConfig(
            temperature=float(job.sampling["temperature"]),
            top_p=float(job.sampling["top_p"]),
            max_tokens=int(job.sampling["max_tokens"]),
        )
        if job.eval_sampling:
            self.eval_sampling = SamplingConfig(
                temperature=float(job.eval_sampling["temperature"]),
                top_p=float(job.eval_sampling["top_p"]),
                max_tokens=int(job.eval_sampling["max_tokens"]),
            )
        self._note_version(job.weight_version, job.weight_endpoint)
        await self.client.send(Credit(n=self.cfg.rollout_concurrency))
        updater = asyncio.create_task(self._update_loop())
        heartbeat = asyncio.create_task(self.client.heartbeat_loop(self.cfg.heartbeat_interval_s, self._heartbeat))
        turns = asyncio.create_task(self.colocate.run(self.engine, self._woke_up)) if self.colocate else None
        try:
            while True:
                if heartbeat.done():
                    heartbeat.result()  # raises BrokerGone
                if updater.done():
                    updater.result()  # a weight update failed: surface it
                if turns is not None and turns.done():
                    turns.result()  # the colocation channel broke: surface it
                if self.fatal is not None:
                    # The engine failed mid-generation: exit so the group's lease is re-dispatched
                    # (by the launcher's teardown or the broker's timeout) instead of hanging forever.
                    raise self.fatal
                self.stall.check(self.engine, time.monotonic(), updating=self.updating)
                msg = await self.client.recv(timeout_s=1.0)
                if self.client.rejoin_needed:
                    await self._rejoin()
                if msg is None or isinstance(msg, Ack):
                    continue
                if isinstance(msg, DispatchGroups):
                    for group in msg.groups:
                        self._spawn(self._generate_group(group))
                elif isinstance(msg, WeightVersionAnnounce):
                    self._note_version(msg.version, msg.endpoint)
                elif isinstance(msg, HeartbeatAck):
                    self._note_version(msg.weight_version, msg.weight_endpoint)
                elif isinstance(msg, Shutdown):
                    log.info("shutdown_requested", reason=msg.reason)
                    return 0
                else:
                    log.warning("unexpected_message", message=type(msg).__name__)
        finally:
            for task in [updater, heartbeat, *([turns] if turns else []), *self.tasks]:
                task.cancel()
            if turns is not None:
                # Let the colocation client say it leaves before the engine's shutdown (which may block
                # the loop): a trainer handing the GPU back must not wait for this engine's silence.
                await asyncio.gather(turns, return_exceptions=True)

    async def _rejoin(self) -> None:
        """The broker restarted: register again and offer the slots not taken by groups in flight (those
        finish, their results are dropped as late by the new broker, and each returns its slot)."""
        job = await self.client.rejoin(weight_version=self.engine.weight_version)
        self._note_version(job.weight_version, job.weight_endpoint)
        free = self.cfg.rollout_concurrency - len(self.tasks)
        if free > 0:
            await self.client.send(Credit(n=free))

    def _spawn(self, coro) -> None:  # type: ignore[no-untyped-def]
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("group_task_failed", error=repr(task.exception()))
            self.fatal = self.fatal or task.exception()

    def _note_version(self, version: int, endpoint: str | None) -> None:
        newer = version > self.target_version
        # The same version from another publisher (a resumed trainer) replaces an address we have not
        # fetched from yet: the old one may be dead.
        moved = version == self.target_version and endpoint != self.endpoint and self.engine.weight_version < version
        if endpoint and (newer or moved):
            self.target_version = version
            self.endpoint = endpoint
            self.update_wanted.set()

    async def _update_loop(self) -> None:
        while True:
            await self.update_wanted.wait()
            self.update_wanted.clear()
            await self.unpinned.wait()  # an eval run holds the weights it measures
            if self.engine.weight_version >= self.target_version or self.endpoint is None:
                continue
            if self.engine.asleep:
                continue  # colocated: the wake-up loads the newest weights (then _woke_up looks again)
            started = time.perf_counter()
            self.updating = True
            try:
                result = await self.engine.update_weights(self.target_version, self.endpoint)
            except WeightFetchFailed as exc:
                # A stuck or broken transfer: the engine keeps its weights and keeps generating; retry
                # later (or sooner, on a newer announcement). Only repeated failures end the worker.
                # Any other WeightUpdateError may have left the model half loaded: it ends the worker.
                self.update_failures += 1
                log.error("weight_update_failed", version=self.target_version, endpoint=self.endpoint,
                          failures=self.update_failures, error=str(exc)[:1000])  # fmt: skip
                if self.update_failures >= MAX_UPDATE_FAILURES:
                    raise
                asyncio.get_running_loop().call_later(UPDATE_RETRY_S, self.update_wanted.set)
                continue
            finally:
                self.updating = False
            self.update_failures = 0
            seconds = time.perf_counter() - started
            self._count_update(result, seconds)
            bind_progress(weight_version=self.engine.weight_version)
            log.info(
                "weights_loaded", version=result.version, requested=result.requested_version, seconds=round(seconds, 4),
                nbytes=result.nbytes, fetch_s=round(result.fetch_s, 4), load_s=round(result.load_s, 4),
                paused_s=round(result.paused_s, 4), in_flight=self.busy.in_flight,
            )
            async with self.version_changed:
                self.version_changed.notify_all()

    async def _woke_up(self, result: WeightUpdateResult | None) -> None:
        """The colocated engine is awake (on the weights of `result`, if it loaded any)."""
        if result is not None and not result.skipped:
            self._count_update(result)
        bind_progress(weight_version=self.engine.weight_version)
        async with self.version_changed:
            self.version_changed.notify_all()
        self.update_wanted.set()  # an announcement that arrived while asleep may name a newer version

    def _count_update(self, result: WeightUpdateResult, seconds: float | None = None) -> None:
        self.stats["update_s"] += result.total_s if seconds is None else seconds
        self.stats["updates"] += 1
        self.stats["fetch_s"] += result.fetch_s
        self.stats["load_s"] += result.load_s
        self.stats["paused_s"] += result.paused_s
        self.stats["update_bytes"] += result.nbytes

    async def _wait_for_version(self, version: int) -> None:
        async with self.version_changed:
            await self.version_changed.wait_for(lambda: self.engine.weight_version >= version)

    async def _generate_group(self, group: Group) -> None:
        if self.engine.weight_version < group.min_weight_version:
            self._note_version(group.min_weight_version, self.endpoint)
            await self._wait_for_version(group.min_weight_version)
        assert self.sampling is not None
        is_eval = group.kind == "eval"
        sampling = (self.eval_sampling or self.sampling) if is_eval else self.sampling
        # Pinned before the first await, so no update can start between the check and the generation.
        pinned = is_eval and self.engine.weight_version == group.min_weight_version
        if pinned:
            self._pin(+1)
        self.busy.begin()
        try:
            if self.agent is None:
                generated = await self.engine.generate(group.prompt_tokens.tolist(), n=group.n_samples, sampling=sampling)
                group.samples = [to_sample(i, g) for i, g in enumerate(generated)]
            else:
                group.samples = await self._generate_with_agent(group, sampling)
        finally:
            self.busy.end()
            if pinned:
                self._pin(-1)
        self.stats["tokens"] += sum(len(s.response_tokens) for s in group.samples)
        self.stats["samples"] += len(group.samples)
        self.stats["eval_groups" if is_eval else "groups"] += 1
        await self.client.send(GroupsGenerated(groups=[group]))
        await self.client.send(Credit(n=1))

    async def _generate_with_agent(self, group: Group, sampling: SamplingConfig) -> list[Sample]:
        """The group's samples from the custom generate function; a failure in user code fails the group
        (its samples are sent failed, with the traceback as the reason) and never the worker."""
        assert self.agent is not None
        outcome = await self.agent.generate_group(
            self.engine, prompt_text=group.prompt_text, prompt_tokens=group.prompt_tokens.tolist(), label=group.label,
            metadata=dict(group.metadata), n_samples=group.n_samples, sampling=sampling,
        )  # fmt: skip
        if outcome.failure is not None:
            self.stats["groups_failed_in_rollout"] += 1
            self._log_generate_failure(group.group_id, outcome.failure)
            return [failed_sample(i, outcome.failure) for i in range(group.n_samples)]
        samples = []
        for i, (generated, reward, stats) in enumerate(zip(outcome.samples, outcome.rewards, outcome.stats)):
            sample = to_sample(i, generated)
            sample.reward = reward
            sample.rollout_stats = stats
            samples.append(sample)
        return samples

    def _log_generate_failure(self, group_id: str, reason: str) -> None:
        """The full traceback once per `FAILURE_LOG_EVERY_S`, its last line otherwise."""
        now = time.monotonic()
        last_line = reason.strip().splitlines()[-1] if reason.strip() else reason
        if now - self._last_failure_log >= FAILURE_LOG_EVERY_S:
            self._last_failure_log = now
            log.error("generate_function_failed", group=group_id, error=last_line, traceback=reason)
        else:
            log.warning("generate_function_failed", group=group_id, error=last_line)

    def _pin(self, delta: int) -> None:
        self.eval_pins += delta
        if self.eval_pins:
            self.unpinned.clear()
            return
        self._hold_token += 1  # a newer release supersedes the timers of earlier ones
        asyncio.get_running_loop().call_later(EVAL_HOLD_GRACE_S, self._release_hold, self._hold_token)

    def _release_hold(self, token: int) -> None:
        if token == self._hold_token and self.eval_pins == 0:
            self.unpinned.set()

    def _heartbeat(self) -> Heartbeat:
        self.stats["busy_s"] = self.busy.total()
        if self.colocate is not None:
            self.stats["asleep_s"] = self.colocate.asleep_s
        heartbeat = Heartbeat(weight_version=self.engine.weight_version, in_flight=self.busy.in_flight, stats=dict(self.stats))
        self.metrics.publish(heartbeat.weight_version, heartbeat.in_flight, heartbeat.stats)
        return heartbeat


async def run(cfg: VimeConfig, worker_id: str | None = None) -> int:
    from vime.rollout import vllm_available

    use_vllm = cfg.rollout_engine == "vllm" or (cfg.rollout_engine == "auto" and vllm_available())
    # --vllm-* flags are vLLM's engine arguments; the transformers fallback takes none of them.
    engine_args = dict(cfg.vllm) if use_vllm else {}
    if not use_vllm and cfg.rollout_dtype:
        engine_args["dtype"] = cfg.rollout_dtype
    # Weight fetchers run in the engine's processes (vLLM's workers): they read the keys from the env.
    security = Security.from_config(cfg)
    os.environ.update(security.env())
    engine = build_engine(
        kind="vllm" if use_vllm else "hf", model_path=str(cfg.hf_checkpoint), engine_args=engine_args,
        capture_routing=cfg.use_rollout_routing_replay, partial_rollout=cfg.partial_rollout, sleep_mode=cfg.colocate,
        engine_core=cfg.rollout_engine_core, lora_rank=cfg.lora_rank, lora_rollout=cfg.lora_rollout,
        lora_target_modules=cfg.target_modules,
    )  # fmt: skip
    agent = None
    if cfg.agent_rollout:
        from vime.agent.rollout import AgentRollout  # the user's code: only where asked for

        agent = AgentRollout.from_config(cfg)  # a bad spec fails here, before the engine starts
    await engine.start()
    try:
        client = BrokerClient(cfg.broker_address, "rollout", worker_id, security=security, job_name=cfg.job_name)
        return await client.run_session(RolloutWorker(cfg, engine, client, agent).run())
    finally:
        if agent is not None:
            await agent.aclose()
        await engine.shutdown()
