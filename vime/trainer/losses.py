"""RL losses and advantage estimators as pure tensor functions.

Shared by every trainer backend (torch here, Megatron later), so nothing in this module knows about
models, batches or process groups. Per-token functions are elementwise and accept any shape.
Reductions work on a flat token layout: `values[N]`, `mask[N]` and `sample_ids[N]` (which sample of the
micro-batch each token belongs to), the layout both a padded-and-gathered HF forward and a packed
Megatron forward produce.

Definitions follow slime (and verl where slime borrows from it), so runs are comparable:
- GRPO advantage: (r - mean_group(r)) / (std_group(r) + eps), std unbiased; Dr.GRPO drops the division.
- PPO-clip with asymmetric range [1 - eps_clip, 1 + eps_clip_high]; ppo_kl = old_logp - logp.
- KL to the reference: k1 = logp - ref, k2 = (logp - ref)^2 / 2, k3 = exp(ref - logp) - (ref - logp) - 1,
  low_var_kl = k3 clamped to [-10, 10].
- TIS: w = clamp(exp(old_logp - rollout_logp), tis_clip_low, tis_clip), detached, multiplies pg loss.
- Loss aggregation: mean over samples of each sample's masked token mean (slime default), or a flat
  mean over all unmasked tokens (slime `--calculate-per-token-loss`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

KL_LOSS_TYPES = ("k1", "k2", "k3", "low_var_kl")


# ----------------------------------------------------------------------------------------- advantages


def grpo_advantages(
    rewards: Tensor, group_ids: Tensor, normalize_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """Per-sample GRPO advantages: reward minus its group's mean, optionally divided by group std + eps.

    `rewards[S]` float, `group_ids[S]` int (any values; samples sharing a value form a group, groups may
    differ in size). `normalize_std=False` is Dr.GRPO. A group whose rewards are all equal (including a
    group of one sample) gets advantage exactly 0: its std is 0, so nothing divides a nonzero residual.
    Must be called on the whole rollout batch, before sharding, or group statistics are wrong.
    """
    if rewards.shape != group_ids.shape or rewards.dim() != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must be equal 1-D")
    rewards = rewards.to(torch.float64)  # group sums of many samples: avoid float32 cancellation
    _, group = torch.unique(group_ids, return_inverse=True)
    num_groups = int(group.max().item()) + 1 if group.numel() else 0
    count = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group, torch.ones_like(rewards))
    mean = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group, rewards) / count
    centered = rewards - mean[group]
    # exact zeros for constant groups: rounding in the mean would otherwise leave ~1e-17 residuals that
    # the std division (std ~1e-17) blows up to a meaningless nonzero advantage
    gmax = torch.full((num_groups,), -torch.inf, dtype=torch.float64).scatter_reduce(0, group, rewards, "amax")
    gmin = torch.full((num_groups,), torch.inf, dtype=torch.float64).scatter_reduce(0, group, rewards, "amin")
    centered = torch.where((gmax == gmin)[group], torch.zeros_like(centered), centered)
    if normalize_std:
        sq = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group, centered.square())
        std = (sq / (count - 1).clamp(min=1)).sqrt()  # unbiased like torch.std; size-1 groups -> 0
        centered = centered / (std[group] + eps)
    return centered.to(torch.float32)


def broadcast_to_tokens(per_sample: Tensor, lengths: Tensor) -> Tensor:
    """Repeat each sample's value over its `lengths[i]` response tokens (flat, sample-major)."""
    return torch.repeat_interleave(per_sample, lengths.to(torch.long))


# ----------------------------------------------------------------------------------- per-token terms


def logprobs_from_logits(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """log p(target) under softmax(logits / temperature), computed in float32. `logits[..., V]`."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of softmax(logits / temperature) per position, float32: logsumexp(l) - sum p*l."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def logprobs_and_entropy_from_logits(
    logits: Tensor, targets: Tensor, temperature: float = 1.0, entropy_grad: bool = True
) -> tuple[Tensor, Tensor]:
    """`logprobs_from_logits` and `entropy_from_logits` together; without `entropy_grad` the entropy is
    computed without a graph (a loss that does not train it must not keep its [N, V] softmax alive)."""
    logprobs = logprobs_from_logits(logits, targets, temperature)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = entropy_from_logits(logits, temperature)
    return logprobs, entropy


def token_logprobs_from_logits(
    logits: Tensor, targets: Tensor, temperature: float, with_entropy: bool, entropy_grad: bool
) -> tuple[Tensor, Tensor | None]:
    """The full-logits head of both trainer backends: logprobs, and the entropy when `with_entropy`
    (else None), as `logprobs_and_entropy_from_logits`."""
    if not with_entropy:
        return logprobs_from_logits(logits, targets, temperature), None
    return logprobs_and_entropy_from_logits(logits, targets, temperature, entropy_grad=entropy_grad)


class PolicyLossTerms(NamedTuple):
    """Per-token PPO terms; reduce them with `masked_mean` / `masked_sum`."""

    pg_loss: Tensor
    pg_clipfrac: Tensor  # 1.0 where the clipped branch was the active (larger) loss
    ppo_kl: Tensor  # old_logp - logp, the k1 estimate of KL(old || new)


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    eps_clip: float,
    eps_clip_high: float | None = None,
) -> PolicyLossTerms:
    """PPO-clip loss per token: max(-r*A, -clip(r, 1-eps_clip, 1+eps_clip_high)*A), r = exp(logp - old).

    `eps_clip_high=None` means symmetric clipping. Only `logprobs` should carry gradient.
    """
    if eps_clip_high is None:
        eps_clip_high = eps_clip
    ppo_kl = old_logprobs - logprobs
    ratio = torch.exp(-ppo_kl)
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high) * advantages
    pg_loss = torch.maximum(unclipped, clipped)
    clipfrac = (clipped > unclipped).float()
    return PolicyLossTerms(pg_loss=pg_loss, pg_clipfrac=clipfrac, ppo_kl=ppo_kl)


def gspo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    token_sample: Tensor,
    num_samples: int,
    eps_clip: float,
    eps_clip_high: float | None = None,
) -> PolicyLossTerms:
    """GSPO (sequence-level PPO-clip): the ratio is the sample's geometric-mean token ratio
    s_i = exp(mean_t (logp - old)) over its loss-masked tokens, clipped per sequence.

    Per token, r_t = sg(s_i) * exp(logp_t - sg(logp_t)): its value is s_i on every token of the sample
    and its gradient is s_i * d logp_t, GSPO-token's form, so the usual per-sample mean aggregation gives
    the sequence objective. `ppo_kl` is the per-token old - logp as for PPO. Clip ranges are much smaller
    than PPO's (the paper uses 3e-4 / 4e-4).
    """
    if eps_clip_high is None:
        eps_clip_high = eps_clip
    m = mask.to(logprobs.dtype)
    delta = (logprobs - old_logprobs) * m
    count = logprobs.new_zeros(num_samples).index_add(0, token_sample, m).clamp(min=1.0)
    seq_log_ratio = logprobs.new_zeros(num_samples).index_add(0, token_sample, delta) / count
    s = seq_log_ratio.exp()[token_sample]
    ratio = s.detach() * torch.exp(logprobs - logprobs.detach())
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high) * advantages
    return PolicyLossTerms(
        pg_loss=torch.maximum(unclipped, clipped), pg_clipfrac=(clipped > unclipped).float(),
        ppo_kl=(old_logprobs - logprobs),
    )  # fmt: skip


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, value_clip: float | None) -> tuple[Tensor, Tensor]:
    """PPO critic loss per token, 0.5 * max((V - R)^2, (clip(V, V_old +- value_clip) - R)^2), and the
    fraction where the clipped term was the larger (`value_clipfrac`). `value_clip=None`: unclipped."""
    unclipped = (values - returns).square()
    if value_clip is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped)
    clipped_values = old_values + (values - old_values).clamp(-value_clip, value_clip)
    clipped = (clipped_values - returns).square()
    return 0.5 * torch.maximum(unclipped, clipped), (clipped > unclipped).float()


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kl_loss_type: str) -> Tensor:
    """Per-token KL estimate between the policy and the reference (slime `compute_approx_kl`).

    Raises ValueError for an unknown `kl_loss_type`.
    """
    log_ratio = logprobs.float() - ref_logprobs.float()
    if kl_loss_type == "k1":
        return log_ratio
    if kl_loss_type == "k2":
        return log_ratio.square() / 2.0
    if kl_loss_type in ("k3", "low_var_kl"):
        neg = -log_ratio
        k3 = neg.exp() - 1.0 - neg
        # low_var_kl: clamp keeps one wildly off token from dominating the gradient (verl)
        return k3.clamp(-10.0, 10.0) if kl_loss_type == "low_var_kl" else k3
    raise ValueError(f"unknown kl_loss_type {kl_loss_type!r}; expected one of {KL_LOSS_TYPES}")


class TISWeights(NamedTuple):
    weights: Tensor  # clamped, detached; multiply the per-token pg loss by it
    ratio: Tensor  # unclamped exp(old_logp - rollout_logp), for the `tis` metric
    clipped: Tensor  # float 1.0 where the clamp changed the ratio, for `tis_clipfrac`


def tis_weights(
    old_logprobs: Tensor, rollout_logprobs: Tensor, tis_clip: float = 2.0, tis_clip_low: float = 0.0
) -> TISWeights:
    """Truncated importance sampling weights correcting for trainer/engine mismatch and staleness."""
    ratio = torch.exp(old_logprobs.detach().float() - rollout_logprobs.float())
    weights = ratio.clamp(min=tis_clip_low, max=tis_clip)
    return TISWeights(weights=weights, ratio=ratio, clipped=(weights != ratio).float())


# -------------------------------------------------------------------------------------- reductions


def per_sample_mean(values: Tensor, mask: Tensor, sample_ids: Tensor, num_samples: int) -> Tensor:
    """Masked token mean of each sample, `[num_samples]`; a sample with no unmasked token gets 0."""
    mask = mask.to(values.dtype)
    sums = values.new_zeros(num_samples).index_add(0, sample_ids, values * mask)
    counts = values.new_zeros(num_samples).index_add(0, sample_ids, mask)
    return sums / counts.clamp(min=1.0)


def masked_sum(
    values: Tensor, mask: Tensor, sample_ids: Tensor, num_samples: int, per_token: bool = False
) -> Tensor:
    """Numerator of the loss aggregation: sum of per-sample means, or sum of unmasked tokens.

    Backends divide this by the matching global denominator (`loss_denominator` summed over every
    micro-batch and rank of the optimizer step), which is what makes gradient accumulation and data
    parallelism give the same gradient as one big batch.
    """
    if per_token:
        return (values * mask.to(values.dtype)).sum()
    return per_sample_mean(values, mask, sample_ids, num_samples).sum()


def loss_denominator(mask: Tensor, num_samples: int, per_token: bool = False) -> float:
    """How many units `masked_sum` summed over: samples (default) or unmasked tokens."""
    return float(mask.sum().item()) if per_token else float(num_samples)


def masked_mean(
    values: Tensor, mask: Tensor, sample_ids: Tensor, num_samples: int, per_token: bool = False
) -> Tensor:
    """Mean over samples of per-sample token means (slime default) or mean over unmasked tokens.

    Returns 0 when there is nothing to average.
    """
    denom = loss_denominator(mask, num_samples, per_token)
    return masked_sum(values, mask, sample_ids, num_samples, per_token) / max(denom, 1.0)


def train_rollout_logprob_abs_diff(
    train_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, sample_ids: Tensor, num_samples: int
) -> Tensor:
    """Mean over samples of the masked per-token mean |logp_train - logp_rollout| (slime's probe).

    Samples with no unmasked response token are left out of the mean rather than counted as zero,
    so the probe does not look better when many samples are fully masked.
    """
    diff = (train_logprobs.float() - rollout_logprobs.float()).abs()
    means = per_sample_mean(diff, mask, sample_ids, num_samples)
    has_tokens = torch.zeros(num_samples, device=mask.device).index_add(0, sample_ids, mask.float()) > 0
    if not bool(has_tokens.any()):
        return diff.new_zeros(())
    return means[has_tokens].mean()
