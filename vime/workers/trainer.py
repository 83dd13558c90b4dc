"""`vime-worker --role trainer`: one rank of the trainer; rank 0 also talks to the broker.

The loop, per step (slime-style, readable in one sitting):
  1. rank 0 asks the broker for `rollout_batch_size` scored groups trained by the current policy version;
  2. rank 0 broadcasts a "train" command and the batch to every rank (tensors only);
  3. every rank runs `TorchTrainer.train_step` (advantages, old logprobs, PPO-clip updates);
  4. rank 0 reports the step; every `update_weights_interval` steps all ranks export the weights and
     rank 0 publishes them as version v+1 on its weight channel and tells the broker;
  5. rank 0 writes one JSON line of metrics (also sent to W&B / TensorBoard with `--use-wandb` /
     `--use-tensorboard`, vime/tracking.py) and one line of the step's group ids
     (`trained_groups.jsonl`); every `save_interval` steps all ranks save a resumable checkpoint.
Ranks > 0 only follow the broadcasts. Rank 0 trains in a worker thread so its heartbeats keep flowing
while a long step runs.

Faults: StepDone, WeightsPublished and CheckpointSaved wait for the broker's Ack; if the broker restarted
meanwhile (it answers `unknown_peer`), rank 0 says Hello again and re-sends what is unanswered,
including its BatchRequest, which the broker answers with the same batch as before. `--load` resumes
from a checkpoint: the steps after it are trained again on the same groups (the broker kept them and
marks them `replayed`); publication resumes with the first step the job had not reached.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from vime.broker.client import BrokerClient, BrokerGone
from vime.colocate import ColocateServer
from vime.config import VimeConfig
from vime.logging import bind_progress, get_logger
from vime.protocol.messages import (
    Ack, BatchRequest, CheckpointSaved, EvalResult, Group, Heartbeat, HeartbeatAck, Message, Sample, Shutdown, StepDone,
    TrainBatch, WeightsPublished,
)
from vime.rollout.vllm_environment import rollout_weight_dtype
from vime.security import Security
from vime.slurm.network import advertised_endpoint
from vime.trainer.batch import RolloutBatch, SampleRecord, broadcast_batch
from vime.trainer.base import PolicyTrainer
from vime.trainer.checkpoint import ResumePoint, checkpoint_dir_for, find_checkpoint, load_checkpoint, save_checkpoint
from vime.trainer.torch_backend import TorchTrainer, TorchTrainerConfig
from vime.prometheus import WorkerMetrics
from vime.tracking import Trackers, check_installed, open_trackers
from vime.weights.publisher import WeightPublisher

log = get_logger("vime.worker.trainer")

COMMAND_STOP, COMMAND_TRAIN, COMMAND_SAVE, COMMAND_PUBLISH = 0, 1, 2, 3


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int


class TrainerLayoutError(RuntimeError):
    """The trainer ranks asked for do not fit the GPUs this node has."""


def init_distributed(megatron: bool = False) -> DistInfo:
    """Join the process group described by torchrun/SLURM-style env vars (no-op for one rank)."""
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))
    world_size = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", 1)))
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", 0)))
    if (world_size > 1 or megatron) and not dist.is_initialized():  # Megatron needs process groups even alone
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            if local_rank >= torch.cuda.device_count():
                raise TrainerLayoutError(
                    f"trainer rank {rank} has local rank {local_rank}, but this node has "
                    f"{torch.cuda.device_count()} GPU(s): one GPU per trainer rank, so lower --trainer-world-size "
                    "or spread the ranks over nodes"
                )
            torch.cuda.set_device(local_rank)
        if world_size == 1:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size)
    return DistInfo(rank, world_size, local_rank)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def trainer_config(cfg: VimeConfig) -> TorchTrainerConfig:
    """The backend config: TorchTrainerConfig, or MegatronTrainerConfig (the same fields plus the layout)."""
    if cfg.train_backend == "megatron":
        from vime.trainer.megatron.backend import MegatronTrainerConfig

        return MegatronTrainerConfig.from_vime_config(cfg, parallel=cfg.megatron_parallel())
    return TorchTrainerConfig.from_vime_config(cfg)


def build_trainer(cfg: VimeConfig) -> PolicyTrainer:
    """The `--train-backend` trainer. Megatron imports megatron-core here and needs CUDA; without them
    the error says so (the torch backend needs neither)."""
    if cfg.train_backend == "torch":
        return TorchTrainer(trainer_config(cfg))
    try:
        from vime.trainer.megatron.backend import MegatronTrainer
    except ImportError as exc:
        raise RuntimeError(f"--train-backend megatron needs megatron-core (pip install 'vime[megatron]', Python "
                           f">= 3.12): {exc}") from exc
    return MegatronTrainer(trainer_config(cfg))  # type: ignore[arg-type]


def groups_to_batch(groups: list[Group]) -> RolloutBatch:
    records = [
        SampleRecord(
            group_index=g_index,
            prompt_tokens=group.prompt_tokens,
            response_tokens=sample.response_tokens,
            rollout_logprobs=sample.rollout_logprobs,
            loss_mask=sample.loss_mask,
            reward=float(sample.reward if sample.reward is not None else 0.0),
            token_versions=sample.token_versions,
            routed_experts=sample.routed_experts,
        )
        for g_index, group in enumerate(groups)
        for sample in group.samples
        if sample.reward is not None
    ]
    return RolloutBatch.from_samples(records)


def rollout_metrics(groups: list[Group], stats: dict[str, float]) -> dict[str, float]:
    samples = [s for g in groups for s in g.samples]
    rewards = np.array([s.reward for s in samples], dtype=np.float64)
    lengths = np.array([len(s.response_tokens) for s in samples], dtype=np.float64)
    per_group_std = [np.std([s.reward for s in g.samples]) for g in groups]
    return {
        "rollout/raw_reward": float(rewards.mean()),
        "rollout/response_len": float(lengths.mean()),
        "rollout/truncated_ratio": float(np.mean([s.status == "truncated" for s in samples])),
        "rollout/zero_std_group_ratio": float(np.mean([std == 0 for std in per_group_std])),
        "rollout/staleness_mean": stats.get("staleness_mean", 0.0),
        "rollout/staleness_max": stats.get("staleness_max", 0.0),
        "rollout/num_samples": float(len(samples)),
        "perf/rollout_busy_s_total": stats.get("rollout_busy_s", 0.0),
        "perf/rollout_update_s_total": stats.get("rollout_update_s", 0.0),
        "perf/rollout_fetch_s_total": stats.get("rollout_fetch_s", 0.0),
        "perf/rollout_load_s_total": stats.get("rollout_load_s", 0.0),
        "perf/rollout_paused_s_total": stats.get("rollout_paused_s", 0.0),
        "perf/rollout_update_bytes_total": stats.get("rollout_update_bytes", 0.0),
        "perf/rollout_updates_total": stats.get("rollout_updates", 0.0),
        "perf/rollout_tokens_total": stats.get("rollout_tokens", 0.0),
        "perf/reward_busy_s_total": stats.get("reward_busy_s", 0.0),
        # What the broker measured itself (dynamic sampling counts, ...) arrives already named.
        **{k: float(v) for k, v in stats.items() if k.startswith("rollout/")},
        **multi_turn_metrics(samples),
    }


def multi_turn_metrics(samples: list[Sample]) -> dict[str, float]:
    """Means per trajectory of the counters multi-turn rollouts carry (`rollout/turns`,
    `rollout/tool_calls`, `rollout/tool_errors`, `rollout/env_s`, `rollout/masked_tokens`, ...), and
    the share of response tokens that were masked out; nothing for plain sampling."""
    keys = sorted({k for s in samples for k in s.rollout_stats})
    if not keys:
        return {}
    out = {f"rollout/{k}": float(np.mean([s.rollout_stats.get(k, 0.0) for s in samples])) for k in keys}
    tokens = sum(len(s.loss_mask) for s in samples)
    out["rollout/masked_token_ratio"] = float(sum(int((s.loss_mask == 0).sum()) for s in samples) / max(tokens, 1))
    return out


def _command(cmd: int, step: int) -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(torch.tensor([cmd, step], dtype=torch.int64), src=0)


def _receive_command() -> tuple[int, int]:
    header = torch.zeros(2, dtype=torch.int64)
    dist.broadcast(header, src=0)
    return int(header[0]), int(header[1])


@dataclass(frozen=True)
class PublishTimes:
    """One weight publish on rank 0: bytes, and its seconds in all and by part (the export from the
    model, the copy into the snapshot's buffers, the chunk checksums)."""

    nbytes: int = 0
    seconds: float = 0.0
    export_s: float = 0.0
    copy_s: float = 0.0
    checksum_s: float = 0.0

    def metrics(self) -> dict[str, float]:
        return {"perf/weight_export_time": self.export_s, "perf/weight_copy_time": self.copy_s,
                "perf/weight_checksum_time": self.checksum_s}  # fmt: skip


def publish_weights(trainer: PolicyTrainer, publisher: WeightPublisher | None, version: int, dtype: torch.dtype) -> PublishTimes:
    """All ranks export (sharded models gather); rank 0 publishes. Returns the publish's times on rank 0
    (zeros elsewhere)."""
    started = time.perf_counter()
    config = None
    if getattr(trainer, "lora", None) is not None:
        # LoRA: only the adapter travels; engines merge or load it over the base they started from.
        adapter = trainer.export_adapter(dtype=dtype)  # type: ignore[attr-defined]
        tensors = [] if adapter is None else list(adapter.tensors.items())
        config = None if adapter is None else adapter.config
    else:
        # A publisher that shares a GPU copy (CUDA IPC) takes the tensors where they are: no host round trip.
        tensors = list(trainer.export_weights(dtype=dtype, on_device=publisher is not None and publisher.cuda_ipc))
    if publisher is None:
        return PublishTimes()
    exported = time.perf_counter()
    stats = publisher.publish(version, tensors, adapter_config=config)
    return PublishTimes(nbytes=int(stats.nbytes), seconds=time.perf_counter() - started, export_s=exported - started,
                        copy_s=stats.copy_seconds, checksum_s=stats.checksum_seconds)  # fmt: skip


def resume_point(trainer: PolicyTrainer, cfg: VimeConfig) -> ResumePoint | None:
    """Every rank: load `--load`'s checkpoint into the trainer (None without --load)."""
    if cfg.load is None:
        return None
    return load_checkpoint(trainer, find_checkpoint(cfg.load, cfg.checkpoint_dir))


def follower_loop(trainer: PolicyTrainer, cfg: VimeConfig, dtype: torch.dtype) -> int:
    """Ranks > 0: do what rank 0's commands say until told to stop (collectives need every rank)."""
    while True:
        cmd, step = _receive_command()
        if cmd == COMMAND_STOP:
            return 0
        if cmd == COMMAND_SAVE:
            save_checkpoint(trainer, cfg.checkpoint_dir, step + 1, weight_version=-1)  # rank 0 writes the version
            continue
        if cmd == COMMAND_PUBLISH:
            publish_weights(trainer, None, 0, dtype)
            continue
        batch = broadcast_batch(None, src=0)
        trainer.train_step(batch)


def lead_publish(trainer: PolicyTrainer, publisher: WeightPublisher, version: int, dtype: torch.dtype) -> PublishTimes:
    """Rank 0's publish: every other rank is told to export too (sharded exports gather, a collective),
    whenever rank 0 publishes: the first version, each step's, none for a replayed step."""
    _command(COMMAND_PUBLISH, version)
    return publish_weights(trainer, publisher, version, dtype)


class LeaderLoop:
    """Rank 0: broker conversation, metrics, publication, checkpoints."""

    def __init__(
        self, cfg: VimeConfig, trainer: PolicyTrainer, client: BrokerClient, publisher: WeightPublisher,
        dtype: torch.dtype, resume: ResumePoint | None = None, trackers: Trackers | None = None,
    ) -> None:  # fmt: skip
        self.cfg = cfg
        self.trainer = trainer
        self.client = client
        self.publisher = publisher
        self.dtype = dtype
        self.resume = resume
        self.version = resume.weight_version if resume else 0
        self.metrics_path = cfg.run_dir / "metrics.jsonl"
        self.ledger_path = cfg.run_dir / "trained_groups.jsonl"
        self.trackers = trackers if trackers is not None else Trackers()
        self.prometheus = WorkerMetrics("trainer")
        self.totals = {"steps": 0.0, "step_s": 0.0, "batch_wait_s": 0.0}  # this process's, for /metrics
        self.heartbeat: asyncio.Task[None] | None = None
        self.shutdown_received = False
        self.published_endpoint: str | None = None
        self.colocate: ColocateServer | None = None  # --colocate: made in run(), inside the event loop

    async def run(self) -> int:
        with self.prometheus.serving(self.cfg, self.client):
            return await self._run()

    async def _run(self) -> int:
        job = await self.client.hello(weight_version=self.version)
        first_step = self.resume.steps_done if self.resume else 0
        # A job that has published before (a resumed or restarted trainer, with or without a restarted
        # broker, whose journal keeps the version but not the endpoint): ours are published under the
        # job's current version from this new endpoint. Workers that hold it keep generating, workers
        # that join fetch ours. Replayed steps publish nothing, and the next new step publishes the next
        # version as usual, so versions (and the staleness gate, which counts them) go on as if the
        # trainer had not stopped. A checkpoint's version behind the job's would leave every worker
        # waiting for a version that never comes.
        self.version = max(self.version, job.weight_version)
        self.heartbeat = asyncio.create_task(
            self.client.heartbeat_loop(self.cfg.heartbeat_interval_s, lambda: Heartbeat(weight_version=self.version))
        )
        if self.cfg.colocate:
            self.colocate = ColocateServer(
                self.cfg.colocate_endpoint(), security=Security.from_config(self.cfg), timeout_s=self.cfg.colocate_timeout_s,
                engine_timeout_s=self.cfg.worker_timeout_s, sleep_level=self.cfg.colocate_sleep_level,
            )  # fmt: skip
            self.colocate.start()
        try:
            await self._publish(step=first_step - 1)  # tells the broker where the weight channel is
            last_step_end = time.perf_counter()
            for step in range(first_step, self.cfg.num_rollout):
                bind_progress(weight_version=self.version, step=step)
                wait_started = time.perf_counter()
                batch_msg = await self._request_batch(step)
                wait_time = time.perf_counter() - wait_started
                metrics = rollout_metrics(batch_msg.groups, batch_msg.stats)
                if self.colocate is not None:
                    metrics.update(await self._take_gpu(step, first=step == first_step))
                train_started = time.perf_counter()
                _command(COMMAND_TRAIN, step)
                batch = broadcast_batch(groups_to_batch(batch_msg.groups), src=0)
                metrics.update(await asyncio.to_thread(self.trainer.train_step, batch))
                train_time = time.perf_counter() - train_started
                group_ids = [g.group_id for g in batch_msg.groups]
                await self._send_acked(StepDone(step=step, group_ids=group_ids), str(step))
                self._write_ledger(step, group_ids)
                sync_time = 0.0
                publish_times = PublishTimes()
                published = False
                if batch_msg.replayed:
                    # Catching up after --load to the step the job had reached: the job's versions up to
                    # there exist already; new ones start with the first new step.
                    log.info("step_replayed", step=step)
                elif (step + 1) % self.cfg.update_weights_interval == 0:
                    sync_started = time.perf_counter()
                    self.version += 1
                    publish_times = await self._publish(step)
                    sync_time = time.perf_counter() - sync_started
                    published = True
                if self.colocate is not None:
                    metrics.update(await self._give_gpu(step, published))
                now = time.perf_counter()
                step_time, last_step_end = now - last_step_end, now
                metrics.update({
                    "perf/step_time": step_time,
                    "perf/wait_time": wait_time,
                    "perf/train_time": train_time,
                    "perf/weight_sync_time": sync_time,
                    **publish_times.metrics(),
                    "perf/wait_time_ratio": wait_time / step_time if step_time > 0 else 0.0,
                    "perf/tokens_per_gpu_per_sec": float(batch.num_tokens) / train_time / max(1, dist.get_world_size() if dist.is_initialized() else 1),
                })
                self._write_metrics(step, metrics)
                self._publish_totals(train_time, wait_time)
                if self.cfg.save_interval and (step + 1) % self.cfg.save_interval == 0:
                    await self._save(step)
            await self._save(self.cfg.num_rollout - 1)
            if self.cfg.eval_interval is not None and self.cfg.eval_prompt_data:
                await self._receive_evals_until_shutdown()
            _command(COMMAND_STOP, self.cfg.num_rollout)
            return 0
        finally:
            self.heartbeat.cancel()
            if self.colocate is not None:
                await self.colocate.close()

    async def _take_gpu(self, step: int, first: bool) -> dict[str, float]:
        """Colocated: every engine asleep before the step trains (their memory is the trainer's now)."""
        assert self.colocate is not None
        if first:  # the batch came from them, so they are up; their join is at most a heartbeat away
            await self.colocate.wait_for_engines(self.cfg.num_rollout_workers, self.cfg.colocate_timeout_s)
        took = await self.colocate.take_gpu(step)
        return {"perf/colocate_sleep_s": took.seconds}

    async def _give_gpu(self, step: int, published: bool) -> dict[str, float]:
        """Colocated: hand the GPU back; the engines wake on the version just published (if any)."""
        assert self.colocate is not None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # cached activations would keep the engines' KV cache from fitting
        version = self.version if published else None
        gave = await self.colocate.give_gpu(step, version, self.published_endpoint if published else None)
        return {"perf/colocate_wake_s": gave.seconds, "perf/colocate_weight_fetch_s": gave.fetch_s,
                "perf/colocate_weight_load_s": gave.load_s, "perf/colocate_weight_bytes": float(gave.nbytes)}  # fmt: skip

    async def _next_message(self) -> Message | None:
        """The next message from the broker (None after a second of silence). Eval results are logged
        here; a broker restart makes rank 0 say Hello again (the caller then re-sends what it waits on)."""
        assert self.heartbeat is not None
        if self.heartbeat.done():
            self.heartbeat.result()  # raises BrokerGone
        msg = await self.client.recv(timeout_s=1.0)
        if isinstance(msg, EvalResult):
            self._write_eval(msg)
            return None
        if isinstance(msg, Shutdown):
            self.shutdown_received = True
        return msg

    async def _rejoin_if_needed(self) -> bool:
        if not self.client.rejoin_needed:
            return False
        await self.client.rejoin(weight_version=self.version)
        if self.published_endpoint is not None:
            # A restarted broker does not trust the weight endpoint in its journal; tell it ours.
            await self.client.send(WeightsPublished(version=self.version, endpoint=self.published_endpoint, step=-1, reannounce=True))
        return True

    async def _request_batch(self, step: int) -> TrainBatch:
        request = BatchRequest(step=step, n_groups=self.cfg.rollout_batch_size, policy_version=self.version)
        await self.client.send(request)
        while True:
            msg = await self._next_message()
            if await self._rejoin_if_needed():
                await self.client.send(request)
                continue
            if isinstance(msg, TrainBatch) and msg.step == step:
                return msg
            if isinstance(msg, Shutdown):
                raise BrokerGone(f"broker shut down before step {step}: {msg.reason}")
            if msg is not None and not isinstance(msg, (Ack, HeartbeatAck, TrainBatch)):
                log.warning("unexpected_message", message=type(msg).__name__)

    async def _send_acked(self, msg: Message, ack_id: str) -> None:
        """Send `msg` until the broker acknowledges it, re-sending after a broker restart. Once the broker
        has said Shutdown (the job is over) the Ack is not waited for: the broker may be gone already."""
        if self.shutdown_received:
            try:
                await self.client.send(msg, timeout_s=5.0)
            except BrokerGone:
                log.info("broker_already_gone", message=type(msg).__name__)
            return
        await self.client.send(msg)
        while not self.shutdown_received:
            reply = await self._next_message()
            if await self._rejoin_if_needed():
                await self.client.send(msg)
                continue
            if isinstance(reply, Ack) and ack_id in reply.ids:
                return

    async def _publish(self, step: int) -> PublishTimes:
        times = await asyncio.to_thread(lead_publish, self.trainer, self.publisher, self.version, self.dtype)
        # Workers on other machines connect here: a wildcard bind is advertised by host, not as 0.0.0.0.
        endpoint = advertised_endpoint(self.publisher.endpoint, self.cfg.weight_advertise_host)
        published = WeightsPublished(version=self.version, endpoint=endpoint, step=step, nbytes=times.nbytes, seconds=times.seconds)
        self.published_endpoint = endpoint
        await self._send_acked(published, str(self.version))
        log.info("weights_published", version=self.version, nbytes=times.nbytes, seconds=round(times.seconds, 4),
                 export_s=round(times.export_s, 4), copy_s=round(times.copy_s, 4), checksum_s=round(times.checksum_s, 4))  # fmt: skip
        return times

    def _write_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, "weight_version": self.version, "time": time.time(), **metrics}
        with self.metrics_path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
        self.trackers.log(step, record)
        log.info("step_done", **{k: round(v, 5) if isinstance(v, float) else v for k, v in record.items() if k != "time"})

    def _publish_totals(self, train_time: float, wait_time: float) -> None:
        """This process's running totals to its /metrics (a fresh dict each time: the scrape thread reads it)."""
        totals = self.totals
        self.totals = {"steps": totals["steps"] + 1, "step_s": totals["step_s"] + train_time,
                       "batch_wait_s": totals["batch_wait_s"] + wait_time}  # fmt: skip
        self.prometheus.publish(self.version, 0, self.totals)

    def _write_ledger(self, step: int, group_ids: list[str]) -> None:
        """Which groups each step trained, as the trainer saw them (checked against the broker's account
        by the chaos test). A resumed trainer appends the replayed steps again; the last line of a step wins."""
        record = {"step": step, "group_ids": group_ids, "weight_version": self.version}
        with self.ledger_path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")

    async def _receive_evals_until_shutdown(self) -> None:
        """After the last step: log eval runs still in flight; the broker says Shutdown after the last."""
        while not self.shutdown_received:
            await self._next_message()
            await self._rejoin_if_needed()

    def _write_eval(self, msg: EvalResult) -> None:
        """An eval run's metrics, as their own line at the step whose weights were evaluated."""
        record = {"step": msg.step, "weight_version": msg.weight_version, "time": time.time(), **msg.metrics}
        with self.metrics_path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
        self.trackers.log(msg.step, record)  # at the evaluated step, behind later steps' lines
        log.info("eval_logged", **{k: round(v, 5) if isinstance(v, float) else v for k, v in record.items() if k != "time"})

    async def _save(self, step: int) -> None:
        if checkpoint_dir_for(self.cfg.checkpoint_dir, step + 1).exists():
            return
        _command(COMMAND_SAVE, step)
        path = await asyncio.to_thread(save_checkpoint, self.trainer, self.cfg.checkpoint_dir, step + 1, self.version)
        log.info("checkpoint_saved", path=str(path))
        await self._send_acked(CheckpointSaved(steps_done=step + 1, path=str(path)), f"checkpoint-{step + 1}")


def run(cfg: VimeConfig, worker_id: str | None = None) -> int:
    info = init_distributed(megatron=cfg.train_backend == "megatron")
    if info.rank == 0:
        check_installed(cfg)  # TrackerNotInstalled now, not after loading the model
    torch.manual_seed(cfg.seed)
    dtype = getattr(torch, rollout_weight_dtype(cfg.vllm, on_cpu=not torch.cuda.is_available()))
    trainer = build_trainer(cfg)
    try:
        resume = resume_point(trainer, cfg)
        if info.rank != 0:
            return follower_loop(trainer, cfg, dtype)
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        # The trackers' runs continue when metrics.jsonl does: a resumed or restarted trainer of the job.
        continuing = resume is not None or (cfg.run_dir / "metrics.jsonl").exists()
        try:
            trackers = open_trackers(cfg, continuing=continuing, first_step=resume.steps_done if resume else 0)
        except BaseException:
            _command(COMMAND_STOP, -1)
            raise
        try:
            return _lead(cfg, trainer, dtype, resume, trackers, worker_id)
        finally:
            trackers.close()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _lead(
    cfg: VimeConfig, trainer: PolicyTrainer, dtype: torch.dtype, resume: ResumePoint | None, trackers: Trackers,
    worker_id: str | None,
) -> int:  # fmt: skip
    """Rank 0 after loading: the weight channel, the broker connection and the leader loop."""
    security = Security.from_config(cfg)
    publisher = WeightPublisher(cfg.weight_bind, security=security, cuda_ipc=cfg.weight_cuda_ipc_on())
    try:
        client = BrokerClient(cfg.broker_address, "trainer", worker_id, security=security, job_name=cfg.job_name)
    except BaseException:
        publisher.close()
        raise
    try:
        return asyncio.run(LeaderLoop(cfg, trainer, client, publisher, dtype, resume, trackers).run())
    except BrokerGone as exc:
        log.error("broker_gone", error=str(exc))
        _command(COMMAND_STOP, -1)
        return 1
    finally:
        publisher.close()
        client.close()


__all__ = ["run", "groups_to_batch", "rollout_metrics"]
