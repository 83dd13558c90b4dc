"""The ledger of finished training groups: each (epoch, prompt) trained or dropped, in one byte.

A group is finished when it leaves the pipeline for good: trained and released (no trainer will ask
for its step again), or dropped ("failed", "filtered", "stale"). The broker needs two things of them:
that a group is never finished twice (the loss and double-training checks), and how many ended each
way (the counters a restored broker recomputes). Keeping one string-keyed entry per group would make
the broker's memory, and the status check that reads the ledgers, grow with the job; here an epoch
still finishing costs one byte per prompt of the dataset, and the epochs whose every prompt is finished
fold into a count (all epochs below it; those finished out of order wait in a small set). So the broker's memory is bounded by the dataset and the groups in play, however
long the job runs (docs/broker.md, "The ledgers").
"""

from __future__ import annotations

from collections import Counter
from typing import Literal

import numpy as np

Outcome = Literal["trained", "failed", "filtered", "stale"]
OUTCOMES: tuple[Outcome, ...] = ("trained", "failed", "filtered", "stale")
_CODE = {outcome: code for code, outcome in enumerate(OUTCOMES, start=1)}  # 0: not finished


class FinishedTwice(ValueError):
    """A group that had already finished finished again: the broker's bookkeeping is wrong."""


class FinishedGroups:
    def __init__(self, prompts_per_epoch: int) -> None:
        self.prompts_per_epoch = prompts_per_epoch
        self.counts: Counter[Outcome] = Counter()
        self._finishing: dict[int, np.ndarray] = {}  # epoch -> outcome code per prompt index
        self._finishing_counts: Counter[int] = Counter()  # epoch -> prompts finished in it
        # Epochs whose every prompt finished: all below `_folded_below`, and those in `_folded_ahead`.
        self._folded_below = 0
        self._folded_ahead: set[int] = set()

    def add(self, epoch: int, prompt_index: int, outcome: Outcome) -> None:
        """Record a group's end. Raises FinishedTwice if it had already ended."""
        if self.has(epoch, prompt_index):
            raise FinishedTwice(f"group e{epoch}-p{prompt_index} finished twice ({outcome} after {self.outcome(epoch, prompt_index)})")
        codes = self._finishing.get(epoch)
        if codes is None or prompt_index >= len(codes):
            codes = self._grown(epoch, prompt_index)
        codes[prompt_index] = _CODE[outcome]
        self.counts[outcome] += 1
        self._finishing_counts[epoch] += 1
        if self._finishing_counts[epoch] >= self.prompts_per_epoch:
            self._fold(epoch)

    def _grown(self, epoch: int, prompt_index: int) -> np.ndarray:
        old = self._finishing.get(epoch)
        codes = np.zeros(max(self.prompts_per_epoch, prompt_index + 1), dtype=np.uint8)
        if old is not None:
            codes[: len(old)] = old
        self._finishing[epoch] = codes
        return codes

    def _fold(self, epoch: int) -> None:
        del self._finishing[epoch]
        del self._finishing_counts[epoch]
        self._folded_ahead.add(epoch)
        while self._folded_below in self._folded_ahead:
            self._folded_ahead.remove(self._folded_below)
            self._folded_below += 1

    def _is_folded(self, epoch: int) -> bool:
        return epoch < self._folded_below or epoch in self._folded_ahead

    def has(self, epoch: int, prompt_index: int) -> bool:
        return self.outcome(epoch, prompt_index) is not None

    def outcome(self, epoch: int, prompt_index: int) -> Outcome | Literal["finished"] | None:
        """How the group ended; "finished" for a folded epoch (only that it did is kept); None if it
        has not."""
        if self._is_folded(epoch):
            return "finished"
        codes = self._finishing.get(epoch)
        if codes is None or prompt_index >= len(codes) or not codes[prompt_index]:
            return None
        return OUTCOMES[codes[prompt_index] - 1]

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def nbytes(self) -> int:
        """Memory held for the epochs still finishing."""
        return sum(codes.nbytes for codes in self._finishing.values())

    # --- journal snapshot --------------------------------------------------------------------------

    def snapshot(self) -> tuple[dict[int, np.ndarray], int, list[int], dict[str, int]]:
        """(epochs still finishing -> outcome codes, epochs below this all folded, other folded epochs,
        counts per outcome) for a journal snapshot (`JournalSnapshot.finishing / folded_below /
        folded_epochs / finished_counts`)."""
        finishing = {e: c.copy() for e, c in self._finishing.items()}
        return finishing, self._folded_below, sorted(self._folded_ahead), dict(self.counts)

    @classmethod
    def from_snapshot(
        cls, prompts_per_epoch: int, finishing: dict[int, np.ndarray], folded_below: int, folded_epochs: list[int],
        counts: dict[str, int],
    ) -> FinishedGroups:  # fmt: skip
        ledger = cls(prompts_per_epoch)
        for epoch, codes in finishing.items():
            if codes.dtype != np.uint8 or codes.ndim != 1 or int(codes.max(initial=0)) > len(OUTCOMES):
                raise ValueError(f"epoch {epoch}'s finished-group codes are not one byte per prompt in 0..{len(OUTCOMES)}")
            ledger._finishing[epoch] = codes.copy()
            ledger._finishing_counts[epoch] = int(np.count_nonzero(codes))
        ledger._folded_below = folded_below
        ledger._folded_ahead = {e for e in folded_epochs if e >= folded_below}
        unknown = set(counts) - set(OUTCOMES)
        if unknown:
            raise ValueError(f"unknown finished-group outcomes {sorted(unknown)}")
        ledger.counts = Counter({k: v for k, v in counts.items() if v})  # type: ignore[misc]
        return ledger
