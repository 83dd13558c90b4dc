"""Resumable trainer checkpoints: `--save-interval N` writes them, `--load PATH|latest` resumes from one.

A checkpoint is a directory `CHECKPOINT_DIR/step_N` (N = training steps done) holding
- the Hugging Face weights (`model.safetensors`, config, tokenizer files), usable on their own; or,
  for a LoRA run (`--lora-rank`), the adapter as a peft adapter directory (`adapter_config.json`,
  `adapter_model.safetensors`: `PeftModel.from_pretrained(base, step_N)` and vLLM's `LoRARequest` load
  it), the base weights being the `--hf-checkpoint` the run started from;
- `trainer/state.pt`: the fp32 policy weights (LoRA: the adapter's only), optimizer and LR-scheduler
  state, optimizer-step count, and the critic's weights and optimizer under PPO (gathered to full
  tensors under FSDP2); or, for
  the Megatron backend, `trainer/state_rank{R}.pt` per rank: its model shards, Megatron's optimizer
  state of its shard (distributed optimizer: bucket-space, no gather) and its tensor-parallel RNG
  tracker, so `--load` there needs the same parallel layout;
- `trainer/rng_rank{R}.pt`: each rank's torch / CUDA / numpy / python RNG states;
- `trainer/trainer_state.json`: steps done, weight version, backend and world size.
It is written to `step_N.partial` and renamed when every rank has finished, so a trainer killed while
saving leaves no directory that `--load latest` would pick.

Which groups the steps trained is the broker's business (its journal): the trainer reports each saved
checkpoint (`CheckpointSaved`) and the broker keeps every later step's batch until then, so a trainer
resumed from step N asks for step N and gets exactly the groups the killed trainer trained at step N.
Files are written with `torch.save` and read back with `weights_only=True` (tensors and plain data, no
arbitrary objects); they never travel over a socket.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from vime.logging import get_logger

log = get_logger(__name__)

STATE_DIR = "trainer"
STATE_JSON = "trainer_state.json"


class CheckpointError(RuntimeError):
    """`--load` names no usable checkpoint; the message says what is missing."""


@dataclass(frozen=True)
class ResumePoint:
    path: Path
    steps_done: int
    weight_version: int


def checkpoint_dir_for(root: Path, steps_done: int) -> Path:
    return root / f"step_{steps_done}"


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def save_checkpoint(trainer: Any, root: Path, steps_done: int, weight_version: int) -> Path:
    """Collective: every rank calls it. Returns the final directory (written by rank 0)."""
    final = checkpoint_dir_for(root, steps_done)
    partial = final.with_name(final.name + ".partial")
    if _rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        (partial / STATE_DIR).mkdir(parents=True)
    _barrier()
    if getattr(trainer, "lora", None) is not None:
        trainer.save_adapter(partial)  # the base weights are the run's --hf-checkpoint, unchanged
    else:
        trainer.save_hf_checkpoint(partial)
    state = trainer.training_state()  # collective under FSDP; None on ranks that do not write
    rank = _rank()
    (partial / STATE_DIR).mkdir(parents=True, exist_ok=True)
    torch.save(_rng_state(), partial / STATE_DIR / f"rng_rank{rank}.pt")
    if trainer.sharded_training_state:
        torch.save(state, partial / STATE_DIR / f"state_rank{rank}.pt")
    elif rank == 0:
        torch.save(state, partial / STATE_DIR / "state.pt")
    if rank == 0:
        meta = {
            "steps_done": steps_done, "weight_version": weight_version, "backend": type(trainer).__name__,
            "world_size": dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1,
        }  # fmt: skip
        (partial / STATE_DIR / STATE_JSON).write_text(json.dumps(meta, indent=1))
    _barrier()
    if rank == 0:
        _fsync_tree(partial)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
    _barrier()
    return final


def find_checkpoint(spec: str, root: Path) -> Path:
    """`spec` is a checkpoint directory or "latest" (the complete step_N under `root` with the largest N)."""
    if spec != "latest":
        path = Path(spec)
        if not (path / STATE_DIR / STATE_JSON).is_file():
            raise CheckpointError(f"--load {spec}: no resumable checkpoint there (missing {STATE_DIR}/{STATE_JSON}; "
                                  "checkpoints saved with --save-interval have it)")  # fmt: skip
        return path
    candidates = []
    for path in root.glob("step_*"):
        suffix = path.name.removeprefix("step_")
        if suffix.isdigit() and (path / STATE_DIR / STATE_JSON).is_file():
            candidates.append((int(suffix), path))
    if not candidates:
        raise CheckpointError(f"--load latest: no resumable checkpoint under {root} (save them with --save-interval N)")
    return max(candidates)[1]


def load_checkpoint(trainer: Any, path: Path) -> ResumePoint:
    """Every rank: restore weights, optimizer, scheduler and this rank's RNG. Raises CheckpointError for a
    checkpoint of another backend or world size."""
    meta = json.loads((path / STATE_DIR / STATE_JSON).read_text())
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if meta.get("backend") != type(trainer).__name__:
        raise CheckpointError(f"--load {path}: saved by the {meta.get('backend')} backend, this is {type(trainer).__name__}")
    sharded = trainer.sharded_training_state
    if sharded and meta.get("world_size") != world:
        raise CheckpointError(f"--load {path}: saved by {meta.get('world_size')} ranks, this run has {world}")
    state_file = path / STATE_DIR / (f"state_rank{_rank()}.pt" if sharded else "state.pt")
    state = torch.load(state_file, map_location="cpu", weights_only=True)
    trainer.load_training_state(state)
    rng_file = path / STATE_DIR / f"rng_rank{_rank()}.pt"
    if rng_file.is_file():
        _set_rng_state(torch.load(rng_file, map_location="cpu", weights_only=True))
    elif meta.get("world_size") != world:
        log.warning("checkpoint_world_size_changed", saved=meta.get("world_size"), now=world, note="RNG states not restored")
    point = ResumePoint(path, int(meta["steps_done"]), int(meta["weight_version"]))
    log.info("checkpoint_loaded", path=str(path), steps_done=point.steps_done, weight_version=point.weight_version)
    return point


def _rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": [np_state[0], torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)), *np_state[2:]],
        "python": list(random.getstate()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), *rest))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_tree(path: Path) -> None:
    for file in path.rglob("*"):
        if file.is_file():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())


__all__ = ["CheckpointError", "ResumePoint", "save_checkpoint", "find_checkpoint", "load_checkpoint", "checkpoint_dir_for"]
