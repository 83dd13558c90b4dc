"""Off-policy corrections: per-token weights on the policy-gradient loss for the gap between the policy
that sampled (the rollout engine: behaviour logprobs) and the trainer's old policy (proximal logprobs).

The gap has two causes: staleness (samples generated with older weights) and the train/inference
mismatch (different kernels, precision, MoE routes). Each correction is a detached weight per token;
several can be combined (they multiply). With log ratio l_t = logp_old - logp_rollout:
- TIS, token level: w_t = clamp(exp(l_t), tis_clip_low, tis_clip);
- TIS, sequence level: every token of sample i gets clamp(exp(sum_t l_t), tis_clip_low, tis_clip);
- MIS (IcePop-style masking), token level: keep token t iff mis_low <= exp(l_t) <= mis_high;
- MIS, sequence level: keep sample i iff mis_low <= exp(sum_t l_t) <= mis_high (the product of its
  token ratios, as in the R3 and seed documents; long responses make this strict);
- decoupled PPO (AReaL): PPO clips around the proximal (old) policy and the loss is weighted by the
  behaviour importance ratio w_t = exp(l_t); tokens with w_t > behav_imp_weight_cap are masked.
Sums over a sample use only loss-masked tokens. Every correction reports the fraction it clipped or
masked (metrics `tis_clipfrac`, `mis_maskfrac`, `decoupled_maskfrac`) and TIS its mean ratio `tis`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class CorrectionConfig:
    use_tis: bool = False
    tis_level: str = "token"  # token | sequence
    tis_clip: float = 2.0
    tis_clip_low: float = 0.0
    use_mis: bool = False
    mis_level: str = "token"  # token | sequence
    mis_low: float = 0.5
    mis_high: float = 2.0
    use_decoupled_ppo: bool = False
    behav_imp_weight_cap: float = 5.0

    def __post_init__(self) -> None:
        for name in ("tis_level", "mis_level"):
            if getattr(self, name) not in ("token", "sequence"):
                raise ValueError(f"{name} must be 'token' or 'sequence', got {getattr(self, name)!r}")
        if not 0 <= self.mis_low < self.mis_high:
            raise ValueError(f"need 0 <= mis_low < mis_high, got {self.mis_low}, {self.mis_high}")

    @property
    def metric_names(self) -> list[str]:
        names = ["tis", "tis_clipfrac"] if self.use_tis else []
        names += ["mis_maskfrac"] if self.use_mis else []
        names += ["decoupled_maskfrac"] if self.use_decoupled_ppo else []
        return names


def _sequence_log_ratio(log_ratio: Tensor, mask: Tensor, token_sample: Tensor, num_samples: int) -> Tensor:
    """Each token's sample-level sum of masked log ratios."""
    sums = log_ratio.new_zeros(num_samples).index_add(0, token_sample, log_ratio * mask.to(log_ratio.dtype))
    return sums[token_sample]


def off_policy_weights(
    old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, token_sample: Tensor, num_samples: int,
    cfg: CorrectionConfig,
) -> tuple[Tensor, dict[str, Tensor]]:  # fmt: skip
    """(detached per-token weight, per-token metric values named by `cfg.metric_names`)."""
    log_ratio = old_logprobs.detach().float() - rollout_logprobs.float()
    weights = torch.ones_like(log_ratio)
    metrics: dict[str, Tensor] = {}
    if cfg.use_tis:
        lr = _sequence_log_ratio(log_ratio, mask, token_sample, num_samples) if cfg.tis_level == "sequence" else log_ratio
        ratio = lr.exp()
        clamped = ratio.clamp(min=cfg.tis_clip_low, max=cfg.tis_clip)
        weights = weights * clamped
        metrics["tis"], metrics["tis_clipfrac"] = ratio, (clamped != ratio).float()
    if cfg.use_mis:
        lr = _sequence_log_ratio(log_ratio, mask, token_sample, num_samples) if cfg.mis_level == "sequence" else log_ratio
        ratio = lr.exp()
        keep = ((ratio >= cfg.mis_low) & (ratio <= cfg.mis_high)).float()
        weights = weights * keep
        metrics["mis_maskfrac"] = 1.0 - keep
    if cfg.use_decoupled_ppo:
        ratio = log_ratio.exp()
        keep = (ratio <= cfg.behav_imp_weight_cap).float()
        weights = weights * ratio * keep
        metrics["decoupled_maskfrac"] = 1.0 - keep
    return weights, metrics
