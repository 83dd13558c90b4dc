"""Telling a wedged rollout engine from a busy or an idle one.

A rollout worker whose engine hangs (a stuck kernel, a stopped engine process, a deadlock in the
engine) keeps its asyncio loop, so it keeps heartbeating and the broker never takes its groups back:
the job waits forever. The engine counts the tokens it samples (`RolloutEngine.progress`) and the
requests it has not answered (`requests_in_flight`); an engine with requests that samples no token for
`timeout_s`, while it is neither paused, asleep nor loading weights, is wedged. The worker then exits
with `EngineStalled`: its groups go back to the broker (Bye) and the supervisor starts it again.

The bound is in seconds without a single token across all requests, so it does not grow with response
length; a tool call an agent waits on is not a request of the engine and never counts.
"""

from __future__ import annotations

from vime.rollout.base import RolloutEngine


class EngineStalled(RuntimeError):
    """The engine had requests and sampled no token for longer than the stall timeout."""


class StallWatch:
    """Call `check` now and then (the worker does once a loop turn, at least once a second)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s  # 0: never
        self._tokens = -1
        self._since: float | None = None  # when the engine last had work and made progress (or got work)

    def stalled_s(self, engine: RolloutEngine, now: float, updating: bool = False) -> float:
        """Seconds the engine has had requests to work on without sampling a token (0 if it is idle,
        paused, asleep, loading weights, or progressing)."""
        waiting_on_us = engine.generation_paused or engine.asleep or updating
        if engine.requests_in_flight == 0 or waiting_on_us:
            self._since = None
            return 0.0
        tokens = engine.progress.tokens
        if self._since is None or tokens != self._tokens:
            self._since, self._tokens = now, tokens
        return now - self._since

    def check(self, engine: RolloutEngine, now: float, updating: bool = False) -> None:
        """Raise EngineStalled if the engine has been stalled for longer than `timeout_s`."""
        stalled = self.stalled_s(engine, now, updating)
        if self.timeout_s > 0 and stalled > self.timeout_s:
            raise EngineStalled(
                f"the rollout engine sampled no token for {stalled:.0f} s with {engine.requests_in_flight} "
                f"request(s) in flight (--rollout-stall-timeout-s {self.timeout_s:g}): it is wedged; exiting so "
                f"the broker re-leases this worker's groups and the supervisor restarts it"
            )
