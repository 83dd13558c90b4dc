"""Losses and advantage estimators against small hand-computed cases."""

import math

import pytest
import torch

from vime.trainer import losses

LN2 = math.log(2.0)


def test_grpo_advantages_groups_in_any_order_and_size():
    # group 7: rewards 1, 0 -> mean .5, unbiased std sqrt(.5) ; group 3: constant ; group 9: single sample
    rewards = torch.tensor([1.0, 2.0, 0.0, 2.0, 5.0, 2.0])
    groups = torch.tensor([7, 3, 7, 3, 9, 3])
    adv = losses.grpo_advantages(rewards, groups)
    expected = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert adv.tolist() == pytest.approx([expected, 0.0, -expected, 0.0, 0.0, 0.0], abs=1e-6)
    assert adv[[1, 3, 4, 5]].eq(0).all()  # exactly zero, not 1e-11


def test_grpo_constant_group_is_exactly_zero_despite_rounding():
    adv = losses.grpo_advantages(torch.tensor([0.1, 0.1, 0.1]), torch.tensor([0, 0, 0]))
    assert adv.eq(0).all()


def test_dr_grpo_skips_std_normalisation():
    adv = losses.grpo_advantages(torch.tensor([3.0, 1.0, 2.0]), torch.tensor([0, 0, 0]), normalize_std=False)
    assert adv.tolist() == pytest.approx([1.0, -1.0, 0.0])


def test_broadcast_to_tokens():
    out = losses.broadcast_to_tokens(torch.tensor([1.0, -2.0, 3.0]), torch.tensor([2, 0, 3]))
    assert out.tolist() == [1.0, 1.0, 3.0, 3.0, 3.0]


def test_logprobs_and_entropy_from_logits():
    logits = torch.tensor([[2.0, 0.0]])
    # temperature 2 -> logits [1, 0]: log p(0) = 1 - log(e + 1)
    lp = losses.logprobs_from_logits(logits, torch.tensor([0]), temperature=2.0)
    assert lp.item() == pytest.approx(1 - math.log(math.e + 1), abs=1e-6)
    probs = torch.tensor([[0.5, 0.25, 0.25], [0.25, 0.25, 0.25]])  # second row is uniform over 3 after renorm
    ent = losses.entropy_from_logits(probs.log())
    assert ent.tolist() == pytest.approx([0.5 * LN2 + 0.5 * 2 * LN2, math.log(3)], abs=1e-6)


@pytest.mark.parametrize(
    "ratio, adv, loss, clipped",
    [
        (1.1, 1.0, -1.1, 0.0),  # inside the range
        (1.5, 1.0, -1.2, 1.0),  # above 1+eps with positive advantage: clipped
        (1.5, -1.0, 1.5, 0.0),  # above with negative advantage: pessimistic unclipped
        (0.5, 1.0, -0.5, 0.0),  # below with positive advantage: unclipped
        (0.5, -1.0, 0.8, 1.0),  # below with negative advantage: clipped at 1-eps
    ],
)
def test_policy_loss_symmetric(ratio, adv, loss, clipped):
    lp = torch.tensor([math.log(ratio)])
    terms = losses.policy_loss(lp, torch.zeros(1), torch.tensor([adv]), eps_clip=0.2)
    assert terms.pg_loss.item() == pytest.approx(loss, abs=1e-6)
    assert terms.pg_clipfrac.item() == clipped
    assert terms.ppo_kl.item() == pytest.approx(-math.log(ratio), abs=1e-6)


def test_policy_loss_asymmetric_clip_and_gradients():
    lp = torch.tensor([math.log(1.5), math.log(1.25), math.log(0.7)], requires_grad=True)
    terms = losses.policy_loss(lp, torch.zeros(3), torch.tensor([1.0, 1.0, -1.0]), eps_clip=0.2, eps_clip_high=0.28)
    assert terms.pg_loss.tolist() == pytest.approx([-1.28, -1.25, 0.8], abs=1e-6)
    assert terms.pg_clipfrac.tolist() == [1.0, 0.0, 1.0]
    terms.pg_loss.sum().backward()
    # clipped tokens get no gradient; d(-r*A)/dlogp = -r*A
    assert lp.grad.tolist() == pytest.approx([0.0, -1.25, 0.0], abs=1e-6)


def test_kl_penalty_types():
    lp, ref = torch.tensor([0.0]), torch.tensor([-LN2])  # log_ratio = ln 2
    assert losses.kl_penalty(lp, ref, "k1").item() == pytest.approx(LN2)
    assert losses.kl_penalty(lp, ref, "k2").item() == pytest.approx(LN2**2 / 2)
    assert losses.kl_penalty(lp, ref, "k3").item() == pytest.approx(0.5 - 1 + LN2, abs=1e-6)
    assert losses.kl_penalty(lp, ref, "low_var_kl").item() == pytest.approx(0.5 - 1 + LN2, abs=1e-6)
    far = torch.tensor([20.0])  # k3 = e^20 - 21 -> clamped to 10 only for low_var_kl
    assert losses.kl_penalty(torch.zeros(1), far, "k3").item() == pytest.approx(math.exp(20) - 21, rel=1e-5)
    assert losses.kl_penalty(torch.zeros(1), far, "low_var_kl").item() == 10.0
    assert losses.kl_penalty(lp, lp, "k3").item() == 0.0
    with pytest.raises(ValueError):
        losses.kl_penalty(lp, ref, "k4")


def test_tis_weights_clip_and_detach():
    old = torch.zeros(3, requires_grad=True)
    rollout = torch.tensor([math.log(0.25), math.log(2.0), 0.0])  # ratios 4, 0.5, 1
    tis = losses.tis_weights(old, rollout, tis_clip=2.0)
    assert tis.weights.tolist() == pytest.approx([2.0, 0.5, 1.0])
    assert tis.ratio.tolist() == pytest.approx([4.0, 0.5, 1.0])
    assert tis.clipped.tolist() == [1.0, 0.0, 0.0]
    assert not tis.weights.requires_grad
    low = losses.tis_weights(old, rollout, tis_clip=2.0, tis_clip_low=0.8)
    assert low.weights.tolist() == pytest.approx([2.0, 0.8, 1.0])
    assert low.clipped.tolist() == [1.0, 1.0, 0.0]


# Two samples: [1, 2, (3)] and [(10), 20]; parenthesised tokens are masked out.
VALUES = torch.tensor([1.0, 2.0, 3.0, 10.0, 20.0])
MASK = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0])
IDS = torch.tensor([0, 0, 0, 1, 1])


def test_masked_means_sample_and_token():
    assert losses.per_sample_mean(VALUES, MASK, IDS, 2).tolist() == [1.5, 20.0]
    assert losses.masked_mean(VALUES, MASK, IDS, 2).item() == pytest.approx(10.75)
    assert losses.masked_mean(VALUES, MASK, IDS, 2, per_token=True).item() == pytest.approx(23 / 3)
    assert losses.masked_sum(VALUES, MASK, IDS, 2).item() == pytest.approx(21.5)
    assert losses.loss_denominator(MASK, 2) == 2.0
    assert losses.loss_denominator(MASK, 2, per_token=True) == 3.0


def test_masked_tokens_contribute_nothing():
    noisy = torch.where(MASK.bool(), VALUES, torch.tensor(1e9))
    noisy.requires_grad_(True)
    for per_token in (False, True):
        out = losses.masked_mean(noisy, MASK, IDS, 2, per_token=per_token)
        assert out.item() == pytest.approx(losses.masked_mean(VALUES, MASK, IDS, 2, per_token=per_token).item())
        (grad,) = torch.autograd.grad(out, noisy)
        assert grad[~MASK.bool()].eq(0).all()


def test_fully_masked_sample_counts_as_zero_in_loss():
    mask = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0])
    assert losses.per_sample_mean(VALUES, mask, IDS, 2).tolist() == [1.5, 0.0]
    assert losses.masked_mean(VALUES, mask, IDS, 2).item() == pytest.approx(0.75)


def test_train_rollout_logprob_abs_diff():
    train = torch.zeros(7)
    rollout = torch.tensor([-0.1, -0.3, -5.0, -1.0, -0.2, -9.0, -9.0])
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    ids = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    # sample 0: (.1 + .3) / 2 = .2 ; sample 1: 1.0 ; sample 2 has no unmasked token and is left out
    diff = losses.train_rollout_logprob_abs_diff(train, rollout, mask, ids, 3)
    assert diff.item() == pytest.approx(0.6)
    assert losses.train_rollout_logprob_abs_diff(train, rollout, torch.zeros(7), ids, 3).item() == 0.0
