"""A process pool with a hard per-call timeout, for CPU-bound checks that may hang.

math-verify bounds its own work with `signal.alarm`, which works only in a process's main thread; a
spawned pool worker runs each task in its main thread, so those inner timeouts work there. They cannot
interrupt C code (a huge sympy integer power, say), so every call also has an outer deadline: when it
passes, the caller gets a timed-out `PoolOutcome` at once and the pool's workers are killed and
replaced. Calls in flight on the killed pool are retried once on the new pool, so one pathological
answer costs the others a retry, never a wrong score.

Functions and arguments cross the process boundary through `concurrent.futures`' own (stdlib pickle)
channel between our processes; pass plain strings and numbers, and only module-level functions.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
import os
import threading
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

from vime.logging import get_logger

log = get_logger(__name__)


@dataclass(frozen=True)
class PoolOutcome:
    """Result of one pool call: `value` when `ok`; otherwise `timed_out` or an `error` message."""

    ok: bool
    value: Any = None
    timed_out: bool = False
    error: str | None = None


def _worker_pid() -> int:
    return os.getpid()


class TimeoutProcessPool:
    """Spawned worker processes that run module-level functions under a hard deadline.

    Thread-safe and usable from asyncio (`arun`) or plain code (`run`). The pool starts lazily on the
    first call (waiting up to `start_timeout_s` for every worker to import and run `initializer`, so
    slow imports never count against a call's deadline) and after a kill. Raises RuntimeError only if
    workers cannot be started at all.
    """

    def __init__(
        self,
        max_workers: int = 1,
        initializer: Callable[[], None] | None = None,
        start_timeout_s: float = 120.0,
        name: str = "pool",
    ) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self._max_workers = max_workers
        self._initializer = initializer
        self._start_timeout_s = start_timeout_s
        self._name = name
        self._lock = threading.Lock()
        self._pool: ProcessPoolExecutor | None = None
        self._generation = 0
        self.restarts = 0  # kills after a timeout; exposed for metrics and tests

    # -- lifecycle -----------------------------------------------------------------------------------

    def _ensure(self) -> tuple[ProcessPoolExecutor, int]:
        with self._lock:
            if self._pool is not None:
                return self._pool, self._generation
            pool = ProcessPoolExecutor(
                max_workers=self._max_workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=self._initializer,
            )
            # Warm up until every worker has answered: spawned workers import lazily and that start-up
            # (seconds for sympy) must not eat into the first calls' deadlines.
            seen: set[int] = set()
            deadline = _monotonic() + self._start_timeout_s
            try:
                while len(seen) < self._max_workers:
                    remaining = deadline - _monotonic()
                    if remaining <= 0:
                        raise concurrent.futures.TimeoutError()
                    futures = [pool.submit(_worker_pid) for _ in range(self._max_workers)]
                    for fut in futures:
                        seen.add(fut.result(timeout=max(remaining, 0.001)))
            except Exception as exc:  # a broken initializer or a start that never finishes
                _kill(pool)
                raise RuntimeError(f"{self._name}: could not start worker processes: {exc!r}") from exc
            self._pool = pool
            self._generation += 1
            log.info("process_pool_started", pool=self._name, workers=self._max_workers, pids=sorted(seen))
            return pool, self._generation

    def _restart(self, generation: int, why: str) -> None:
        """Kill the pool of `generation` (if it is still current); the next call starts a new one."""
        with self._lock:
            if self._pool is None or generation != self._generation:
                return
            pool, self._pool = self._pool, None
            self.restarts += 1
        log.warning("process_pool_killed", pool=self._name, reason=why, restarts=self.restarts)
        _kill(pool)

    def _is_current(self, generation: int) -> bool:
        with self._lock:
            return self._pool is not None and self._generation == generation

    def close(self) -> None:
        """Stop the workers (killing any stuck one). The pool restarts if used again."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            _kill(pool)

    # -- calls ---------------------------------------------------------------------------------------

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float) -> PoolOutcome:
        """Run `fn(*args)` in a worker; blocks at most about `timeout_s` (plus a one-off pool start)."""
        for attempt in range(2):
            pool, generation = self._ensure()
            try:
                future = pool.submit(fn, *args)
                return PoolOutcome(ok=True, value=future.result(timeout=timeout_s))
            except concurrent.futures.TimeoutError:
                self._restart(generation, f"call exceeded {timeout_s}s")
                return PoolOutcome(ok=False, timed_out=True, error=f"timed out after {timeout_s}s")
            except BrokenProcessPool as exc:
                if attempt == 0 and not self._is_current(generation):
                    continue  # killed because of another call's timeout: retry on the new pool
                self._restart(generation, "worker died")
                return PoolOutcome(ok=False, error=f"worker process died: {exc}")
            except Exception as exc:
                return PoolOutcome(ok=False, error=f"{type(exc).__name__}: {exc}")
        raise AssertionError("unreachable")

    async def arun(self, fn: Callable[..., Any], *args: Any, timeout_s: float) -> PoolOutcome:
        """Async `run`: awaits the worker without blocking the event loop."""
        for attempt in range(2):
            if self._pool is None:
                pool, generation = await asyncio.to_thread(self._ensure)
            else:
                pool, generation = self._ensure()
            try:
                future = pool.submit(fn, *args)
                value = await asyncio.wait_for(asyncio.wrap_future(future), timeout=timeout_s)
                return PoolOutcome(ok=True, value=value)
            except (asyncio.TimeoutError, concurrent.futures.TimeoutError):
                self._restart(generation, f"call exceeded {timeout_s}s")
                return PoolOutcome(ok=False, timed_out=True, error=f"timed out after {timeout_s}s")
            except BrokenProcessPool as exc:
                if attempt == 0 and not self._is_current(generation):
                    continue
                self._restart(generation, "worker died")
                return PoolOutcome(ok=False, error=f"worker process died: {exc}")
            except Exception as exc:
                return PoolOutcome(ok=False, error=f"{type(exc).__name__}: {exc}")
        raise AssertionError("unreachable")


def _monotonic() -> float:
    import time

    return time.monotonic()


def _kill(pool: ProcessPoolExecutor) -> None:
    """Kill a pool's workers outright (a stuck worker ignores polite shutdown) and release it."""
    kill_workers = getattr(pool, "kill_workers", None)  # Python 3.14+
    if kill_workers is not None:
        kill_workers()
    else:
        # Python < 3.14 has no public way to stop a busy worker; `_processes` is the pid -> Process map.
        for process in list(getattr(pool, "_processes", {}).values()):
            try:
                process.kill()
            except (OSError, ValueError):
                pass  # already gone
    pool.shutdown(wait=False, cancel_futures=True)
