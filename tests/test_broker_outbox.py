"""The broker's outbox: a broadcast goes out a few peers per loop turn, and never behind a peer's own later messages."""

from __future__ import annotations

import zmq

from vime.broker.outbox import Outbox
from vime.protocol.codec import decode
from vime.protocol.messages import Ack, DispatchGroups, WeightVersionAnnounce


class RecordingSocket:
    """Stands in for the ROUTER socket: records (peer, decoded message); one peer is gone."""

    def __init__(self, gone: bytes = b"") -> None:
        self.sent: list[tuple[bytes, object]] = []
        self.gone = gone

    def send_multipart(self, frames: list, copy: bool = True) -> None:
        if frames[0] == self.gone:
            raise zmq.ZMQError(zmq.EHOSTUNREACH)
        payload = [f if isinstance(f, (bytes, memoryview)) else f.bytes if hasattr(f, "bytes") else f for f in frames[1:]]
        self.sent.append((frames[0], decode(payload, (WeightVersionAnnounce, DispatchGroups, Ack))))


def test_a_broadcast_is_spread_over_turns_and_a_peers_own_message_never_overtakes_it() -> None:
    socket = RecordingSocket(gone=b"w003")
    flushes = []
    outbox = Outbox(socket, before_send=lambda: flushes.append(len(socket.sent)), per_turn=4)  # type: ignore[arg-type]
    peers = [f"w{i:03d}".encode() for i in range(10)]
    announce = WeightVersionAnnounce(version=7, endpoint="tcp://trainer:1")
    outbox.broadcast([(peer, announce) for peer in peers])
    assert flushes == [0] and socket.sent == [] and outbox.pending == 10  # write-ahead flush, nothing sent yet

    outbox.send_some()
    assert [peer for peer, _ in socket.sent] == peers[:3]  # w003 is gone: logged and skipped, not fatal
    assert outbox.pending == 6

    outbox.send([(b"w008", Ack(ids=["x"]))])  # w008's announcement goes first, then its ack
    assert socket.sent[-2:] == [(b"w008", announce), (b"w008", Ack(ids=["x"]))]
    outbox.send_some()
    assert [peer for peer, _ in socket.sent[5:]] == [b"w004", b"w005", b"w006", b"w007"]
    outbox.flush()
    assert outbox.pending == 0
    announced = [peer for peer, msg in socket.sent if isinstance(msg, WeightVersionAnnounce)]
    assert sorted(announced) == sorted(p for p in peers if p != b"w003") and len(announced) == 9


def test_one_message_for_many_peers_is_encoded_once(monkeypatch) -> None:
    import vime.broker.outbox as outbox_module

    calls = []
    real = outbox_module.encode
    monkeypatch.setattr(outbox_module, "encode", lambda msg: calls.append(msg) or real(msg))
    outbox = Outbox(RecordingSocket(), before_send=lambda: None)  # type: ignore[arg-type]
    announce = WeightVersionAnnounce(version=1, endpoint="e")
    outbox.broadcast([(f"p{i}".encode(), announce) for i in range(100)])
    outbox.send([(f"p{i}".encode(), Ack(ids=["a"])) for i in range(3)])
    assert len(calls) == 1 + 3  # the announcement once; distinct Ack objects each
    outbox.flush()
