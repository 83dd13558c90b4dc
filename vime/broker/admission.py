"""Admission: which prompts enter the pipeline, in what order, and how many training groups may be in it.

Owns the prompt cursor, the ledger of admitted training groups (each one's dispatch order) and of
those that left untrained (each one's reason), and the admission limit: the staleness bound widened
by the margin over-sampling asks for (docs/broker.md, "Staleness" and "Dynamic sampling"). Writes the
journal records of its decisions (`JournalAdmit`, `JournalDropped`) and replays them on restore.
Counts `groups_admitted` in the broker's shared counters; the drop counters are the caller's, which
knows why a group left.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from vime.broker.journal import JournalAdmit, JournalDropped, JournalRecord, JournalSnapshot
from vime.broker.settings import BrokerSettings
from vime.data.prompts import PromptCursor
from vime.protocol.messages import Group

DropReason = str  # "failed", "filtered" or "stale" (JournalDropped's reasons)


class Admission:
    def __init__(
        self, settings: BrokerSettings, cursor: PromptCursor, counters: dict[str, int],
        record: Callable[[JournalRecord], None],
    ) -> None:  # fmt: skip
        self.settings = settings
        self.cursor = cursor
        self.counters = counters
        self._record = record
        self.seq: dict[str, int] = {}  # admitted group id -> its place in dispatch order
        self.admitted: set[str] = set()
        self.dropped: dict[str, DropReason] = {}
        self.next_seq = 0

    @property
    def committed(self) -> int:
        """Training groups admitted and not dropped: trained, or on their way to it."""
        return len(self.admitted) - len(self.dropped)

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
        self.seq[group.group_id] = seq
        self.admitted.add(group.group_id)
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
        return self.seq.get(group_id, 0)

    def drop(self, group_id: str, reason: DropReason) -> None:
        """A training group leaves without being trained; the reason is kept and journaled."""
        self.dropped[group_id] = reason
        self._record(JournalDropped(group_id=group_id, reason=reason))  # type: ignore[arg-type]

    def unplaced(self, placed: Iterable[str]) -> list[str]:
        """Admitted groups neither dropped nor in `placed`, in dispatch order."""
        missing = self.admitted - set(placed) - self.dropped.keys()
        return sorted(missing, key=self.order)

    # --- restore -------------------------------------------------------------------------------

    def replay(self, record: JournalRecord) -> None:
        """Apply one of this part's journal records (others are ignored)."""
        if isinstance(record, JournalAdmit):
            self.admitted.add(record.group_id)
            self.seq[record.group_id] = record.seq
            self.next_seq = max(self.next_seq, record.seq + 1)
            self.cursor.seek(record.cursor_epoch, record.cursor_position)
        elif isinstance(record, JournalDropped):
            self.dropped[record.group_id] = record.reason

    def restore_snapshot(self, snap: JournalSnapshot) -> None:
        """A compacted journal's snapshot: the cursor, and the finished groups (trained or dropped)."""
        self.cursor.seek(snap.cursor_epoch, snap.cursor_position)
        self.next_seq = snap.next_seq
        self.dropped = dict(snap.dropped)
        self.admitted = set(snap.trained_ids) | set(snap.dropped)
