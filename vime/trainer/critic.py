"""PPO's value model (critic) for the torch backend: a transformers backbone with a scalar head.

The critic starts from the policy's checkpoint (or `critic_hf_checkpoint`) with a zero-initialised head,
so its first values are 0 and the first GAE advantages are the discounted rewards. It predicts, at every
position that predicts a response token (the same `logit_index` rows the policy uses), the value of
the state before that token. It has its own AdamW and learning rate (`critic_lr`) and is trained after
the policy on the same micro-batches with the clipped value loss (`losses.value_loss`), data parallel
like the policy (DDP over the default group). Its gradient is scaled exactly like the policy's (sum
over micro-batches and ranks divided by the step's denominator).
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import Tensor, nn

from vime.trainer import losses
from vime.trainer.batch import MicroBatch, RolloutBatch
from vime.trainer.optim import OptimizerImplementation, adamw
from vime.trainer.varlen_attention import attention_kwargs


class _ValueModule(nn.Module):
    def __init__(self, backbone: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(
        self, input_ids: Tensor, position_ids: Tensor, logit_index: Tensor, cu_seqlens: Tensor | None = None,
        max_seqlen: int = 0, attention_mask: Tensor | None = None,
    ) -> Tensor:
        out = self.backbone(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                            **attention_kwargs(cu_seqlens, max_seqlen, attention_mask))  # fmt: skip
        hidden = out.last_hidden_state.flatten(0, 1).index_select(0, logit_index)
        return self.head(hidden.float()).squeeze(-1)


class Critic:
    """Value model + optimizer on this rank. Construct on every rank (DDP when `world_size > 1`)."""

    def __init__(
        self, checkpoint: str, lr: float, weight_decay: float, device: torch.device, world_size: int,
        autocast: Callable[[], contextlib.AbstractContextManager], attn_implementation: str = "sdpa",
        optimizer_implementation: OptimizerImplementation = "auto",
    ) -> None:  # fmt: skip
        from transformers import AutoModel

        backbone = AutoModel.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation=attn_implementation)
        self.module = _ValueModule(backbone, backbone.config.hidden_size).to(device).train()
        self.model: nn.Module = self.module
        if world_size > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            ids = [device.index] if device.type == "cuda" else None
            self.model = DDP(self.module, device_ids=ids, broadcast_buffers=False)
        self.device = device
        self.autocast = autocast
        self.optimizer = adamw(self.module.parameters(), lr=lr, weight_decay=weight_decay,
                               implementation=optimizer_implementation)  # fmt: skip

    def _dummy(self) -> Tensor:
        ids = torch.zeros(1, 2, dtype=torch.int64, device=self.device)
        with self.autocast():
            return self.model(ids, torch.arange(2, device=self.device)[None], torch.zeros(1, dtype=torch.int64, device=self.device))

    @torch.no_grad()
    def values(self, micro_batches: list[MicroBatch | None], num_tokens: int) -> Tensor:
        """Values of every response token of a shard (flat, shard order); None entries are the dummy
        forwards that keep ranks in step."""
        out = torch.zeros(num_tokens, dtype=torch.float32)
        for mb in micro_batches:
            if mb is None:
                self._dummy()
                continue
            mb = mb.to(self.device)
            with self.autocast():
                values = self.module(mb.input_ids, mb.position_ids, mb.logit_index, mb.cu_seqlens, mb.max_seqlen,
                                     mb.attention_mask)  # fmt: skip
                out[mb.token_index.cpu()] = values.float().cpu()
        return out

    def step(
        self, shard: RolloutBatch, micro_batches: list[MicroBatch | None], returns: Tensor, old_values: Tensor,
        value_clip: float | None, scale: float, per_token: bool, clip_grad: float,
    ) -> Tensor:  # fmt: skip
        """One optimizer step on the value loss; returns metric numerators [value_loss, value_clipfrac]."""
        sums = torch.zeros(2, dtype=torch.float64)
        for j, mb in enumerate(micro_batches):
            last = j == len(micro_batches) - 1
            sync = self.model.no_sync() if self.model is not self.module and not last else contextlib.nullcontext()  # type: ignore[operator]
            with sync:
                if mb is None:
                    (self._dummy().sum() * 0.0).backward()
                    continue
                mb = mb.to(self.device)
                index = mb.token_index.cpu()
                with self.autocast():
                    v = self.model(mb.input_ids, mb.position_ids, mb.logit_index, mb.cu_seqlens, mb.max_seqlen,
                                   mb.attention_mask).float()  # fmt: skip
                loss_t, clipfrac = losses.value_loss(v, old_values[index].to(self.device), returns[index].to(self.device), value_clip)
                loss = losses.masked_sum(loss_t, mb.loss_mask, mb.token_sample, mb.num_samples, per_token)
                (loss * scale).backward()
                frac = losses.masked_sum(clipfrac, mb.loss_mask, mb.token_sample, mb.num_samples, per_token)
                sums += torch.stack([loss.detach(), frac.detach()]).double().cpu()
        params = [p for p in self.module.parameters() if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(params, clip_grad if clip_grad > 0 else float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return sums
