"""Resumable trainer checkpoints: a trainer resumed with --load continues exactly where it stopped.

Uninterrupted: steps A, B, C. Interrupted: steps A, B, save, a new trainer loads the checkpoint, step C.
The weights, optimizer moments and the step-C metrics must be the same (CPU, fp32: bit for bit).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_torch_backend import config, make_batch, make_checkpoint

from vime.trainer.checkpoint import CheckpointError, find_checkpoint, load_checkpoint, save_checkpoint
from vime.trainer.torch_backend import TorchTrainer

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "dense"), moe=False)


@pytest.mark.parametrize("estimator", ["grpo", "ppo"])
def test_resume_continues_bit_for_bit(dense: str, tmp_path: Path, estimator: str) -> None:
    cfg = config(dense, advantage_estimator=estimator, lr_warmup_steps=4)
    batches = [make_batch(seed) for seed in range(3)]

    straight = TorchTrainer(cfg)
    for batch in batches[:2]:
        straight.train_step(batch)
    torch.manual_seed(123)  # RNG state at the cut: the resumed trainer must restore it
    expected = straight.train_step(batches[2])

    first = TorchTrainer(cfg)
    for batch in batches[:2]:
        first.train_step(batch)
    torch.manual_seed(123)
    path = save_checkpoint(first, tmp_path / "checkpoints", steps_done=2, weight_version=2)
    steps_at_save = first.optimizer_steps
    del first
    torch.manual_seed(999)  # whatever the new process's RNG is

    resumed = TorchTrainer(cfg)
    point = load_checkpoint(resumed, find_checkpoint("latest", tmp_path / "checkpoints"))
    assert (point.path, point.steps_done, point.weight_version) == (path, 2, 2)
    assert resumed.optimizer_steps == steps_at_save > 0
    got = resumed.train_step(batches[2])

    for (name, a), (_, b) in zip(straight.module.named_parameters(), resumed.module.named_parameters()):
        assert torch.equal(a, b), name
    assert got["train/loss"] == expected["train/loss"]
    assert got["train/lr"] == expected["train/lr"]
    assert resumed.optimizer_steps == straight.optimizer_steps
    if estimator == "ppo":
        assert resumed.critic is not None and straight.critic is not None
        for a, b in zip(straight.critic.module.parameters(), resumed.critic.module.parameters()):
            assert torch.equal(a, b)
    # The HF weights in the checkpoint load on their own (transformers).
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(path) is not None


def test_load_errors_say_what_is_missing(dense: str, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no resumable checkpoint under"):
        find_checkpoint("latest", tmp_path)
    (tmp_path / "step_3.partial" / "trainer").mkdir(parents=True)  # a save cut short is never picked
    with pytest.raises(CheckpointError, match="no resumable checkpoint under"):
        find_checkpoint("latest", tmp_path)
    with pytest.raises(CheckpointError, match="missing trainer/trainer_state.json"):
        find_checkpoint(str(tmp_path / "step_3.partial"), tmp_path)


def test_a_checkpoint_of_another_backend_is_refused_by_name(dense: str, tmp_path: Path) -> None:
    import json

    trainer = TorchTrainer(config(dense))
    path = save_checkpoint(trainer, tmp_path, steps_done=1, weight_version=1)
    meta_file = path / "trainer" / "trainer_state.json"
    meta = json.loads(meta_file.read_text())
    meta["backend"] = "MegatronTrainer"
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="saved by the MegatronTrainer backend, this is TorchTrainer"):
        load_checkpoint(TorchTrainer(config(dense)), path)
