"""The transformers fallback rollout engine: same contract as the vLLM engine, no vLLM needed.

For tests, for machines without a vLLM build, and as a readable reference of what the vLLM engine
computes. It is slow (no batching across `generate` calls, no paged attention) and that is fine.

How it keeps the contract:
- Each `generate` call decodes its `n` samples as one batch (the prompt repeated n times) with a
  transformers KV cache, one model step at a time on a worker thread, so the asyncio loop stays free.
- Sampling mirrors vLLM's sampler: temperature, then top-k, then top-p (smallest set with cumulative
  probability >= top_p), and the logprob reported is that of the sampled token under this processed
  distribution (vLLM's `processed_logprobs`). Greedy (temperature 0) reports the raw log-softmax.
- Every model step holds `_model_lock`; a weight update copies new tensors in place under the same
  lock, between steps. A token is stamped with the version of the weights whose logits it was
  sampled from. Sequences in flight keep their KV cache across the update (the "keep" trade-off).
- `pause_generation` is a gate every step passes under `_model_lock` before running: while it is
  closed the decode threads wait on it (releasing the lock, so an update can still load), holding
  their sequences and KV caches; `resume_generation` opens it.
- Weights come from `vime.weights.fetcher.WeightFetcher` (fetched outside the lock, so generation
  continues during the transfer); names are Hugging Face names, as the trainer publishes them.

engine_args: `dtype` ("float32" default, or "bfloat16"/"float16"), `num_threads` (torch intra-op
threads, default unchanged), `max_model_len` (default: the model's `max_position_embeddings`),
`seed` (seeds torch's global generator once at start, for reproducible unseeded sampling),
`max_concurrent` (decode threads, default 16: more concurrent `generate` calls wait their turn),
`device` (where the model runs, default "cpu"; e.g. "cuda" for a model too big for the CPU).
Unknown keys raise ValueError.

R3: with `capture_routing=True` (constructor flag) every MoE router's top-k is recorded
(`vime.r3.hf_router.RoutingRecorder`) over the prompt forward and every decode step, and each sample
carries its trace `[prompt_len + response_len - 1, moe_layers, top_k]` (compact dtype, see
`vime.r3.trace`) plus the expert count. A model without MoE routers fails at `start`. Weight fetches and copies run on their own thread, so a full set of
generations never delays an update.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from vime.logging import get_logger
from vime.rollout.adapter_merge import AdapterMergeError, AdapterMerger
from vime.rollout.base import (
    FinishReason,
    GeneratedSample,
    GenerationProgress,
    RolloutEngine,
    SamplingConfig,
    WeightFetchFailed,
    WeightUpdateError,
    WeightUpdateResult,
)

log = get_logger(__name__)

_KNOWN_ARGS = {"dtype", "num_threads", "max_model_len", "seed", "max_concurrent", "device"}
_SAMPLING_EPS = 1e-5  # below this temperature sampling is greedy, as in vLLM
# How often a decode thread held at the pause gate looks at its cancel flag: cancelling a frozen
# `generate` sets a threading.Event that cannot notify the gate's condition.
_GATE_POLL_S = 0.05


def process_logits(logits: Any, temperature: float, top_k: int, top_p: float) -> Any:
    """Log-probabilities of the distribution vLLM samples from, for fp32 `logits` of shape (B, V).

    Temperature divides the logits; top-k keeps the k largest; top-p keeps the smallest set whose
    probability mass reaches `top_p` (always at least the top token). Removed entries get -inf.
    """
    import torch

    logits = logits / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        # vLLM's rule: sort ascending, drop the prefix whose cumulative mass is <= 1 - top_p.
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - top_p
        drop[..., -1] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return torch.log_softmax(logits, dim=-1)


def sample_tokens(logits: Any, sampling: SamplingConfig, generator: Any) -> tuple[Any, Any]:
    """Sample one token per row of fp32 `logits` (B, V); returns (tokens int64 (B,), logprobs fp32 (B,))."""
    import torch

    if sampling.temperature < _SAMPLING_EPS:
        logprobs = torch.log_softmax(logits, dim=-1)
        tokens = logits.argmax(dim=-1)
    else:
        logprobs = process_logits(logits, sampling.temperature, sampling.top_k, sampling.top_p)
        tokens = torch.multinomial(logprobs.exp(), 1, generator=generator).squeeze(-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


_EXPERT_WEIGHT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def fuse_expert_weights(tensors: list[tuple[str, Any]], targets: dict[str, Any]) -> list[tuple[str, Any]]:
    """Per-expert checkpoint names (`...experts.<e>.gate_proj.weight`, as the trainer publishes them,
    the format vLLM loads) to the fused parameters of transformers 5 MoE blocks (`...experts.gate_up_proj`
    [E, 2I, H] = per expert cat(gate, up); `...experts.down_proj` [E, H, I]), when the model has those.
    Other names pass through unchanged. Raises WeightUpdateError when an expert is missing."""
    import torch

    out: list[tuple[str, Any]] = []
    groups: dict[str, dict[str, dict[int, Any]]] = {}
    for name, tensor in tensors:
        m = _EXPERT_WEIGHT.match(name)
        if m is None or f"{m['prefix']}.down_proj" not in targets or name in targets:
            out.append((name, tensor))
            continue
        groups.setdefault(m["prefix"], {}).setdefault(m["proj"], {})[int(m["expert"])] = tensor
    for prefix, projs in groups.items():
        num = int(targets[f"{prefix}.down_proj"].shape[0])

        def stack(proj: str, prefix: str = prefix, projs: dict = projs, num: int = num) -> Any:
            per = projs.get(proj, {})
            if sorted(per) != list(range(num)):
                raise WeightUpdateError(f"fetched {prefix}.*.{proj} covers experts {sorted(per)[:8]}..., need 0..{num - 1}")
            return torch.stack([per[e] for e in range(num)])

        out.append((f"{prefix}.gate_up_proj", torch.cat([stack("gate_proj"), stack("up_proj")], dim=1)))
        out.append((f"{prefix}.down_proj", stack("down_proj")))
    return out


class HfRolloutEngine(RolloutEngine):
    """`RolloutEngine` on a transformers causal LM (CPU or one GPU). See the module docstring."""

    def __init__(
        self,
        model_path: str,
        engine_args: dict[str, Any] | None = None,
        weight_endpoint: str | None = None,
        initial_version: int = 0,
        *,
        fetch_timeout_s: float = 60.0,
        capture_routing: bool = False,
    ) -> None:
        args = {str(k).replace("-", "_"): v for k, v in (engine_args or {}).items()}
        unknown = set(args) - _KNOWN_ARGS
        if unknown:
            raise ValueError(f"unknown hf engine args {sorted(unknown)}; known: {sorted(_KNOWN_ARGS)}")
        self._model_path = str(model_path)
        self._args = args
        self._weight_endpoint = weight_endpoint
        self._version = int(initial_version)
        self._fetch_timeout_s = float(fetch_timeout_s)
        self._capture_routing = bool(capture_routing)
        self._routers: list[tuple[str, Any]] = []  # the MoE routers, found once at load (R3 capture)
        self._model: Any = None
        self._tokenizer: Any = None
        self._eos_ids: set[int] = set()
        self._max_len = 0
        self._device: Any = None
        # Held for every model step and for the in-place weight copy: updates land between steps.
        self._model_lock = threading.Lock()
        self._adapters = AdapterMerger()  # base values of the weights LoRA versions adapt
        # The pause gate: a step starts only with the lock held and `_paused` false.
        self._step_gate = threading.Condition(self._model_lock)
        self._paused = False
        self._asleep = False
        self._progress_lock = threading.Lock()  # decode threads add to the counters concurrently
        self._sequences_started = 0
        self._tokens_sampled = 0
        self._generate_calls = 0  # generate() calls not yet answered (requests_in_flight)
        self._update_lock = asyncio.Lock()
        self._decode_pool = ThreadPoolExecutor(int(args.get("max_concurrent", 16)), thread_name_prefix="vime-hf-decode")
        self._weights_pool = ThreadPoolExecutor(1, thread_name_prefix="vime-hf-weights")
        self._closed = False

    # --- lifecycle ----------------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the model (and tokenizer, if the directory has one) on a worker thread."""
        if self._model is not None:
            return
        await asyncio.get_running_loop().run_in_executor(self._weights_pool, self._load_model)
        log.info("hf engine started", model=self._model_path, weight_version=self._version, max_len=self._max_len)

    def _load_model(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if self._args.get("num_threads"):
            torch.set_num_threads(int(self._args["num_threads"]))
        if self._args.get("seed") is not None:
            torch.manual_seed(int(self._args["seed"]))
        dtype = getattr(torch, str(self._args.get("dtype", "float32")))
        model = AutoModelForCausalLM.from_pretrained(self._model_path, dtype=dtype)
        model.to(str(self._args.get("device", "cpu")))
        model.eval()
        self._device = next(model.parameters()).device
        try:
            self._tokenizer = AutoTokenizer.from_pretrained(self._model_path)
        except Exception as exc:  # a weights-only directory still generates tokens
            log.warning("no tokenizer; response_text will be empty", model=self._model_path, error=str(exc))
        eos = getattr(model.generation_config, "eos_token_id", None)
        if eos is None:
            eos = getattr(model.config, "eos_token_id", None)
        self._eos_ids = {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None}
        self._max_len = int(self._args.get("max_model_len") or model.config.max_position_embeddings)
        if self._capture_routing:
            from vime.r3.hf_router import find_routers

            self._routers = find_routers(model)
            if not self._routers:
                raise ValueError(f"capture_routing needs an MoE model; {self._model_path} has no MoE routers")
        self._model = model

    async def shutdown(self) -> None:
        """Drop the model. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with self._step_gate:
            self._model = None
            self._step_gate.notify_all()  # threads held by a pause see the flag and return
        # Decode threads see the flag at their next step and return "abort" samples.
        self._decode_pool.shutdown(wait=False, cancel_futures=True)
        self._weights_pool.shutdown(wait=False, cancel_futures=True)

    # --- generation ---------------------------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def generation_paused(self) -> bool:
        return self._paused

    @property
    def progress(self) -> GenerationProgress:
        with self._progress_lock:
            return GenerationProgress(sequences=self._sequences_started, tokens=self._tokens_sampled)

    async def pause_generation(self) -> None:
        """Freeze every decode thread before its next step; returns once the step running now (if any)
        has finished. Requests keep their tokens and KV caches, new ones wait at the same gate (see
        `RolloutEngine.pause_generation`). A cancelled call still leaves the engine paused."""
        self._running()
        self._paused = True  # read under the lock before every step: no step starts from here on
        # Taking the lock once waits out a step already past the gate (on a thread: steps take ms-s).
        await asyncio.to_thread(self._wait_for_step_boundary)
        log.info("hf engine generation paused", weight_version=self._version)

    async def resume_generation(self) -> None:
        """Open the gate: frozen requests continue (with the weights loaded meanwhile, if any)."""
        if not self._paused:
            return
        self._paused = False
        await asyncio.to_thread(self._wake_steps)
        log.info("hf engine generation resumed", weight_version=self._version)

    @property
    def asleep(self) -> bool:
        return self._asleep

    async def sleep(self, level: int) -> None:
        """This engine's model lives in host memory, so sleeping frees nothing: it freezes generation
        (requests keep their state and continue after `wake_up`, on the weights loaded by it)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self._asleep:
            return
        await self.pause_generation()
        self._asleep = True

    async def wake_up(self, version: int | None = None, endpoint: str | None = None) -> WeightUpdateResult | None:
        if not self._asleep:
            raise RuntimeError("wake_up on an engine that is not asleep")
        result = None
        if version is not None and version > self._version:
            result = await self.update_weights(version, endpoint)  # raises: the engine stays asleep
        self._asleep = False
        await self.resume_generation()
        return result

    def _wait_for_step_boundary(self) -> None:
        with self._model_lock:
            pass

    def _wake_steps(self) -> None:
        with self._step_gate:
            self._step_gate.notify_all()

    def _pass_gate(self, cancel: threading.Event | None) -> bool:
        """Wait, with `_model_lock` held (released while waiting), until a step may run; False if the
        caller was cancelled or the engine closed meanwhile."""
        while self._paused and not self._closed and not (cancel is not None and cancel.is_set()):
            self._step_gate.wait(timeout=_GATE_POLL_S)
        return not self._closed and not (cancel is not None and cancel.is_set())

    def _count_progress(self, sequences: int, tokens: int) -> None:
        with self._progress_lock:
            self._sequences_started += sequences
            self._tokens_sampled += tokens

    async def generate(self, prompt_tokens: list[int], n: int, sampling: SamplingConfig) -> list[GeneratedSample]:
        """Sample `n` responses on a worker thread. Cancelling the caller stops the decode loop at the
        next step. Raises ValueError for an empty prompt, n < 1, or a prompt that fills the context."""
        self._running()
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if len(prompt_tokens) == 0:
            raise ValueError("empty prompt")
        if len(prompt_tokens) >= self._max_len:
            raise ValueError(f"prompt of {len(prompt_tokens)} tokens leaves no room (max_model_len {self._max_len})")
        cancel = threading.Event()
        self._generate_calls += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self._decode_pool, self._generate_sync, [int(t) for t in prompt_tokens], n, sampling, cancel
            )
        except asyncio.CancelledError:
            cancel.set()  # the thread notices at its next step and returns
            raise
        finally:
            self._generate_calls -= 1

    @property
    def requests_in_flight(self) -> int:
        return self._generate_calls

    def _generate_sync(
        self, prompt: list[int], n: int, sampling: SamplingConfig, cancel: threading.Event
    ) -> list[GeneratedSample]:
        import torch

        generator = None
        if sampling.seed is not None:
            generator = torch.Generator(device=self._device).manual_seed(int(sampling.seed))
        stop_ids = set(sampling.stop_token_ids or ())
        if not sampling.ignore_eos:
            stop_ids |= self._eos_ids
        max_new = min(sampling.max_tokens, self._max_len - len(prompt))

        tokens = np.zeros((n, max_new), dtype=np.int32)
        logprobs = np.zeros((n, max_new), dtype=np.float32)
        versions = np.zeros((n, max_new), dtype=np.int32)
        lengths = np.zeros(n, dtype=np.int64)
        finish: list[FinishReason | None] = [None] * n

        ids = torch.tensor([prompt] * n, dtype=torch.long, device=self._device)
        cache = None
        recorder = None
        if self._capture_routing:
            from vime.r3.hf_router import RoutingRecorder

            # Per call: its hooks are installed only around this call's own forwards (under the lock).
            recorder = RoutingRecorder(self._model, routers=self._routers)
        with torch.inference_mode():
            for step in range(max_new):
                if cancel.is_set() or self._closed:
                    finish = [f or "abort" for f in finish]
                    break
                with self._step_gate:
                    model = self._model if self._pass_gate(cancel) else None
                    if model is None:
                        finish = [f or "abort" for f in finish]
                        break
                    if recorder is not None:
                        with recorder:
                            out = model(input_ids=ids, past_key_values=cache, use_cache=True)
                    else:
                        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
                    version = self._version  # the weights these logits came from
                    # Sampled under the lock too, so a returned pause has every sampled token counted.
                    next_tokens, next_logprobs = sample_tokens(out.logits[:, -1, :].float(), sampling, generator)
                    next_list = next_tokens.tolist()
                    next_lp = next_logprobs.tolist()
                    self._count_progress(n if step == 0 else 0, sum(f is None for f in finish))
                cache = out.past_key_values
                for row in range(n):
                    if finish[row] is not None:
                        continue
                    tokens[row, step] = next_list[row]
                    logprobs[row, step] = next_lp[row]
                    versions[row, step] = version
                    lengths[row] = step + 1
                    if next_list[row] in stop_ids:
                        finish[row] = "stop"
                if all(f is not None for f in finish):
                    break
                ids = next_tokens[:, None]  # finished rows keep decoding; their tokens are ignored
        traces: list[np.ndarray | None] = [None] * n
        if recorder is not None and recorder.recorded_tokens:
            # Row b's trace covers prompt + response - 1 tokens: the last sampled token was never fed back.
            traces = list(recorder.traces([len(prompt) + int(length) for length in lengths]))
        samples = []
        for row in range(n):
            length = int(lengths[row])
            response = tokens[row, :length].copy()
            text = ""
            if self._tokenizer is not None and length:
                text = self._tokenizer.decode(response.tolist(), skip_special_tokens=True)
            samples.append(
                GeneratedSample(
                    response_tokens=response,
                    rollout_logprobs=logprobs[row, :length].copy(),
                    loss_mask=np.ones(length, dtype=np.uint8),
                    token_versions=versions[row, :length].copy(),
                    finish_reason=finish[row] or "length",
                    response_text=text,
                    routed_experts=traces[row],
                    num_experts=recorder.num_experts if traces[row] is not None else None,  # type: ignore[union-attr]
                )
            )
        return samples

    async def score(self, prompt_tokens: list[int], response_tokens: list[int]) -> np.ndarray:
        """Raw logprobs of `response_tokens` after `prompt_tokens` under the current weights (fp32 math)."""
        self._running()
        if len(prompt_tokens) == 0:
            raise ValueError("empty prompt")
        return await asyncio.get_running_loop().run_in_executor(
            self._decode_pool, self._score_sync, [int(t) for t in prompt_tokens], [int(t) for t in response_tokens]
        )

    def _score_sync(self, prompt: list[int], response: list[int]) -> np.ndarray:
        import torch

        if not response:
            return np.zeros(0, dtype=np.float32)
        ids = torch.tensor([prompt + response], dtype=torch.long, device=self._device)
        with torch.inference_mode(), self._step_gate:
            self._pass_gate(None)
            logits = self._running()(input_ids=ids).logits[0].float()
        logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
        target = torch.tensor(response, dtype=torch.long, device=logprobs.device)
        return logprobs.gather(-1, target[:, None]).squeeze(-1).cpu().numpy().astype(np.float32)

    # --- weights ------------------------------------------------------------------------------------

    async def update_weights(self, version: int, endpoint: str | None = None) -> WeightUpdateResult:
        """Fetch the newest weights >= `version` (generation continues), then copy them in between two
        decode steps. Serialized; an already loaded version is skipped. Raises `WeightUpdateError`; names
        or shapes that do not match the model are rejected before any parameter changes. On a paused
        engine the copy happens while the decode threads wait at the gate, and the engine stays paused:
        their next tokens, after `resume_generation`, carry the new version."""
        self._running()
        endpoint = endpoint or self._weight_endpoint
        if not endpoint:
            raise ValueError("no weight endpoint: pass one or build the engine with weight_endpoint")
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        async with self._update_lock:
            if version <= self._version:
                return WeightUpdateResult(version=self._version, requested_version=version, skipped=True)
            try:
                fetched = await loop.run_in_executor(self._weights_pool, self._fetch, endpoint, version)
            except Exception as exc:
                raise WeightFetchFailed(
                    f"weight fetch from {endpoint} failed (engine keeps its weights): {exc}"
                ) from exc
            fetch_s = time.perf_counter() - started
            # The copy runs on a thread under the model lock; shield it so a cancelled caller cannot
            # leave a half-copied model (the thread would finish anyway; this keeps our state in step).
            load = loop.run_in_executor(self._weights_pool, self._load_fetched, fetched)
            try:
                waited_s, load_s = await asyncio.shield(load)
            except asyncio.CancelledError:
                await asyncio.wait([load])
                raise
        result = WeightUpdateResult(
            version=self._version,
            requested_version=version,
            nbytes=int(fetched.nbytes),
            fetch_s=fetch_s,
            pause_s=waited_s,
            load_s=load_s,
            paused_s=load_s,
            total_s=time.perf_counter() - started,
        )
        log.info("weights updated in flight", version=result.version, requested=version, nbytes=result.nbytes,
                 fetch_s=round(fetch_s, 4), load_s=round(load_s, 4), total_s=round(result.total_s, 4))
        return result

    def _fetch(self, endpoint: str, version: int) -> Any:
        from vime.weights.fetcher import WeightFetcher

        with WeightFetcher(endpoint, timeout_s=self._fetch_timeout_s) as fetcher:
            return fetcher.fetch(min_version=int(version))

    def _load_fetched(self, fetched: Any) -> tuple[float, float]:
        """Copy fetched tensors into the model in place; returns (lock wait s, copy s)."""
        model = self._running()
        targets = model.state_dict(keep_vars=True)  # tied weights appear under both names
        if fetched.adapter_config is not None:
            return self._load_adapter(fetched, targets)
        tensors = fuse_expert_weights(list(fetched.tensors), targets)
        for name, tensor in tensors:  # validate everything before touching anything
            if name not in targets:
                raise WeightUpdateError(f"fetched weight {name!r} is not a parameter of the model")
            if tuple(targets[name].shape) != tuple(tensor.shape):
                raise WeightUpdateError(
                    f"fetched weight {name!r} has shape {tuple(tensor.shape)}, model has {tuple(targets[name].shape)}"
                )
        # A tied weight (lm_head = embed_tokens) is covered when any of its names arrives.
        covered = {targets[name].data_ptr() for name, _ in tensors}
        missing = [name for name, t in targets.items() if t.data_ptr() not in covered and t.numel()]
        if missing:
            log.warning("fetched weights do not cover the model; keeping old values", missing=sorted(missing)[:8],
                        num_missing=len(missing))
        return self._copy_in(targets, tensors, int(fetched.version))

    def _copy_in(self, targets: dict[str, Any], tensors: list[tuple[str, Any]], version: int) -> tuple[float, float]:
        """Copy checked tensors into the model under the model lock and take `version`; returns (lock
        wait s, copy s)."""
        import torch

        wait_start = time.perf_counter()
        with self._model_lock, torch.no_grad():
            copy_start = time.perf_counter()
            for name, tensor in tensors:
                targets[name].copy_(tensor.to(targets[name].device))
            self._version = version
            copy_s = time.perf_counter() - copy_start
        return copy_start - wait_start, copy_s

    def _load_adapter(self, fetched: Any, targets: dict[str, Any]) -> tuple[float, float]:
        """A LoRA adapter version: merged into the adapted weights from their base values
        (`adapter_merge`); the rest of the model is the base loaded at start."""
        try:
            merged = self._adapters.merged(targets, fetched.tensors, fetched.adapter_config)
        except AdapterMergeError as exc:
            raise WeightUpdateError(f"adapter version {fetched.version}: {exc}") from exc
        return self._copy_in(targets, merged, int(fetched.version))

    def _running(self) -> Any:
        if self._model is None:
            raise RuntimeError("engine shut down" if self._closed else "engine not started")
        return self._model
