"""AdamW's kernel choice (vime/trainer/optim.py): the same update from every implementation, the one
"auto" picks, and the trainer training alike with each."""

from __future__ import annotations

import pytest
import torch

from vime.trainer.optim import adamw


def _steps(implementation: str, sharded: bool = False) -> tuple[list[torch.Tensor], torch.optim.AdamW]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in ((7, 5), (5,), (3, 4, 2))]
    opt = adamw([{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0}],
                lr=1e-2, betas=(0.9, 0.99), eps=1e-8, implementation=implementation, sharded=sharded)  # fmt: skip
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return [p.detach().clone() for p in params], opt


def test_every_implementation_makes_the_same_update() -> None:
    reference, _ = _steps("for-loop")
    for implementation in ("fused", "foreach", "auto"):
        got, _ = _steps(implementation)
        for a, b in zip(got, reference):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_auto_is_fused_except_for_sharded_parameters() -> None:
    _, opt = _steps("auto")
    assert opt.defaults["fused"] is True
    _, sharded = _steps("auto", sharded=True)
    assert sharded.defaults["foreach"] is True and not sharded.defaults["fused"]
    _, loop = _steps("for-loop")
    assert loop.defaults["foreach"] is False and not loop.defaults["fused"]


def test_an_unknown_implementation_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="optimizer_implementation must be one of"):
        adamw([torch.nn.Parameter(torch.zeros(2))], lr=1e-3, implementation="fast")  # type: ignore[arg-type]


def test_the_trainer_trains_alike_with_each_implementation(tmp_path) -> None:
    from test_torch_backend import config, make_batch, make_checkpoint

    from vime.trainer.torch_backend import TorchTrainer

    ckpt = make_checkpoint(str(tmp_path / "dense"), False)
    trainers = {i: TorchTrainer(config(ckpt, optimizer_implementation=i, num_steps_per_rollout=2, micro_batch_size=2))
                for i in ("fused", "for-loop")}  # fmt: skip
    assert trainers["fused"].optimizer.defaults["fused"] is True
    before = {n: w.detach().clone() for n, w in trainers["fused"].hf_model.named_parameters()}
    metrics = {i: t.train_step(make_batch(seed=5)) for i, t in trainers.items()}
    for name in metrics["for-loop"]:
        assert metrics["fused"][name] == pytest.approx(metrics["for-loop"][name], rel=1e-5, abs=1e-7), name
    loop = dict(trainers["for-loop"].hf_model.named_parameters())
    for name, w in trainers["fused"].hf_model.named_parameters():
        torch.testing.assert_close(w, loop[name], rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(w, before[n]) for n, w in trainers["fused"].hf_model.named_parameters())
