"""The repeated decoder blocks of a transformers causal LM: what FSDP2 shards, torch.compile compiles
and LoRA's `all-linear` looks inside."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn


def decoder_layers(hf_model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers (transformers names their class in `_no_split_modules`). Raises
    ValueError for a model that names none."""
    names = set(getattr(hf_model, "_no_split_modules", None) or [])
    layers = [m for m in hf_model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"cannot find decoder layers of {type(hf_model).__name__} (to shard with FSDP2 or compile)")
    return layers
