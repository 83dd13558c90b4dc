"""Merging a LoRA adapter version into full weights: W = W_base + scaling * B @ A, from the base every time."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from vime.rollout.adapter_merge import AdapterMergeError, AdapterMerger, CheckpointWeights, adapter_scaling

CONFIG = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"]}


def lora(module: str, a: torch.Tensor, b: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    prefix = f"base_model.model.{module}"
    return [(f"{prefix}.lora_A.weight", a), (f"{prefix}.lora_B.weight", b)]


def test_each_version_merges_from_the_base() -> None:
    torch.manual_seed(0)
    weights = {"m.q_proj.weight": torch.randn(6, 5), "m.v_proj.weight": torch.randn(6, 5), "m.o_proj.weight": torch.randn(5, 6)}
    base = {k: v.clone() for k, v in weights.items()}
    merger = AdapterMerger()
    a, b = torch.randn(2, 5), torch.randn(6, 2)
    first = dict(merger.merged(weights, lora("m.q_proj", a, b) + lora("m.v_proj", a, 2 * b), CONFIG))
    torch.testing.assert_close(first["m.q_proj.weight"], base["m.q_proj.weight"] + 2.0 * b @ a)
    torch.testing.assert_close(first["m.v_proj.weight"], base["m.v_proj.weight"] + 4.0 * b @ a)
    assert "m.o_proj.weight" not in first
    weights.update(first)  # the engine loaded them
    second = dict(merger.merged(weights, lora("m.q_proj", a, -b), CONFIG))
    torch.testing.assert_close(second["m.q_proj.weight"], base["m.q_proj.weight"] - 2.0 * b @ a)
    assert torch.equal(second["m.v_proj.weight"], base["m.v_proj.weight"]), "not adapted any more: back to the base"


def test_scaling_follows_peft_and_unsupported_adapters_are_refused() -> None:
    assert adapter_scaling(CONFIG) == 2.0 and adapter_scaling({**CONFIG, "use_rslora": True}) == pytest.approx(4 / 2**0.5)
    for change, message in [({"use_dora": True}, "DoRA"), ({"bias": "all"}, "biases"), ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
                            ({"rank_pattern": {"q_proj": 4}}, "patterns"), ({"r": 0}, "positive int r")]:  # fmt: skip
        with pytest.raises(AdapterMergeError, match=message):
            adapter_scaling({**CONFIG, **change})
    weights = {"m.q_proj.weight": torch.zeros(6, 5)}
    a, b = torch.zeros(2, 5), torch.zeros(6, 2)
    cases = [
        (lora("m.k_proj", a, b), "not a weight of the model"),
        (lora("m.q_proj", torch.zeros(2, 4), b), "do not fit"),
        (lora("m.q_proj", a, b)[:1], "without their other half"),
        ([("m.q_proj.weight", a)], "not a peft LoRA matrix"),
    ]
    for tensors, message in cases:
        with pytest.raises(AdapterMergeError, match=message):
            AdapterMerger().merged(weights, tensors, CONFIG)


def test_checkpoint_weights_read_by_name(tmp_path: Path) -> None:
    tensors = {"m.q_proj.weight": torch.arange(6.0).reshape(2, 3), "m.v_proj.weight": torch.ones(2, 2)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    weights = CheckpointWeights(tmp_path)
    assert set(weights) == set(tensors) and len(weights) == 2
    assert torch.equal(weights["m.q_proj.weight"], tensors["m.q_proj.weight"])
    with pytest.raises(AdapterMergeError, match="no safetensors"):
        CheckpointWeights(tmp_path / "missing")
