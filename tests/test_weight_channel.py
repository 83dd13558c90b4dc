"""The weight channel end to end over loopback TCP: publisher thread, fetchers, raw peers, faults."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vime.protocol.codec import PROTOCOL_VERSION, ProtocolError, decode, encode
from vime.protocol.weights import (
    CHECKSUM_ALGORITHM,
    ERROR_SUPERSEDED,
    FETCHER_ACCEPTS,
    MIN_CHUNK_BYTES,
    TensorSpec,
    WeightChunk,
    WeightChunkRequest,
    WeightError,
    WeightFetch,
    WeightManifest,
    chunk_checksum,
)
from vime.weights import WeightFetcher, WeightFetchError, WeightPublisher

CHUNK = MIN_CHUNK_BYTES  # 64 KiB: small chunks so a ~1 MB model crosses many boundaries


def model_state(seed: int) -> list[tuple[str, torch.Tensor]]:
    """A small model-like state dict: mixed dtypes, odd sizes, a strided tensor, a scalar, an empty one."""
    g = torch.Generator().manual_seed(seed)
    return [
        ("model.embed_tokens.weight", torch.randn(517, 129, generator=g).to(torch.bfloat16)),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(129, 131, generator=g)),
        ("model.layers.0.input_layernorm.weight", torch.randn(129, generator=g).to(torch.bfloat16)),
        ("model.layers.0.mlp.up_proj.weight", torch.randn(301, 129, generator=g).to(torch.bfloat16).t()),
        ("model.layers.0.mlp.down_proj.weight", torch.randn(129, 301, generator=g).to(torch.float16)),
        ("model.norm.bias", torch.randn((), generator=g)),
        ("model.rotary.inv_freq", torch.arange(5, dtype=torch.int64) * seed),
        ("model.mask", torch.rand(7, generator=g) > 0.5),
        ("model.empty", torch.zeros(0, 3)),
        ("lm_head.weight", torch.randn(300_001, generator=g).to(torch.bfloat16)),
    ]


def assert_bit_identical(sent: list[tuple[str, torch.Tensor]], got: list[tuple[str, torch.Tensor]]) -> None:
    assert [n for n, _ in sent] == [n for n, _ in got]
    for (name, a), (_, b) in zip(sent, got):
        assert b.device.type == "cpu", name
        assert (a.dtype, tuple(a.shape)) == (b.dtype, tuple(b.shape)), name
        raw_a = a.contiguous().reshape(-1).view(torch.uint8)
        raw_b = b.contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(raw_a, raw_b), name


@pytest.fixture
def publisher() -> Iterator[WeightPublisher]:
    pub = WeightPublisher(chunk_bytes=CHUNK)
    yield pub
    pub.close()


def fetcher_for(pub: WeightPublisher, **kw: float) -> WeightFetcher:
    kw.setdefault("timeout_s", 5.0)
    return WeightFetcher(pub.endpoint, **kw)  # type: ignore[arg-type]


def raw_dealer(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 3000)
    sock.connect(endpoint)
    return sock


def test_round_trip_mixed_dtypes_is_bit_identical(publisher: WeightPublisher) -> None:
    state = model_state(1)
    stats = publisher.publish(1, state)
    fetcher = fetcher_for(publisher)
    try:
        got = fetcher.fetch()
    finally:
        fetcher.close()
    assert got.version == 1 and publisher.latest_version == 1
    assert got.nbytes == stats.nbytes and stats.num_chunks == -(-stats.nbytes // CHUNK) > 10
    assert_bit_identical(state, got.tensors)
    # The layout really straddles chunk boundaries (else this test would prove little).
    crossing = [name for name, t in got.tensors if t.numel() and _crosses(t, CHUNK)]
    assert len(crossing) >= 3
    assert publisher.completed_fetches(1) == 1


def _crosses(tensor: torch.Tensor, chunk: int) -> bool:
    """Whether a received tensor (a view of the receive buffer) spans a chunk boundary."""
    start = tensor.storage_offset() * tensor.element_size()
    end = start + tensor.numel() * tensor.element_size()
    return start // chunk != (end - 1) // chunk


def test_two_fetchers_at_once(publisher: WeightPublisher) -> None:
    state = model_state(2)
    publisher.publish(7, state)
    results: dict[int, object] = {}

    def run(slot: int, window: int) -> None:
        with fetcher_for(publisher, window=window) as f:
            try:
                results[slot] = f.fetch(min_version=7)
            except Exception as exc:  # surfaced by the assertion below
                results[slot] = exc

    threads = [threading.Thread(target=run, args=(i, w)) for i, w in enumerate((1, 4, 8))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert sorted(results) == [0, 1, 2]
    for got in results.values():
        assert not isinstance(got, Exception), got
        assert got.version == 7  # type: ignore[attr-defined]
        assert_bit_identical(state, got.tensors)  # type: ignore[attr-defined]
    assert publisher.completed_fetches(7) == 3


def test_fetch_after_several_publishes_gets_only_the_latest(publisher: WeightPublisher) -> None:
    for version in (1, 2, 5):
        publisher.publish(version, model_state(version))
    with pytest.raises(ValueError, match="versions must increase"):
        publisher.publish(5, model_state(5))
    with fetcher_for(publisher) as f:
        got = f.fetch(min_version=2)
        assert got.version == 5
        assert_bit_identical(model_state(5), got.tensors)
        assert f.fetch().version == 5  # a repeat fetch on the same socket works too


def test_fetch_waits_for_min_version_then_times_out(publisher: WeightPublisher) -> None:
    publisher.publish(1, model_state(1))
    timer = threading.Timer(0.3, publisher.publish, args=(2, model_state(2)))
    timer.start()
    try:
        with fetcher_for(publisher) as f:
            assert f.fetch(min_version=2).version == 2
    finally:
        timer.join()
    with fetcher_for(publisher, timeout_s=0.5) as f:
        began = time.monotonic()
        with pytest.raises(WeightFetchError, match=r"version 2; no version >= 3 appeared within 0.5 s"):
            f.fetch(min_version=3)
        assert time.monotonic() - began < 1.5


def test_one_publish_during_a_fetch_keeps_the_started_version(publisher: WeightPublisher) -> None:
    """keep=2: the snapshot being fetched survives one newer publish, so the fetch completes on it."""
    publisher.publish(1, model_state(1))
    with fetcher_for(publisher, window=2) as f:
        f._after_chunk = lambda i: publisher.publish(2, model_state(2)) if i == 3 else None
        got = f.fetch()
    assert got.version == 1 and publisher.latest_version == 2
    assert_bit_identical(model_state(1), got.tensors)


def test_publishes_that_drop_the_fetched_version_restart_the_fetch(publisher: WeightPublisher) -> None:
    publisher.publish(1, model_state(1))

    def publish_twice(index: int) -> None:
        if index == 3 and publisher.latest_version == 1:
            publisher.publish(2, model_state(2))
            publisher.publish(3, model_state(3))  # version 1 is now dropped (keep=2)

    with fetcher_for(publisher, window=4) as f:
        f._after_chunk = publish_twice
        got = f.fetch()
    assert got.version == 3
    assert_bit_identical(model_state(3), got.tensors)


def test_chunk_request_for_a_dropped_version_is_answered_superseded(publisher: WeightPublisher) -> None:
    publisher.publish(1, model_state(1))
    ctx = zmq.Context()
    sock = raw_dealer(ctx, publisher.endpoint)
    try:
        sock.send_multipart(encode(WeightFetch(fetch_id=11)))
        manifest = decode(sock.recv_multipart(copy=False), expect=FETCHER_ACCEPTS)
        assert isinstance(manifest, WeightManifest) and manifest.version == 1
        publisher.publish(2, model_state(2))
        sock.send_multipart(encode(WeightChunkRequest(fetch_id=11, version=1, index=0)))
        assert isinstance(decode(sock.recv_multipart(copy=False), expect=FETCHER_ACCEPTS), WeightChunk)
        publisher.publish(3, model_state(3))
        sock.send_multipart(encode(WeightChunkRequest(fetch_id=11, version=1, index=1)))
        reply = decode(sock.recv_multipart(copy=False), expect=FETCHER_ACCEPTS)
        assert isinstance(reply, WeightError)
        assert (reply.code, reply.fetch_id, reply.latest_version) == (ERROR_SUPERSEDED, 11, 3)
    finally:
        sock.close()
        ctx.term()


def test_dropped_snapshot_buffer_is_reused_only_when_no_send_points_into_it() -> None:
    """Same-size publishes recycle the dropped buffer, but never while queued chunk frames still use it."""
    mib = 1 << 20
    size = 32 * mib  # more than loopback socket buffers absorb, so unread chunks stay queued in libzmq

    def state(version: int) -> list[tuple[str, torch.Tensor]]:
        return [("w", torch.full((size,), version, dtype=torch.uint8))]

    with WeightPublisher(chunk_bytes=mib) as pub:
        pub.publish(1, state(1))
        pub.publish(2, state(2))
        buf1 = pub._snapshots[1].buffer
        pub.publish(3, state(3))  # drops 1; nothing was sent from it, so its buffer is reused
        assert pub._snapshots[3].buffer is buf1
        buf2 = pub._snapshots[2].buffer
        # The server thread answers a chunk request, sends the chunk and records its send tracker under
        # the publisher's lock, the lock `publish` takes to drop a version: once the filter has seen
        # the last index, every chunk of version 2 is queued before the drop below can happen.
        all_answered = threading.Event()

        def note_last(version: int, index: int, data: np.ndarray) -> np.ndarray:
            if version == 2 and index == 31:
                all_answered.set()
            return data

        pub._chunk_filter = note_last
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 3000)
        sock.setsockopt(zmq.RCVHWM, 1)  # libzmq must not read ahead for us: the chunks back up
        sock.setsockopt(zmq.RCVBUF, 4096)
        sock.connect(pub.endpoint)
        try:
            for index in range(32):  # ask for all of version 2, read nothing yet
                sock.send_multipart(encode(WeightChunkRequest(fetch_id=9, version=2, index=index)))
            assert all_answered.wait(30), "the publisher did not answer the chunk requests"
            pub.publish(4, state(4))  # drops 2 while its chunks are queued: a fresh buffer is used
            assert pub._snapshots[4].buffer is not buf2
            for _ in range(32):  # every queued chunk still carries version 2's bytes
                chunk = decode(sock.recv_multipart(copy=False), expect=FETCHER_ACCEPTS)
                assert isinstance(chunk, WeightChunk) and chunk.version == 2
                assert bool((chunk.data == 2).all()), chunk.index
        finally:
            sock.close()
            ctx.term()
        with fetcher_for(pub) as f:
            got = f.fetch()
        assert got.version == 4 and bool((got.tensors[0][1] == 4).all())


def test_reuse_buffer_recycles_only_unreferenced_receive_memory(publisher: WeightPublisher) -> None:
    def first_ptr(got: object) -> int:
        return got.tensors[0][1].untyped_storage().data_ptr()  # type: ignore[attr-defined, no-any-return]

    with fetcher_for(publisher, reuse_buffer=True) as f:
        publisher.publish(1, model_state(1))
        got1 = f.fetch()
        view = got1.tensors[1][1][3:5]  # a view keeps the buffer referenced, like the tensors
        ptr1 = first_ptr(got1)
        del got1
        publisher.publish(2, model_state(2))
        got2 = f.fetch()  # the view of version 1 is alive: fresh memory, version 1 untouched
        assert first_ptr(got2) != ptr1
        assert torch.equal(view, model_state(1)[1][1][3:5])
        assert_bit_identical(model_state(2), got2.tensors)
        ptr2 = first_ptr(got2)
        del got2, view
        publisher.publish(3, model_state(3))
        got3 = f.fetch()  # nothing references version 2's buffer any more: written in place
        assert first_ptr(got3) == ptr2
        assert_bit_identical(model_state(3), got3.tensors)
        as_numpy = got3.tensors[0][1].view(torch.uint8).numpy()
        del got3
        publisher.publish(4, model_state(4))
        got4 = f.fetch()  # a numpy alias counts as a reference too
        assert first_ptr(got4) != ptr2
        assert_bit_identical(model_state(4), got4.tensors)
        assert torch.equal(torch.from_numpy(as_numpy), model_state(3)[0][1].view(torch.uint8))


def test_corrupted_chunk_is_detected_and_refetched(publisher: WeightPublisher) -> None:
    state = model_state(4)
    publisher.publish(1, state)
    sent: list[int] = []

    def corrupt_first_send_of_chunk_2(version: int, index: int, data: np.ndarray) -> np.ndarray:
        sent.append(index)
        if index == 2 and sent.count(2) == 1:
            data = data.copy()
            data[1234] ^= 0x40
        return data

    publisher._chunk_filter = corrupt_first_send_of_chunk_2
    with fetcher_for(publisher) as f:
        got = f.fetch()
    assert sent.count(2) == 2  # detected, requested again
    assert_bit_identical(state, got.tensors)


def test_persistently_corrupted_chunk_fails_with_a_clear_error(publisher: WeightPublisher) -> None:
    publisher.publish(1, model_state(1))

    def corrupt(version: int, index: int, data: np.ndarray) -> np.ndarray:
        return data[:-1] if index == 1 else data  # a short chunk is corruption too

    publisher._chunk_filter = corrupt
    with fetcher_for(publisher) as f:
        with pytest.raises(WeightFetchError, match=r"chunk 1 of version 1 .* failed its checksum 4 times"):
            f.fetch()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_dead_endpoint_times_out_within_the_timeout() -> None:
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    with WeightFetcher(endpoint, timeout_s=0.5) as f:
        began = time.monotonic()
        with pytest.raises(WeightFetchError, match=r"could not connect .* within 0.5 s"):
            f.fetch()
        assert 0.4 < time.monotonic() - began < 1.5


def test_silent_peer_times_out_with_a_clear_error() -> None:
    ctx = zmq.Context()
    mute = ctx.socket(zmq.ROUTER)
    mute.setsockopt(zmq.LINGER, 0)
    port = mute.bind_to_random_port("tcp://127.0.0.1")
    try:
        with WeightFetcher(f"tcp://127.0.0.1:{port}", timeout_s=0.5) as f:
            began = time.monotonic()
            with pytest.raises(WeightFetchError, match=r"no reply .* within 0.5 s while waiting for a manifest"):
                f.fetch()
            assert time.monotonic() - began < 1.5
    finally:
        mute.close()
        ctx.term()


def test_an_adapter_version_carries_its_config_and_a_full_one_none(publisher: WeightPublisher) -> None:
    """A LoRA version travels like full weights, with its adapter_config.json beside the tensors."""
    adapter = [("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", torch.randn(4, 16)),
               ("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight", torch.randn(16, 4))]  # fmt: skip
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    publisher.publish(1, adapter, adapter_config=config)
    fetcher = fetcher_for(publisher)
    try:
        got = fetcher.fetch()
        assert got.adapter_config == config
        assert_bit_identical(adapter, got.tensors)
        publisher.publish(2, model_state(2))
        assert fetcher.fetch(min_version=2).adapter_config is None, "a full-weight version is not an adapter"
    finally:
        fetcher.close()
    with pytest.raises(ValueError, match="not JSON"):
        publisher.publish(3, adapter, adapter_config={"r": object()})
    assert publisher.latest_version == 2


def test_publish_rejects_bad_input_without_changing_state(publisher: WeightPublisher) -> None:
    with pytest.raises(ValueError, match="dtype complex64"):
        publisher.publish(1, [("x", torch.zeros(3, dtype=torch.complex64))])
    with pytest.raises(ValueError, match="appears twice"):
        publisher.publish(1, [("x", torch.zeros(3)), ("x", torch.zeros(3))])
    assert publisher.latest_version is None


def test_manifest_validation_rejects_inconsistent_layouts() -> None:
    good = dict(fetch_id=1, version=1, total_bytes=128, chunk_bytes=CHUNK, checksum="xxh3_64", chunk_checksums=[0])
    spec = dict(name="w", dtype="float32", shape=[4], offset=0, nbytes=16)
    decode(encode(WeightManifest(**good, tensors=[TensorSpec(**spec)])))
    cases = {
        "overlap": [TensorSpec(**spec), TensorSpec(**{**spec, "name": "v", "offset": 8})],
        "needs 16 bytes": [TensorSpec(**{**spec, "nbytes": 12})],
        "unsupported dtype": [TensorSpec(**{**spec, "dtype": "complex64"})],
        "out of bounds": [TensorSpec(**{**spec, "offset": 120})],
        "not aligned": [TensorSpec(**{**spec, "offset": 2})],
    }
    for expected, tensors in cases.items():
        with pytest.raises(ProtocolError, match=expected):
            decode(encode(WeightManifest(**good, tensors=tensors)))
    with pytest.raises(ProtocolError, match="2 checksums for 1 chunks"):
        decode(encode(WeightManifest(**{**good, "chunk_checksums": [0, 0]}, tensors=[])))
    with pytest.raises(ProtocolError, match="not a uint64"):
        decode(encode(WeightManifest(**{**good, "chunk_checksums": [-1]}, tensors=[])))
    decode(encode(WeightManifest(**{**good, "chunk_checksums": [(1 << 64) - 1]}, tensors=[])))  # full range
    for config in ("[1, 2]", "{not json", "x" * (70 << 10)):
        with pytest.raises(ProtocolError, match="adapter_config"):
            decode(encode(WeightManifest(**good, tensors=[], adapter_config=config)))


def test_manifest_with_another_checksum_algorithm_is_refused() -> None:
    fields = dict(fetch_id=1, version=1, total_bytes=128, chunk_bytes=CHUNK, tensors=[], chunk_checksums=[7])
    with pytest.raises(ProtocolError, match=r"chunk checksums are 'crc32', this build verifies only 'xxh3_64'"):
        decode(encode(WeightManifest(**fields, checksum="crc32")))
    # A manifest from a build that predates the algorithm field (CRC-32 in `chunk_crc32`) is refused by
    # name too, never read as if its numbers were XXH3 checksums.
    old = {"type": "weight_manifest", "fetch_id": 1, "version": 1, "total_bytes": 128, "chunk_bytes": CHUNK,
           "tensors": [], "chunk_crc32": [7]}
    with pytest.raises(ProtocolError, match="missing required field `checksum`"):
        decode([msgspec.msgpack.encode([PROTOCOL_VERSION, old])], expect=FETCHER_ACCEPTS)


def test_fetcher_facing_an_older_publisher_fails_with_a_clear_error() -> None:
    """A peer that sends a CRC-32 manifest: the fetch fails naming the missing algorithm field."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.RCVTIMEO, 3000)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    def answer_once() -> None:
        identity, header = router.recv_multipart()
        request = decode([header])
        old = {"type": "weight_manifest", "fetch_id": request.fetch_id, "version": 1,  # type: ignore[attr-defined]
               "total_bytes": 128, "chunk_bytes": CHUNK, "tensors": [], "chunk_crc32": [7]}
        router.send_multipart([identity, msgspec.msgpack.encode([PROTOCOL_VERSION, old])])

    server = threading.Thread(target=answer_once, daemon=True)
    server.start()
    try:
        with WeightFetcher(f"tcp://127.0.0.1:{port}", timeout_s=2.0) as f:
            with pytest.raises(WeightFetchError, match=r"unreadable reply .*missing required field `checksum`"):
                f.fetch()
    finally:
        server.join(timeout=5)
        router.close()
        ctx.term()


def test_chunk_checksum_changes_for_every_single_bit_flip_tried() -> None:
    assert CHECKSUM_ALGORITHM == "xxh3_64"
    data = np.frombuffer(np.random.default_rng(0).bytes(CHUNK), dtype=np.uint8).copy()
    base = chunk_checksum(data)
    assert base == chunk_checksum(data.tobytes())  # array views and bytes hash alike (no copy needed)
    assert 0 <= base < 1 << 64
    # Start, end, and both sides of XXH3's 64-byte stripe and 1 KiB block boundaries, every bit.
    positions = [0, 1, 63, 64, 1023, 1024, 1025, CHUNK // 2, CHUNK - 65, CHUNK - 64, CHUNK - 2, CHUNK - 1]
    for pos in positions:
        for bit in range(8):
            data[pos] ^= 1 << bit
            assert chunk_checksum(data) != base, (pos, bit)
            data[pos] ^= 1 << bit
    assert chunk_checksum(data) == base
    assert chunk_checksum(data[:-1]) != base  # truncation
    swapped = data.copy()
    swapped[:8], swapped[8:16] = data[8:16], data[:8]  # two 8-byte words trade places
    assert chunk_checksum(swapped) != base


# --- malformed input: the publisher answers with an error and keeps serving ---------------------


@pytest.fixture(scope="module")
def fuzz_target() -> Iterator[tuple[WeightPublisher, zmq.Socket]]:
    pub = WeightPublisher(chunk_bytes=CHUNK)
    pub.publish(1, model_state(1))
    ctx = zmq.Context()
    sock = raw_dealer(ctx, pub.endpoint)
    yield pub, sock
    sock.close()
    ctx.term()
    pub.close()


def _exchange(sock: zmq.Socket, frames: list[bytes]) -> object:
    sock.send_multipart(frames)
    return decode(sock.recv_multipart(copy=False), expect=FETCHER_ACCEPTS)


HAND_WRITTEN = {
    "empty frame": [b""],
    "not msgpack": [b"\xc1\xc1\xc1"],
    "wrong protocol version": [msgspec.msgpack.encode([99, {"type": "weight_fetch", "fetch_id": 1}])],
    "unknown type": [msgspec.msgpack.encode([PROTOCOL_VERSION, {"type": "no_such_thing"}])],
    "a reply type as request": encode(WeightError(code="x", detail="y")),
    "negative fetch id": [msgspec.msgpack.encode([PROTOCOL_VERSION, {"type": "weight_fetch", "fetch_id": -1}])],
    "chunk index out of range": encode(WeightChunkRequest(fetch_id=5, version=1, index=10**6)),
    "too many frames": [*encode(WeightFetch(fetch_id=1)), b"x", b"y"],
    "oversized header": [b"\x00" * (70 << 10)],  # over MAXMSGSIZE: libzmq drops the peer, no reply
}


def test_hand_written_bad_requests_get_error_replies(fuzz_target: tuple[WeightPublisher, zmq.Socket]) -> None:
    pub, sock = fuzz_target
    for label, frames in HAND_WRITTEN.items():
        if label == "oversized header":
            continue
        reply = _exchange(sock, frames)
        assert isinstance(reply, WeightError), label
        assert reply.code and reply.detail, label
    # An oversized message makes libzmq drop that connection (MAXMSGSIZE); a new peer is served fine.
    ctx = zmq.Context()
    big = raw_dealer(ctx, pub.endpoint)
    big.send_multipart(HAND_WRITTEN["oversized header"])
    big.close()
    ctx.term()
    assert isinstance(_exchange(sock, encode(WeightFetch(fetch_id=3))), WeightManifest)


frame_bytes = st.one_of(
    st.binary(max_size=300),
    # Well-formed envelopes with random bodies reach field validation, not just the msgpack parser.
    st.builds(
        lambda tag, body: msgspec.msgpack.encode([PROTOCOL_VERSION, {"type": tag, **body}]),
        st.sampled_from(["weight_fetch", "weight_chunk_request", "weight_fetch_done", "weight_chunk", "nope"]),
        st.dictionaries(
            st.sampled_from(["fetch_id", "version", "index", "min_version", "nbytes", "seconds", "data"]),
            st.one_of(st.integers(-(2**63), 2**64 - 1), st.floats(), st.text(max_size=5), st.binary(max_size=5)),
            max_size=5,
        ),
    ),
)


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=st.lists(frame_bytes, min_size=1, max_size=4))
def test_fuzzed_frames_get_a_reply_and_never_break_the_publisher(
    fuzz_target: tuple[WeightPublisher, zmq.Socket], frames: list[bytes]
) -> None:
    _, sock = fuzz_target
    reply = _exchange(sock, frames)  # exactly one reply per request, always decodable
    # Random input may happen to be a valid request; anything else must be refused with a reason.
    assert isinstance(reply, (WeightError, WeightManifest, WeightChunk)) or type(reply).__name__ == "WeightFetchAck"


def test_publisher_still_serves_a_real_fetch_after_the_fuzz(fuzz_target: tuple[WeightPublisher, zmq.Socket]) -> None:
    pub, _ = fuzz_target
    with fetcher_for(pub) as f:
        got = f.fetch()
    assert got.version == 1
    assert_bit_identical(model_state(1), got.tensors)
