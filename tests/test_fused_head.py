"""The chunked LM head (`vime.trainer.fused_head`) against the plain path: `lm_head(hidden)`, then
`losses.logprobs_from_logits` and `losses.entropy_from_logits`, values and gradients."""

from __future__ import annotations

import pytest
import torch

from vime.trainer import losses
from vime.trainer.fused_head import default_chunk_tokens, head_logprobs_and_entropy


def _inputs(n: int = 37, h: int = 24, v: int = 301, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g) * 2.0
    weight = torch.randn(v, h, generator=g) * 0.5
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, targets


def _plain(hidden, weight, targets, temperature):
    logits = torch.nn.functional.linear(hidden, weight)
    return losses.logprobs_from_logits(logits, targets, temperature), losses.entropy_from_logits(logits, temperature)


def _grads(fn, hidden, weight, targets, temperature, a, b):
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    lp, ent = fn(h, w, targets, temperature)
    (a * lp).sum().backward() if b is None else ((a * lp).sum() + (b * ent).sum()).backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1, 5, 64])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_values_and_gradients_match_the_plain_path_in_float32(temperature, chunk, with_entropy) -> None:
    hidden, weight, targets = _inputs()
    g = torch.Generator().manual_seed(1)
    a = torch.randn(hidden.shape[0], generator=g)  # stands in for advantages x ratios: any upstream gradient
    b = torch.randn(hidden.shape[0], generator=g) if with_entropy else None
    fused = _grads(lambda h, w, t, T: head_logprobs_and_entropy(h, w, t, T, chunk_tokens=chunk), hidden, weight, targets, temperature, a, b)
    plain = _grads(_plain, hidden, weight, targets, temperature, a, b)
    for got, want in zip(fused, plain):
        _assert_near(got, want, 1e-5)


def _assert_near(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    """Equal up to rounding: the error's norm against the reference's (elementwise tolerances would flag
    the float32 rounding of logits of magnitude ~10 that the entropy's gradient multiplies)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    error = float((got - want).norm() / want.norm())
    assert error < rel, f"relative error {error:.2e} >= {rel:.0e}"


def test_under_bfloat16_autocast_it_rounds_like_the_plain_path() -> None:
    """The plain path's head runs in bf16 under autocast; the fused one must round its logits the same way."""
    hidden, weight, targets = _inputs(n=20, h=64, v=517)
    a = torch.ones(hidden.shape[0])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = _grads(lambda h, w, t, T: head_logprobs_and_entropy(h, w, t, T, chunk_tokens=7), hidden, weight, targets, 1.0, a, a)
        plain = _grads(_plain, hidden, weight, targets, 1.0, a, a)
    torch.testing.assert_close(fused[0], plain[0], rtol=0, atol=1e-5)  # same bf16 logits, float32 softmax
    torch.testing.assert_close(fused[1], plain[1], rtol=0, atol=1e-4)  # lse - E[z] cancels where peaked
    # gradients pass through bf16 matrix products on both paths (the fused one sums chunks in float32)
    _assert_near(fused[2], plain[2], 2e-2)
    _assert_near(fused[3], plain[3], 2e-2)
    assert fused[2].dtype == plain[2].dtype and fused[3].dtype == plain[3].dtype == torch.float32


def test_an_unused_output_gets_no_gradient_work() -> None:
    hidden, weight, targets = _inputs(n=4)
    h = hidden.clone().requires_grad_(True)
    lp, ent = head_logprobs_and_entropy(h, weight, targets)
    (lp.sum() * 0.0 + ent.detach().sum()).backward()
    assert torch.count_nonzero(h.grad) == 0  # a zero upstream gradient gives zero, not garbage


def test_without_entropy_the_logprobs_are_the_same_and_still_train() -> None:
    hidden, weight, targets = _inputs()
    h = hidden.clone().requires_grad_(True)
    lp, ent = head_logprobs_and_entropy(h, weight, targets, 0.7, chunk_tokens=5, with_entropy=False)
    assert ent is None
    torch.testing.assert_close(lp, head_logprobs_and_entropy(hidden, weight, targets, 0.7, chunk_tokens=5)[0], rtol=0, atol=0)
    lp.sum().backward()
    want = _grads(_plain, hidden, weight, targets, 0.7, torch.ones(hidden.shape[0]), None)[2]
    _assert_near(h.grad, want, 1e-5)


def test_bad_shapes_and_temperature_are_refused() -> None:
    hidden, weight, targets = _inputs(n=4)
    with pytest.raises(ValueError, match=r"hidden \[N, H\]"):
        head_logprobs_and_entropy(hidden, weight.t(), targets)
    with pytest.raises(ValueError, match="targets must be"):
        head_logprobs_and_entropy(hidden, weight, targets[:2])
    with pytest.raises(ValueError, match="temperature"):
        head_logprobs_and_entropy(hidden, weight, targets, temperature=0.0)


def test_default_chunk_keeps_one_chunk_of_logits_near_the_budget() -> None:
    assert default_chunk_tokens(151936) * 151936 * 4 <= 1024 * 1024 * 1024
    assert default_chunk_tokens(151936, chunk_bytes=1) == 1
