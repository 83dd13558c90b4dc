"""Shared set-up for the rollout-engine tests (test_rollout_hf, test_rollout_vllm) that need requests
held in flight: wait until requests have started, by the engine's progress counters, not by a sleep.

The pattern: submit requests that cannot finish soon (`ignore_eos`, `max_tokens` up to the model's
length), wait with `until_started` until every one has sampled a token, `pause_generation()` the
engine. From then on they are in flight by construction, on any machine, until `resume_generation()`.

Not a test module (pytest does not collect it); tests import it as `helpers_engines`, which works
because tests/ has no __init__.py, so pytest puts tests/ itself on sys.path.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from vime.rollout import GeneratedSample, GenerationProgress, RolloutEngine, SamplingConfig, WeightUpdateResult


class StubEngine(RolloutEngine):
    """A rollout engine that does nothing: tests subclass it and override what they exercise. Its
    weight version is the `version` attribute."""

    version = 0

    @property
    def weight_version(self) -> int:
        return self.version

    async def start(self) -> None: ...

    async def generate(self, prompt_tokens: list[int], n: int, sampling: SamplingConfig) -> list[GeneratedSample]:
        raise NotImplementedError

    async def update_weights(self, version: int, endpoint: str | None = None) -> WeightUpdateResult:
        raise NotImplementedError

    async def pause_generation(self) -> None: ...

    async def resume_generation(self) -> None: ...

    @property
    def generation_paused(self) -> bool:
        return False

    @property
    def progress(self) -> GenerationProgress:
        return GenerationProgress()

    async def score(self, prompt_tokens: list[int], response_tokens: list[int]) -> np.ndarray:
        raise NotImplementedError

    async def shutdown(self) -> None: ...


async def until_started(
    engine: RolloutEngine, since: GenerationProgress, sequences: int, timeout_s: float = 120.0
) -> GenerationProgress:
    """Wait until `sequences` more sequences than at `since` have sampled their first token; returns the
    progress then. A deadline loop: fails (AssertionError) only if generation does not start at all."""
    deadline = time.monotonic() + timeout_s
    while (now := engine.progress).sequences - since.sequences < sequences:
        assert time.monotonic() < deadline, f"{sequences} sequences did not start within {timeout_s:g} s: {now}"
        await asyncio.sleep(0.001)
    return now


async def freeze_in_flight(
    engine: RolloutEngine, prompt: list[int], *, requests: int, n: int, max_tokens: int
) -> list[asyncio.Task]:
    """Submit `requests` generate calls of `n` sequences each that ignore EOS, wait until every sequence
    has sampled a token, then freeze the engine. The returned tasks stay in flight until the caller
    resumes it; the assertion fails only if `max_tokens` tokens were sampled between the start and the
    freeze (a few steps), which no machine does for a response that long."""
    start = engine.progress
    sampling = SamplingConfig(max_tokens=max_tokens, ignore_eos=True)
    tasks = [asyncio.create_task(engine.generate(prompt, n=n, sampling=sampling)) for _ in range(requests)]
    await until_started(engine, start, sequences=requests * n)
    await engine.pause_generation()
    assert not any(t.done() for t in tasks), "generation finished before the engine froze"
    return tasks


@contextlib.contextmanager
def environ_restored() -> Iterator[None]:
    """os.environ exactly as it was, once the block is over. A vLLM engine started in the test process
    writes its own settings into os.environ (TORCHINDUCTOR_CACHE_DIR pointing at its model's compile
    cache, LD_PRELOAD, VIME_ENGINE_OWNER_PID, ...); left there, they reach every later test of the same
    pytest worker and every process those start (a torch.compile test after them compiled into that
    cold cache: 108 s instead of 10 in the suite)."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def started_vllm_engine(
    loop: asyncio.AbstractEventLoop, model_dir: Path, max_len: int, *, eager: bool = False, dtype: str | None = "bfloat16",
    **kwargs: Any,
) -> Iterator[Any]:
    """A started `VllmRolloutEngine` on `model_dir` for a test module (`kwargs` to its constructor), shut
    down at exit. On CPU: 1 GiB of KV cache and one OpenMP thread (the engine's processes read these at
    spawn; the caller's values come back after), and the model compiled as the CPU default runs it
    unless `eager` (compiling costs ~30 s of the start on 2 cores). On CUDA: eager, so it starts in
    seconds. `dtype=None` leaves the engine's dtype to vime's default."""
    import torch

    from vime.rollout.vllm_engine import VllmRolloutEngine

    with environ_restored():  # the caller's values come back after, and nothing vLLM set stays
        for k, v in {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0", "OMP_NUM_THREADS": "1"}.items():
            os.environ.setdefault(k, v)
        args: dict[str, Any] = {"max-model-len": max_len} if dtype is None else {"dtype": dtype, "max-model-len": max_len}
        if torch.cuda.is_available():
            args.update(enforce_eager=True, gpu_memory_utilization=0.3)
        elif eager:
            args.update(enforce_eager=True)
        engine = VllmRolloutEngine(str(model_dir), engine_args=args, **kwargs)
        engine._fetch_timeout_s = 3.0  # keeps the unreachable-publisher tests short
        try:
            loop.run_until_complete(engine.start())
            yield engine
        finally:
            loop.run_until_complete(engine.shutdown())
