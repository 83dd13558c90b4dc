"""Admission: which prompts enter the pipeline, in what order, and how many training groups may be in it.

Owns the prompt cursor, the ledger of training groups (the open ones, admitted and not finished, with
their dispatch order; the finished ones folded into `FinishedGroups`), and the admission limit: the
staleness bound widened by the margin over-sampling asks for (docs/broker.md, "Staleness" and "Dynamic
sampling"). Writes the journal records of its decisions (`JournalAdmit`, `JournalDropped`) and replays
them on restore. Counts `groups_admitted` in the broker's shared counters; the drop counters are the
caller's, which knows why a group left.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import NamedTuple

from vime.broker.finished import FinishedGroups, Outcome
from vime.broker.journal import JournalAdmit, JournalDropped, JournalError, JournalRecord, JournalSnapshot
from vime.broker.settings import BrokerSettings
from vime.data.prompts import PromptCursor
from vime.protocol.messages import Group

DropReason = str  # "failed", "filtered" or "stale" (JournalDropped's reasons)


class UnknownGroup(LookupError):
    """A group id that is not open: never admitted, or already finished."""


class OpenGroup(NamedTuple):
    seq: int  # its place in dispatch order
    epoch: int
    prompt_index: int


class Admission:
    def __init__(
        self, settings: BrokerSettings, cursor: PromptCursor, counters: dict[str, int],
        record: Callable[[JournalRecord], None],
    ) -> None:  # fmt: skip
        self.settings = settings
        self.cursor = cursor
        self.counters = counters
        self._record = record
        # Admitted and not finished: on their way, or trained but still replayable to a resumed trainer.
        self.open: dict[str, OpenGroup] = {}
        self.finished = FinishedGroups(len(cursor))
        self.next_seq = 0

    @property
    def committed(self) -> int:
        """Training groups admitted and not dropped: trained, or on their way to it."""
        return self.finished.counts["trained"] + len(self.open)

    @property
    def trained_released(self) -> int:
        """Trained groups no trainer will ask for again (finished as trained)."""
        return self.finished.counts["trained"]

    def base_limit(self, published_version: int) -> int:
        """The staleness bound on `committed`: groups that can still train within max_staleness versions
        of the published weights, and never more than the job trains."""
        s = self.settings
        by_staleness = (published_version + s.max_staleness + 1) * s.groups_per_version
        return min(by_staleness, s.num_rollout * s.rollout_batch_size)

    def limit(self, published_version: int, kept: int, keep_rate: float) -> int:
        """Admit while `committed` is below this. `kept`: groups the filter kept (buffered, training,
        trained); the rest of the headroom is divided by the expected keep rate, so that many more are
        in flight as the filter is expected to drop."""
        base = self.base_limit(published_version)
        if keep_rate >= 1.0:
            return base
        headroom = max(0, base - kept)
        return kept + math.ceil(headroom / keep_rate - 1e-9)

    def admit(self) -> Group:
        """The next prompt of the dataset as a new training group, journaled."""
        epoch, prompt = self.cursor.next()
        group = self.group_for(epoch, prompt.index)
        seq = self.next_seq
        self.next_seq += 1
        self.open[group.group_id] = OpenGroup(seq, epoch, prompt.index)
        self.counters["groups_admitted"] += 1
        self._record(JournalAdmit(
            group_id=group.group_id, epoch=epoch, prompt_index=prompt.index, seq=seq,
            cursor_epoch=self.cursor.epoch, cursor_position=self.cursor.position,
        ))  # fmt: skip
        return group

    def group_for(self, epoch: int, prompt_index: int) -> Group:
        """A fresh (ungenerated) training group for a prompt of the dataset."""
        prompt = self.cursor.prompt(prompt_index)
        return Group(
            group_id=f"e{epoch}-p{prompt.index}",
            prompt_index=prompt.index,
            epoch=epoch,
            prompt_tokens=prompt.tokens,
            prompt_text=prompt.text,
            label=prompt.label,
            metadata=prompt.metadata,
            n_samples=self.settings.n_samples_per_prompt,
        )

    def order(self, group_id: str) -> int:
        """A group's place in dispatch order (ties between equal deadlines go to the earlier one)."""
        entry = self.open.get(group_id)
        return 0 if entry is None else entry.seq

    def is_open(self, group_id: str) -> bool:
        """Admitted and not finished."""
        return group_id in self.open

    def drop(self, group_id: str, reason: DropReason) -> None:
        """A training group leaves without being trained; the reason is counted and journaled. Raises
        UnknownGroup if it is not open."""
        self._finish(group_id, reason)  # type: ignore[arg-type]
        self._record(JournalDropped(group_id=group_id, reason=reason))  # type: ignore[arg-type]

    def release_trained(self, group_id: str) -> None:
        """A trained group no trainer will ask for again finishes (not journaled: the trainer's
        checkpoint or step record says so). Raises UnknownGroup if it is not open."""
        self._finish(group_id, "trained")

    def _finish(self, group_id: str, outcome: Outcome) -> None:
        entry = self.open.pop(group_id, None)
        if entry is None:
            raise UnknownGroup(f"group {group_id} is not open (never admitted, or already finished)")
        self.finished.add(entry.epoch, entry.prompt_index, outcome)

    def unplaced(self, placed: Iterable[str]) -> list[str]:
        """Open groups not in `placed`, in dispatch order."""
        missing = self.open.keys() - set(placed)
        return sorted(missing, key=self.order)

    # --- restore -------------------------------------------------------------------------------

    def replay(self, record: JournalRecord) -> None:
        """Apply one of this part's journal records (others are ignored). Raises JournalError when the
        journal contradicts itself."""
        if isinstance(record, JournalAdmit):
            if record.group_id in self.open or self.finished.has(record.epoch, record.prompt_index):
                raise JournalError(f"journal: group {record.group_id} admitted twice")
            self.open[record.group_id] = OpenGroup(record.seq, record.epoch, record.prompt_index)
            self.next_seq = max(self.next_seq, record.seq + 1)
            self.cursor.seek(record.cursor_epoch, record.cursor_position)
        elif isinstance(record, JournalDropped):
            try:
                self._finish(record.group_id, record.reason)
            except UnknownGroup as exc:
                raise JournalError(f"journal: {record.reason} {exc}") from None

    def restore_snapshot(self, snap: JournalSnapshot) -> None:
        """A compacted journal's snapshot: the cursor, and the finished groups (trained or dropped)."""
        self.cursor.seek(snap.cursor_epoch, snap.cursor_position)
        self.next_seq = snap.next_seq
        self.open = {}
        self.finished = FinishedGroups.from_snapshot(
            len(self.cursor), snap.finishing, snap.folded_below, snap.folded_epochs, snap.finished_counts,
        )  # fmt: skip
