"""The rate limit on the broker's `bad_message` log lines: a flood of garbage (or of unknown-peer
heartbeats after a restart) must not become a flood of log lines. Every bad message is still answered
and counted; only its line may be left out, and what was left out is reported per interval."""

from __future__ import annotations

from collections import Counter

from vime.logging import get_logger
from vime.protocol.codec import ERROR_UNKNOWN_PEER

log = get_logger("vime.broker.server")

# `bad_message` lines: at most this many of each error code per interval; the rest are counted and
# reported in one `bad_message_suppressed` line when the interval is over (or at shutdown). A flood of
# garbage (or of unknown-peer heartbeats after a restart) must not become a flood of log lines.
BAD_MESSAGE_LOG_BURST = 10
BAD_MESSAGE_LOG_EVERY_S = 10.0


class BadMessageLog:
    """The rate limit on `bad_message` lines (see BAD_MESSAGE_LOG_BURST). Every bad message is still
    answered and counted in the broker's `bad_messages` counter; only its log line may be left out."""

    def __init__(self, burst: int = BAD_MESSAGE_LOG_BURST, every_s: float = BAD_MESSAGE_LOG_EVERY_S) -> None:
        self.burst = burst
        self.every_s = every_s
        self.suppressed_total = 0  # lines left out so far (each reported in a bad_message_suppressed line)
        self._started = float("-inf")
        self._logged: Counter[str] = Counter()
        self._suppressed: Counter[str] = Counter()

    def allow(self, code: str, now: float) -> bool:
        """Whether to log this bad message's line; if not, it is counted for the interval's summary."""
        self.roll(now)
        if self._logged[code] < self.burst:
            self._logged[code] += 1
            return True
        self._suppressed[code] += 1
        self.suppressed_total += 1
        return False

    def roll(self, now: float, *, force: bool = False) -> None:
        """End the interval if it is over (or `force`): report what was left out, start counting again."""
        if not force and now - self._started < self.every_s:
            return
        if self._suppressed:
            expected_only = set(self._suppressed) == {ERROR_UNKNOWN_PEER}
            (log.info if expected_only else log.warning)(
                "bad_message_suppressed", suppressed=sum(self._suppressed.values()), by_code=dict(self._suppressed),
                interval_s=round(now - self._started, 1), burst_per_code=self.burst,
            )  # fmt: skip
        self._started = now
        self._logged.clear()
        self._suppressed.clear()
