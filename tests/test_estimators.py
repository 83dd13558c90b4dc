"""Advantage estimators, off-policy corrections, GSPO and the value loss against hand-computed cases,
and each estimator through a real TorchTrainer step (PPO with its critic)."""

from __future__ import annotations

import math

import pytest
import torch

from vime.trainer import estimators, losses
from vime.trainer.corrections import CorrectionConfig, off_policy_weights
from vime.trainer.torch_backend import TorchTrainer

from test_torch_backend import checkpoints, config, make_batch  # noqa: F401  (fixture)

torch.set_num_threads(1)
LN2 = math.log(2.0)


def test_discounted_returns_by_hand():
    # sample 0: 2 tokens, reward 1; sample 1: 3 tokens, reward 2; gamma 0.5
    r = estimators.token_rewards(torch.tensor([1.0, 2.0]), torch.tensor([2, 3]))
    assert r.tolist() == [0, 1, 0, 0, 2]
    g = estimators.discounted_returns(r, torch.tensor([2, 3]), gamma=0.5)
    assert g.tolist() == pytest.approx([0.5, 1.0, 0.5, 1.0, 2.0])


def test_gae_by_hand():
    # one sample, 2 tokens, reward 1 at the end, values [0.5, 0.25], gamma 0.9, lambda 0.5
    r = torch.tensor([0.0, 1.0])
    v = torch.tensor([0.5, 0.25])
    adv, ret = estimators.gae(r, v, torch.tensor([2]), gamma=0.9, lambd=0.5)
    d1 = 1.0 - 0.25  # last token: r + gamma * 0 - V
    d0 = 0.0 + 0.9 * 0.25 - 0.5
    assert adv.tolist() == pytest.approx([d0 + 0.9 * 0.5 * d1, d1])
    assert ret.tolist() == pytest.approx([d0 + 0.45 * d1 + 0.5, d1 + 0.25])
    # gamma = lambda = 1: advantages are return - value
    adv1, _ = estimators.gae(r, v, torch.tensor([2]), 1.0, 1.0)
    assert adv1.tolist() == pytest.approx([1.0 - 0.5, 1.0 - 0.25])


def test_whiten_and_reinforce_plus_plus_baseline():
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    w = estimators.whiten(torch.tensor([1.0, 2.0, 3.0, 100.0]), mask)
    assert w[:3].mean().item() == pytest.approx(0.0, abs=1e-6)
    assert (w[:3].square().mean().sqrt()).item() == pytest.approx(1.0, rel=1e-5)  # population std
    assert estimators.whiten(torch.full((3,), 7.0), torch.ones(3)).eq(0).all()
    # groups {0: rewards 1, 0}, {1: rewards 1, 1}; one token each -> baseline [0.5, -0.5, 0, 0]
    adv = estimators.reinforce_plus_plus_baseline(
        torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1]), torch.ones(4, dtype=torch.long), torch.ones(4)
    )
    base = torch.tensor([0.5, -0.5, 0.0, 0.0])
    assert adv.tolist() == pytest.approx((base / base.std(unbiased=False)).tolist(), rel=1e-5)
    pp = estimators.reinforce_plus_plus(torch.tensor([1.0, 0.0]), torch.tensor([2, 1]), torch.ones(3))
    # returns [1, 1, 0] whitened
    x = torch.tensor([1.0, 1.0, 0.0])
    assert pp.tolist() == pytest.approx(((x - x.mean()) / x.std(unbiased=False)).tolist(), rel=1e-5)


def test_corrections_by_hand():
    # sample 0: tokens with old/rollout ratios 2, 2 (product 4); sample 1: ratios 0.4, 1, 6
    ratios = torch.tensor([2.0, 2.0, 0.4, 1.0, 6.0])
    old, rollout = ratios.log(), torch.zeros(5)
    mask, ts = torch.ones(5), torch.tensor([0, 0, 1, 1, 1])
    w, m = off_policy_weights(old, rollout, mask, ts, 2, CorrectionConfig(use_tis=True, tis_clip=2.0))
    assert w.tolist() == pytest.approx([2, 2, 0.4, 1, 2]) and m["tis_clipfrac"].tolist() == [0, 0, 0, 0, 1]
    w, _ = off_policy_weights(old, rollout, mask, ts, 2, CorrectionConfig(use_tis=True, tis_level="sequence", tis_clip=3.0))
    assert w.tolist() == pytest.approx([3, 3, 2.4, 2.4, 2.4])  # sample ratios 4 -> 3 (clipped), 2.4
    w, m = off_policy_weights(old, rollout, mask, ts, 2, CorrectionConfig(use_mis=True, mis_low=0.5, mis_high=2.0))
    assert w.tolist() == [1, 1, 0, 1, 0] and m["mis_maskfrac"].tolist() == [0, 0, 1, 0, 1]
    w, _ = off_policy_weights(old, rollout, mask, ts, 2,
                              CorrectionConfig(use_mis=True, mis_level="sequence", mis_low=0.5, mis_high=3.0))  # fmt: skip
    assert w.tolist() == [0, 0, 1, 1, 1]  # sample 0's product 4 is outside, sample 1's 2.4 inside
    w, m = off_policy_weights(old, rollout, mask, ts, 2, CorrectionConfig(use_decoupled_ppo=True, behav_imp_weight_cap=5.0))
    assert w.tolist() == pytest.approx([2, 2, 0.4, 1, 0]) and m["decoupled_maskfrac"].tolist() == [0, 0, 0, 0, 1]
    masked = off_policy_weights(old, rollout, torch.tensor([1.0, 0, 1, 1, 1]), ts, 2,
                                CorrectionConfig(use_tis=True, tis_level="sequence", tis_clip=10.0))[0]  # fmt: skip
    assert masked[0].item() == pytest.approx(2.0)  # the unmasked token alone makes the sequence ratio
    with pytest.raises(ValueError, match="mis_level"):
        CorrectionConfig(mis_level="word")


def test_gspo_ratio_is_per_sequence_and_gradient_is_scaled():
    lp = torch.tensor([-1.0, -2.0, -1.0], requires_grad=True)
    old = torch.tensor([-1.0 - LN2, -2.0, -1.0])
    mask, ts, adv = torch.ones(3), torch.tensor([0, 0, 1]), torch.ones(3)
    terms = losses.gspo_policy_loss(lp, old, adv, mask, ts, 2, eps_clip=10.0)
    s0 = math.exp(LN2 / 2)  # geometric mean of ratios 2 and 1
    assert (-terms.pg_loss).tolist() == pytest.approx([s0, s0, 1.0])
    terms.pg_loss.sum().backward()
    assert lp.grad.tolist() == pytest.approx([-s0, -s0, -1.0])
    clipped = losses.gspo_policy_loss(lp.detach(), old, adv, mask, ts, 2, eps_clip=0.1)
    assert clipped.pg_clipfrac.tolist() == [1.0, 1.0, 0.0]


def test_value_loss_by_hand():
    v, old, ret = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0]), torch.tensor([0.0, 1.0])
    loss, frac = losses.value_loss(v, old, ret, value_clip=0.5)
    # token 0: unclipped (1-0)^2 = 1, clipped V=0.5 -> 0.25 -> max 1; token 1: both 1
    assert loss.tolist() == pytest.approx([0.5, 0.5]) and frac.tolist() == [0.0, 0.0]
    loss, frac = losses.value_loss(torch.tensor([2.0]), torch.tensor([0.0]), torch.tensor([3.0]), value_clip=0.5)
    assert loss.item() == pytest.approx(0.5 * 2.5**2) and frac.item() == 1.0


@pytest.mark.parametrize("estimator", ["gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_critic_free_estimators_train(checkpoints, estimator):  # noqa: F811
    extra = dict(eps_clip=3e-4, eps_clip_high=4e-4) if estimator == "gspo" else {}
    trainer = TorchTrainer(config(checkpoints["dense"], advantage_estimator=estimator, use_mis=True, **extra))
    before = [p.detach().clone() for p in trainer.module.parameters()]
    m = trainer.train_step(make_batch())
    assert all(math.isfinite(v) for v in m.values()) and "train/mis_maskfrac" in m
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.module.parameters()))


def test_ppo_trains_its_critic(checkpoints):  # noqa: F811
    # lambda = gamma = 1: the returns are the rewards-to-go whatever the values, a fixed regression target
    trainer = TorchTrainer(config(checkpoints["dense"], advantage_estimator="ppo", critic_lr=3e-3, lr=1e-4,
                                  micro_batch_size=2, normalize_advantages=True, value_clip=None))  # fmt: skip
    batch = make_batch()
    losses_seen = [trainer.train_step(batch)["critic/value_loss"] for _ in range(6)]
    assert all(math.isfinite(x) for x in losses_seen)
    assert losses_seen[-1] < losses_seen[0]  # the critic fits the (fixed) batch's returns
    values = trainer.critic.values(trainer._synced_micro_batches(batch), batch.rollout_logprobs.numel())
    assert torch.isfinite(values).all() and values.abs().sum() > 0  # the head left zero


def test_megatron_and_unknown_estimators_are_refused(checkpoints):  # noqa: F811
    with pytest.raises(ValueError, match="expected one of"):
        config(checkpoints["dense"], advantage_estimator="dapo")
