"""New weight versions into a vLLM-CPU model without vLLM's layer-wise reload machinery.

vLLM's `reload_weights` puts every layer back on the meta device, materializes it, runs the model's
`load_weights` through element-counting wrappers and redoes each layer's post-processing. On the CPU
build that machinery, not the bytes, is the cost: ~20 ms a version for the demo's 1.6 MB model, on the
rollout worker's one busy core (docs/benchmarks.md). What the CPU build actually needs after new
weights is narrower: its linear layers drop their checkpoint-layout weight at start and compute from a
repacked copy, so new values must be loaded somewhere and repacked; embeddings and norms keep their
tensors and are simply overwritten.

`DirectCpuReload` does that, after one ordinary `reload_weights` has shown which names a version
carries:
- each packed linear layer gets a persistent checkpoint-layout weight of its own (made once, from the
  metadata vLLM recorded of the original parameter, so it has the original's class and weight loader);
- the model's own `load_weights` writes a version into those and into the tensors layers kept;
- each linear and embedding layer's `process_weights_after_loading` repacks, as at start.

It declines (`accepts` is False, and the caller uses vLLM's reload) for a version whose names differ
from the first one's, and `build` returns None for what it was not made for: a quantized model, a LoRA
engine, a quantized KV cache, a layer with any other post-processing, or a vLLM without the recorded
metadata. A load that leaves a shadowed weight unwritten raises `IncompleteWeightLoad` (the model is then
partly updated, as after any failed `reload_weights`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch

from vime.logging import get_logger

log = get_logger(__name__)


class IncompleteWeightLoad(RuntimeError):
    """A version did not write every weight the direct reload repacks."""


@dataclass
class _PackedLinear:
    layer: torch.nn.Module
    name: str  # the weight's parameter name in the model, as `load_weights` reports it
    shadow: torch.nn.Parameter  # checkpoint layout, written by the model's weight loaders
    kept: torch.nn.Parameter  # the empty parameter vLLM leaves on the layer after repacking


class DirectCpuReload:
    """Loads versions into one vLLM-CPU model; see the module docstring. Not thread-safe: the worker
    calls it with the scheduler paused, like `reload_weights`."""

    def __init__(self, runner: Any, model: torch.nn.Module, names: frozenset[str], linears: list[_PackedLinear],
                 embeddings: list[torch.nn.Module]) -> None:  # fmt: skip
        self._runner = runner
        self._model = model
        self.names = names
        self._linears = linears
        self._embeddings = embeddings

    @classmethod
    def build(cls, runner: Any, names: Iterable[str]) -> "DirectCpuReload | None":
        """For `runner`'s model, after a `reload_weights` of a version with these tensor `names`; None
        when the model is not one this handles (see the module docstring)."""
        try:
            from vllm.model_executor.layers.linear import UnquantizedLinearMethod
            from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
            from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
            from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor, to_meta_tensor
            from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs
        except ImportError as exc:
            log.info("direct cpu reload unavailable", reason=f"this vLLM lacks {exc.name}")
            return None
        config = runner.vllm_config
        why = _not_plain(config)
        if why:
            log.info("direct cpu reload unavailable", reason=why)
            return None
        model = runner.get_model()
        linears: list[_PackedLinear] = []
        embeddings: list[torch.nn.Module] = []
        for module_name, layer in model.named_modules():
            method = getattr(layer, "quant_method", None)
            if method is None:
                continue
            if isinstance(method, UnquantizedEmbeddingMethod):
                embeddings.append(layer)
                continue
            if not isinstance(method, UnquantizedLinearMethod):
                log.info("direct cpu reload unavailable", reason=f"{module_name} post-processes with {type(method).__name__}")
                return None
            weight = getattr(layer, "weight", None)
            if not isinstance(weight, torch.nn.Parameter) or weight.numel() > 0:
                continue  # computes from its own weight (torch's linear): loaded in place
            recorded = get_layerwise_info(layer).restore_metadata[0].get("weight")
            if recorded is None or not recorded.is_meta:
                log.info("direct cpu reload unavailable", reason=f"no recorded layout for {module_name}.weight")
                return None
            layout = restore_layer_refs(to_meta_tensor(recorded), layer)
            with torch.device(weight.device):
                shadow = materialize_meta_tensor(layout)
            shadow.weight_loader = _unwrapped(shadow.weight_loader)
            full_name = f"{module_name}.weight" if module_name else "weight"
            linears.append(_PackedLinear(layer, full_name, shadow, weight))
        return cls(runner, model, frozenset(names), linears, embeddings)

    def accepts(self, names: Iterable[str]) -> bool:
        return frozenset(names) == self.names

    @torch.no_grad()
    def load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Load one version (the names `accepts`) and repack. Raises IncompleteWeightLoad if a packed
        linear layer's weight was not written."""
        for packed in self._linears:
            packed.layer._parameters["weight"] = packed.shadow
        try:
            loaded = self._model.load_weights(iter(weights))
            missing = [p.name for p in self._linears if loaded is None or p.name not in loaded]
            if missing:
                raise IncompleteWeightLoad(f"the version wrote no value for {missing[:4]} ({len(missing)} weights)")
            for packed in self._linears:
                packed.layer.quant_method.process_weights_after_loading(packed.layer)
            for layer in self._embeddings:
                layer.quant_method.process_weights_after_loading(layer)
        finally:
            for packed in self._linears:
                packed.layer._parameters["weight"] = packed.kept
        self._runner.reset_lora_state()
        self._runner.reset_encoder_cache()
        self._runner.reset_mm_cache()


def _unwrapped(loader: Any) -> Any:
    """The parameter's own weight loader: vLLM's reload wraps the loaders of the layout it recorded in
    deferring ones (`online_process_loader`, which buffer values until the whole layer has arrived)."""
    while getattr(loader, "__name__", "") == "online_process_loader" and hasattr(loader, "__wrapped__"):
        loader = loader.__wrapped__
    return loader


def _not_plain(config: Any) -> str:
    """Why `config` is not a model the direct reload handles; empty when it is."""
    if getattr(config.model_config, "quantization", None):
        return f"quantized model ({config.model_config.quantization})"
    if getattr(config, "lora_config", None) is not None:
        return "LoRA engine"
    cache_dtype = str(getattr(config.cache_config, "cache_dtype", "auto"))
    if cache_dtype not in ("auto", "bfloat16", "float16", "float32"):
        return f"quantized KV cache ({cache_dtype})"
    return ""
