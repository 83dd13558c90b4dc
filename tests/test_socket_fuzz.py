"""Hostile input on the live ports: the broker's ROUTER and the weight publisher's ROUTER.

The codec's own fuzz tests (tests/test_protocol.py) feed decode() directly; these go through the real
sockets on loopback: random, truncated, mutated and wrong-type messages from ZeroMQ peers; raw TCP bytes
that are not ZMTP at all or break off mid-handshake; frames above MAXMSGSIZE, including a hand-built
ZMTP frame header that claims a terabyte; unauthenticated peers against CURVE servers. Checked: no
crash, every request still answered afterwards, one error reply and one log line (or, past the rate
limit, one count in a summary line) per rejected message, oversized frames dropped by libzmq after
the header alone (nothing buffered), bounded bookkeeping.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import struct
import threading
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest
import torch
import zmq
from helpers_sockets import Recorder, dealer, start_broker, start_publisher, stop_broker
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import vime.broker.server as server_module
import vime.security
import vime.weights.publisher as publisher_module
from vime.broker.server import BrokerServer
from vime.protocol.codec import PROTOCOL_VERSION, decode, encode
from vime.protocol.messages import (
    BatchRequest,
    Credit,
    ErrorReply,
    Group,
    GroupsGenerated,
    Heartbeat,
    Hello,
    Sample,
    StatusReply,
    StatusRequest,
    Welcome,
)
from vime.protocol.weights import (
    MAX_REQUEST_BYTES,
    WeightChunkRequest,
    WeightError,
    WeightFetch,
    WeightFetchDone,
    WeightManifest,
)
from vime.security import Security, create_keys
from vime.weights import WeightFetcher, WeightPublisher

BROKER_MAX_BYTES = 256 << 10  # small, so "oversized" stays cheap to send


def served_weights() -> list[tuple[str, torch.Tensor]]:
    """What the publishers serve, as version 1."""
    return [("w", torch.arange(100_000, dtype=torch.float32))]


@pytest.fixture(scope="module")
def logs() -> Iterator[dict[str, Recorder]]:
    recorders = {"broker": Recorder(), "publisher": Recorder(), "security": Recorder()}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(server_module, "log", recorders["broker"])
        mp.setattr(publisher_module, "log", recorders["publisher"])
        mp.setattr(vime.security, "log", recorders["security"])
        yield recorders


def start_fuzz_broker(security: Security | None = None) -> tuple[str, BrokerServer, threading.Thread]:
    return start_broker(security, n_prompts=64, worker_timeout_s=300.0, max_message_bytes=BROKER_MAX_BYTES)


@pytest.fixture(scope="module")
def broker(logs: dict[str, Recorder]) -> Iterator[tuple[str, BrokerServer]]:
    endpoint, server, thread = start_fuzz_broker()
    yield endpoint, server
    stop_broker(server, thread)


@pytest.fixture(scope="module")
def publisher(logs: dict[str, Recorder]) -> Iterator[WeightPublisher]:
    pub = start_publisher(served_weights())
    yield pub
    pub.close()


_identities = itertools.count()


def fuzz_dealer(ctx: zmq.Context, endpoint: str, keys: Security | None = None) -> zmq.Socket:
    """A bare DEALER with a fresh identity; CURVE with `keys`' rollout key, or plaintext."""
    keys_dir = keys.keys_dir if keys is not None else None
    return dealer(ctx, endpoint, keys_dir, identity=f"fuzz-{next(_identities)}".encode())


def still_serves_status(endpoint: str, keys: Security | None = None) -> None:
    ctx = zmq.Context.instance()
    sock = fuzz_dealer(ctx, endpoint, keys)
    try:
        sock.send_multipart(encode(StatusRequest()))
        assert sock.poll(10_000), "the broker stopped answering"
        assert isinstance(decode(sock.recv_multipart(copy=False)), StatusReply)
    finally:
        sock.close()


def still_serves_weights(pub: WeightPublisher) -> None:
    with WeightFetcher(pub.endpoint, timeout_s=10.0, security=Security()) as fetcher:
        got = fetcher.fetch()
    assert torch.equal(got.tensors[0][1], served_weights()[0][1])


# --- ZMTP by hand (RFC 23/ZMTP 3.0), for what pyzmq will not send ------------------------------------


def zmtp_greeting(mechanism: bytes = b"NULL") -> bytes:
    return b"\xff" + b"\x00" * 8 + b"\x7f" + bytes([3, 0]) + mechanism.ljust(20, b"\x00") + b"\x00" * 32


def zmtp_ready(socket_type: bytes = b"DEALER") -> bytes:
    def prop(name: bytes, value: bytes) -> bytes:
        return bytes([len(name)]) + name + struct.pack(">I", len(value)) + value

    body = b"\x05READY" + prop(b"Socket-Type", socket_type) + prop(b"Identity", b"")
    return bytes([0x04, len(body)]) + body


def zmtp_long_frame_header(size: int) -> bytes:
    return b"\x02" + struct.pack(">Q", size)


def zmtp_connect(endpoint: str) -> socket.socket:
    """A TCP connection that has completed a NULL-mechanism ZMTP handshake as a DEALER."""
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    conn = socket.create_connection((host, int(port)), timeout=10)
    conn.sendall(zmtp_greeting() + zmtp_ready())
    received = b""
    while len(received) < 64 + 2:  # the server's greeting and the start of its READY command
        chunk = conn.recv(4096)
        assert chunk, "the server hung up during a valid handshake"
        received += chunk
    size = received[65]
    while len(received) < 64 + 2 + size:
        received += conn.recv(4096)
    return conn


def hangs_up(conn: socket.socket, timeout_s: float = 10.0) -> bool:
    """Whether the peer closes the connection (within a generous bound; not a timing assertion)."""
    conn.settimeout(timeout_s)
    try:
        while True:
            data = conn.recv(4096)
            if not data:
                return True
    except (TimeoutError, socket.timeout):
        return False
    except ConnectionResetError:
        return True


# --- socket options -----------------------------------------------------------------------------------


def test_listening_sockets_cap_the_message_size(broker: tuple[str, BrokerServer], publisher: WeightPublisher) -> None:
    _, server = broker
    assert server.socket.getsockopt(zmq.MAXMSGSIZE) == BROKER_MAX_BYTES
    assert publisher._router.getsockopt(zmq.MAXMSGSIZE) == MAX_REQUEST_BYTES


# --- malformed messages from ZeroMQ peers --------------------------------------------------------------


def _valid_broker_messages() -> list[list[bytes]]:
    sample = Sample(index=0, response_tokens=np.arange(40, dtype=np.int32), rollout_logprobs=np.zeros(40, np.float32),
                    loss_mask=np.ones(40, np.uint8), token_versions=np.zeros(40, np.int32), finish_reason="stop")  # fmt: skip
    group = Group(group_id="g1", prompt_index=0, epoch=0, prompt_tokens=np.arange(80, dtype=np.int32), prompt_text="p",
                  n_samples=1, samples=[sample])  # fmt: skip
    messages = [Hello(role="rollout", worker_id="w"), Credit(n=3), GroupsGenerated(groups=[group]), Heartbeat(),
                BatchRequest(step=0, n_groups=1, policy_version=0), StatusRequest()]  # fmt: skip
    return [[bytes(f) for f in encode(m)] for m in messages]


VALID = _valid_broker_messages()
BROKER_TAGS = ["hello", "credit", "groups_generated", "groups_scored", "heartbeat", "bye", "batch_request",
               "step_done", "weights_published", "status_request", "welcome", "dispatch_groups", "error", "nope"]  # fmt: skip
ANY_VALUE = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**64 - 1),
        st.floats(),
        st.text(max_size=8),
        st.binary(max_size=8),
    ),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=6,
)


@st.composite
def hostile_messages(draw: st.DrawFn) -> list[bytes]:
    kind = draw(st.sampled_from(["random", "wrong_types", "truncated", "mutated", "extra_frames", "empty"]))
    if kind == "random":
        return draw(st.lists(st.binary(max_size=300), min_size=1, max_size=4))
    if kind == "wrong_types":  # a well-formed envelope: reaches field validation, not just the parser
        body = draw(st.dictionaries(st.sampled_from(["role", "worker_id", "n", "groups", "scores", "step", "version",
                                                     "endpoint", "weight_version", "stats", "policy_version"]),
                                    ANY_VALUE, max_size=5))  # fmt: skip
        version = draw(st.sampled_from([PROTOCOL_VERSION, PROTOCOL_VERSION, 0, 999, "1"]))
        return [msgspec.msgpack.encode([version, {"type": draw(st.sampled_from(BROKER_TAGS)), **body}])]
    frames = [bytearray(f) for f in draw(st.sampled_from(VALID))]
    index = draw(st.integers(0, len(frames) - 1))
    if kind == "truncated":
        frames[index] = frames[index][: draw(st.integers(0, max(0, len(frames[index]) - 1)))]
    elif kind == "mutated":
        for _ in range(draw(st.integers(1, 4))):
            if frames[index]:
                at = draw(st.integers(0, len(frames[index]) - 1))
                frames[index][at] ^= draw(st.integers(1, 255))
    elif kind == "extra_frames":
        frames += [bytearray(draw(st.binary(max_size=64))) for _ in range(draw(st.integers(1, 3)))]
    else:
        frames = [bytearray()]
    return [bytes(f) for f in frames]


@settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=hostile_messages())
def test_hostile_messages_to_the_broker_get_one_reply_and_each_rejection_one_log_line(
    broker: tuple[str, BrokerServer], logs: dict[str, Recorder], frames: list[bytes]
) -> None:
    endpoint, server = broker
    sock = fuzz_dealer(zmq.Context.instance(), endpoint)  # a new peer each time: no registration carries over
    try:
        # Each rejection is one log line, or (past the rate limit) one count in the next
        # bad_message_suppressed line.
        logged_before = logs["broker"].count("bad_message") + server.bad_message_log.suppressed_total
        counted_before = server.state.counters["bad_messages"]
        sock.send_multipart(frames)
        # An unregistered peer gets exactly one reply to anything: Welcome or StatusReply for the rare
        # valid Hello/StatusRequest, an ErrorReply (with a reason) for everything else.
        assert sock.poll(10_000), "no reply"
        reply = decode(sock.recv_multipart(copy=False))
        assert isinstance(reply, (ErrorReply, Welcome, StatusReply))
        rejected = isinstance(reply, ErrorReply)
        if rejected:
            assert reply.code and reply.detail
        assert logs["broker"].count("bad_message") + server.bad_message_log.suppressed_total == logged_before + rejected
        assert server.state.counters["bad_messages"] == counted_before + rejected
        assert not sock.poll(50), "more than one reply"
    finally:
        sock.close()


def test_the_broker_still_works_after_the_fuzz(broker: tuple[str, BrokerServer]) -> None:
    endpoint, _ = broker
    still_serves_status(endpoint)


@settings(max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=st.lists(st.one_of(
    st.binary(max_size=200),
    st.builds(lambda tag, body: msgspec.msgpack.encode([PROTOCOL_VERSION, {"type": tag, **body}]),
              st.sampled_from(["weight_fetch", "weight_chunk_request", "weight_fetch_done", "weight_chunk", "nope"]),
              st.dictionaries(st.sampled_from(["fetch_id", "version", "index", "min_version", "nbytes", "seconds"]),
                              ANY_VALUE, max_size=5)),
    st.just(b"".join(bytes(f) for f in encode(WeightChunkRequest(fetch_id=1, version=9, index=0)))),
    st.just(b"".join(bytes(f) for f in encode(WeightChunkRequest(fetch_id=1, version=1, index=10**6)))),
), min_size=1, max_size=3))  # fmt: skip
def test_hostile_weight_requests_are_refused_and_logged(
    publisher: WeightPublisher, logs: dict[str, Recorder], frames: list[bytes]
) -> None:
    sock = fuzz_dealer(zmq.Context.instance(), publisher.endpoint)
    try:
        before = logs["publisher"].count("bad weight request") + logs["publisher"].count("weight request refused")
        sock.send_multipart(frames)
        assert sock.poll(10_000), "no reply"
        reply = decode(sock.recv_multipart(copy=False))
        after = logs["publisher"].count("bad weight request") + logs["publisher"].count("weight request refused")
        if isinstance(reply, WeightError) and reply.code not in ("not_ready", "superseded"):
            assert after == before + 1, reply
        else:  # a request that happened to be valid
            assert after == before
    finally:
        sock.close()


def test_the_publisher_still_serves_after_the_fuzz(publisher: WeightPublisher) -> None:
    still_serves_weights(publisher)


# --- oversized frames: dropped by libzmq itself --------------------------------------------------------


def test_a_message_over_maxmsgsize_is_dropped_with_its_connection_and_logged(
    broker: tuple[str, BrokerServer], publisher: WeightPublisher, logs: dict[str, Recorder]
) -> None:
    endpoint, server = broker
    ctx = zmq.Context.instance()
    for target, limit in ((endpoint, BROKER_MAX_BYTES), (publisher.endpoint, MAX_REQUEST_BYTES)):
        big = fuzz_dealer(ctx, target)
        bad_before = server.state.counters["bad_messages"]
        big.send_multipart([b"\x00" * (limit + 1)])
        assert not big.poll(1000), "an oversized message was answered: it reached the application"
        big.close()
        assert server.state.counters["bad_messages"] == bad_before
    logs["security"].wait_for("zmq_peer_disconnected", socket="broker")
    logs["security"].wait_for("zmq_peer_disconnected", socket="weight publisher")
    still_serves_status(endpoint)
    still_serves_weights(publisher)


@pytest.mark.parametrize("claimed", [BROKER_MAX_BYTES + 1, 1 << 40, (1 << 63) - 1])
def test_a_frame_header_claiming_too_much_is_refused_from_the_header_alone(
    broker: tuple[str, BrokerServer], publisher: WeightPublisher, claimed: int
) -> None:
    """libzmq allocates a message when its header arrives: without MAXMSGSIZE a peer could claim 8 GB
    and dribble the bytes in (measured: the connection stays open, waiting). With it, the connection
    is closed as soon as the header is read, before any of the claimed bytes exist."""
    endpoint, _ = broker
    for target in (endpoint, publisher.endpoint):
        conn = zmtp_connect(target)
        try:
            conn.sendall(zmtp_long_frame_header(claimed) + b"x" * 100)
            assert hangs_up(conn), f"{target} kept a connection that claimed a {claimed}-byte frame"
        finally:
            conn.close()
    still_serves_status(endpoint)
    still_serves_weights(publisher)


# --- bytes that are not (valid) ZMTP -------------------------------------------------------------------


@st.composite
def raw_streams(draw: st.DrawFn) -> bytes:
    kind = draw(
        st.sampled_from(
            ["noise", "bad_greeting", "short_greeting", "bad_command", "frames_then_noise", "curve_greeting"]
        )
    )
    noise = draw(st.binary(max_size=400))
    greeting = bytearray(zmtp_greeting())
    if kind == "noise":
        return noise
    if kind == "bad_greeting":
        greeting[draw(st.integers(0, 63))] ^= draw(st.integers(1, 255))
        return bytes(greeting) + noise
    if kind == "short_greeting":
        return bytes(greeting[: draw(st.integers(1, 63))])
    if kind == "bad_command":
        return bytes(greeting) + bytes([0x04, len(noise) % 256]) + noise
    if kind == "curve_greeting":  # CURVE against a NULL server (and garbage where HELLO should be)
        return zmtp_greeting(b"CURVE") + noise
    return bytes(greeting) + zmtp_ready() + bytes([0x00, 5]) + b"hello" + noise


def _throw(endpoint: str, data: bytes) -> None:
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        try:
            conn.sendall(data)
            conn.shutdown(socket.SHUT_WR)
            hangs_up(conn, timeout_s=0.2)  # either way; we only care that the server survives
        except OSError:
            pass  # the server hung up first (reset, broken pipe, not connected): that is fine


@settings(max_examples=80, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=raw_streams())
def test_raw_bytes_on_the_ports_never_break_the_servers(
    broker: tuple[str, BrokerServer], publisher: WeightPublisher, data: bytes
) -> None:
    endpoint, _ = broker
    _throw(endpoint, data)
    _throw(publisher.endpoint, data)


def test_the_servers_still_serve_after_the_raw_fuzz(
    broker: tuple[str, BrokerServer], publisher: WeightPublisher
) -> None:
    endpoint, _ = broker
    still_serves_status(endpoint)
    still_serves_weights(publisher)


# --- bounded bookkeeping --------------------------------------------------------------------------------


def test_a_flood_of_fetches_cannot_grow_the_publishers_bookkeeping(
    publisher: WeightPublisher, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(publisher_module, "_MAX_TRACKED_FETCHES", 8)
    ctx = zmq.Context.instance()
    socks = [fuzz_dealer(ctx, publisher.endpoint) for _ in range(40)]
    try:
        for i, sock in enumerate(socks):  # 40 peers each start a fetch and never finish it
            sock.send_multipart(encode(WeightFetch(fetch_id=i + 1)))
        for sock in socks:
            assert sock.poll(10_000)
            assert isinstance(decode(sock.recv_multipart(copy=False)), WeightManifest)
        assert len(publisher._fetches) <= 8
        for i, sock in enumerate(socks):  # and the ones that do finish are forgotten at once
            sock.send_multipart(encode(WeightFetchDone(fetch_id=i + 1, version=1, nbytes=0, seconds=0.0)))
            assert sock.poll(10_000)
            sock.recv_multipart()
        assert len(publisher._fetches) == 0
    finally:
        for sock in socks:
            sock.close()


# --- unauthenticated peers against CURVE servers ----------------------------------------------------


@pytest.fixture(scope="module")
def curve_servers(
    tmp_path_factory: pytest.TempPathFactory, logs: dict[str, Recorder]
) -> Iterator[tuple[str, WeightPublisher, Security, Security]]:
    root = tmp_path_factory.mktemp("fuzzkeys")
    create_keys(root / "job")
    create_keys(root / "stranger")
    job, stranger = Security(root / "job"), Security(root / "stranger")
    endpoint, server, thread = start_fuzz_broker(job)
    pub = start_publisher(served_weights(), security=job)
    yield endpoint, pub, job, stranger
    pub.close()
    stop_broker(server, thread)


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=raw_streams())
def test_raw_bytes_never_get_past_a_curve_server(
    curve_servers: tuple[str, WeightPublisher, Security, Security], data: bytes
) -> None:
    endpoint, pub, _, _ = curve_servers
    _throw(endpoint, data)
    _throw(pub.endpoint, data)


def test_unauthenticated_peers_are_refused_and_logged_and_cannot_reach_the_application(
    curve_servers: tuple[str, WeightPublisher, Security, Security], logs: dict[str, Recorder]
) -> None:
    endpoint, pub, job, stranger = curve_servers
    ctx = zmq.Context.instance()
    for target, request in ((endpoint, Hello(role="rollout", worker_id="x")), (pub.endpoint, WeightFetch(fetch_id=1))):
        for keys in (None, stranger):  # plaintext, and a CURVE key of another job
            sock = fuzz_dealer(ctx, target, keys)
            # Without a connection that finished its handshake a DEALER may have no pipe to queue on,
            # and a blocking send would wait forever (seen once on a loaded machine): either way
            # nothing reaches the application, which is what is checked.
            with contextlib.suppress(zmq.Again):
                sock.send_multipart(encode(request), flags=zmq.NOBLOCK)
            assert not sock.poll(1000), "an unauthenticated peer got a reply"
            sock.close()
        # ZMTP by hand: a plaintext handshake, then a frame. Refused during the handshake.
        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as conn:
            conn.sendall(zmtp_greeting() + zmtp_ready() + bytes([0x00, 5]) + b"hello")
            assert hangs_up(conn)
    for name in ("broker", "weight publisher"):
        logs["security"].wait_for("zmq_handshake_failed", socket=name, reason="mechanism mismatch")
        logs["security"].wait_for("zmq_handshake_failed", socket=name, reason="cryptographic")
    # Someone who knows the server's public key but holds a key of its own that is not allowed:
    # refused by ZAP, by name.
    intruder_keys = stranger.keys_dir / "clients" / "rollout.key_secret"
    assert intruder_keys.is_file()
    (stranger.keys_dir / "server.key").write_bytes((job.keys_dir / "server.key").read_bytes())
    sock = fuzz_dealer(ctx, endpoint, stranger)
    with contextlib.suppress(zmq.Again):
        sock.send_multipart(encode(Hello(role="rollout", worker_id="x")), flags=zmq.NOBLOCK)
    assert not sock.poll(1000)
    sock.close()
    logs["security"].wait_for("zap_denied", socket="broker")
    assert logs["broker"].count("worker_joined") == 0 or all(
        f.get("worker") != "x" for _, e, f in logs["broker"].records if e == "worker_joined"
    )
    # The servers still serve their own job.
    still_serves_status(endpoint, job)
    with WeightFetcher(pub.endpoint, timeout_s=10.0, security=job) as fetcher:
        assert fetcher.fetch().version == 1
