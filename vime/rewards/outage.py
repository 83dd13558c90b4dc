"""Reward-server outages as the remote reward client sees them: which servers are failing and since
when, whether a failed chunk of samples should fail or wait, and the warnings a waiting job gives.

`OutageLedger` is told of every request's outcome (`failed`, `succeeded`); a chunk of samples keeps its
own `ChunkWait` while its requests fail. After each failed round of retries, `samples_at_fault` decides:
the samples fail only when the failure looks like theirs (the server was reached, did not say it was
busy, and answered more other requests than it failed since the chunk first failed) for
`sample_fault_rounds` rounds in a row, or once `max_wait_s` has passed; otherwise they wait. While they
wait, `warn_waiting` logs `reward_server_unavailable` at most once per URL every `warn_interval_s`;
`succeeded` logs `reward_server_back` for a URL that had been warned about.
"""

from __future__ import annotations

import time
from typing import Protocol

from vime.logging import get_logger

log = get_logger(__name__)


class RequestFailure(Protocol):
    """What the ledger needs to know of a failed request (vime.rewards.remote.RewardServerError)."""

    kind: str

    @property
    def may_be_the_samples(self) -> bool: ...


class ChunkWait:
    """One chunk of samples' failures while it fails and waits."""

    __slots__ = ("first_failure", "ok_mark", "fail_mark", "fails", "rounds", "fault_rounds")

    def __init__(self) -> None:
        self.first_failure: float | None = None
        self.ok_mark = 0  # the ledger's success count at the chunk's first failure
        self.fail_mark = 0  # its failure count just before it
        self.fails = 0  # the chunk's own failed requests
        self.rounds = 0  # rounds of retries that failed
        self.fault_rounds = 0  # of which, in a row, looked like the samples' own fault


class OutageLedger:
    """Per-URL outage state and the fail-or-wait rule for one client (one event loop; no locking)."""

    def __init__(
        self, urls: list[str], *, warn_interval_s: float, max_wait_s: float | None, sample_fault_rounds: int
    ) -> None:  # fmt: skip
        self.warn_interval_s = warn_interval_s
        self.max_wait_s = max_wait_s
        self.sample_fault_rounds = sample_fault_rounds
        self.last_error: dict[str, str] = {}
        self.last_kind: dict[str, str] = {}
        self._down_since: dict[str, float | None] = dict.fromkeys(urls)  # None: answering
        self._next_warn: dict[str, float | None] = dict.fromkeys(urls)  # None: not warned in this outage
        self._ok_count = 0
        self._fail_count = 0
        self.samples_waiting = 0

    def failed(self, url: str | None, chunk: ChunkWait, error: RequestFailure | None = None) -> None:
        """A request of `chunk` failed at `url` (None: no server was tried, every circuit was open)."""
        now = time.monotonic()
        if chunk.first_failure is None:
            chunk.first_failure = now
            chunk.ok_mark, chunk.fail_mark = self._ok_count, self._fail_count
        chunk.fails += 1
        self._fail_count += 1
        if url is None:
            return
        if error is not None:
            self.last_error[url] = str(error)
            self.last_kind[url] = error.kind
        if self._down_since[url] is None:
            self._down_since[url] = now

    def succeeded(self, url: str) -> None:
        self._ok_count += 1
        since = self._down_since[url]
        if since is None:
            return
        if self._next_warn[url] is not None:
            log.warning("reward_server_back", url=url, down_s=round(time.monotonic() - since, 1),
                        samples_waiting=self.samples_waiting, console=True)  # fmt: skip
        self._down_since[url] = None
        self._next_warn[url] = None

    def samples_at_fault(self, error: RequestFailure, chunk: ChunkWait) -> bool:
        """After a failed round of retries: fail the chunk's samples (True), or let them wait (False)?"""
        chunk.rounds += 1
        if self.max_wait_s is not None and time.monotonic() - (chunk.first_failure or 0.0) >= self.max_wait_s:
            return True
        others_ok = self._ok_count - chunk.ok_mark
        others_failed = self._fail_count - chunk.fail_mark - chunk.fails
        if error.may_be_the_samples and others_ok > others_failed:
            chunk.fault_rounds += 1
        else:
            chunk.fault_rounds = 0
        return chunk.fault_rounds >= self.sample_fault_rounds

    def warn_waiting(self) -> None:
        """Say which servers fail and for how long, at most once per URL every `warn_interval_s`."""
        now = time.monotonic()
        for url, since in self._down_since.items():
            next_warn = self._next_warn[url]
            if since is None or (next_warn is not None and now < next_warn):
                continue
            self._next_warn[url] = now + self.warn_interval_s
            log.warning(
                "reward_server_unavailable", url=url, down_s=round(now - since, 1), samples_waiting=self.samples_waiting,
                kind=self.last_kind.get(url), error=self.last_error.get(url), console=True,
                waiting=self._waiting_text(),
            )  # fmt: skip

    def _waiting_text(self) -> str:
        if self.max_wait_s is None:
            return "samples wait and are scored once the server answers; none is dropped"
        return f"samples wait up to {self.max_wait_s:g}s (--rm-max-wait-s) for the server, then fail"

    def outage_s(self) -> float:
        """How long the longest-failing URL has failed (0 while all answer)."""
        now = time.monotonic()
        return max((now - t for t in self._down_since.values() if t is not None), default=0.0)
