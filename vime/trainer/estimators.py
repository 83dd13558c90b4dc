"""Advantage estimators beyond GRPO: REINFORCE++ (with and without a group baseline), GAE for PPO, and
whitening. Pure tensor functions on the flat response-token layout of `RolloutBatch`
(`lengths[S]` response tokens per sample, tokens sample-major), so both backends share them.

Definitions (as in slime / OpenRLHF, which introduced REINFORCE++):
- token rewards: the sample's reward on its last response token, minus `kl_coef * (logp_old - logp_ref)`
  on every token when a KL reward penalty is used (REINFORCE++'s shaping);
- returns: G_t = r_t + gamma * G_{t+1} within each sample (gamma = 1: every token gets the reward plus
  the KL penalties that follow it);
- `reinforce_plus_plus`: advantages = returns, whitened over every loss-masked token of the batch;
- `reinforce_plus_plus_baseline`: the sample's reward minus its group's mean reward on every token
  (no KL shaping: the KL goes into the loss instead), whitened over the batch;
- GAE (PPO): delta_t = r_t + gamma V_{t+1} - V_t (V past the last token = 0),
  A_t = delta_t + gamma lambda A_{t+1}; returns R_t = A_t + V_t train the critic.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vime.trainer.losses import broadcast_to_tokens

ADVANTAGE_ESTIMATORS = ("grpo", "gspo", "ppo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")


def _padded(values: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
    """Flat [N] -> right-padded [S, R_max] and its bool validity mask."""
    lengths = lengths.to(torch.long)
    width = int(lengths.max().item()) if lengths.numel() else 0
    valid = torch.arange(width)[None, :] < lengths[:, None]
    out = values.new_zeros(lengths.numel(), width)
    out[valid] = values
    return out, valid


def token_rewards(rewards: Tensor, lengths: Tensor, kl: Tensor | None = None, kl_coef: float = 0.0) -> Tensor:
    """Flat per-token rewards: each sample's reward on its last token, minus `kl_coef * kl` everywhere.

    `rewards[S]`, `lengths[S]`, `kl[N]` (per-token logp_old - logp_ref) or None. Samples with no response
    token contribute nothing.
    """
    lengths = lengths.to(torch.long)
    out = torch.zeros(int(lengths.sum().item()), dtype=torch.float32)
    ends = torch.cumsum(lengths, 0) - 1
    has = lengths > 0
    out[ends[has]] = rewards.to(torch.float32)[has]
    if kl is not None and kl_coef != 0.0:
        out = out - kl_coef * kl.to(torch.float32)
    return out


def discounted_returns(token_reward: Tensor, lengths: Tensor, gamma: float = 1.0) -> Tensor:
    """G_t = r_t + gamma * G_{t+1} within each sample (flat in, flat out)."""
    r, valid = _padded(token_reward.to(torch.float32), lengths)
    g = torch.zeros_like(r)
    running = torch.zeros(r.shape[0])
    for t in range(r.shape[1] - 1, -1, -1):
        running = r[:, t] + gamma * running * valid[:, t]
        g[:, t] = running
    return g[valid]


def gae(token_reward: Tensor, values: Tensor, lengths: Tensor, gamma: float = 1.0, lambd: float = 1.0) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation per sample; returns (advantages, returns), flat [N]."""
    r, valid = _padded(token_reward.to(torch.float32), lengths)
    v, _ = _padded(values.to(torch.float32), lengths)
    adv = torch.zeros_like(r)
    next_value = torch.zeros(r.shape[0])
    running = torch.zeros(r.shape[0])
    for t in range(r.shape[1] - 1, -1, -1):
        live = valid[:, t].float()
        delta = r[:, t] + gamma * next_value - v[:, t]
        running = (delta + gamma * lambd * running) * live
        adv[:, t] = running
        next_value = v[:, t] * live
    return adv[valid], (adv + v)[valid]


def group_baseline(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """Each sample's reward minus the mean reward of its group (REINFORCE++-baseline), per sample."""
    rewards = rewards.to(torch.float64)
    _, group = torch.unique(group_ids, return_inverse=True)
    n = int(group.max().item()) + 1 if group.numel() else 0
    count = torch.zeros(n, dtype=torch.float64).index_add_(0, group, torch.ones_like(rewards))
    mean = torch.zeros(n, dtype=torch.float64).index_add_(0, group, rewards) / count
    return (rewards - mean[group]).to(torch.float32)


def whiten(values: Tensor, mask: Tensor, eps: float = 1e-8, shift_mean: bool = True) -> Tensor:
    """(x - mean) / std over the loss-masked tokens of the whole batch (unmasked tokens pass through the
    same affine map). A batch whose masked values are all equal gets zeros (no signal), not NaN."""
    m = mask.to(torch.float64)
    x = values.to(torch.float64)
    count = m.sum().clamp(min=1.0)
    mean = (x * m).sum() / count
    var = ((x - mean).square() * m).sum() / count
    out = (x - mean) if shift_mean else x
    return (out / (var.sqrt() + eps)).to(torch.float32) if var > 0 else torch.zeros_like(values, dtype=torch.float32)


def reinforce_plus_plus(
    rewards: Tensor, lengths: Tensor, mask: Tensor, gamma: float = 1.0, kl: Tensor | None = None, kl_coef: float = 0.0
) -> Tensor:
    """REINFORCE++ token advantages: discounted (KL-shaped) returns, whitened over the batch."""
    returns = discounted_returns(token_rewards(rewards, lengths, kl, kl_coef), lengths, gamma)
    return whiten(returns, mask)


def reinforce_plus_plus_baseline(rewards: Tensor, group_ids: Tensor, lengths: Tensor, mask: Tensor) -> Tensor:
    """REINFORCE++-baseline token advantages: group-centred reward on every token, whitened over the batch."""
    return whiten(broadcast_to_tokens(group_baseline(rewards, group_ids), lengths), mask)
