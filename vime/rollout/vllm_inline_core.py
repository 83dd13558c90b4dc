"""vLLM's engine core stepped on the rollout worker's own event loop: `AsyncLLM` without a second process.

`AsyncLLM` always runs its engine core in a child process and talks to it over ZeroMQ: every request
and every step's outputs are serialized twice, and an output thread in the child ships them. On a GPU
that hop overlaps the model's work; on the CPU it is plain extra work on the same cores (measured on
the demo in docs/benchmarks.md). `InlineEngineCoreClient` is an `EngineCoreClient` that holds vLLM's
`EngineCore` itself and steps it from an asyncio task whenever it has requests; `inline_async_llm`
builds an `AsyncLLM` on it, so the front end, the weight-update protocol and everything vime reads of
vLLM stay exactly as they are.

How it stays correct without the child's busy loop:
- Everything that touches the scheduler runs on the event loop's thread, between steps, so nothing
  needs a lock against a step; a step is synchronous and short (one batch of the model).
- Calls into the model's workers (`collective_rpc`, pauses, sleep, wake) run on a helper thread, since
  a weight fetch's status call may wait; `_core_lock` keeps the stepper out meanwhile.
- Pause modes keep vLLM's meaning: "keep" freezes after the step in progress, "wait" lets the running
  requests finish first, "abort" ends them and hands their final outputs to the front end.
- A step that raises marks the engine dead: every waiting request gets vLLM's `EngineDeadError`, as
  when the engine core process dies.

Only for an engine with one worker: tensor or pipeline parallel engines need vLLM's process layout.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from vllm.v1.core.sched.interface import PauseState
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.engine.core import EngineCore
from vllm.v1.engine.core_client import EngineCoreClient
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.request import RequestStatus

from vime.logging import get_logger

log = get_logger(__name__)

# One engine is built at a time: AsyncLLM's constructor is pointed at this client while it runs.
_build_lock = threading.Lock()


@dataclass
class _Resources:
    """What AsyncLLM reads of a client's background resources: whether the engine died."""

    engine_dead: bool = False


class InlineEngineCoreClient(EngineCoreClient):
    """An `EngineCoreClient` whose engine core lives in this process, stepped by an asyncio task.

    Built (and its model loaded) on any thread; its async methods must all be called from one event
    loop, the one that then runs the stepping task (started by the first call)."""

    def __init__(self, vllm_config: Any, executor_class: type, log_stats: bool) -> None:
        self.engine_core = EngineCore(vllm_config, executor_class, log_stats)
        self.engine_ranks_managed = [0]
        self.resources = _Resources()
        # asyncio's queues, events and locks bind to the loop that first uses them (Python >= 3.10), so
        # they can be made here, on the thread that builds the engine.
        self.outputs_queue: asyncio.Queue[Any] = asyncio.Queue()  # what AsyncLLM's output handler reads
        self._has_work = asyncio.Event()
        self._idle = asyncio.Event()  # set while the scheduler has nothing to step
        self._core_lock = asyncio.Lock()
        self._stepper: asyncio.Task[None] | None = None
        self._closed = False

    # --- the stepping task ---------------------------------------------------------------------------

    def _ensure_stepper(self) -> None:
        if self._stepper is not None:
            return
        self._stepper = asyncio.get_running_loop().create_task(self._step_forever(), name="vllm-inline-engine-core")

    async def _step_forever(self) -> None:
        core, queue = self.engine_core, self.outputs_queue
        try:
            while True:
                if not core.scheduler.has_requests():
                    self._idle.set()
                    self._has_work.clear()
                    await self._has_work.wait()
                    continue
                self._idle.clear()
                # Let everything that is ready run first: submissions join this step's batch, and the
                # front end takes the last step's outputs.
                await asyncio.sleep(0)
                async with self._core_lock:
                    outputs, model_executed = core.step_fn()
                    core.post_step(model_executed=model_executed)
                for _, engine_outputs in (outputs or {}).items():
                    queue.put_nowait(engine_outputs)
                if not model_executed and core.scheduler.has_requests():
                    await asyncio.sleep(0.001)  # work that waits on something else: do not spin
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.error("vllm inline engine core failed", error=repr(exc))
            self.resources.engine_dead = True
            queue.put_nowait(EngineDeadError())

    def _wake(self) -> None:
        self._has_work.set()

    def _deliver_aborted(self, request_ids: list[str]) -> None:
        """Final "abort" outputs for requests the engine ended, as vLLM's engine process sends them."""
        if request_ids:
            outputs = [EngineCoreOutput(request_id, [], finish_reason=FinishReason.ABORT) for request_id in request_ids]
            self.outputs_queue.put_nowait(EngineCoreOutputs(finished_requests=set(request_ids), outputs=outputs))

    async def _on_workers(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run `fn` on a helper thread with the stepper held off (calls into the model's workers)."""
        self._ensure_stepper()
        async with self._core_lock:
            return await asyncio.to_thread(fn, *args, **kwargs)

    # --- what AsyncLLM calls -------------------------------------------------------------------------

    async def get_output_async(self) -> Any:
        self._ensure_stepper()
        outputs = self.outputs_queue.get_nowait() if not self.outputs_queue.empty() else await self.outputs_queue.get()
        if isinstance(outputs, BaseException):
            raise outputs
        return outputs

    async def add_request_async(self, request: Any) -> None:
        self._ensure_stepper()
        self._raise_if_dead()
        req, wave = self.engine_core.preprocess_add_request(request)
        self.engine_core.add_request(req, wave)
        self._wake()

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(list(request_ids))

    async def pause_scheduler_async(self, mode: str = "abort", clear_cache: bool = True) -> None:
        self._ensure_stepper()
        core = self.engine_core
        if mode == "wait":
            core.scheduler.set_pause_state(PauseState.PAUSED_NEW)  # new requests wait, running ones finish
            self._wake()
            while core.scheduler.has_requests():
                self._idle.clear()
                await self._idle.wait()
            # Drained. vLLM's in-process core finishes a pause only as "keep" or "abort" (it cannot wait
            # itself); "keep" with nothing running finishes it alike, then the state is "wait"'s again.
            await self._on_workers(core.pause_scheduler, mode="keep", clear_cache=clear_cache)
            core.scheduler.set_pause_state(PauseState.PAUSED_NEW)
            return
        if mode == "abort":
            aborted = core.scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)
            self._deliver_aborted([request.request_id for request in aborted or ()])
        await self._on_workers(core.pause_scheduler, mode=mode, clear_cache=clear_cache)

    async def resume_scheduler_async(self) -> None:
        self.engine_core.resume_scheduler()
        self._wake()

    async def is_scheduler_paused_async(self) -> bool:
        return bool(self.engine_core.is_scheduler_paused())

    async def sleep_async(self, level: int = 1, mode: str = "abort") -> None:
        await self.pause_scheduler_async(mode=mode, clear_cache=level >= 1)
        if level >= 1:
            await self._on_workers(self.engine_core.model_executor.sleep, level)

    async def wake_up_async(self, tags: list[str] | None = None) -> bool:
        awake = await self._on_workers(self.engine_core.wake_up, tags)
        self._wake()
        return bool(awake)

    async def is_sleeping_async(self) -> bool:
        return bool(self.engine_core.is_sleeping())

    async def collective_rpc_async(
        self, method: Any, timeout: float | None = None, args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        return await self._on_workers(self.engine_core.collective_rpc, method, timeout, args, kwargs)

    async def set_weight_version_async(self, weight_version: str) -> None:
        self.engine_core.set_weight_version(weight_version)

    async def get_weight_version_async(self) -> str:
        return str(self.engine_core.get_weight_version())

    # LoRA adapters are loaded by the workers, with the stepper held off like any other worker call.
    async def add_lora_async(self, lora_request: Any) -> bool:
        return bool(await self._on_workers(self.engine_core.add_lora, lora_request))

    async def remove_lora_async(self, lora_id: int) -> bool:
        return bool(await self._on_workers(self.engine_core.remove_lora, lora_id))

    async def list_loras_async(self) -> set[int]:
        return set(await self._on_workers(self.engine_core.list_loras))

    async def pin_lora_async(self, lora_id: int) -> bool:
        return bool(await self._on_workers(self.engine_core.pin_lora, lora_id))

    async def get_supported_tasks_async(self) -> tuple[Any, ...]:
        return tuple(self.engine_core.get_supported_tasks())

    async def reset_prefix_cache_async(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        return bool(self.engine_core.reset_prefix_cache(reset_running_requests, reset_connector))

    async def reset_mm_cache_async(self) -> None:
        self.engine_core.reset_mm_cache()

    async def reset_encoder_cache_async(self) -> None:
        self.engine_core.reset_encoder_cache()

    def dp_engines_running(self) -> bool:
        return False

    def shutdown(self, timeout: float | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        stepper, self._stepper = self._stepper, None
        if stepper is not None and not stepper.done():
            with contextlib.suppress(RuntimeError):  # its loop is closed already: it runs no more
                stepper.get_loop().call_soon_threadsafe(stepper.cancel)
        self.engine_core.shutdown()

    def _raise_if_dead(self) -> None:
        if self.resources.engine_dead or self._closed:
            raise EngineDeadError()


@contextlib.contextmanager
def _async_llm_on_inline_client() -> Iterator[None]:
    """While it is open, a new AsyncLLM gets an `InlineEngineCoreClient`. AsyncLLM takes no client of
    the caller's: it asks `EngineCoreClient.make_async_mp_client`, which this points here."""

    def make_client(vllm_config: Any, executor_class: type, log_stats: bool, *args: Any, **kwargs: Any) -> Any:
        return InlineEngineCoreClient(vllm_config, executor_class, log_stats)

    with _build_lock:
        original = EngineCoreClient.__dict__["make_async_mp_client"]
        EngineCoreClient.make_async_mp_client = staticmethod(make_client)  # type: ignore[method-assign]
        try:
            yield
        finally:
            EngineCoreClient.make_async_mp_client = original  # type: ignore[method-assign]


def inline_async_llm(engine_args: Any, stat_loggers: list[Any] | None = None) -> Any:
    """`AsyncLLM.from_engine_args` with the engine core in this process (see the module docstring).
    Blocks while the model loads; call it on a thread from async code."""
    from vllm.v1.engine.async_llm import AsyncLLM

    with _async_llm_on_inline_client():
        llm = AsyncLLM.from_engine_args(engine_args, stat_loggers=stat_loggers)
    if not isinstance(llm.engine_core, InlineEngineCoreClient):
        llm.shutdown()
        raise RuntimeError("this vLLM's AsyncLLM did not take vime's in-process engine core client")
    return llm
