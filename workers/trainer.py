"""`vime-worker --role trainer`: one rank of the trainer; rank 0 also talks to the broker.

The loop, per step (slime-style, readable in one sitting):
  1. rank 0 asks the broker for `rollout_batch_size` scored groups trained by the current policy version;
  2. rank 0 broadcasts a "train" command and the batch to every rank (tensors only);
  3. every rank runs `TorchTrainer.train_step` (advantages, old logprobs, PPO-clip updates);
  4. rank 0 reports the step; every `update_weights_interval` steps all ranks export the weights and
     rank 0 publishes them as version v+1 on its weight channel and tells the broker;
  5. rank 0 writes one JSON line of metrics; checkpoints every `save_interval` steps.
Ranks > 0 only follow the broadcasts. Rank 0 trains in a worker thread so its heartbeats keep flowing
while a long step runs.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from vime.broker.client import BrokerClient, BrokerGone
from vime.config import VimeConfig
from vime.logging import bind_progress, get_logger
from vime.protocol.messages import (
    Ack, BatchRequest, EvalResult, Group, Heartbeat, HeartbeatAck, Shutdown, StepDone, TrainBatch, WeightsPublished,
)
from vime.security import Security
from vime.slurm.network import advertised_endpoint
from vime.trainer.batch import RolloutBatch, SampleRecord, broadcast_batch
from vime.trainer.base import PolicyTrainer
from vime.trainer.torch_backend import TorchTrainer, TorchTrainerConfig
from vime.weights.publisher import WeightPublisher

log = get_logger("vime.worker.trainer")

COMMAND_STOP, COMMAND_TRAIN, COMMAND_SAVE = 0, 1, 2


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int


def init_distributed(megatron: bool = False) -> DistInfo:
    """Join the process group described by torchrun/SLURM-style env vars (no-op for one rank)."""
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))
    world_size = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", 1)))
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", 0)))
    if (world_size > 1 or megatron) and not dist.is_initialized():  # Megatron needs process groups even alone
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
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
    kwargs: dict[str, Any] = {}
    config_type: type[TorchTrainerConfig] = TorchTrainerConfig
    if cfg.train_backend == "megatron":
        from vime.trainer.megatron.backend import MegatronTrainerConfig

        config_type, kwargs = MegatronTrainerConfig, {"parallel": cfg.megatron_parallel()}
    return config_type(
        **kwargs,
        hf_checkpoint=str(cfg.hf_checkpoint),
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        clip_grad=cfg.clip_grad,
        eps_clip=cfg.eps_clip,
        eps_clip_high=cfg.eps_clip_high,
        use_kl_loss=cfg.use_kl_loss,
        kl_loss_coef=cfg.kl_loss_coef,
        kl_loss_type=cfg.kl_loss_type,
        entropy_coef=cfg.entropy_coef,
        use_tis=cfg.use_tis,
        tis_level=cfg.tis_level,
        tis_clip=cfg.tis_clip,
        tis_clip_low=cfg.tis_clip_low,
        use_mis=cfg.use_mis,
        mis_level=cfg.mis_level,
        mis_low=cfg.mis_low,
        mis_high=cfg.mis_high,
        use_decoupled_ppo=cfg.use_decoupled_ppo,
        behav_imp_weight_cap=cfg.behav_imp_weight_cap,
        advantage_estimator=cfg.advantage_estimator,
        normalize_advantages=cfg.normalize_advantages,
        gamma=cfg.gamma,
        lambd=cfg.lambd,
        value_clip=cfg.value_clip,
        critic_lr=cfg.critic_lr,
        critic_hf_checkpoint=str(cfg.critic_hf_checkpoint) if cfg.critic_hf_checkpoint else None,
        disable_grpo_std_normalization=cfg.disable_grpo_std_normalization,
        micro_batch_size=cfg.micro_batch_size,
        global_batch_size=cfg.global_batch_size,
        seed=cfg.seed,
        use_fsdp=cfg.use_fsdp,
        rollout_temperature=cfg.rollout_temperature,
        use_rollout_routing_replay=cfg.use_rollout_routing_replay,
    )


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
        "perf/reward_busy_s_total": stats.get("reward_busy_s", 0.0),
        # What the broker measured itself (dynamic sampling counts, ...) arrives already named.
        **{k: float(v) for k, v in stats.items() if k.startswith("rollout/")},
    }


def _command(cmd: int, step: int) -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(torch.tensor([cmd, step], dtype=torch.int64), src=0)


def _receive_command() -> tuple[int, int]:
    header = torch.zeros(2, dtype=torch.int64)
    dist.broadcast(header, src=0)
    return int(header[0]), int(header[1])


def publish_weights(trainer: PolicyTrainer, publisher: WeightPublisher | None, version: int, dtype: torch.dtype) -> tuple[int, float]:
    """All ranks export (sharded models gather); rank 0 publishes. Returns (bytes, seconds) on rank 0."""
    started = time.perf_counter()
    tensors = list(trainer.export_weights(dtype=dtype))
    if publisher is None:
        return 0, 0.0
    stats = publisher.publish(version, tensors)
    return int(stats.nbytes), time.perf_counter() - started


def checkpoint_path(cfg: VimeConfig, step: int) -> Path:
    return cfg.checkpoint_dir / f"step_{step + 1}"


def follower_loop(trainer: PolicyTrainer, cfg: VimeConfig, dtype: torch.dtype) -> int:
    """Ranks > 0: do what rank 0's commands say until told to stop (collectives need every rank)."""
    while True:
        cmd, step = _receive_command()
        if cmd == COMMAND_STOP:
            return 0
        if cmd == COMMAND_SAVE:
            trainer.save_hf_checkpoint(checkpoint_path(cfg, step))
            continue
        batch = broadcast_batch(None, src=0)
        trainer.train_step(batch)
        if (step + 1) % cfg.update_weights_interval == 0:
            publish_weights(trainer, None, 0, dtype)


class LeaderLoop:
    """Rank 0: broker conversation, metrics, publication, checkpoints."""

    def __init__(self, cfg: VimeConfig, trainer: PolicyTrainer, client: BrokerClient, publisher: WeightPublisher, dtype: torch.dtype) -> None:
        self.cfg = cfg
        self.trainer = trainer
        self.client = client
        self.publisher = publisher
        self.dtype = dtype
        self.version = 0
        self.metrics_path = cfg.run_dir / "metrics.jsonl"

    async def run(self) -> int:
        await self.client.hello(weight_version=0)
        heartbeat = asyncio.create_task(self.client.heartbeat_loop(self.cfg.heartbeat_interval_s, lambda: Heartbeat(weight_version=self.version)))
        try:
            await self._publish(step=-1)  # version 0: tells the broker where the weight channel is
            last_step_end = time.perf_counter()
            for step in range(self.cfg.num_rollout):
                bind_progress(weight_version=self.version, step=step)
                wait_started = time.perf_counter()
                batch_msg = await self._request_batch(step, heartbeat)
                wait_time = time.perf_counter() - wait_started
                metrics = rollout_metrics(batch_msg.groups, batch_msg.stats)
                train_started = time.perf_counter()
                _command(COMMAND_TRAIN, step)
                batch = broadcast_batch(groups_to_batch(batch_msg.groups), src=0)
                metrics.update(await asyncio.to_thread(self.trainer.train_step, batch))
                train_time = time.perf_counter() - train_started
                await self.client.send(StepDone(step=step, group_ids=[g.group_id for g in batch_msg.groups]))
                sync_time = 0.0
                if (step + 1) % self.cfg.update_weights_interval == 0:
                    sync_started = time.perf_counter()
                    self.version += 1
                    await self._publish(step)
                    sync_time = time.perf_counter() - sync_started
                now = time.perf_counter()
                step_time, last_step_end = now - last_step_end, now
                metrics.update({
                    "perf/step_time": step_time,
                    "perf/wait_time": wait_time,
                    "perf/train_time": train_time,
                    "perf/weight_sync_time": sync_time,
                    "perf/wait_time_ratio": wait_time / step_time if step_time > 0 else 0.0,
                    "perf/tokens_per_gpu_per_sec": float(batch.num_tokens) / train_time / max(1, dist.get_world_size() if dist.is_initialized() else 1),
                })
                self._write_metrics(step, metrics)
                if self.cfg.save_interval and (step + 1) % self.cfg.save_interval == 0:
                    self._save(step)
            self._save(self.cfg.num_rollout - 1)
            if self.cfg.eval_interval is not None and self.cfg.eval_prompt_data:
                await self._receive_evals_until_shutdown(heartbeat)
            _command(COMMAND_STOP, self.cfg.num_rollout)
            return 0
        finally:
            heartbeat.cancel()

    async def _request_batch(self, step: int, heartbeat: asyncio.Task[None]) -> TrainBatch:
        await self.client.send(BatchRequest(step=step, n_groups=self.cfg.rollout_batch_size, policy_version=self.version))
        while True:
            if heartbeat.done():
                heartbeat.result()
            msg = await self.client.recv(timeout_s=1.0)
            if isinstance(msg, TrainBatch):
                return msg
            if isinstance(msg, EvalResult):
                self._write_eval(msg)
                continue
            if isinstance(msg, Shutdown):
                raise BrokerGone(f"broker shut down before step {step}: {msg.reason}")
            if msg is not None and not isinstance(msg, (Ack, HeartbeatAck)):
                log.warning("unexpected_message", message=type(msg).__name__)

    async def _publish(self, step: int) -> None:
        nbytes, seconds = await asyncio.to_thread(publish_weights, self.trainer, self.publisher, self.version, self.dtype)
        # Workers on other machines connect here: a wildcard bind is advertised by host, not as 0.0.0.0.
        endpoint = advertised_endpoint(self.publisher.endpoint, self.cfg.weight_advertise_host)
        await self.client.send(WeightsPublished(version=self.version, endpoint=endpoint, step=step, nbytes=nbytes, seconds=seconds))
        log.info("weights_published", version=self.version, nbytes=nbytes, seconds=round(seconds, 4))

    def _write_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, "weight_version": self.version, "time": time.time(), **metrics}
        with self.metrics_path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
        log.info("step_done", **{k: round(v, 5) if isinstance(v, float) else v for k, v in record.items() if k != "time"})

    async def _receive_evals_until_shutdown(self, heartbeat: asyncio.Task[None]) -> None:
        """After the last step: log eval runs still in flight; the broker says Shutdown after the last."""
        while True:
            if heartbeat.done():
                heartbeat.result()
            msg = await self.client.recv(timeout_s=1.0)
            if isinstance(msg, EvalResult):
                self._write_eval(msg)
            elif isinstance(msg, Shutdown):
                return

    def _write_eval(self, msg: EvalResult) -> None:
        """An eval run's metrics, as their own line at the step whose weights were evaluated."""
        record = {"step": msg.step, "weight_version": msg.weight_version, "time": time.time(), **msg.metrics}
        with self.metrics_path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
        log.info("eval_logged", **{k: round(v, 5) if isinstance(v, float) else v for k, v in record.items() if k != "time"})

    def _save(self, step: int) -> None:
        path = checkpoint_path(self.cfg, step)
        if path.exists():
            return
        _command(COMMAND_SAVE, step)
        self.trainer.save_hf_checkpoint(path)
        log.info("checkpoint_saved", path=str(path))


def run(cfg: VimeConfig, worker_id: str | None = None) -> int:
    info = init_distributed(megatron=cfg.train_backend == "megatron")
    torch.manual_seed(cfg.seed)
    dtype = getattr(torch, str(cfg.vllm.get("dtype", "bfloat16")))
    trainer = build_trainer(cfg)
    try:
        if info.rank != 0:
            return follower_loop(trainer, cfg, dtype)
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        security = Security.from_config(cfg)
        publisher = WeightPublisher(cfg.weight_bind, security=security)
        try:
            client = BrokerClient(cfg.broker_address, "trainer", worker_id, security=security)
        except BaseException:
            publisher.close()
            raise
        try:
            return asyncio.run(LeaderLoop(cfg, trainer, client, publisher, dtype).run())
        except BrokerGone as exc:
            log.error("broker_gone", error=str(exc))
            _command(COMMAND_STOP, -1)
            return 1
        finally:
            publisher.close()
            client.close()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


__all__ = ["run", "groups_to_batch", "rollout_metrics"]
