"""Rollout engines: token-in/token-out generation with per-token weight versions and in-flight weight
updates. `build_engine` picks vLLM (`vllm_engine`) or the transformers fallback (`hf_engine`); both
modules import their heavy dependencies lazily, so importing this package is cheap."""

from vime.rollout.base import (
    EngineKind,
    FinishReason,
    GeneratedSample,
    GenerationProgress,
    RolloutEngine,
    SamplingConfig,
    WeightFetchFailed,
    WeightUpdateError,
    WeightUpdateResult,
    build_engine,
    vllm_available,
)

__all__ = [
    "EngineKind",
    "FinishReason",
    "GeneratedSample",
    "GenerationProgress",
    "RolloutEngine",
    "SamplingConfig",
    "WeightFetchFailed",
    "WeightUpdateError",
    "WeightUpdateResult",
    "build_engine",
    "vllm_available",
]
