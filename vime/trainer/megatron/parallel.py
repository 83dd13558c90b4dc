"""Megatron parallel layout: the flags (Megatron's own names), their checks, and process-group setup.

No megatron import at module level: the config is validated on any machine (the launcher checks a
layout before it starts processes); `init_model_parallel` imports megatron-core when it runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class MegatronParallelConfig:
    """Parallel sizes and memory options, named as Megatron-LM's flags (`--tensor-model-parallel-size`, ...).

    Data parallelism is what is left: world_size / (TP * PP * CP). Expert parallelism splits the experts
    of each MoE layer over EP ranks taken from the data-parallel (and context-parallel) ranks.
    """

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int = 1
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = True
    recompute_granularity: Literal["full", "selective"] | None = None
    recompute_method: Literal["uniform", "block"] | None = None
    recompute_num_layers: int | None = None
    # Megatron-LM's --transformer-impl: megatron-core's local layers (SDPA attention) or TransformerEngine's
    # fused norm + linear layers and fused attention (needs TransformerEngine where the trainer runs)
    transformer_impl: Literal["local", "transformer_engine"] = "local"

    def validate(self, world_size: int, *, num_layers: int | None = None, num_experts: int = 0) -> None:
        """Raise ValueError naming the first size that does not fit `world_size` GPUs or the model."""
        tp, pp, cp, ep = (self.tensor_model_parallel_size, self.pipeline_model_parallel_size,
                          self.context_parallel_size, self.expert_model_parallel_size)  # fmt: skip
        for name, value in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp),
                            ("context_parallel_size", cp), ("expert_model_parallel_size", ep),
                            ("expert_tensor_parallel_size", self.expert_tensor_parallel_size)):  # fmt: skip
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if world_size % (tp * pp * cp):
            raise ValueError(f"world size {world_size} is not divisible by TP*PP*CP = {tp}*{pp}*{cp}")
        dp = world_size // (tp * pp * cp)
        if (dp * cp * tp) % (ep * self.expert_tensor_parallel_size):
            raise ValueError(f"expert_model_parallel_size {ep} x expert_tensor_parallel_size "
                             f"{self.expert_tensor_parallel_size} must divide DP*CP*TP = {dp * cp * tp}")
        if self.sequence_parallel and tp == 1:
            raise ValueError("sequence_parallel needs tensor_model_parallel_size > 1")
        if self.sequence_parallel and self.transformer_impl != "transformer_engine":
            # seen on the GPU machine: Megatron's torch-norm fallback asserts "sequence parallel not
            # supported by torch LayerNorm"
            raise ValueError("sequence_parallel needs TransformerEngine's norms (--transformer-impl "
                             "transformer_engine); Megatron's torch norm fallback of the local layers does not support it")
        if num_experts and tp > 1 and not self.sequence_parallel:
            raise ValueError("MoE with tensor_model_parallel_size > 1 needs sequence_parallel (Megatron refuses "
                             "the combination in training); use expert_model_parallel_size instead of TP")
        if cp > 1:
            raise ValueError("context_parallel_size > 1 is not supported: vime's Megatron backend does not split "
                             "its micro-batches' sequences over context-parallel ranks (and the local layers' SDPA "
                             "attention has no ring exchange of key/value chunks)")
        if num_layers is not None and num_layers % pp:
            raise ValueError(f"{num_layers} layers do not split evenly over {pp} pipeline stages")
        if ep > 1 and num_experts % ep:
            raise ValueError(f"{num_experts} experts do not split evenly over expert_model_parallel_size {ep}")
        if self.recompute_granularity == "full" and self.recompute_method is None:
            raise ValueError("recompute_granularity 'full' needs recompute_method 'uniform' or 'block'")

    def transformer_kwargs(self) -> dict[str, Any]:
        """The TransformerConfig fields this layout sets."""
        kw: dict[str, Any] = dict(
            tensor_model_parallel_size=self.tensor_model_parallel_size,
            pipeline_model_parallel_size=self.pipeline_model_parallel_size,
            context_parallel_size=self.context_parallel_size,
            expert_model_parallel_size=self.expert_model_parallel_size,
            expert_tensor_parallel_size=self.expert_tensor_parallel_size,
            sequence_parallel=self.sequence_parallel,
            transformer_impl=self.transformer_impl,
        )
        if self.recompute_granularity is not None:
            kw.update(recompute_granularity=self.recompute_granularity, recompute_method=self.recompute_method,
                      recompute_num_layers=self.recompute_num_layers or (1 if self.recompute_method else None))
        return kw


def init_model_parallel(cfg: MegatronParallelConfig, seed: int) -> None:
    """Create Megatron's process groups over the already initialised default group, and seed the
    tensor-parallel RNG streams. Idempotent: a second call with the groups in place does nothing."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if parallel_state.model_parallel_is_initialized():
        return
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=cfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
        context_parallel_size=cfg.context_parallel_size,
        expert_model_parallel_size=cfg.expert_model_parallel_size,
        expert_tensor_parallel_size=cfg.expert_tensor_parallel_size,
    )  # fmt: skip
    model_parallel_cuda_manual_seed(seed)
