"""What the broker sends, and when: messages to one peer at once, announcements to many a few at a time.

A weight version is announced to every rollout worker. Sent inside one loop turn, a thousand sends
hold that turn for milliseconds while credits that arrived meanwhile wait for their groups, which is
where the broker's dispatch-latency tail came from. So a broadcast goes out `BROADCAST_PER_TURN` peers
per loop turn, and a peer's own messages never overtake its announcement: sending to a peer that still
has one waiting sends that first. A message meant for many peers is encoded once.

A send to a peer that is gone fails under ROUTER_MANDATORY; it is logged and dropped (the peer's leases
expire through the heartbeat timeout), so one dead peer never stops a broadcast.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Iterator

import zmq

from vime.broker.state import Outgoing
from vime.logging import get_logger
from vime.protocol.codec import encode
from vime.protocol.messages import Message

log = get_logger(__name__)

# Sends per loop turn for a broadcast: at ~5-10 us a send, well under a millisecond of a turn.
BROADCAST_PER_TURN = 64
# Frames this large go without a copy (the array frames of big groups); smaller ones are copied, which
# costs less than handing libzmq a reference to release later (pyzmq's own threshold).
ZERO_COPY_BYTES = zmq.COPY_THRESHOLD
# A plain int: pyzmq's IntFlag arithmetic costs microseconds per frame.
_SNDMORE = int(zmq.SNDMORE)


class Outbox:
    """Sends on the broker's ROUTER socket. `before_send` runs before anything leaves (the journal's
    write-ahead flush)."""

    def __init__(self, socket: zmq.Socket, before_send: Callable[[], None], per_turn: int = BROADCAST_PER_TURN) -> None:
        self.socket = socket
        self.before_send = before_send
        self.per_turn = per_turn
        self._waiting: OrderedDict[bytes, list[tuple[Message, list[Any]]]] = OrderedDict()

    @property
    def pending(self) -> int:
        """Peers with broadcast messages still to send."""
        return len(self._waiting)

    def send(self, outgoing: Outgoing) -> None:
        """Send now, each peer's waiting broadcast first."""
        if not outgoing:
            return
        self.before_send()
        for identity, msg, frames in _encoded(outgoing):
            for earlier, earlier_frames in self._waiting.pop(identity, ()):
                self._send_one(identity, earlier, earlier_frames)
            self._send_one(identity, msg, frames)

    def broadcast(self, outgoing: Outgoing) -> None:
        """Queue messages for many peers; `send_some` sends them over the next loop turns in order."""
        if not outgoing:
            return
        self.before_send()
        for identity, msg, frames in _encoded(outgoing):
            self._waiting.setdefault(identity, []).append((msg, frames))

    def send_some(self) -> None:
        """One loop turn's share of the waiting broadcasts, oldest peers first."""
        for _ in range(min(self.per_turn, len(self._waiting))):
            identity, queued = self._waiting.popitem(last=False)
            for msg, frames in queued:
                self._send_one(identity, msg, frames)

    def flush(self) -> None:
        """Everything waiting, now (at shutdown)."""
        while self._waiting:
            self.send_some()

    def _send_one(self, identity: bytes, msg: Message, frames: list[Any]) -> None:
        # Frame by frame rather than send_multipart, whose per-call type checks and flag arithmetic
        # took 6.5-6.8 us of a two-frame message against 1.6-2.4 us (docs/benchmarks.md). A peer
        # that is gone fails the first frame, so a failure never leaves half a message queued.
        send = self.socket.send
        last = len(frames) - 1
        try:
            send(identity, _SNDMORE)
            for i, frame in enumerate(frames):
                size = frame.nbytes if isinstance(frame, memoryview) else len(frame)
                send(frame, 0 if i == last else _SNDMORE, copy=size < ZERO_COPY_BYTES)
        except zmq.ZMQError as exc:
            log.warning("send_failed", peer=identity.hex(), message=type(msg).__name__, error=str(exc))


def _encoded(outgoing: Outgoing) -> Iterator[tuple[bytes, Message, list[Any]]]:
    """Each (peer, message) with its frames; a message object repeated for consecutive peers is encoded once."""
    last: tuple[Message | None, list[Any]] = (None, [])
    for identity, msg in outgoing:
        frames = last[1] if msg is last[0] else encode(msg)
        last = (msg, frames)
        yield identity, msg, frames
