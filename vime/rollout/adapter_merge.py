"""A LoRA adapter version folded into an engine that runs full weights: W = W_base + scaling * B @ A.

The weight channel moves only the adapter (peft's tensor names and adapter_config.json); an engine
that loads full weights keeps the base values of the adapted weights (the hf engine: from its model
before the first version; a vLLM worker: read from the checkpoint's safetensors, `CheckpointWeights`)
and loads the merged ones for each version. Every version merges from the base, never from the last merge, so
rounding does not accumulate. Refuses, with `AdapterMergeError` naming the field, what a plain merge
cannot reproduce: DoRA, trained biases, extra trained modules, and tensors that do not fit the model.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

_PREFIX = "base_model.model."
_A, _B = ".lora_A.weight", ".lora_B.weight"


class AdapterMergeError(ValueError):
    """The adapter version cannot be merged into this model."""


def adapter_scaling(config: Mapping[str, Any]) -> float:
    """peft's LoRA scaling: lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora."""
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank <= 0 or not isinstance(alpha, (int, float)):
        raise AdapterMergeError(f"adapter_config needs a positive int r and a numeric lora_alpha, got r={rank!r} lora_alpha={alpha!r}")
    if config.get("use_dora"):
        raise AdapterMergeError("adapter_config has use_dora: DoRA adapters are not supported")
    if config.get("bias", "none") != "none" or config.get("modules_to_save"):
        raise AdapterMergeError("adapter_config trains biases or modules_to_save: only LoRA matrices are supported")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise AdapterMergeError("adapter_config has per-module rank or alpha patterns: not supported")
    return float(alpha) / (math.sqrt(rank) if config.get("use_rslora") else rank)


def adapter_pairs(tensors: Sequence[tuple[str, torch.Tensor]]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{base weight name: (A, B)} from peft-named adapter tensors
    (`base_model.model.<module>.lora_A.weight` -> `<module>.weight`)."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        for suffix, half in ((_A, "A"), (_B, "B")):
            if name.startswith(_PREFIX) and name.endswith(suffix):
                halves.setdefault(name[len(_PREFIX) : -len(suffix)] + ".weight", {})[half] = tensor
                break
        else:
            raise AdapterMergeError(f"adapter tensor {name!r} is not a peft LoRA matrix (base_model.model.*.lora_A/B.weight)")
    unpaired = sorted(target for target, pair in halves.items() if len(pair) != 2)
    if unpaired:
        raise AdapterMergeError(f"adapter tensors without their other half (lora_A/lora_B): {unpaired[:4]}")
    return {target: (pair["A"], pair["B"]) for target, pair in halves.items()}


class AdapterMerger:
    """Keeps the base values of the weights adapters touch, and merges each version from them."""

    def __init__(self) -> None:
        self._base: dict[str, torch.Tensor] = {}

    def merged(
        self, weights: Mapping[str, torch.Tensor], tensors: Sequence[tuple[str, torch.Tensor]], config: Mapping[str, Any],
    ) -> list[tuple[str, torch.Tensor]]:  # fmt: skip
        """(weight name, merged value) for every weight this version or an earlier one adapted, ready to
        copy into `weights` (the model's state dict). A weight an earlier version adapted and this one
        does not goes back to its base value. Checks everything before returning; copies nothing."""
        scaling = adapter_scaling(config)
        pairs = adapter_pairs(tensors)
        for target, (a, b) in pairs.items():
            weight = weights.get(target)
            if weight is None:
                raise AdapterMergeError(f"the adapter adapts {target!r}, which is not a weight of the model")
            rows, cols = weight.shape if weight.dim() == 2 else (None, None)
            if rows is None or a.dim() != 2 or b.dim() != 2 or a.shape[1] != cols or b.shape[0] != rows or a.shape[0] != b.shape[1]:
                raise AdapterMergeError(
                    f"adapter for {target!r}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit the weight {tuple(weight.shape)}"
                )
        for target in pairs:
            if target not in self._base:
                self._base[target] = weights[target].detach().clone()
        merged = []
        for target, base in self._base.items():
            if target in pairs:
                a, b = pairs[target]
                delta = (b.to(base.device, torch.float32) @ a.to(base.device, torch.float32)) * scaling
                merged.append((target, (base.float() + delta).to(base.dtype)))
            else:
                merged.append((target, base))
        return merged


class CheckpointWeights(Mapping[str, torch.Tensor]):
    """The weights of an HF checkpoint directory by name, read from its safetensors files on access
    (for an engine whose loaded parameters are repacked and no longer hold the HF tensors). Each file
    is opened once (memory-mapped) and kept open."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        path = os.fspath(path)
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                files = json.load(f)["weight_map"]
            self._file_of = {name: os.path.join(path, file) for name, file in files.items()}
        else:
            from safetensors import safe_open

            single = os.path.join(path, "model.safetensors")
            if not os.path.exists(single):
                raise AdapterMergeError(f"no safetensors weights in {path} to merge adapters into")
            with safe_open(single, "pt") as f:
                self._file_of = dict.fromkeys(f.keys(), single)
        self._open: dict[str, Any] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        file = self._file_of[name]
        handle = self._open.get(file)
        if handle is None:
            handle = self._open[file] = safe_open(file, "pt")
        return handle.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)
