"""What every trainer backend shares: the rollout step's shape, sharding, old/ref logprobs and metrics.

`PolicyTrainer.train_step` is the slime-style rollout step (see `torch_backend` for the full story):
GRPO advantages over the whole batch, optimizer steps of `global_batch_size` samples split over the
data-parallel ranks, old-policy (and reference) logprobs before the first update, then one
`_optimizer_step` per chunk, and slime-named metrics reduced over ranks. A backend supplies the
model-specific parts:
- `_shard_logprobs(shard, module, replay, record)`: no-grad logprobs of a shard's response tokens;
- `_optimizer_step(shard, old, ref, fill_old, replay, counts)`: forward/backward/step over a shard;
- `_moe_shape()` / `_model_name()`: for checking routing traces;
- `rank` / `world_size`: the *data-parallel* coordinates (ranks of one tensor/pipeline group see the same
  data), `distributed`, and `_all_reduce` over the data-parallel group;
- `module` (the policy) and `ref_module` (frozen reference or None), passed back to `_shard_logprobs`.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from vime.logging import get_logger
from vime.trainer import estimators, losses
from vime.trainer.batch import RolloutBatch, _ranges

log = get_logger(__name__)


class PolicyTrainer:
    """Backend-independent rollout step; subclasses implement the hooks listed in the module docstring."""

    cfg: Any
    rank: int = 0
    world_size: int = 1
    distributed: bool = False
    optimizer_steps: int = 0
    module: Any = None
    ref_module: Any = None

    # ------------------------------------------------------------------------- backend hooks

    def _moe_shape(self) -> tuple[int, int, int] | None:
        """(MoE layers, top_k, experts) of the policy, or None for a dense model."""
        raise NotImplementedError

    def _model_name(self) -> str:
        return type(self).__name__

    def _shard_logprobs(
        self, shard: RolloutBatch, module: Any, replay: bool = False, record: bool = False
    ) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def _optimizer_step(
        self, shard: RolloutBatch, old_lp: Tensor, ref_lp: Tensor | None, fill_old: bool,
        replay: bool = False, counts: Tensor | None = None,
    ) -> dict[str, float]:  # fmt: skip
        raise NotImplementedError

    def export_weights(self, dtype: torch.dtype = torch.bfloat16, on_device: bool = False) -> Iterator[tuple[str, Tensor]]:
        """(HF checkpoint name, CPU tensor) on global rank 0; every rank iterates (collectives).
        `on_device`: leave the tensors on the trainer's device (a publisher shares them there)."""
        raise NotImplementedError

    def save_hf_checkpoint(self, path: str | os.PathLike, dtype: torch.dtype | None = None) -> None:
        raise NotImplementedError

    # True: every rank saves and loads its own training state (model-parallel shards); False: rank 0's
    # state holds everything (gathered) and every rank loads it.
    sharded_training_state = False

    def training_state(self) -> dict[str, Any] | None:
        """Weights, optimizer and schedule for `--load` (vime.trainer.checkpoint); None on ranks that
        do not write."""
        raise NotImplementedError

    def load_training_state(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def _advantages(self, batch: RolloutBatch) -> Tensor:
        """Per-token advantages of the whole batch for the critic-free estimators."""
        cfg = self.cfg
        lengths = batch.response_lengths
        if cfg.advantage_estimator == "reinforce_plus_plus":
            return estimators.reinforce_plus_plus(batch.rewards, lengths, batch.loss_mask, gamma=cfg.gamma)
        if cfg.advantage_estimator == "reinforce_plus_plus_baseline":
            return estimators.reinforce_plus_plus_baseline(batch.rewards, batch.group_ids, lengths, batch.loss_mask)
        # grpo, and gspo (GRPO's group advantages with sequence-level ratios in the loss)
        per_sample = losses.grpo_advantages(
            batch.rewards, batch.group_ids, normalize_std=not cfg.disable_grpo_std_normalization
        )
        return losses.broadcast_to_tokens(per_sample, lengths)

    def _ppo_advantages(self, batch: RolloutBatch) -> tuple[Tensor, Any]:
        """(per-token GAE advantages, whatever the critic update needs); backends with a critic override."""
        raise ValueError(f"advantage_estimator 'ppo' needs a critic, which the {type(self).__name__} backend lacks")

    def _critic_update(self, batch: RolloutBatch, shards: list[RolloutBatch], targets: Any) -> dict[str, float]:
        raise NotImplementedError

    def _dp_group(self) -> Any:
        """The process group metrics and logprobs are reduced over (None: the default group)."""
        return None

    # --------------------------------------------------------------------------- shared logic

    def _replay(self, batch: RolloutBatch) -> bool:
        return self.cfg.use_rollout_routing_replay and batch.routed_experts is not None

    def check_routes(self, batch: RolloutBatch) -> None:
        """Raise ValueError when `batch`'s routing traces do not fit this model's MoE routers (layer count,
        top-k, expert ids). A batch without traces always passes."""
        if batch.routed_experts is None:
            return
        shape = self._moe_shape()
        if shape is None:
            raise ValueError(f"batch carries routing traces but {self._model_name()} has no MoE routers")
        moe_layers, k, experts = shape
        layers, top_k = tuple(batch.routed_experts.shape[1:])
        if (layers, top_k) != (moe_layers, k):
            raise ValueError(f"routing traces are [tokens - 1, {layers}, {top_k}] but the model has {moe_layers} "
                             f"MoE layers with top_k {k}: expected [tokens - 1, {moe_layers}, {k}]")
        if batch.routed_experts.numel():
            hi = int(batch.routed_experts.max())
            if hi >= experts:
                raise ValueError(f"routing traces hold expert id {hi}, the model has {experts} experts")

    @torch.no_grad()
    def compute_logprobs(self, batch: RolloutBatch) -> list[np.ndarray]:
        """Current policy's logprob of every response token, one float32 array per sample, every rank.

        Collective: every rank must call it with the same batch. Work is split across ranks. With
        `use_rollout_routing_replay` and a batch with routing traces, the forward replays them.
        """
        self.check_routes(batch)
        idx = batch.shard_indices(self.world_size)[self.rank]
        shard = batch.select(idx)
        flat = torch.zeros(batch.rollout_logprobs.numel(), dtype=torch.float32)
        positions = _ranges(batch.resp_offsets[torch.tensor(idx, dtype=torch.int64)], shard.response_lengths)
        flat[positions] = self._shard_logprobs(shard, self.module, replay=self._replay(batch))[0]
        if self.distributed:
            flat = self._all_reduce(flat)
        return batch.split_responses(flat)

    def train_step(self, batch: RolloutBatch) -> dict[str, float]:
        """One rollout step (possibly several optimizer steps).

        Returns slime-named metrics, equal on all ranks, averaged over the optimizer steps. Collective:
        every rank calls it with the same (broadcast) batch. Raises ValueError on an empty batch. An
        optimizer step whose gradient norm is not finite is skipped (and logged). A batch with routing
        traces adds `train/routing_agreement` and `train/routing_agreement_unreplayed` (see module
        docstring; NaN if no response token) and raises
        ValueError when its traces do not fit the model (`check_routes`).
        """
        cfg = self.cfg
        if batch.num_samples == 0:
            raise ValueError("train_step got an empty batch")
        self.check_routes(batch)
        replay, record = self._replay(batch), batch.routed_experts is not None
        start = time.perf_counter()
        batch = batch.select(range(batch.num_samples))  # a copy: the caller's batch stays untouched
        critic_targets = None
        if cfg.advantage_estimator == "ppo":
            batch.advantages, critic_targets = self._ppo_advantages(batch)
        else:
            batch.advantages = self._advantages(batch)
        if cfg.normalize_advantages:
            batch.advantages = estimators.whiten(batch.advantages, batch.loss_mask)

        if cfg.num_steps_per_rollout is not None:
            step_size = math.ceil(batch.num_samples / cfg.num_steps_per_rollout)
        else:
            step_size = cfg.global_batch_size or batch.num_samples
        shards = [chunk.shard(self.rank, self.world_size) for chunk in batch.chunks(step_size)]

        # Old-policy logprobs must be taken before the first update. With one update they equal the
        # training forward's own (detached) logprobs, so that forward fills them in instead.
        recompute_old = len(shards) > 1
        old: list[Tensor | None] = [None] * len(shards)
        used_counts = torch.zeros(2, dtype=torch.float64)  # routes of the old-logprob forward
        free_counts = torch.zeros(2, dtype=torch.float64)  # routes of an unreplayed forward
        for k, s in enumerate(shards):
            if recompute_old:
                old[k], c = self._shard_logprobs(s, self.module, replay=replay, record=record)
                used_counts += c
            if record and replay:  # the unreplayed figure needs its own no-grad pass
                free_counts += self._shard_logprobs(s, self.module, record=True)[1]
        ref = [
            self._shard_logprobs(s, self.ref_module, replay=replay)[0] if self.ref_module is not None else None
            for s in shards
        ]

        step_metrics = []
        for k, shard in enumerate(shards):
            if old[k] is None:
                old[k] = torch.zeros(shard.rollout_logprobs.numel(), dtype=torch.float32)
            # with one update the training forward is the old-logprob forward: record its routes there
            counts = used_counts if record and not recompute_old else None
            step_metrics.append(
                self._optimizer_step(shard, old[k], ref[k], fill_old=not recompute_old, replay=replay, counts=counts)
            )

        metrics = {name: float(np.mean([m[name] for m in step_metrics])) for name in step_metrics[0]}
        if critic_targets is not None:
            metrics.update(self._critic_update(batch, shards, critic_targets))
        metrics["train/train_rollout_logprob_abs_diff"] = self._abs_diff(shards, old)
        if record:
            if not replay:  # unreplayed: the routes used are the trainer's own
                free_counts = used_counts
            both = torch.cat([used_counts, free_counts])
            if self.distributed:
                both = self._all_reduce(both)
            (m_used, r_used, m_free, r_free) = both.tolist()
            metrics["train/routing_agreement"] = m_used / r_used if r_used > 0 else float("nan")
            metrics["train/routing_agreement_unreplayed"] = m_free / r_free if r_free > 0 else float("nan")
        if self.rank == 0:
            log.info(
                "train_step", optimizer_step=self.optimizer_steps, samples=batch.num_samples,
                seconds=round(time.perf_counter() - start, 3),
                **{k.split("/")[-1]: round(v, 6) for k, v in metrics.items()},
            )  # fmt: skip
        return metrics

    def _abs_diff(self, shards: list[RolloutBatch], old: list[Tensor]) -> float:
        """Global mean over samples of each sample's masked mean |old_logp - rollout_logp|."""
        total = torch.zeros(2, dtype=torch.float64)
        for shard, lp in zip(shards, old):
            ids = shard.response_token_sample_ids()
            means = losses.per_sample_mean((lp - shard.rollout_logprobs).abs(), shard.loss_mask, ids, shard.num_samples)
            has_tokens = torch.zeros(shard.num_samples).index_add(0, ids, shard.loss_mask) > 0
            total += torch.tensor([means[has_tokens].sum().item(), float(has_tokens.sum())], dtype=torch.float64)
        if self.distributed:
            total = self._all_reduce(total)
        return float(total[0] / total[1]) if total[1] > 0 else 0.0

    # ---------------------------------------------------------------------------------- comms

    def _comm_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def _all_reduce(self, t: Tensor) -> Tensor:
        t = t.to(self._comm_device())
        dist.all_reduce(t, group=self._dp_group())
        return t.cpu()
