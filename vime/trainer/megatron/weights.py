"""Megatron model shards <-> Hugging Face safetensors: load this rank's shards, export full HF tensors.

Loading reads, for each local parameter, only the HF tensors it is made of (lazily, with
`safetensors.safe_open`), builds the full Megatron tensor (`hf_mapping`), and keeps this rank's slice:
- tensor parallel: the slice along the parameter's `partition_dim` (Megatron marks TP parameters with
  `tensor_model_parallel`); a gated `linear_fc1` is sliced per half so each rank holds `[gate_r; up_r]`;
  vocab-parallel tensors are zero-padded to the padded vocabulary first;
- expert parallel: local expert i of EP rank r is global expert r * experts_per_rank + i, and experts
  use the expert tensor-parallel group;
- pipeline parallel: each stage holds its own layers; `TransformerLayer.layer_number` is the global one.

Export is the reverse, streamed one tensor at a time: all-gather TP (and EP) shards, then the
pipeline stages hand their tensors to global rank 0 over the pipeline group in stage order. Only
global rank 0 yields; every rank must iterate (the gathers are collectives). Names and shapes are the
checkpoint's, ready for vLLM's `load_weights` and the weight channel.
"""

from __future__ import annotations

import json
import os
import re
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from torch import Tensor, nn

from vime.trainer.megatron.hf_mapping import ModelLayout, hf_to_megatron, megatron_to_hf

_LOCAL_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"\.experts\.local_experts\.(\d+)\.")
_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")


def safetensors_reader(checkpoint_dir: str) -> Callable[[str], Tensor]:
    """A `read(name) -> Tensor` over a HF checkpoint directory (sharded or single file). Raises KeyError
    naming the tensor and directory for a name the checkpoint lacks."""
    from safetensors import safe_open

    index_path = os.path.join(checkpoint_dir, "model.safetensors.index.json")
    if os.path.exists(index_path):
        with open(index_path) as f:
            where = json.load(f)["weight_map"]
    else:
        single = "model.safetensors"
        with safe_open(os.path.join(checkpoint_dir, single), framework="pt") as f:
            where = {k: single for k in f.keys()}
    handles: dict[str, object] = {}

    def read(name: str) -> Tensor:
        if name not in where:
            raise KeyError(f"tensor {name!r} not in checkpoint {checkpoint_dir}")
        file = where[name]
        if file not in handles:
            handles[file] = safe_open(os.path.join(checkpoint_dir, file), framework="pt")
        return handles[file].get_tensor(name)  # type: ignore[attr-defined]

    return read


def global_name(local_name: str, model: nn.Module, layout: ModelLayout) -> str:
    """The global (unsharded) Megatron name of a local parameter name of this rank's GPTModel."""
    name = local_name.replace("output_layer.inner.", "output_layer.")  # ResponseRowsOutputLayer
    m = _LOCAL_LAYER.match(name)
    if m is not None:
        layer = model.decoder.layers[int(m.group(1))].layer_number - 1  # type: ignore[index,union-attr]
        name = f"decoder.layers.{layer}." + name[m.end():]
    e = _LOCAL_EXPERT.search(name)
    if e is not None:
        per_rank = layout.num_experts // ps.get_expert_model_parallel_world_size()
        expert = ps.get_expert_model_parallel_rank() * per_rank + int(e.group(1))
        name = name[: e.start()] + f".experts.local_experts.{expert}." + name[e.end():]
    return name


def _is_expert(name: str) -> bool:
    return ".experts.local_experts." in name


def _tp_group(name: str) -> tuple[int, int, object]:
    if _is_expert(name):
        return (ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size(),
                ps.get_expert_tensor_parallel_group())  # fmt: skip
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_group()


def _shard(full: Tensor, name: str, param: Tensor, padded_rows: int) -> Tensor:
    """This rank's slice of the full tensor for `param`."""
    rank, size, _ = _tp_group(name)
    if name.endswith(_VOCAB) and full.shape[0] < padded_rows:
        full = torch.cat([full, full.new_zeros(padded_rows - full.shape[0], *full.shape[1:])])
    if size == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    dim = param.partition_dim  # type: ignore[attr-defined]
    if name.endswith("linear_fc1.weight"):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]])
    return full.chunk(size, dim=dim)[rank]


@torch.no_grad()
def load_hf_weights(model: nn.Module, checkpoint_dir: str, layout: ModelLayout) -> int:
    """Copy a HF checkpoint into this rank's (unwrapped) GPTModel in place; returns tensors loaded.

    Raises KeyError for a parameter the mapping or the checkpoint lacks, ValueError on a shape mismatch
    (naming the parameter and both shapes).
    """
    read = safetensors_reader(checkpoint_dir)
    loaded = 0
    for local, param in model.named_parameters():
        name = global_name(local, model, layout)
        if name == "output_layer.weight" and layout.tie_word_embeddings:
            name = "embedding.word_embeddings.weight"  # the last stage's copy of a tied embedding
        full = hf_to_megatron(name, read, layout)
        part = _shard(full, name, param, padded_rows=param.shape[0] * _tp_group(name)[1])
        if part.shape != param.shape:
            raise ValueError(f"{local}: checkpoint gives {tuple(part.shape)}, model has {tuple(param.shape)}")
        param.copy_(part)
        loaded += 1
    for local, buf in model.named_buffers():
        if local.endswith("router.expert_bias"):
            buf.copy_(hf_to_megatron(global_name(local, model, layout), read, layout))
            loaded += 1
    return loaded


def _gather_tp(t: Tensor, name: str, param: Tensor) -> Tensor:
    rank, size, group = _tp_group(name)
    if size == 1 or not getattr(param, "tensor_model_parallel", False):
        return t
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=group)  # type: ignore[arg-type]
    if name.endswith("linear_fc1.weight"):
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(parts, dim=param.partition_dim)  # type: ignore[attr-defined]


def _stage_tensors(model: nn.Module, layout: ModelLayout) -> Iterator[tuple[str, Tensor]]:
    """(global Megatron name, full TP-gathered tensor) for this stage; experts of every EP rank."""
    tensors: list[tuple[str, Tensor, Tensor]] = list(
        (n, p.detach(), p) for n, p in model.named_parameters()
    ) + [(n, b, b) for n, b in model.named_buffers() if n.endswith("router.expert_bias")]
    ep_size = ps.get_expert_model_parallel_world_size()
    for local, t, param in tensors:
        name = global_name(local, model, layout)
        if name == "output_layer.weight" and layout.tie_word_embeddings:
            continue
        full = _gather_tp(t, name, param)
        if name.endswith(_VOCAB):
            full = full[: layout.vocab_size]
        if _is_expert(name) and ep_size > 1:
            parts = [torch.empty_like(full) for _ in range(ep_size)]
            dist.all_gather(parts, full.contiguous(), group=ps.get_expert_model_parallel_group())
            per_rank = layout.num_experts // ep_size
            local_e = int(_LOCAL_EXPERT.search(local).group(1))  # type: ignore[union-attr]
            for r, part in enumerate(parts):
                yield _LOCAL_EXPERT.sub(f".experts.local_experts.{r * per_rank + local_e}.", name, count=1), part
            continue
        yield name, full


def _send_name(name: str, src: int, group: object, device: torch.device) -> None:
    data = torch.tensor(list(name.encode()), dtype=torch.uint8, device=device)
    dist.broadcast(torch.tensor([data.numel()], device=device), src=src, group=group)  # type: ignore[arg-type]
    dist.broadcast(data, src=src, group=group)  # type: ignore[arg-type]


def _recv_name(src: int, group: object, device: torch.device) -> str:
    n = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(n, src=src, group=group)  # type: ignore[arg-type]
    data = torch.zeros(int(n.item()), dtype=torch.uint8, device=device)
    dist.broadcast(data, src=src, group=group)  # type: ignore[arg-type]
    return bytes(data.cpu().tolist()).decode()


@torch.no_grad()
def export_hf_weights(
    model: nn.Module, layout: ModelLayout, dtype: torch.dtype, device: torch.device, on_device: bool = False
) -> Iterator[tuple[str, Tensor]]:
    """Yield (HF checkpoint name, contiguous CPU tensor in `dtype`) on global rank 0; collective.
    `on_device` leaves the tensors on the GPU, for a publisher that shares them there.

    Pipeline stages s > 0 send their tensors to stage 0 over the pipeline group of the ranks with
    TP/DP/CP rank 0 (the group global rank 0 is in), in stage order: first a count, then per tensor its
    name (as bytes), dtype-cast shape and data. Names travel as uint8 tensors, never pickled.
    """
    pp = ps.get_pipeline_model_parallel_world_size()
    is_root = dist.get_rank() == 0
    if pp == 1:
        for name, full in _stage_tensors(model, layout):
            if is_root:
                for hf_name, t in megatron_to_hf(name, full.to(dtype), layout):
                    yield hf_name, (t if on_device else t.cpu()).contiguous()
        return
    stage, group = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_group()
    ranks = dist.get_process_group_ranks(group)
    in_root_group = 0 in ranks
    for s in range(pp):
        src = ranks[s]
        if stage == s:
            items = list(_stage_tensors(model, layout)) if s > 0 else _stage_tensors(model, layout)
            if s > 0 and in_root_group:
                dist.broadcast(torch.tensor([len(items)], device=device), src=src, group=group)  # type: ignore[arg-type]
            for name, full in items:
                full = full.to(dtype)
                if s > 0 and in_root_group:
                    _send_name(name, src, group, device)
                    shape = torch.tensor(list(full.shape), dtype=torch.int64, device=device)
                    dist.broadcast(torch.tensor([shape.numel()], device=device), src=src, group=group)  # type: ignore[arg-type]
                    dist.broadcast(shape, src=src, group=group)  # type: ignore[arg-type]
                    dist.broadcast(full.to(device).contiguous(), src=src, group=group)  # type: ignore[arg-type]
                if is_root:
                    for hf_name, t in megatron_to_hf(name, full, layout):
                        yield hf_name, (t if on_device else t.cpu()).contiguous()
        elif in_root_group and s > 0:  # stage 0's tensors are already on global rank 0: nothing to receive
            count = torch.zeros(1, dtype=torch.int64, device=device)
            dist.broadcast(count, src=src, group=group)  # type: ignore[arg-type]
            for _ in range(int(count.item())):
                name = _recv_name(src, group, device)
                ndim = torch.zeros(1, dtype=torch.int64, device=device)
                dist.broadcast(ndim, src=src, group=group)  # type: ignore[arg-type]
                shape = torch.zeros(int(ndim.item()), dtype=torch.int64, device=device)
                dist.broadcast(shape, src=src, group=group)  # type: ignore[arg-type]
                data = torch.empty(*shape.tolist(), dtype=dtype, device=device)
                dist.broadcast(data, src=src, group=group)  # type: ignore[arg-type]
                if is_root:
                    for hf_name, t in megatron_to_hf(name, data, layout):
                        yield hf_name, (t if on_device else t.cpu()).contiguous()
