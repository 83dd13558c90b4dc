"""The vLLM rollout engine: `AsyncLLM`, token in / token out, with in-flight versioned weight updates.

This process runs vLLM's front end on the caller's asyncio loop; the engine core runs in a process of
vLLM's, or, for a one-worker engine on the CPU, inline on the same loop (`vllm_inline_core`). Weights reach the workers straight from the trainer's publisher (`VimeWorkerExtension`); the
front end passes only an endpoint and a version. An update fetches in the background while generation
goes on, then pauses vLLM with every request and its KV cache kept, loads, marks the new version and
resumes; with `partial_rollout=False` it lets the requests in flight finish first instead.

Per-token versions come from vLLM's own stamps (0.32+) or, where vLLM has none (0.26), from vime's
`VersionLedger`; `version_source` picks, "auto" by feature detection. R3 capture needs CUDA. What each
step costs, why pauses can be slow, and the vLLM versions this runs on: docs/vllm.md.

A LoRA run's versions are adapters: merged into the base weights by the workers (`adapter_merge`), or,
natively, loaded as vLLM's own adapter (`vllm_lora`): this process fetches the adapter, and the same
pause swaps it in place of the previous version's.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
import uuid
from typing import Any, Awaitable, Callable, Iterator, Literal

import numpy as np

from vime.logging import get_logger
from vime.rollout.base import (
    FinishReason,
    GeneratedSample,
    GenerationProgress,
    RolloutEngine,
    SamplingConfig,
    EngineCannotSleep,
    WeightFetchFailed,
    WeightUpdateError,
    WeightUpdateResult,
    versions_from_spans,
)
from vime.rollout.vllm_environment import apply_vllm_environment, cpu_engine_dtype, engine_arg_name
from vime.rollout.vllm_lora import (
    ADAPTER_ID,
    ADAPTER_NAME,
    AdapterVersions,
    LoraRollout,
    NotAnAdapter,
    choose_lora_rollout,
    native_lora_engine_args,
)
from vime.rollout.vllm_owner_watch import arm as arm_owner_watch
from vime.rollout.vllm_stats import OutputBarrier, StatHooks, silent_prometheus_logger, stat_logger_factory
from vime.rollout.vllm_versions import VersionLedger, output_positions

log = get_logger(__name__)

WORKER_EXTENSION = "vime.rollout.vllm_worker_extension.VimeWorkerExtension"
# Engine arguments vime sets itself: the logprobs must describe the distribution actually sampled from,
# and weight loading needs our worker extension.
FORCED_ENGINE_ARGS: dict[str, Any] = {
    "logprobs_mode": "processed_logprobs",
    "worker_extension_cls": WORKER_EXTENSION,
}
# On CPU, vLLM's default gpu_memory_utilization (0.92) is a fraction of host RAM for the KV cache and
# fails to start next to a trainer; use a small share unless the user chose one (or VLLM_CPU_KVCACHE_SPACE).
CPU_DEFAULT_MEMORY_FRACTION = 0.1
_FETCH_POLL_S = (0.002, 0.02)  # status polling interval while the worker fetches: start, cap
# How long a worker of an engine with no request in flight may hold a status poll for the fetch to end:
# the engine core serves nothing else meanwhile, so a request arriving then waits up to this long.
_IDLE_FETCH_WAIT_S = 0.25
_FINISH_REASONS: dict[str | None, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}
# Where per-token weight versions come from: vLLM's own stamps (0.32+), vime's ledger (any vLLM whose
# front end it can read; the only choice on 0.26), or "auto": vLLM's when it has them.
VersionSource = Literal["auto", "vllm", "vime"]
# Where vLLM's engine core runs: its own process (vLLM's layout), stepped on this process's event loop
# (`vllm_inline_core`), or "auto": inline for a one-worker engine on the CPU, where the process hop is
# extra work on the same cores, in a process everywhere else.
EngineCorePlacement = Literal["auto", "process", "inline"]
R3_CPU_ERROR = (
    "--use-rollout-routing-replay with the vLLM engine needs CUDA: vLLM captures routed experts only in its "
    "GPU model runners. For R3 on CPU use --rollout-engine hf."
)

def moe_layer_indices(hf_config: Any) -> list[int]:
    """Decoder layers with a sparse MoE block, in order (Qwen2/3-MoE rules: `mlp_only_layers`,
    `decoder_sparse_step`); every layer when the config has no such fields but has experts."""
    text = getattr(hf_config, "text_config", None) or hf_config
    layers = int(text.num_hidden_layers)
    experts = int(getattr(text, "num_experts", None) or getattr(text, "n_routed_experts", None) or 0)
    if experts <= 0:
        return []
    dense = set(getattr(text, "mlp_only_layers", None) or ())
    step = int(getattr(text, "decoder_sparse_step", 1) or 1)
    return [i for i in range(layers) if i not in dense and (i + 1) % step == 0]

def num_routed_experts(hf_config: Any) -> int:
    text = getattr(hf_config, "text_config", None) or hf_config
    return int(getattr(text, "num_experts", None) or getattr(text, "n_routed_experts", None) or 0)

def vllm_routing_trace(routed: Any, moe_layers: list[int], num_experts: int, num_tokens: int) -> np.ndarray:
    """vLLM's `CompletionOutput.routed_experts` `(num_tokens - 1, num_hidden_layers, top_k)` as a vime
    trace `(num_tokens - 1, moe_layers, top_k)` of the compact dtype. Also accepts an array that already
    has only the MoE layers. Raises ValueError when the shape fits neither."""
    from vime.r3.trace import encode_trace

    arr = np.asarray(routed)
    if arr.ndim != 3 or arr.shape[0] != num_tokens - 1:
        raise ValueError(f"vLLM routed_experts has shape {arr.shape}, expected ({num_tokens - 1}, layers, top_k)")
    if arr.shape[1] != len(moe_layers):
        if not moe_layers or arr.shape[1] <= max(moe_layers):
            raise ValueError(f"vLLM routed_experts has {arr.shape[1]} layers; MoE layers are {moe_layers}")
        arr = arr[:, moe_layers]
    return encode_trace(arr, num_experts)

def normalize_engine_args(engine_args: dict[str, Any] | None) -> dict[str, Any]:
    """`--vllm-max-model-len` style keys to `max_model_len`; rejects the arguments vime owns."""
    args = {engine_arg_name(k): v for k, v in (engine_args or {}).items()}
    for key, value in FORCED_ENGINE_ARGS.items():
        if key in args and args[key] != value:
            raise ValueError(f"engine arg {key}={args[key]!r} conflicts with vime, which needs {key}={value!r}")
    if "model" in args:
        raise ValueError("pass the model as model_path, not as an engine arg")
    return args

def _one_worker(args: dict[str, Any]) -> bool:
    return all(int(args.get(key, 1) or 1) == 1 for key in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"))


class VllmRolloutEngine(RolloutEngine):
    """`RolloutEngine` on vLLM's `AsyncLLM`. See the module docstring for the update protocol.

    `engine_args` go to `AsyncEngineArgs` (unknown names raise ValueError at `start`).
    `fetch_timeout_s` bounds each weight fetch (no publisher, no progress); `warmup=False` skips the
    start-up warm-up (then the first pause may take seconds, see the module docstring). With
    `lora_rank`, versions are LoRA adapters of that rank, loaded as `lora_rollout` says (`vllm_lora`);
    a native engine adapts only `lora_target_modules` (the trainer's `--target-modules`).
    """

    def __init__(
        self,
        model_path: str,
        engine_args: dict[str, Any] | None = None,
        weight_endpoint: str | None = None,
        initial_version: int = 0,
        *,
        fetch_timeout_s: float = 60.0,
        warmup: bool = True,
        capture_routing: bool = False,
        partial_rollout: bool = True,
        version_source: VersionSource = "auto",
        sleep_mode: bool = False,
        engine_core: EngineCorePlacement = "auto",
        lora_rank: int | None = None,
        lora_rollout: LoraRollout = "auto",
        lora_target_modules: str | list[str] = "all-linear",
    ) -> None:
        if lora_rollout not in ("auto", "native", "merge"):
            raise ValueError(f"lora_rollout must be auto, native or merge, got {lora_rollout!r}")
        self._lora_rank = lora_rank or None
        self._lora_rollout_wanted: LoraRollout = lora_rollout
        self._lora_target_modules = lora_target_modules
        self.lora_rollout: Literal["native", "merge"] | None = None  # resolved at start for a LoRA run
        self._adapters: AdapterVersions | None = None  # native LoRA: the versions' directories
        self._lora_request: Any = None  # native LoRA: vLLM's LoRARequest of the version loaded
        if version_source not in ("auto", "vllm", "vime"):
            raise ValueError(f"version_source must be auto, vllm or vime, got {version_source!r}")
        if engine_core not in ("auto", "process", "inline"):
            raise ValueError(f"engine_core must be auto, process or inline, got {engine_core!r}")
        self._engine_core_wanted: EngineCorePlacement = engine_core
        self.engine_core_placement: EngineCorePlacement | None = None  # resolved at start
        self._version_source_wanted: VersionSource = version_source
        self.version_source: VersionSource | None = None  # resolved at start
        self._native_versions = False  # this vLLM has update_weight_version / CompletionOutput.weight_versions
        self._ledger: VersionLedger | None = None
        self._barrier: OutputBarrier | None = None
        self._registrations_done = asyncio.Event()  # no request is between the gate and vLLM's registry
        self._registrations_done.set()
        self._requests_in_flight = 0
        self._requests_done = asyncio.Event()  # every registered request has had its final output
        self._requests_done.set()
        # Requests whose vime ledger versions differed from vLLM's stamps (both kept: a self-check).
        self.version_disagreements = 0
        # How the workers loaded the last version: "vllm" (its reload_weights) or "direct" (vLLM-CPU,
        # vime.rollout.vllm_cpu_reload)
        self.last_load_path: str | None = None
        # partial rollouts (default): requests in flight at an update are frozen, then continue under the
        # new weights (their tokens carry both versions). Off: the update waits until they finish, so
        # every sample is generated by one version, at the cost of a pause as long as the longest one.
        self._partial_rollout = bool(partial_rollout)
        if capture_routing:
            import torch

            if not torch.cuda.is_available():
                raise RuntimeError(R3_CPU_ERROR)
        self._capture_routing = bool(capture_routing)
        self._sleep_mode = bool(sleep_mode)
        self._asleep_level = 0  # the level of the sleep in effect, 0 when awake
        self._moe_layers: list[int] = []
        self._num_experts = 0
        self._model_path = str(model_path)
        self._engine_args = normalize_engine_args(engine_args)
        self._weight_endpoint = weight_endpoint
        self._initial_version = int(initial_version)
        self._version = int(initial_version)
        self._fetch_timeout_s = float(fetch_timeout_s)
        self._warmup = warmup
        self._llm: Any = None  # vllm AsyncLLM once started
        self._tokenizer: Any = None
        self._update_lock = asyncio.Lock()
        # Serializes changes of vLLM's pause state: user pause/resume and an update's critical section.
        self._pause_lock = asyncio.Lock()
        self._user_paused = False
        # Cleared while the engine is paused (by the user or for an update): new prompts wait, then use
        # the salt of the version current when they are submitted.
        self._submit_open = asyncio.Event()
        self._submit_open.set()
        self._stats = StatHooks()
        self._ids = itertools.count()
        self._run_id = uuid.uuid4().hex[:8]
        self._closed = False
        self.start_seconds: float | None = None
        self.warmup_seconds: float | None = None

    # --- lifecycle ----------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start vLLM (engine core + worker processes), warm it up, set the initial version.

        Takes tens of seconds on CPU (model load, torch.compile, KV cache allocation); the build runs
        on a thread, so the event loop keeps serving other tasks meanwhile. Raises ValueError for
        unknown engine args, and whatever vLLM raises for a bad model or resources.
        """
        if self._llm is not None:
            return
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        arm_owner_watch()  # the engine's processes die with this one, even by SIGKILL
        apply_vllm_environment(
            on_cuda=current_platform.is_cuda_alike() and not current_platform.is_cpu(),
            capture_routing=self._capture_routing,
        )
        args = dict(self._engine_args)
        if (
            current_platform.is_cpu()
            and "gpu_memory_utilization" not in args
            and "VLLM_CPU_KVCACHE_SPACE" not in os.environ
        ):
            args["gpu_memory_utilization"] = CPU_DEFAULT_MEMORY_FRACTION
        if current_platform.is_cpu():
            args = cpu_engine_dtype(args)
        args.update(FORCED_ENGINE_ARGS)
        if current_platform.is_cpu() and "distributed_executor_backend" not in args and _one_worker(args):
            from vime.rollout.vllm_cpu_executor import CpuInCoreExecutor

            args["distributed_executor_backend"] = CpuInCoreExecutor
        placement = self._engine_core_wanted
        if placement == "auto":
            placement = "inline" if current_platform.is_cpu() and _one_worker(args) else "process"
        if placement == "inline" and not _one_worker(args):
            raise ValueError("engine_core='inline' runs one worker; tensor, pipeline or data parallel engines need "
                             "vLLM's processes (engine_core='process')")  # fmt: skip
        if self._sleep_mode and current_platform.is_sleep_mode_available():
            # vLLM's CuMem allocator, so that sleeping really frees the GPU memory (the CPU build has no
            # sleep mode: there sleeping only stops the scheduler).
            args["enable_sleep_mode"] = True
        if self._lora_rank:
            self.lora_rollout = choose_lora_rollout(self._lora_rollout_wanted, current_platform.is_cpu(), self._sleep_mode)
            if self.lora_rollout == "native":
                from vime.trainer.lora import target_module_names

                targets = target_module_names(self._model_path, self._lora_target_modules)
                args.update(native_lora_engine_args(self._lora_rank, targets))
                self._adapters = AdapterVersions()
        if self._capture_routing:
            if current_platform.is_cpu():
                raise RuntimeError(R3_CPU_ERROR)
            args["enable_return_routed_experts"] = True
            args.setdefault("enable_prefix_caching", True)  # vLLM's routed-experts capture needs it on
        try:
            engine_args = AsyncEngineArgs(model=self._model_path, **args)
        except TypeError as exc:
            raise ValueError(f"bad vLLM engine args {sorted(self._engine_args)}: {exc}") from None
        started = time.perf_counter()
        # Built on a thread so this loop stays responsive (heartbeats) during the tens of seconds vLLM
        # needs; AsyncLLM starts its asyncio tasks lazily on first use when made outside a loop.
        stat_loggers = [stat_logger_factory(self._stats)]
        if args.get("disable_log_stats"):
            stat_loggers.append(silent_prometheus_logger())
        if placement == "inline":
            from vime.rollout.vllm_inline_core import inline_async_llm

            self._llm = await asyncio.to_thread(inline_async_llm, engine_args, stat_loggers)
        else:
            self._llm = await asyncio.to_thread(AsyncLLM.from_engine_args, engine_args, stat_loggers=stat_loggers)
        self.engine_core_placement = placement
        self._choose_version_source()
        self._tokenizer = self._llm.tokenizer
        if self._capture_routing:
            hf_config = self._llm.model_config.hf_config
            self._moe_layers = moe_layer_indices(hf_config)
            self._num_experts = num_routed_experts(hf_config)
            if not self._moe_layers:
                raise ValueError(f"capture_routing needs an MoE model; {self._model_path} has no MoE layers")
        self.start_seconds = time.perf_counter() - started
        if self._warmup:
            warm = time.perf_counter()
            await self._warm_up()
            self.warmup_seconds = time.perf_counter() - warm
        if self._native_versions:
            await self._llm.update_weight_version(str(self._version))
        log.info(
            "vllm engine started",
            model=self._model_path,
            start_s=round(self.start_seconds, 2),
            warmup_s=round(self.warmup_seconds or 0.0, 2),
            weight_version=self._version,
            version_source=self.version_source,
            engine_core=self.engine_core_placement,
            engine_args=self._engine_args,
            lora_rollout=self.lora_rollout,
        )

    def _choose_version_source(self) -> None:
        """Feature detection: vLLM's stamps where it makes them, vime's ledger otherwise (or when asked).
        Raises RuntimeError when neither is possible on this vLLM."""
        from vllm.outputs import CompletionOutput

        has_field = "weight_versions" in getattr(CompletionOutput, "__dataclass_fields__", {})
        self._native_versions = has_field and hasattr(self._llm, "update_weight_version")
        source = self._version_source_wanted
        if source == "auto":
            source = "vllm" if self._native_versions else "vime"
        if source == "vllm" and not self._native_versions:
            raise RuntimeError("version_source='vllm': this vLLM does not stamp per-token weight versions")
        if source == "vime":
            try:
                self._barrier = OutputBarrier(self._llm, self._stats)
                output_positions(self._llm)
            except RuntimeError as exc:
                raise RuntimeError(f"this vLLM neither stamps per-token versions nor lets vime count them: {exc}") from exc
            self._ledger = VersionLedger()
        self.version_source = source

    async def _warm_up(self) -> None:
        """Run the code paths whose first use compiles something, before any pause can wait on them."""
        from vllm import SamplingParams

        prompt = self._inputs([self._any_token()] * 4, cache_salt=f"vime-warmup-{self._run_id}")
        jobs = [
            SamplingParams(n=1, max_tokens=2, temperature=1.0, logprobs=0, detokenize=False),
            SamplingParams(n=2, max_tokens=2, temperature=0.7, top_p=0.9, top_k=5, logprobs=0, detokenize=False),
            SamplingParams(n=1, max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False),
        ]
        for i, params in enumerate(jobs):  # one at a time: batch size 1 first, then 2
            async for _ in self._llm.generate(prompt, params, request_id=self._request_id(f"warmup{i}")):
                pass

    async def shutdown(self) -> None:
        """Stop vLLM's processes. Idempotent; generations still running fail with vLLM's error."""
        if self._closed:
            return
        self._closed = True
        llm, self._llm = self._llm, None
        self._user_paused = False
        self._submit_open.set()  # calls waiting on a pause go on and fail with "engine shut down"
        if llm is not None:
            llm.shutdown()
            log.info("vllm engine stopped", model=self._model_path)
        if self._adapters is not None:
            self._adapters.close()

    # --- generation ---------------------------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def generation_paused(self) -> bool:
        return self._user_paused

    @property
    def progress(self) -> GenerationProgress:
        return GenerationProgress(sequences=self._stats.sequences, tokens=self._stats.tokens)

    @property
    def requests_in_flight(self) -> int:
        return self._requests_in_flight

    async def pause_generation(self) -> None:
        """Freeze vLLM's scheduler with every request and its KV cache kept (`mode="keep"`); returns
        after the engine step in progress. New `generate`/`score` calls wait in this process until
        `resume_generation`. Waits for an update's critical section, not for its fetch. Raises
        RuntimeError if the engine is not running, and vLLM's error if the engine core is gone."""
        llm = self._running()
        async with self._pause_lock:
            if self._user_paused:
                return
            self._submit_open.clear()
            try:
                await _to_completion(llm.pause_generation(mode="keep", clear_cache=False))
            except asyncio.CancelledError:
                self._user_paused = True  # the pause went through before the cancellation: keep its state
                raise
            except Exception:
                self._submit_open.set()  # nothing was frozen
                raise
            self._user_paused = True
        log.info("vllm engine generation paused", weight_version=self._version)

    async def resume_generation(self) -> None:
        """Unfreeze: requests continue, waiting calls are submitted (with the current version's salt).
        A no-op on an engine that is not frozen (also one shut down meanwhile)."""
        if not self._user_paused:
            return
        llm = self._running()
        async with self._pause_lock:
            if not self._user_paused:
                return
            try:
                await _to_completion(llm.resume_generation())
            except asyncio.CancelledError:
                self._user_paused = False  # the resume went through before the cancellation
                self._submit_open.set()
                raise
            self._user_paused = False
            self._submit_open.set()
        log.info("vllm engine generation resumed", weight_version=self._version)

    async def generate(self, prompt_tokens: list[int], n: int, sampling: SamplingConfig) -> list[GeneratedSample]:
        """Sample `n` responses (one vLLM request with `SamplingParams(n=n)`; the prompt is prefilled
        once and shared through the prefix cache). Raises RuntimeError if the engine is not running,
        ValueError for an empty prompt or n < 1, and vLLM's errors for prompts too long."""
        llm = self._running()
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if len(prompt_tokens) == 0:
            raise ValueError("empty prompt")
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            n=n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_tokens=sampling.max_tokens,
            stop_token_ids=list(sampling.stop_token_ids or ()),
            seed=sampling.seed,
            ignore_eos=sampling.ignore_eos,
            logprobs=0,  # the sampled token's logprob only
            detokenize=False,  # text is decoded once at the end; per-step detokenizing costs the front end
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        await self._through_gate()
        llm = self._running()  # it may have shut down while we waited
        fallback_version = self._version
        inputs = self._inputs([int(t) for t in prompt_tokens], cache_salt=self._cache_salt())
        request_id = self._request_id("gen")
        try:
            final = await self._run_request(llm, request_id, inputs, params, self._lora_request)
            completions = sorted(final.outputs, key=lambda c: c.index)
            prompt_len = len(prompt_tokens)
            texts = self._decode([c.token_ids for c in completions])
            return [self._to_sample(c, text, fallback_version, prompt_len, request_id) for c, text in zip(completions, texts)]
        finally:
            if self._ledger is not None:
                self._ledger.forget(request_id)

    async def _run_request(self, llm: Any, request_id: str, inputs: Any, params: Any, lora_request: Any = None) -> Any:
        """Submit one request and wait for its final output (vLLM's `generate` loop, with the moment the
        request is registered made visible to the version ledger). Aborts it in vLLM if we fail or are
        cancelled once it is registered."""
        with self._in_flight():
            self._begin_registration()
            try:
                collector = await llm.add_request(request_id, inputs, params, lora_request=lora_request)
                if self._ledger is not None:
                    self._ledger.track(request_id, params.n, self._version)
            finally:
                self._end_registration()
            try:
                while True:
                    output = collector.get_nowait() or await collector.get()
                    if output.finished:
                        return output
            except BaseException:
                if not self._closed:
                    try:
                        await _to_completion(llm.abort(collector.request_id, internal=True))
                    except Exception as exc:  # the engine is gone: the original error says more
                        log.warning("could not abort a vLLM request", request_id=request_id, error=str(exc))
                raise

    @contextlib.contextmanager
    def _in_flight(self) -> Iterator[None]:
        """Counts a request from the gate to its final output (entered before anything yields, so with
        the gate closed a count of 0 means vLLM holds no request of ours)."""
        self._requests_in_flight += 1
        self._requests_done.clear()
        try:
            yield
        finally:
            self._requests_in_flight -= 1
            if self._requests_in_flight == 0:
                self._requests_done.set()

    async def _through_gate(self) -> None:
        # Re-checked after waking: an update may have closed the gate again before this task ran, and
        # from here to the registration nothing yields, so no update can start in between.
        while not self._submit_open.is_set():
            await self._submit_open.wait()

    def _begin_registration(self) -> None:
        if self._ledger is not None:
            self._ledger.submitting += 1
            self._registrations_done.clear()

    def _end_registration(self) -> None:
        if self._ledger is not None:
            self._ledger.submitting -= 1
            if self._ledger.submitting == 0:
                self._registrations_done.set()

    async def score(self, prompt_tokens: list[int], response_tokens: list[int]) -> np.ndarray:
        """Logprobs of `response_tokens` after `prompt_tokens` via vLLM prompt logprobs (raw logits,
        temperature 1). Requests with prompt logprobs skip the prefix cache, so this always reflects
        the current weights."""
        llm = self._running()
        if len(prompt_tokens) == 0:
            raise ValueError("empty prompt")
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        await self._through_gate()
        llm = self._running()
        tokens = [int(t) for t in prompt_tokens] + [int(t) for t in response_tokens]
        final = None
        inputs = self._inputs(tokens, cache_salt=self._cache_salt())
        with self._in_flight():
            async for output in llm.generate(inputs, params, request_id=self._request_id("score"), lora_request=self._lora_request):
                final = output
        if final is None or final.prompt_logprobs is None:
            raise RuntimeError("vLLM returned no prompt logprobs")
        start = len(prompt_tokens)
        return np.asarray(
            [final.prompt_logprobs[i][tokens[i]].logprob for i in range(start, len(tokens))], dtype=np.float32
        )

    def _decode(self, token_ids: list[Any]) -> list[str]:
        """The samples' texts in one tokenizer call (vLLM's tokenizer wrapper costs a pool checkout per call)."""
        if self._tokenizer is None:
            return [""] * len(token_ids)
        texts = self._tokenizer.batch_decode([list(ids) for ids in token_ids], skip_special_tokens=True)
        return [text if len(ids) else "" for text, ids in zip(texts, token_ids)]

    def _to_sample(
        self, completion: Any, text: str, fallback_version: int, prompt_len: int = 0, request_id: str | None = None
    ) -> GeneratedSample:
        tokens = np.asarray(completion.token_ids, dtype=np.int32)
        logprobs = _sampled_logprobs(completion.logprobs, completion.token_ids)
        versions = self._token_versions(completion, len(tokens), fallback_version, request_id)
        finish = _FINISH_REASONS.get(completion.finish_reason)
        if finish is None:  # "error" or unknown: the sample is unusable, like an abort
            log.warning("vllm request ended abnormally", finish_reason=completion.finish_reason)
            finish = "abort"
        routed = getattr(completion, "routed_experts", None) if self._capture_routing else None
        trace = None
        if routed is not None and finish != "abort":
            trace = vllm_routing_trace(routed, self._moe_layers, self._num_experts, prompt_len + len(tokens))
        return GeneratedSample(
            response_tokens=tokens,
            rollout_logprobs=logprobs,
            loss_mask=np.ones(len(tokens), dtype=np.uint8),
            token_versions=versions,
            finish_reason=finish,
            response_text=text,
            routed_experts=trace,
            num_experts=self._num_experts if trace is not None else None,
        )

    def _token_versions(
        self, completion: Any, num_tokens: int, fallback_version: int, request_id: str | None
    ) -> np.ndarray:
        native = None
        if self._native_versions:
            spans = [(self._parse_version(s.version), s.start, s.end) for s in (completion.weight_versions or ())]
            native = versions_from_spans(spans, num_tokens, fallback_version)
        if self._ledger is None or request_id is None:
            assert native is not None, "an engine without vLLM stamps tracks every generate request"
            return native
        ledger = self._ledger.versions(request_id, int(completion.index), num_tokens)
        if native is not None and not np.array_equal(native, ledger):
            self.version_disagreements += 1
            log.warning(
                "vime's per-token versions differ from vLLM's", request_id=request_id,
                vllm=_version_runs(native), vime=_version_runs(ledger),
            )
        return ledger

    # --- weights ------------------------------------------------------------------------------------

    async def update_weights(self, version: int, endpoint: str | None = None) -> WeightUpdateResult:
        """Load the publisher's newest weights (>= `version`) while generation continues.

        Serialized: concurrent calls run one after another, and a call for a version already loaded
        returns `skipped=True` at once. Raises `WeightUpdateError`: if the fetch fails the engine keeps
        its old weights and keeps generating; if the load itself fails the message says so and the
        engine should be restarted. Cancelling the caller never leaves the engine paused by the update.
        On an engine frozen by `pause_generation` it returns with the engine still frozen; with
        `partial_rollout=False` the frozen requests first run to completion on the old weights.
        """
        self._running()
        endpoint = endpoint or self._weight_endpoint
        if not endpoint:
            raise ValueError("no weight endpoint: pass one or build the engine with weight_endpoint")
        started = time.perf_counter()
        async with self._update_lock:
            if version <= self._version:
                return WeightUpdateResult(version=self._version, requested_version=version, skipped=True)
            fetch_start = time.perf_counter()
            if self._adapters is not None:
                status, load = await self._fetch_adapter(endpoint, version)
            else:
                status, load = await self._fetch_in_background(endpoint, version), self._load_into_workers
            fetch_s = time.perf_counter() - fetch_start
            # The critical section runs as its own task: if our caller is cancelled we still finish it
            # (it resumes generation) before letting the cancellation through.
            critical = asyncio.ensure_future(self._apply_paused(load))
            try:
                timings = await asyncio.shield(critical)
            except asyncio.CancelledError:
                await asyncio.wait([critical])
                raise
        result = WeightUpdateResult(
            version=self._version,
            requested_version=version,
            nbytes=int(status["nbytes"]),
            fetch_s=fetch_s,
            total_s=time.perf_counter() - started,
            extra=_fetch_extra(status),
            **timings,
        )
        log.info(
            "weights updated in flight",
            version=result.version,
            requested=version,
            nbytes=result.nbytes,
            fetch_s=round(result.fetch_s, 4),
            pause_s=round(result.pause_s, 4),
            load_s=round(result.load_s, 4),
            resume_s=round(result.resume_s, 4),
            paused_s=round(result.paused_s, 4),
            total_s=round(result.total_s, 4),
            transport=status["transport"],
        )
        return result

    async def _fetch_in_background(self, endpoint: str, version: int) -> dict[str, Any]:
        """Have every worker fetch the same version >= `version`; return the merged status."""
        llm = self._running()
        min_version = version
        for _ in range(3):  # workers can see different "latest" versions if one is published mid-way
            await llm.collective_rpc("vime_start_fetch", args=(endpoint, min_version, self._fetch_timeout_s))
            statuses = await self._wait_fetched(llm)
            errors = [s["error"] for s in statuses if "error" in s]
            if errors:
                raise WeightFetchFailed(f"weight fetch from {endpoint} failed (engine keeps its weights): {errors[0]}")
            versions = {int(s["version"]) for s in statuses}
            if len(versions) == 1:
                return {"version": versions.pop(), "nbytes": statuses[0]["nbytes"],
                        "fetch_s": max(s["fetch_s"] for s in statuses),
                        "transport": ",".join(sorted({str(s.get("transport", "chunks")) for s in statuses}))}
            min_version = max(versions)
        raise WeightFetchFailed(f"workers could not agree on a weight version from {endpoint}")

    async def _wait_fetched(self, llm: Any) -> list[dict[str, Any]]:
        # Each poll is a small RPC the engine core serves between steps, so polling does not pause
        # generation. The worker's fetcher enforces the transfer timeout; this bound is a backstop.
        deadline = time.monotonic() + 3 * self._fetch_timeout_s
        delay = _FETCH_POLL_S[0]
        while True:
            # An idle engine has no steps to keep going: its workers answer when the fetch is done
            # (or after a short wait), instead of after the next backoff interval.
            wait_s = _IDLE_FETCH_WAIT_S if self._requests_in_flight == 0 else 0.0
            statuses = await llm.collective_rpc("vime_fetch_status", args=(wait_s,))
            if any(s is None for s in statuses):
                raise WeightFetchFailed("a vLLM worker lost its weight fetch")
            if all(s["done"] for s in statuses):
                return statuses
            if time.monotonic() > deadline:
                raise WeightFetchFailed("weight fetch did not finish in time")
            await asyncio.sleep(delay)
            delay = min(delay * 2, _FETCH_POLL_S[1])

    # --- colocation: sleep and wake ----------------------------------------------------------------

    @property
    def asleep(self) -> bool:
        return self._asleep_level > 0

    async def sleep(self, level: int) -> None:
        """vLLM's sleep with mode "wait": requests in flight finish first (level 1 and 2 discard the KV
        cache, so frozen requests could not continue), new ones wait in vime until `wake_up` and then
        run on the weights it loads. See `RolloutEngine.sleep`."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if not self._sleep_mode:
            raise EngineCannotSleep("this engine was built without sleep_mode (colocation needs it)")
        llm = self._running()
        async with self._update_lock, self._pause_lock:
            if self._asleep_level:
                return
            if self._user_paused:
                raise RuntimeError("the engine is frozen by pause_generation; resume it before sleep")
            started = time.perf_counter()
            self._submit_open.clear()
            try:
                await self._registrations_done.wait()
                await llm.sleep(level=level, mode="wait")
                # vLLM answers the sleep call before its front end has handed the drained requests'
                # final outputs to their callers; "finish first" means those callers have them.
                await self._requests_done.wait()
            except BaseException:
                self._submit_open.set()
                raise
            self._asleep_level = level
        log.info("vllm engine asleep", level=level, seconds=round(time.perf_counter() - started, 4),
                 weight_version=self._version)  # fmt: skip

    async def wake_up(self, version: int | None = None, endpoint: str | None = None) -> WeightUpdateResult | None:
        """Wake the weights, load the new version into them, then wake the KV cache and the scheduler,
        so peak memory stays one model plus the fetch. After a level-2 sleep the weights are always
        reloaded (the latest version >= the current one), since their memory was discarded."""
        llm = self._running()
        endpoint = endpoint or self._weight_endpoint
        started = time.perf_counter()
        async with self._update_lock, self._pause_lock:
            if not self._asleep_level:
                raise RuntimeError("wake_up on an engine that is not asleep")
            reload = self._asleep_level == 2
            wanted = max(version or 0, self._version if reload else 0)
            load = version is not None and version > self._version or reload
            if load and not endpoint:
                raise ValueError("no weight endpoint: pass one or build the engine with weight_endpoint")
            await llm.wake_up(tags=["weights"])
            result = None
            if load:
                assert endpoint is not None
                fetch_start = time.perf_counter()
                status = await self._fetch_in_background(endpoint, wanted)
                fetch_s = time.perf_counter() - fetch_start
                load_start = time.perf_counter()
                await self._load_into_workers(llm)
                load_s = time.perf_counter() - load_start
                result = WeightUpdateResult(
                    version=self._version, requested_version=wanted, nbytes=int(status["nbytes"]), fetch_s=fetch_s,
                    load_s=load_s, paused_s=0.0, total_s=time.perf_counter() - started,
                    extra=_fetch_extra(status),
                )  # fmt: skip
            await llm.wake_up(tags=["kv_cache"])  # the last tag: vLLM resumes its scheduler
            self._asleep_level = 0
            self._submit_open.set()
        log.info("vllm engine awake", seconds=round(time.perf_counter() - started, 4), weight_version=self._version,
                 loaded=result is not None, transport=None if result is None else result.extra["transport"])  # fmt: skip
        return result

    async def _apply_paused(self, load: Callable[..., Awaitable[None]]) -> dict[str, float]:
        async with self._pause_lock:
            return await self._apply_paused_locked(load)

    async def _apply_paused_locked(self, load: Callable[..., Awaitable[None]]) -> dict[str, float]:
        llm = self._running()
        self._submit_open.clear()
        user_paused = self._user_paused
        t0 = time.perf_counter()
        paused = False
        try:
            await self._registrations_done.wait()  # requests past the gate reach vLLM's registry first
            # With the gate closed and no request of ours in vLLM, nothing can run during the load: the
            # pause and resume (two engine round trips) would guard nothing.
            idle = self._requests_in_flight == 0
            # The first native adapter also lets requests in flight finish: they run without an adapter,
            # and vLLM would not move them onto it, so their later tokens would not be the new version's.
            first_adapter = self._adapters is not None and self._lora_request is None
            if (not self._partial_rollout or first_adapter) and not idle:
                # Also on a frozen engine: PAUSED_ALL -> PAUSED_NEW lets its requests finish first.
                await llm.pause_generation(mode="wait", clear_cache=False)
                paused = True
            elif not user_paused and not idle:
                await llm.pause_generation(mode="keep", clear_cache=False)
                paused = True
            positions = None
            if self._ledger is not None:
                assert self._barrier is not None
                await self._barrier.wait()  # every output made before the pause is counted
                positions = output_positions(llm)
            t1 = time.perf_counter()
            await load(llm, positions=positions)
            t2 = time.perf_counter()
        finally:
            # Never leave the engine paused by the update, whatever failed above; a user's freeze stays.
            if not user_paused:
                if paused:
                    await llm.resume_generation()
                self._submit_open.set()
            elif paused and (not self._partial_rollout or first_adapter):
                await llm.pause_generation(mode="keep", clear_cache=False)  # back from "wait" to a freeze
        t3 = time.perf_counter()
        return {"pause_s": t1 - t0, "load_s": t2 - t1, "resume_s": t3 - t2, "paused_s": t3 - t0}

    async def _load_into_workers(self, llm: Any, positions: Any = None) -> None:
        """Load the fetched version in every worker and make it the engine's (`_mark_version`). Raises
        WeightUpdateError: the model may be partly updated."""
        try:
            results = await llm.collective_rpc("vime_apply_fetched", args=(self._fetch_timeout_s,))
        except Exception as exc:
            raise WeightUpdateError(
                f"loading fetched weights into vLLM failed; the model may be partly updated, restart the engine: {exc}"
            ) from exc
        loaded = {int(r["version"]) for r in results}
        self.last_load_path = ",".join(sorted({str(r.get("load_path", "vllm")) for r in results}))
        if len(loaded) != 1:
            raise WeightUpdateError(f"vLLM workers loaded different versions {sorted(loaded)}; restart")
        await self._mark_version(llm, loaded.pop(), positions)

    async def _fetch_adapter(self, endpoint: str, version: int) -> tuple[dict[str, Any], Callable[..., Awaitable[None]]]:
        """Native LoRA: fetch the newest adapter >= `version` here (megabytes, on a thread) and write it
        for vLLM; returns its status and the load step for the paused section. Raises WeightFetchFailed
        (the engine keeps its adapter)."""
        from vime.weights.fetcher import WeightFetcher

        assert self._adapters is not None
        adapters = self._adapters

        def fetch_and_write() -> tuple[Any, Any]:
            with WeightFetcher(endpoint, timeout_s=self._fetch_timeout_s) as fetcher:
                fetched = fetcher.fetch(min_version=version)
                try:
                    return fetched, adapters.write(fetched.version, fetched.tensors, fetched.adapter_config)
                finally:
                    fetched.release()  # vLLM reads the written files; the tensors are not needed past here

        try:
            fetched, directory = await asyncio.to_thread(fetch_and_write)
        except NotAnAdapter as exc:
            raise WeightFetchFailed(str(exc)) from exc
        except Exception as exc:  # the fetcher's errors: publisher gone, timeout, checksum
            raise WeightFetchFailed(f"adapter fetch from {endpoint} failed (engine keeps its adapter): {exc}") from exc

        async def load(llm: Any, positions: Any = None) -> None:
            from vllm.lora.request import LoRARequest

            try:
                await llm.add_lora(LoRARequest(ADAPTER_NAME, ADAPTER_ID, str(directory), load_inplace=True))
            except Exception as exc:
                raise WeightUpdateError(f"vLLM could not load adapter version {fetched.version}; restart the engine: {exc}") from exc
            # What requests carry must not say load_inplace: vLLM's workers reload an in-place adapter
            # from disk at every step that schedules a request carrying it.
            self._lora_request = LoRARequest(ADAPTER_NAME, ADAPTER_ID, str(adapters.make_current(directory)))
            await self._mark_version(llm, int(fetched.version), positions)

        status = {"version": fetched.version, "nbytes": fetched.nbytes, "fetch_s": fetched.seconds, "transport": "lora"}
        return status, load

    async def _mark_version(self, llm: Any, new_version: int, positions: Any) -> None:
        """Make `new_version` the engine's: vLLM's stamps, vime's ledger at `positions`. A version already
        current (a level-2 wake-up refilling its weights) needs no mark."""
        if new_version == self._version:
            return
        if self._native_versions:
            await llm.update_weight_version(str(new_version))
        if self._ledger is not None:
            in_flight = self._ledger.mark(new_version, positions if positions is not None else output_positions(llm))
            log.debug("version boundary marked", weight_version=new_version, sequences_in_flight=in_flight)
        self._version = new_version

    # --- helpers ------------------------------------------------------------------------------------

    def _running(self) -> Any:
        if self._llm is None:
            raise RuntimeError("engine not started" if not self._closed else "engine shut down")
        return self._llm

    def _request_id(self, kind: str) -> str:
        return f"vime-{self._run_id}-{kind}-{next(self._ids)}"

    def _cache_salt(self) -> str:
        # Prefix-cache blocks are keyed by the salt: a new version never reuses KV from older weights.
        return f"vime-{self._run_id}-w{self._version}"

    def _parse_version(self, label: str) -> int:
        # Labels are the str(int) versions we set; vLLM's initial "default" means the start checkpoint.
        try:
            return int(label)
        except (TypeError, ValueError):
            return self._initial_version

    def _any_token(self) -> int:
        tok = self._tokenizer
        for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(tok, attr, None) if tok is not None else None
            if isinstance(value, int):
                return value
        return 0

    @staticmethod
    def _inputs(tokens: list[int], cache_salt: str) -> Any:
        try:  # the engine-input form (vLLM >= 0.32): no renderer pass, no deprecation warning
            from vllm.inputs.engine import tokens_input

            return tokens_input(tokens, cache_salt=cache_salt)
        except ImportError:
            from vllm.inputs import TokensPrompt

            return TokensPrompt(prompt_token_ids=tokens, cache_salt=cache_salt)

def _fetch_extra(status: dict[str, Any]) -> dict[str, Any]:
    """The merged workers' fetch status, as a WeightUpdateResult's extras."""
    return {"worker_fetch_s": float(status["fetch_s"]), "transport": status["transport"]}


async def _to_completion(coro: Any) -> Any:
    """Await `coro` even if the caller is cancelled meanwhile (then re-raise the cancellation once it
    finished): a pause or resume half sent would leave vLLM's scheduler in a state vime does not know."""
    task = asyncio.ensure_future(coro)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait([task])
        error = None if task.cancelled() else task.exception()
        if error is not None:
            raise error from None  # the call failed: that, not the cancellation, says what state we are in
        raise

def _version_runs(versions: np.ndarray) -> list[tuple[int, int]]:
    """(version, count) runs, for a readable log line."""
    runs: list[tuple[int, int]] = []
    for v in versions.tolist():
        if runs and runs[-1][0] == v:
            runs[-1] = (v, runs[-1][1] + 1)
        else:
            runs.append((v, 1))
    return runs

def _sampled_logprobs(logprobs: Any, token_ids: Any) -> np.ndarray:
    """The sampled token's logprob per position from vLLM's per-position logprobs (`logprobs=0`).

    vLLM returns either a list of {token_id: Logprob} dicts or a `FlatLogprobs`; with `logprobs=0`
    each position holds exactly the sampled token, which the flat form lets us read without dicts.
    """
    if logprobs is None:
        raise RuntimeError("vLLM returned no logprobs; the request asked for them")
    flat = getattr(logprobs, "logprobs", None)
    if isinstance(flat, list) and len(flat) == len(token_ids) and list(logprobs.token_ids) == list(token_ids):
        return np.asarray(flat, dtype=np.float32)
    return np.asarray([position[tok].logprob for position, tok in zip(logprobs, token_ids)], dtype=np.float32)
