"""LoRA adapters for the torch trainer, through peft: wrap, reference view, adapter export, merged weights.

With `--lora-rank R` the policy's linear layers inside its decoder layers get a peft LoRA adapter
(`lora_A` [R, in], `lora_B` [out, R], scaled by `lora_alpha / R`); every base weight is frozen, so only
the adapter has gradients and AdamW state. peft injects its layers into the transformers model in place:
the trainer keeps running the same `nn.Module` (its decoder, its chunked LM head), and the
decoder layers that FSDP2 shards and torch.compile compiles are the same objects as without LoRA.

The KL reference policy is the frozen base, i.e. the same model with the adapter switched off (peft's
`disable_adapter()`), so no second copy of the weights is held (`AdapterOffView`).

What leaves the trainer:
- `adapter_state_dict`: the adapter tensors under the names a peft `adapter_model.safetensors` holds
  (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`, ...), named by peft's own
  `get_peft_model_state_dict`; `LoraAdapter.config_dict()` is the matching `adapter_config.json`.
  `write_adapter_dir` writes both: a directory `PeftModel.from_pretrained` and vLLM's `LoRARequest` read.
- `merged_named_tensors`: the full weights with the adapter merged (W + B @ A * scale) under the base
  model's own parameter names, for publishing full weights and for `save_hf_checkpoint`.

Not supported (refused with ValueError when the adapter is built, and by `vime.config` for the flags):
adapters on the LM head or the embeddings (the chunked head reads the head's base weight directly,
and vLLM serves neither), and target modules outside the decoder layers.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vime.logging import get_logger

if TYPE_CHECKING:  # torch and peft are imported where used: vime.config validates the flags without them
    import torch
    from torch import Tensor, nn

log = get_logger(__name__)

ADAPTER_NAME = "default"  # peft's name for a model's only adapter; it is not part of the exported names
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
# peft's prefix of the transformers model inside a PeftModel: exported names start with it
PEFT_PREFIX = "base_model.model."
ALL_LINEAR = "all-linear"
# Module names LoRA may not target: the LM head and the embeddings (see the module docstring).
UNSUPPORTED_TARGETS = ("lm_head", "embed_tokens", "embed_in", "embed_out", "wte", "word_embeddings")


def parse_target_modules(value: str | list[str] | tuple[str, ...]) -> str | list[str]:
    """`"all-linear"`, or a list of module names from `"q_proj,v_proj"` (or a list). Raises ValueError
    for an empty list or a name LoRA may not target here (`UNSUPPORTED_TARGETS`)."""
    if isinstance(value, str):
        if value.strip() == ALL_LINEAR:
            return ALL_LINEAR
        names = [v.strip() for v in value.split(",")]
    else:
        names = [str(v).strip() for v in value]
    names = [n for n in names if n]
    if not names:
        raise ValueError("target_modules is empty: give module names (q_proj,k_proj,...) or all-linear")
    if ALL_LINEAR in names:
        raise ValueError("target_modules: all-linear stands alone, not in a list of module names")
    bad = sorted(n for n in names if n.split(".")[-1] in UNSUPPORTED_TARGETS)
    if bad:
        raise ValueError(f"target_modules {bad}: LoRA on the LM head or the embeddings is not supported (the "
                         "trainer's chunked LM head reads the base weight, and vLLM does not serve such adapters); "
                         "target the decoder layers' linear layers (all-linear does)")  # fmt: skip
    return names


@dataclass(frozen=True)
class LoraSettings:
    """peft's LoRA hyper-parameters, under the flag names (`--lora-rank --lora-alpha --lora-dropout
    --target-modules`)."""

    rank: int
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: str | list[str] = field(default=ALL_LINEAR)

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"lora_rank must be >= 1 for a LoRA adapter, got {self.rank}")
        if self.alpha <= 0:
            raise ValueError(f"lora_alpha must be positive, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora_dropout must be in [0, 1), got {self.dropout}")
        object.__setattr__(self, "target_modules", parse_target_modules(self.target_modules))

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class LoraAdapter:
    """A transformers model with a peft LoRA adapter injected in place; see the module docstring.

    `hf_model` is the model object passed to `apply_lora` (now holding LoRA layers); `peft_model` the
    `PeftModelForCausalLM` around it, for peft's own calls.
    """

    def __init__(self, hf_model: nn.Module, peft_model: nn.Module, settings: LoraSettings) -> None:
        self.hf_model = hf_model
        self.peft_model = peft_model
        self.settings = settings

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """The base model: the adapter switched off inside the block (peft's `disable_adapter`).

        peft marks the adapter's parameters requires_grad=False while off and True again on exit, so
        this is meant for no-grad forwards (the KL reference); a backward through it trains nothing.
        """
        with self.peft_model.disable_adapter():  # type: ignore[operator]
            yield

    @contextlib.contextmanager
    def dropout_off(self) -> Iterator[None]:
        """LoRA dropout layers in eval mode inside the block: no-grad logprob passes (old policy,
        `compute_logprobs`) measure the policy itself, not one dropout draw of it."""
        layers = [m for name, m in self.hf_model.named_modules() if name.endswith(f"lora_dropout.{ADAPTER_NAME}")]
        modes = [m.training for m in layers]
        for m in layers:
            m.eval()
        try:
            yield
        finally:
            for m, mode in zip(layers, modes):
                m.train(mode)

    def config_dict(self) -> dict[str, Any]:
        """The adapter's `adapter_config.json` as a dict, as peft's `save_pretrained` writes it: sets
        (target_modules after all-linear was expanded) become lists, sorted here so equal adapters give
        equal bytes."""
        config = self.peft_model.peft_config[ADAPTER_NAME]  # type: ignore[index]
        out: dict[str, Any] = {}
        for key, value in config.to_dict().items():
            out[key] = sorted(value) if isinstance(value, set) else value
        return json.loads(json.dumps(out))  # plain JSON types (peft's enums are str subclasses)

    def adapter_parameter_names(self) -> list[str]:
        """The adapter's parameters' names relative to `hf_model` (`...q_proj.lora_A.default.weight`)."""
        return [name for name, _ in self._adapter_parameters()]

    def _adapter_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.hf_model.named_parameters() if _is_adapter_name(n)]

    def adapter_state_dict(
        self, gather: Callable[[Tensor], Tensor], dtype: torch.dtype | None = None
    ) -> dict[str, Tensor]:
        """The adapter's tensors (CPU, contiguous) under the names of a peft `adapter_model.safetensors`.

        `gather` turns a parameter into its full tensor (FSDP2: `full_tensor()`, a collective, so every
        rank calls this). `dtype=None` keeps the parameters' dtype (float32 master weights), as peft's
        `save_pretrained` of the trained model would.
        """
        from peft import get_peft_model_state_dict

        state: dict[str, Tensor] = {}
        for name, param in self._adapter_parameters():
            tensor = gather(param.detach())
            if dtype is not None:
                tensor = tensor.to(dtype)
            state[PEFT_PREFIX + name] = tensor.to("cpu").contiguous()
        # peft's own renaming (drops the adapter name); save_embedding_layers: no embedding is targeted
        named = get_peft_model_state_dict(self.peft_model, state_dict=state, adapter_name=ADAPTER_NAME,
                                          save_embedding_layers=False)  # fmt: skip
        return {k: v.contiguous() for k, v in named.items()}

    def trainable_parameters(self) -> int:
        return sum(p.numel() for _, p in self._adapter_parameters())


def _is_adapter_name(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def apply_lora(hf_model: nn.Module, settings: LoraSettings, decoder_layers: list[nn.Module]) -> LoraAdapter:
    """Inject a LoRA adapter into `hf_model` in place and freeze every base parameter.

    `decoder_layers` are the model's repeated blocks. `all-linear` means every `nn.Linear` inside them
    except MoE routers, resolved here to module names (peft's own all-linear would also adapt a
    transformers MoE model's router and fused expert tensors, which vLLM's LoRA and R3 do not follow).
    Raises ValueError (naming the modules) when an adapter would land anywhere but a plain linear
    layer of a decoder layer (LM head, embeddings, routers, fused experts), and whatever peft raises for
    a target that matches no module.
    """
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    targets = settings.target_modules
    if targets == ALL_LINEAR:
        targets = linear_module_names(decoder_layers)
    config = LoraConfig(
        r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
        target_modules=targets, bias="none", task_type="CAUSAL_LM",
    )  # fmt: skip
    peft_model = get_peft_model(hf_model, config, adapter_name=ADAPTER_NAME)
    allowed = {id(m) for m in _plain_linears(decoder_layers)}
    # a LoRA layer wraps its module in place: what it wraps must be one of the plain linear layers
    wrong = sorted(n for n, m in hf_model.named_modules()
                   if isinstance(m, LoraLayer) and not (isinstance(m, LoraLinear) and id(m.base_layer) in allowed))  # fmt: skip
    if wrong:
        raise ValueError(f"target_modules put LoRA on {wrong[:4]}{' ...' if len(wrong) > 4 else ''}: only the plain "
                         "linear layers of the decoder layers can take an adapter here (not the LM head, the "
                         "embeddings, MoE routers or fused expert weights)")  # fmt: skip
    for name, param in hf_model.named_parameters():
        param.requires_grad_(_is_adapter_name(name))
    adapter = LoraAdapter(hf_model, peft_model, settings)
    log.info(
        "lora_adapter_applied", rank=settings.rank, alpha=settings.alpha, dropout=settings.dropout,
        target_modules=adapter.config_dict()["target_modules"], adapter_params=adapter.trainable_parameters(),
        base_params=sum(p.numel() for n, p in hf_model.named_parameters() if not _is_adapter_name(n)),
    )  # fmt: skip
    return adapter


def _plain_linears(decoder_layers: list[nn.Module]) -> list[nn.Module]:
    """The `nn.Linear` modules of the decoder layers, less those inside MoE routers."""
    from torch import nn

    from vime.r3.hf_router import is_topk_router

    routers = {id(m) for layer in decoder_layers for r in layer.modules() if is_topk_router(r) for m in r.modules()}
    return [m for layer in decoder_layers for m in layer.modules() if isinstance(m, nn.Linear) and id(m) not in routers]


def linear_module_names(decoder_layers: list[nn.Module]) -> list[str]:
    """What `all-linear` adapts: the (sorted, distinct) names of the decoder layers' plain linear layers,
    e.g. q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj for a dense Qwen3. Raises
    ValueError when there is none."""
    ids = {id(m) for m in _plain_linears(decoder_layers)}
    names = sorted({name.rpartition(".")[2] for layer in decoder_layers for name, m in layer.named_modules()
                    if id(m) in ids})  # fmt: skip
    if not names:
        raise ValueError("all-linear found no linear layer in the decoder layers to put LoRA on")
    return names


def target_module_names(model_path: str, target_modules: str | list[str]) -> list[str]:
    """The module names an adapter for the model at `model_path` adapts, as `apply_lora` resolves them:
    `target_modules` itself when it names modules, or what `all-linear` finds in the model's decoder
    layers, built weightless on the meta device from its config (no weights are read). A rollout engine
    serving the adapter natively wraps only these. Raises ValueError as `parse_target_modules` and
    `linear_module_names` do, and OSError when the model's config cannot be read."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from vime.trainer.decoder_layers import decoder_layers

    targets = parse_target_modules(target_modules)
    if targets != ALL_LINEAR:
        return sorted({name.rpartition(".")[2] for name in targets})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    return linear_module_names(decoder_layers(model))


def merged_named_tensors(adapter: LoraAdapter, gather: Callable[[Tensor], Tensor]) -> Iterator[tuple[str, Tensor]]:
    """(base model parameter name, full tensor) with the adapter merged into every adapted weight:
    W + (B @ A) * scaling, computed in float32 (the master weights' dtype) on the parameters' device.

    Names are those of the model without LoRA (`...q_proj.weight`, peft's `.base_layer` removed), in
    `named_parameters` order, each parameter once. `gather` as in `adapter_state_dict`: every rank
    iterates the same sequence, so collectives line up. Nothing in the model changes.
    """
    from peft.tuners.lora import LoraLayer

    layers = {name: m for name, m in adapter.hf_model.named_modules() if isinstance(m, LoraLayer)}
    for name, param in adapter.hf_model.named_parameters():
        if _is_adapter_name(name):
            continue
        owner, _, leaf = name.rpartition(".")
        module_name = owner.removesuffix(".base_layer")
        tensor = gather(param.detach())
        if owner.endswith(".base_layer") and leaf == "weight" and module_name in layers:
            layer = layers[module_name]
            a = gather(layer.lora_A[ADAPTER_NAME].weight.detach())
            b = gather(layer.lora_B[ADAPTER_NAME].weight.detach())
            delta = (b.float() @ a.float()) * float(layer.scaling[ADAPTER_NAME])
            tensor = (tensor.float() + delta).to(tensor.dtype)
        yield f"{module_name}.{leaf}" if owner else leaf, tensor


def write_adapter_dir(path: str | os.PathLike, tensors: dict[str, Tensor], config: dict[str, Any]) -> None:
    """Write `adapter_model.safetensors` and `adapter_config.json` into directory `path` (created if
    missing): the layout `PeftModel.from_pretrained` and vLLM's `LoRARequest(name, id, path)` load.

    Both files are written under temporary names and renamed, so a reader never sees half a file; a
    reader may still see the new config beside the old weights between the two renames, so a
    publisher of versions writes each version to a fresh directory. Raises OSError from the filesystem.
    """
    from safetensors.torch import save_file

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    weights_tmp = os.path.join(path, ADAPTER_WEIGHTS_FILE + ".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, weights_tmp, metadata={"format": "pt"})
    config_tmp = os.path.join(path, ADAPTER_CONFIG_FILE + ".tmp")
    with open(config_tmp, "w") as f:
        f.write(json.dumps(config, indent=2, sort_keys=True))
    os.replace(weights_tmp, os.path.join(path, ADAPTER_WEIGHTS_FILE))
    os.replace(config_tmp, os.path.join(path, ADAPTER_CONFIG_FILE))


@dataclass(frozen=True)
class AdapterExport:
    """One adapter version: tensors named as in `adapter_model.safetensors`, and `adapter_config.json`."""

    tensors: dict[str, Tensor]
    config: dict[str, Any]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def write(self, path: str | os.PathLike) -> None:
        """`write_adapter_dir(path, ...)`: a directory peft and vLLM load as a LoRA adapter."""
        write_adapter_dir(path, self.tensors, self.config)


class AdapterOffView:
    """The frozen base policy as a callable with the policy module's signature: calls `module` with
    the adapter switched off. Holds no weights of its own (no second model in memory) and is not an
    `nn.Module`, so nothing (optimizer, FSDP, state dicts) sees the policy's parameters twice.
    `hf` is the transformers model, where R3 hooks attach."""

    def __init__(self, module: nn.Module, adapter: LoraAdapter) -> None:
        self.module = module
        self.adapter = adapter
        self.hf = adapter.hf_model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.adapter.disabled():
            return self.module(*args, **kwargs)
