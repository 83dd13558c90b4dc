"""What vime reads from vLLM's per-iteration statistics: generation progress and output barriers.

vLLM's front end hands every batch of engine outputs, once processed, to its stat loggers. A logger of
ours (`AsyncLLM.from_engine_args(stat_loggers=[...])`) is therefore the one public hook that runs
after each batch, in order, on the front end's asyncio loop:

- progress: it adds up each iteration's generated tokens and first tokens, so nothing streams per
  token to the caller. A custom logger turns vLLM's stats collection on even with
  `disable_log_stats=True`; the counters lag the engine core by the output handling of one batch.
- barriers (`OutputBarrier`): a marker batch put at the end of the front end's output queue reaches
  the logger only after every batch queued before it has been processed. Per-token version tracking
  needs that: when a pause returns, the engine core has sent all of its outputs, but the front end may
  not have processed them yet.
"""

from __future__ import annotations

import asyncio
from typing import Any


class FrontEndBarrierUnavailable(RuntimeError):
    """This vLLM's front end has no output queue that vime knows how to put a barrier into."""


class StatHooks:
    """What the stat logger updates (on the front end's asyncio loop, the thread readers are on)."""

    def __init__(self) -> None:
        self.sequences = 0
        self.tokens = 0
        self.last_scheduler_stats: Any = None
        self.last_engine_index = 0
        self._barriers: dict[int, asyncio.Event] = {}

    def _record(self, scheduler_stats: Any, iteration_stats: Any, engine_idx: int) -> None:
        if scheduler_stats is not None:
            event = self._barriers.pop(id(scheduler_stats), None)
            if event is not None:
                event.set()
                return
            self.last_scheduler_stats = scheduler_stats
            self.last_engine_index = engine_idx
        if iteration_stats is None:
            return
        self.tokens += int(iteration_stats.num_generation_tokens)
        # One entry per request at its first output (each sequence of an n > 1 group is a request of its
        # own); a request aborted before its first token also ends its prefill here.
        self.sequences += len(iteration_stats.time_to_first_tokens_iter)


def stat_logger_factory(hooks: StatHooks) -> Any:
    """A per-engine `StatLoggerFactory` whose loggers feed `hooks`."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class VimeStatLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(
            self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0
        ) -> None:
            hooks._record(scheduler_stats, iteration_stats, engine_idx)

        def log_engine_initialized(self) -> None:
            pass

    def factory(vllm_config: Any, engine_index: int) -> Any:
        return VimeStatLogger(vllm_config, engine_index)

    return factory


def silent_prometheus_logger() -> type:
    """A stand-in for vLLM's Prometheus stat logger that records nothing, for jobs that turn vLLM's
    stats off (`disable_log_stats`): vLLM adds its own Prometheus logger to any custom ones unless one
    of them is a Prometheus logger, and its per-request histograms cost the front end more CPU per step
    than the rest of vime's sample handling. vime serves no Prometheus endpoint from the engine."""
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    class SilentPrometheusStatLogger(PrometheusStatLogger):
        def __init__(self, vllm_config: Any, engine_indexes: Any = None) -> None:  # registers no metrics
            pass

        def record(self, *args: Any, **kwargs: Any) -> None:
            pass

        def record_sleep_state(self, *args: Any, **kwargs: Any) -> None:
            pass

        def record_admission_rejection(self, *args: Any, **kwargs: Any) -> None:
            pass

        def log(self) -> None:
            pass

        def log_engine_initialized(self) -> None:
            pass

    return SilentPrometheusStatLogger


class OutputBarrier:
    """Waits until vLLM's front end has processed every engine output that reached it so far.

    Built once per engine (raises `FrontEndBarrierUnavailable` when the front end lacks the output
    queue this relies on, so the engine can refuse to start rather than mislabel tokens later).
    The marker is an empty output batch whose scheduler stats copy the last real gauges, so metric
    exporters that also see it record no change.
    """

    def __init__(self, llm: Any, hooks: StatHooks) -> None:
        queue = getattr(getattr(llm, "engine_core", None), "outputs_queue", None)
        if not isinstance(queue, asyncio.Queue):
            raise FrontEndBarrierUnavailable(
                f"vLLM's engine client {type(getattr(llm, 'engine_core', None)).__name__} has no asyncio "
                "outputs_queue; vime cannot order its weight-version marks against generated tokens"
            )
        from vllm.v1.engine import EngineCoreOutputs
        from vllm.v1.metrics.stats import SchedulerStats

        self._queue = queue
        self._hooks = hooks
        self._outputs_cls = EngineCoreOutputs
        self._stats_cls = SchedulerStats

    async def wait(self, timeout_s: float = 30.0) -> None:
        """Return once everything queued before this call has been processed. Raises TimeoutError if
        the front end's output handler does not get there within `timeout_s` (it died or is stuck)."""
        last = self._hooks.last_scheduler_stats
        marker = self._stats_cls()
        if last is not None:
            marker.num_running_reqs = last.num_running_reqs
            marker.num_waiting_reqs = last.num_waiting_reqs
            marker.kv_cache_usage = last.kv_cache_usage
        event = asyncio.Event()
        self._hooks._barriers[id(marker)] = event
        try:
            self._queue.put_nowait(
                self._outputs_cls(engine_index=self._hooks.last_engine_index, scheduler_stats=marker)
            )
            await asyncio.wait_for(event.wait(), timeout_s)
        finally:
            self._hooks._barriers.pop(id(marker), None)
