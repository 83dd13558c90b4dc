"""The policy objective of one micro-batch, shared by every trainer backend.

Both the torch backend (`torch_backend.py`) and the Megatron backend (`megatron/backend.py`) turn a
micro-batch's token logprobs and entropies into the same loss with this one function, so PPO-clip, TIS,
entropy and the KL penalty are defined once. Backends differ only in how they get those (the torch
backend from hidden states through the chunked head, `fused_head.py`; Megatron from its output layer's
logits) and in how they scale the returned numerator into a gradient:
the loss is a *numerator* (`losses.masked_sum`), to be divided by the global `losses.loss_denominator`
of the optimizer step, which makes accumulation over micro-batches and ranks equal one big batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from vime.trainer import losses
from vime.trainer.batch import MicroBatch
from vime.trainer.corrections import CorrectionConfig, off_policy_weights


@dataclass(frozen=True)
class ObjectiveConfig:
    """The loss settings (slime flag names); both backends' configs carry these fields."""

    advantage_estimator: str = "grpo"  # gspo switches the policy loss to sequence-level ratios
    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    use_tis: bool = False
    tis_level: str = "token"
    tis_clip: float = 2.0
    tis_clip_low: float = 0.0
    use_mis: bool = False
    mis_level: str = "token"
    mis_low: float = 0.5
    mis_high: float = 2.0
    use_decoupled_ppo: bool = False
    behav_imp_weight_cap: float = 5.0
    entropy_coef: float = 0.0
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "k1"
    calculate_per_token_loss: bool = False
    rollout_temperature: float = 1.0

    @classmethod
    def from_trainer_config(cls, cfg: object) -> "ObjectiveConfig":
        """Pick the objective's fields out of a backend config (any object with these attributes)."""
        return cls(**{name: getattr(cfg, name) for name in cls.__dataclass_fields__})

    @property
    def corrections(self) -> CorrectionConfig:
        return CorrectionConfig(**{name: getattr(self, name) for name in CorrectionConfig.__dataclass_fields__})

    @property
    def metric_names(self) -> list[str]:
        """Names (without the `train/` prefix) of the sums `micro_batch_objective` returns, in order."""
        names = ["loss", "pg_loss", "pg_clipfrac", "ppo_kl", "entropy_loss", "kl_loss"]
        return names + self.corrections.metric_names + (["ois"] if self.use_tis else [])


def micro_batch_objective(
    logprobs: Tensor,
    entropy: Tensor,
    mb: MicroBatch,
    old_logprobs: Tensor | None,
    ref_logprobs: Tensor | None,
    cfg: ObjectiveConfig,
) -> tuple[Tensor, Tensor, Tensor]:
    """Loss numerator, detached metric numerators and the policy's logprobs for one micro-batch.

    `logprobs` and `entropy` are [N] float32, one per token of `mb` (under softmax(logits / rollout
    temperature)); the entropy is trained only with `entropy_coef != 0`. `old_logprobs` /
    `ref_logprobs` are [N] aligned with the micro-batch's tokens, on the same device; `old_logprobs=None`
    means the policy has not moved since the rollout batch arrived (a single optimizer step), so the
    detached logprobs of this very forward are the old ones. Returns (loss, metric sums in
    `cfg.metric_names` order as float64 on CPU, logprobs). Each metric is summed like the loss
    (`losses.masked_sum`), so dividing by the step's denominator gives its mean.
    """

    def reduce(x: Tensor) -> Tensor:
        return losses.masked_sum(x, mb.loss_mask, mb.token_sample, mb.num_samples, cfg.calculate_per_token_loss)

    lp = logprobs
    if old_logprobs is None:
        old_logprobs = lp.detach()
    if cfg.advantage_estimator == "gspo":
        terms = losses.gspo_policy_loss(lp, old_logprobs, mb.advantages, mb.loss_mask, mb.token_sample,
                                        mb.num_samples, cfg.eps_clip, cfg.eps_clip_high)  # fmt: skip
    else:
        terms = losses.policy_loss(lp, old_logprobs, mb.advantages, cfg.eps_clip, cfg.eps_clip_high)
    weights, correction_metrics = off_policy_weights(
        old_logprobs, mb.rollout_logprobs, mb.loss_mask, mb.token_sample, mb.num_samples, cfg.corrections
    )
    pg = terms.pg_loss * weights
    extra: dict[str, Tensor] = {name: reduce(v) for name, v in correction_metrics.items()}
    if cfg.use_tis:
        extra["ois"] = reduce(torch.exp(-terms.ppo_kl.detach()))  # current / old policy ratio
    pg_loss = reduce(pg)
    entropy = reduce(entropy if cfg.entropy_coef != 0.0 else entropy.detach())
    loss = pg_loss - cfg.entropy_coef * entropy
    kl_loss = torch.zeros((), device=lp.device)
    if ref_logprobs is not None:
        kl_loss = reduce(losses.kl_penalty(lp, ref_logprobs, cfg.kl_loss_type))
        loss = loss + cfg.kl_loss_coef * kl_loss
    values = {
        "loss": loss, "pg_loss": pg_loss, "pg_clipfrac": reduce(terms.pg_clipfrac),
        "ppo_kl": reduce(terms.ppo_kl.detach()), "entropy_loss": entropy, "kl_loss": kl_loss, **extra,
    }  # fmt: skip
    sums = torch.stack([values[n].detach().double().cpu() for n in cfg.metric_names])
    return loss, sums, lp
