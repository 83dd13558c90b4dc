"""How many requests the reward client keeps in flight to one reward server: an adaptive limit.

A fixed concurrency is wrong for someone: 64 requests at once fill a big server but flood a twenty-line
standard-library one (`http.server.ThreadingHTTPServer` accepts from a listen queue of 5; the SYNs of
connections that find it full are dropped and retried by the kernel after 1, 3, 7 s, and each such stall
holds a training step). So the client finds the level each server sustains, like TCP's congestion
window (AIMD):

- It starts at `initial` (4) and, in *slow start*, adds 1 per completed request, doubling each round
  trip, while the smoothed round trip (an exponential average over ~5 requests) stays near the lowest
  it has been lately (within `tolerance` x that + `slack_s`) and new connections open about as fast as
  the fastest one did (a server whose accept loop falls behind fills its listen queue next).
- Past that the server is queueing: slow start ends and the limit holds. Below it, *congestion
  avoidance* adds about 1 per round trip (1/limit per completed request).
- A *stall* (a connection took longer than `stall_s` to open, a round trip exceeded max(8 x best,
  best + `stall_s`), or a request timed out) cuts the limit by 30% and remembers the level that
  stalled (`ceiling`): the limit then stays at or below `ceiling` - 1 until the probe interval has
  passed, and only then probes above it. The interval starts at `probe_interval_s` (10 s) and doubles
  whenever a probe stalls within an interval of starting (up to `max_probe_interval_s`, 5 min): each
  probe of a small server's level costs a step a second or more, so a level that keeps stalling is
  probed ever less often. A stall after a probe has held that long resets it. An overload answer (a
  connection refused or reset while opening, HTTP 408/429/502/503/504) halves the limit too, without
  a ceiling.
- One cut per burst: only a request sent after the last cut can cause the next one, so the 20 requests
  that stalled together halve the limit once, not twenty times.
- The limit grows only while it is in use (some request found it full), never above `max_limit`
  (`--rm-concurrency`), never below `min_limit` (2). `adaptive=False` keeps it at `initial` and only counts
  stalls (the old fixed client, for benchmarks).

Plain asyncio, one event loop: `acquire()` waits for a slot and returns a ticket; `release(ticket, ...)`
reports how the request went.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

# Weight of the newest round trip in the smoothed one (an exponential moving average over ~5 requests).
SMOOTHING = 0.2
# A stall costs one request a second or more, not the others in flight: cut by 30%, not half (measured
# against bench/stdlib_reward_server.py under load, halving left the limit at 1-2 and half the rate).
STALL_CUT = 0.7


class Outcome(enum.Enum):
    """What a request says about the server's capacity."""

    OK = "ok"  # answered (any 2xx, or a per-sample refusal such as slime's 422)
    OVERLOAD = "overload"  # refused or reset connection, 408/429/502/503/504: back off
    STALL = "stall"  # timed out: back off and remember the level
    NEUTRAL = "neutral"  # answered with an error that says nothing about load (401, 404, 500, bad JSON)


@dataclass
class Ticket:
    started: float
    saturation: int  # the limiter's saturation count when this request was let through


class AdaptiveLimit:
    """AIMD limit on requests in flight to one server; see the module docstring."""

    def __init__(
        self,
        max_limit: int,
        initial: int = 4,
        *,
        min_limit: int = 2,
        tolerance: float = 2.0,
        slack_s: float = 0.001,
        stall_s: float = 0.5,
        probe_interval_s: float = 10.0,
        max_probe_interval_s: float = 300.0,
        window: int = 256,
        adaptive: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_limit < 1 or min_limit < 1:
            raise ValueError(f"limits must be >= 1, got max {max_limit}, min {min_limit}")
        self.max_limit = max_limit
        self.min_limit = min(min_limit, max_limit)
        self.limit = float(max(self.min_limit, min(initial, max_limit)))
        self.tolerance = tolerance
        self.slack_s = slack_s
        self.stall_s = stall_s
        self.probe_interval_s = probe_interval_s
        self.max_probe_interval_s = max(probe_interval_s, max_probe_interval_s)
        self.probe_wait_s = probe_interval_s  # the current interval: grows while probes keep stalling
        self.clock = clock
        self.adaptive = adaptive  # False: a fixed limit that only counts stalls (the old client, for benchmarks)
        self.slow_start = True
        self.ceiling: float | None = None  # the limit at which the server last stalled
        self.in_flight = 0
        self.peak_in_flight = 0
        self.stalls = 0
        self.decreases = 0
        self._ceiling_at = -math.inf
        self._probing_since: float | None = None  # when the limit last began to probe above a ceiling
        self._last_cut = -math.inf
        self._saturation = 0  # bumped whenever a request finds the limit full or just fills it
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        # The best round trip: the minimum of this window and the previous one, so it follows a server
        # that gets slower for good instead of keeping a best from long ago.
        self._window = window
        self._seen = 0
        self._best_now = math.inf
        self._best_before = math.inf
        self._smooth: float | None = None
        self._connects = 0
        self._connect_now = math.inf
        self._connect_before = math.inf

    # -- slots -------------------------------------------------------------------------------------

    @property
    def slots(self) -> int:
        return max(self.min_limit, int(self.limit))

    @property
    def best_latency_s(self) -> float | None:
        """The lowest smoothed round trip lately (this window and the last): the server's unloaded pace."""
        best = min(self._best_now, self._best_before)
        return None if math.isinf(best) else best

    @property
    def connect_best_s(self) -> float | None:
        """The fastest a new connection to the server opened lately (this window and the last)."""
        best = min(self._connect_now, self._connect_before)
        return None if math.isinf(best) else best

    async def acquire(self) -> Ticket:
        mark = self._saturation  # a request that fills the limit counts as one that found it in use
        if self.in_flight >= self.slots or self._waiters:
            self._saturation += 1
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter  # release() counted us in before waking us
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self.in_flight -= 1  # woken and cancelled at once: give the slot on
                    self._wake()
                else:
                    self._waiters.remove(waiter)
                raise
        else:
            self.in_flight += 1
            if self.in_flight >= self.slots:
                self._saturation += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        return Ticket(self.clock(), mark)

    def _wake(self) -> None:
        while self._waiters and self.in_flight < self.slots:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self.in_flight += 1
                waiter.set_result(None)

    def release(self, ticket: Ticket, outcome: Outcome, latency_s: float, connect_s: float | None = None) -> None:
        """The request of `ticket` ended: `latency_s` from being let through to the last byte,
        `connect_s` how long opening its connection took (None: it reused one)."""
        self.in_flight -= 1
        try:
            self._observe(ticket, outcome, latency_s, connect_s)
        finally:
            self._wake()

    # -- control -----------------------------------------------------------------------------------

    def _observe(self, ticket: Ticket, outcome: Outcome, latency_s: float, connect_s: float | None) -> None:
        base = self.best_latency_s
        stalled = outcome is Outcome.STALL or (connect_s is not None and connect_s > self.stall_s)
        if outcome is Outcome.OK and base is not None and latency_s > max(8.0 * base, base + self.stall_s):
            stalled = True  # e.g. a SYN-ACK the server's kernel sent again because its accept queue was full
        if stalled:
            self.stalls += 1
            if self.adaptive:
                self._cut(ticket, STALL_CUT, remember=True)
            return
        if outcome is Outcome.OVERLOAD:
            if self.adaptive:
                self._cut(ticket, 0.5, remember=False)
            return
        if outcome is not Outcome.OK:
            return
        # Decisions use the smoothed round trip, against the lowest it has been lately: one fast or slow
        # answer says little (a judge's requests differ in cost), a trend says the server is queueing.
        self._smooth = latency_s if self._smooth is None else self._smooth + SMOOTHING * (latency_s - self._smooth)
        self._record(self._smooth)
        if not self.adaptive:
            return
        base = self.best_latency_s
        assert base is not None
        connect_best = self.connect_best_s
        if connect_s is not None:
            self._record_connect(connect_s)
        slow_connect = connect_s is not None and connect_best is not None and connect_s > self.tolerance * connect_best + self.slack_s
        if self._smooth > self.tolerance * base + self.slack_s or slow_connect:
            # The server queues (its round trips grow), or it no longer accepts new connections at once
            # (its listen queue is filling, the step before dropped SYNs): more in flight would only wait.
            self.slow_start = False
            return
        if self._saturation <= ticket.saturation:
            return  # nobody found the limit full while this request ran: more room would not be used
        now = self.clock()
        step = 1.0 if self.slow_start else 1.0 / self.limit
        if self.ceiling is not None:
            if now - self._ceiling_at < self.probe_wait_s:
                cap = max(float(self.min_limit), self.ceiling - 1.0)
                if self.limit + step > cap:  # plateau just below the level that stalled
                    self.slow_start = False
                    self.limit = max(self.limit, min(self.limit + step, cap))
                    return
            else:
                if self._probing_since is None:
                    self._probing_since = now
                if self.limit >= self.ceiling:
                    self.ceiling = None  # probed up to the old stall level without a stall: forget it
        self.limit = min(float(self.max_limit), self.limit + step)

    def _cut(self, ticket: Ticket, factor: float, *, remember: bool) -> None:
        if ticket.started < self._last_cut:
            return  # sent before the last cut: part of the burst that caused it
        now = self.clock()
        if remember:
            if self._probing_since is not None and now - self._probing_since < self.probe_wait_s:
                # The probe stalled within an interval of starting: its level is still too high.
                self.probe_wait_s = min(self.max_probe_interval_s, 2.0 * self.probe_wait_s)
            else:
                self.probe_wait_s = self.probe_interval_s
            self._probing_since = None
            self.ceiling = self.limit
            self._ceiling_at = now
        self.limit = max(float(self.min_limit), self.limit * factor)
        self.slow_start = False
        self._last_cut = now
        self.decreases += 1

    def _record_connect(self, connect_s: float) -> None:
        self._connect_now = min(self._connect_now, connect_s)
        self._connects += 1
        if self._connects >= self._window:
            self._connect_before, self._connect_now, self._connects = self._connect_now, math.inf, 0

    def _record(self, latency_s: float) -> None:
        self._best_now = min(self._best_now, latency_s)
        self._seen += 1
        if self._seen >= self._window:
            self._best_before, self._best_now, self._seen = self._best_now, math.inf, 0
