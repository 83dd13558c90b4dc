"""The broker's durable journal: an append-only file of typed records, replayed at start-up.

Why: the broker holds the job's memory (which prompts were handed out, every scored group not yet
trained, which batch went to which step, the weight version). A broker killed at any moment and started
again with the same flags must continue the job with nothing lost and nothing trained twice.

File format (one file, `RUN_DIR/broker.journal`): a sequence of records, each
    u32 body length | u32 CRC-32 of body | body
where the body is `u32 frame count` followed by `u32 length | bytes` per frame, the frames being the
wire codec's encoding of one `JournalRecord` message (msgpack header + raw array frames, no pickle).
The first record is always a `JournalHeader` naming the job it belongs to.

Durability (the write-ahead rule): records are appended while the broker's state changes and written to
the kernel (`write(2)`) before the broker sends any message that depends on them, so a SIGKILL of the
broker never loses a record another process has acted on. Whether they also reach the disk before a
machine crash is `--journal-fsync`:
- `always`: fsync after every write (survives power loss; one fsync per event-loop turn that changed state);
- `interval` (default): fsync at most every `--journal-fsync-interval-s` seconds (a machine crash may lose
  that window; the lost work is regenerated, but a batch already trained could be handed out again);
- `never`: leave it to the kernel.

Recovery: a record cut short at the end of the file (the broker died mid-write) is dropped with a warning
and the file is truncated there; a damaged record anywhere else is an error that names the offset, since
guessing would silently lose or repeat work. Compaction rewrites the live state as a fresh journal (a
temporary file, fsync, atomic rename) when the file has grown past `--journal-compact-bytes`.
"""

from __future__ import annotations

import os
import struct
import time
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from vime.logging import get_logger
from vime.protocol.codec import Message, ProtocolError, decode, encode
from vime.protocol.messages import Group

log = get_logger(__name__)

FsyncPolicy = Literal["always", "interval", "never"]
JOURNAL_FORMAT = 2  # 2: finished groups as one byte per prompt (JournalSnapshot.finishing)
_U32 = struct.Struct("<I")
_RECORD_HEAD = struct.Struct("<II")
_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
# A record longer than this is damage, not data (a group of R3 traces is megabytes, not gigabytes).
MAX_RECORD_BYTES = 4 << 30


class JournalError(RuntimeError):
    """The journal cannot be used: damaged in the middle, or written by a different job."""


# --- records ---------------------------------------------------------------------------------------


class JournalRecord(Message):
    """Base of journal records (not wire messages: no socket accepts them)."""


class JournalHeader(JournalRecord, tag="j_header"):
    """First record: which job this journal belongs to. Restoring under other settings is refused."""

    format: int
    fingerprint: dict[str, Any]


class JournalAdmit(JournalRecord, tag="j_admit"):
    """A prompt group was admitted (the prompt cursor moved past it)."""

    group_id: str
    epoch: int
    prompt_index: int
    seq: int
    # The cursor after this admission, so restoring does not walk the dataset again.
    cursor_epoch: int
    cursor_position: int


class JournalBuffered(JournalRecord, tag="j_buffered"):
    """A scored group the filter kept entered the buffer (the full payload: it is training data)."""

    group: Group


class JournalDropped(JournalRecord, tag="j_dropped"):
    """A training group left the pipeline without being trained ("failed", "filtered" or "stale")."""

    group_id: str
    reason: Literal["failed", "filtered", "stale"]


class JournalBatch(JournalRecord, tag="j_batch"):
    """Buffered groups became training step `step`'s batch."""

    step: int
    group_ids: list[str]
    policy_version: int


class JournalStepDone(JournalRecord, tag="j_step_done"):
    """The trainer finished step `step`; `counters` is a snapshot of the status counters."""

    step: int
    counters: dict[str, int] = {}


class JournalCheckpoint(JournalRecord, tag="j_checkpoint"):
    """The trainer saved a resumable checkpoint after `steps_done` steps; older batches can go."""

    steps_done: int


class JournalPublished(JournalRecord, tag="j_published"):
    version: int
    endpoint: str


class JournalFinished(JournalRecord, tag="j_finished"):
    """The job finished: every step trained, no eval outstanding, the workers told to shut down. A journal
    without it was cut short, even after its last step (a kill while the job wound down), and resumes."""

    trained_steps: int


class JournalSnapshot(JournalRecord, tag="j_snapshot"):
    """Compaction: everything about finished groups, in one record (the live ones follow it)."""

    cursor_epoch: int
    cursor_position: int
    next_seq: int
    published_version: int
    weight_endpoint: str | None
    trained_steps: int
    checkpoint_steps: int
    # Finished groups (`vime.broker.finished`): per epoch still finishing, one outcome code per prompt
    # index; the epochs whose every prompt finished (all below `folded_below`, and `folded_epochs`); how
    # many ended each way.
    finishing: dict[int, np.ndarray]
    folded_below: int
    folded_epochs: list[int]
    finished_counts: dict[str, int]
    counters: dict[str, int]


JOURNAL_TYPES: tuple[type[JournalRecord], ...] = (
    JournalHeader, JournalAdmit, JournalBuffered, JournalDropped, JournalBatch, JournalStepDone,
    JournalCheckpoint, JournalPublished, JournalSnapshot, JournalFinished,
)  # fmt: skip


# --- file format ---------------------------------------------------------------------------------


def encode_record(record: JournalRecord) -> bytes:
    return b"".join(record_pieces(record))


def record_pieces(record: JournalRecord) -> list[bytes | memoryview]:
    """A record's bytes as pieces to write in order (`os.writev`): the codec's frames are not copied
    (a buffered group's token arrays and R3 traces are most of the journal's bytes)."""
    frames = [memoryview(f).cast("B") for f in encode(record)]
    pieces: list[bytes | memoryview] = [b"", _U32.pack(len(frames))]
    for frame in frames:
        pieces += [_U32.pack(len(frame)), frame]
    crc = 0
    for piece in pieces[1:]:
        crc = zlib.crc32(piece, crc)
    pieces[0] = _RECORD_HEAD.pack(sum(len(p) for p in pieces[1:]), crc)
    return pieces


def _write_all(fd: int, pieces: list[bytes | memoryview]) -> int:
    """Write every piece in order with as few system calls as the kernel allows; returns the bytes written."""
    total = 0
    views = [memoryview(p) for p in pieces if len(p)]
    first = 0  # views before it are written
    while first < len(views):
        written = os.writev(fd, views[first : first + _IOV_MAX])
        total += written
        # Step past what was written, keeping the unwritten tail of a piece cut short.
        while first < len(views) and written >= len(views[first]):
            written -= len(views[first])
            first += 1
        if written:
            views[first] = views[first][written:]
    return total


def _decode_body(body: bytes, offset: int) -> JournalRecord:
    view = memoryview(body)
    try:
        (count,) = _U32.unpack_from(view, 0)
        pos, frames = 4, []
        for _ in range(count):
            (length,) = _U32.unpack_from(view, pos)
            frames.append(view[pos + 4 : pos + 4 + length])
            pos += 4 + length
        if pos != len(body):
            raise ValueError(f"{len(body) - pos} stray bytes")
        return decode(frames, JOURNAL_TYPES, max_total_bytes=MAX_RECORD_BYTES)  # type: ignore[return-value]
    except (struct.error, ValueError, ProtocolError) as exc:
        raise JournalError(f"journal record at byte {offset} does not decode: {exc}") from None


def read_journal(path: Path) -> tuple[list[JournalRecord], int]:
    """The records of a journal and the byte length of its intact part.

    A torn last record (the writer died mid-write) is left out; damage before the end raises
    JournalError naming the offset.
    """
    data = path.read_bytes()
    records: list[JournalRecord] = []
    offset = 0
    while offset < len(data):
        if len(data) - offset < _RECORD_HEAD.size:
            break  # torn head
        length, crc = _RECORD_HEAD.unpack_from(data, offset)
        end = offset + _RECORD_HEAD.size + length
        if length > MAX_RECORD_BYTES:
            raise JournalError(f"journal {path}: record at byte {offset} claims {length} bytes: damaged")
        if end > len(data):
            break  # torn body
        body = data[offset + _RECORD_HEAD.size : end]
        if zlib.crc32(body) != crc:
            if end == len(data):
                break  # the last record, half written
            raise JournalError(f"journal {path}: record at byte {offset} fails its checksum (damaged file)")
        records.append(_decode_body(body, offset))
        offset = end
    if offset < len(data):
        log.warning("journal_torn_tail", path=str(path), dropped_bytes=len(data) - offset, at=offset)
    return records, offset


class JournalWriter:
    """Appends records; `flush()` writes them to the kernel and fsyncs per the policy.

    Opened with O_APPEND on a file whose intact length is known (`truncate_to`), so a torn tail from a
    previous crash is cut off before anything new is written after it.
    """

    def __init__(
        self, path: Path, *, fsync: FsyncPolicy = "interval", fsync_interval_s: float = 1.0, truncate_to: int | None = None,
    ) -> None:  # fmt: skip
        self.path = path
        self.fsync_policy = fsync
        self.fsync_interval_s = fsync_interval_s
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        if truncate_to is not None:
            os.ftruncate(self._fd, truncate_to)
        self.size = os.fstat(self._fd).st_size
        self._pending: list[bytes | memoryview] = []
        self._last_fsync = time.monotonic()
        self._dirty = False

    def append(self, record: JournalRecord) -> None:
        self._pending += record_pieces(record)

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def flush(self) -> None:
        """Write pending records (few write calls), then fsync if the policy says so now."""
        if self._pending:
            pieces, self._pending = self._pending, []
            self.size += _write_all(self._fd, pieces)
            self._dirty = True
        if self._dirty and self._fsync_due():
            os.fsync(self._fd)
            self._dirty = False
            self._last_fsync = time.monotonic()

    def _fsync_due(self) -> bool:
        if self.fsync_policy == "always":
            return True
        if self.fsync_policy == "never":
            return False
        return time.monotonic() - self._last_fsync >= self.fsync_interval_s

    def rewrite(self, records: Sequence[JournalRecord]) -> None:
        """Compaction: replace the whole journal by `records`, atomically (tmp file, fsync, rename)."""
        self.flush()
        tmp = self.path.with_suffix(".compacting")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for record in records:
                _write_all(fd, record_pieces(record))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        _fsync_dir(self.path.parent)
        os.close(self._fd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self.size = os.fstat(self._fd).st_size
        self._dirty = False

    def close(self) -> None:
        if self._fd < 0:
            return
        self.flush()
        if self._dirty and self.fsync_policy != "never":
            os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def journal_file(run_dir: Path) -> Path:
    return run_dir / "broker.journal"


def move_aside(path: Path, label: str) -> Path:
    """Keep an old journal under a dated name (`broker.journal.<label>-<time>`) so a new job can start."""
    target = path.with_name(f"{path.name}.{label}-{time.strftime('%Y%m%d-%H%M%S')}")
    path.rename(target)
    return target


__all__ = [
    "FsyncPolicy", "JournalError", "JournalRecord", "JournalHeader", "JournalAdmit", "JournalBuffered",
    "JournalDropped", "JournalBatch", "JournalStepDone", "JournalCheckpoint", "JournalPublished",
    "JournalSnapshot", "JournalFinished", "JournalWriter", "read_journal", "encode_record", "journal_file", "move_aside",
]
