"""The broker's outbox: a broadcast goes out a few peers per loop turn, and never behind a peer's own later messages."""

from __future__ import annotations

import zmq

from vime.broker.outbox import Outbox
from vime.protocol.codec import decode
from vime.protocol.messages import Ack, DispatchGroups, WeightVersionAnnounce


class RecordingSocket:
    """Stands in for the ROUTER socket: records (peer, decoded message) per whole multipart message; one
    peer is gone (its first frame fails, as under ROUTER_MANDATORY)."""

    def __init__(self, gone: bytes = b"") -> None:
        self.sent: list[tuple[bytes, object]] = []
        self.gone = gone
        self._parts: list[bytes] = []

    def send(self, data: bytes | memoryview, flags: int = 0, copy: bool = True) -> None:
        if not self._parts and data == self.gone:
            raise zmq.ZMQError(zmq.EHOSTUNREACH)
        self._parts.append(bytes(data))
        if not flags & zmq.SNDMORE:
            identity, *payload = self._parts
            self._parts = []
            self.sent.append((identity, decode(payload, (WeightVersionAnnounce, DispatchGroups, Ack))))


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


def test_messages_arrive_whole_over_a_real_router_with_large_frames_uncopied() -> None:
    """A real ROUTER/DEALER pair: multipart messages arrive whole and in order, a group whose arrays are
    larger than ZERO_COPY_BYTES (sent without a copy) arrives intact, and a gone peer is skipped."""
    import numpy as np

    from vime.broker.outbox import ZERO_COPY_BYTES
    from vime.protocol.messages import Group, Sample

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"w1")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    try:
        dealer.send(b"hello")
        assert router.recv_multipart() == [b"w1", b"hello"]
        n = ZERO_COPY_BYTES // 4 + 100
        sample = Sample(index=0, response_tokens=np.arange(n, dtype=np.int32), rollout_logprobs=np.full(n, -0.5, np.float32),
                        loss_mask=np.ones(n, np.uint8), token_versions=np.zeros(n, np.int32), finish_reason="length")  # fmt: skip
        group = Group(group_id="g", prompt_index=0, epoch=0, prompt_tokens=np.arange(5, dtype=np.int32), prompt_text="p", n_samples=1,
                      samples=[sample])  # fmt: skip
        outbox = Outbox(router, before_send=lambda: None)
        outbox.send([(b"gone", Ack(ids=["lost"])), (b"w1", Ack(ids=["a"])), (b"w1", DispatchGroups(groups=[group])), (b"w1", Ack(ids=["b"]))])
        received = [decode(dealer.recv_multipart(copy=False), (Ack, DispatchGroups)) for _ in range(3)]
        assert received[0] == Ack(ids=["a"]) and received[2] == Ack(ids=["b"])
        [got] = received[1].groups  # type: ignore[attr-defined]
        assert np.array_equal(got.samples[0].response_tokens, sample.response_tokens)
        assert np.array_equal(got.samples[0].rollout_logprobs, sample.rollout_logprobs)
        assert dealer.poll(100) == 0  # nothing else, nothing for the gone peer
    finally:
        dealer.close(linger=0)
        router.close(linger=0)
        ctx.term()
