"""The broker over a real ROUTER socket: malformed input gets an error reply, the broker keeps going."""

from __future__ import annotations

import threading
import time

import msgspec
import numpy as np
import pytest
import zmq

from vime.broker.server import BrokerServer
from vime.broker.state import BrokerSettings, BrokerState
from vime.data.prompts import Prompt, PromptCursor
from vime.protocol.codec import PROTOCOL_VERSION, decode, encode
from vime.protocol.messages import Credit, DispatchGroups, ErrorReply, GroupsScored, Hello, StatusReply, StatusRequest, Welcome


@pytest.fixture()
def broker() -> tuple[str, BrokerServer]:
    prompts = [Prompt(i, "1+1=", np.array([1, 2], dtype=np.int32), "2") for i in range(4)]
    settings = BrokerSettings(2, 2, 0, 1, 10, 30.0, {"temperature": 1.0, "top_p": 1.0, "max_tokens": 4})
    server = BrokerServer(BrokerState(settings, PromptCursor(prompts, shuffle=False, seed=0)), "tcp://127.0.0.1:*")
    endpoint = server.socket.getsockopt(zmq.LAST_ENDPOINT).decode()
    server_thread = threading.Thread(target=_serve, args=(server,), daemon=True)
    server_thread.start()
    yield endpoint, server
    server.stop()
    server_thread.join(timeout=10)


def _serve(server: BrokerServer) -> None:
    server.serve()


def client(endpoint: str, identity: bytes) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def reply(sock: zmq.Socket, timeout_ms: int = 5000):
    assert sock.poll(timeout_ms), "no reply from broker"
    return decode(sock.recv_multipart(copy=False))


def test_garbage_unknown_and_unexpected_messages_get_errors_and_the_broker_keeps_serving(broker) -> None:
    endpoint, server = broker
    sock = client(endpoint, b"w1")
    sock.send_multipart([b"\x00\x01garbage"])
    err = reply(sock)
    assert isinstance(err, ErrorReply) and err.code == "malformed"
    sock.send_multipart([msgspec.msgpack.encode((PROTOCOL_VERSION, {"type": "launch_missiles"}))])
    err = reply(sock)
    assert isinstance(err, ErrorReply) and err.code == "unknown_type"
    sock.send_multipart(encode(Credit(n=1)))
    err = reply(sock)
    assert isinstance(err, ErrorReply) and "send Hello first" in err.detail
    sock.send_multipart(encode(Hello(role="rollout", worker_id="w1")))
    assert isinstance(reply(sock), Welcome)
    sock.send_multipart(encode(GroupsScored(scores=[])))
    err = reply(sock)
    assert isinstance(err, ErrorReply) and "rollout worker may not send GroupsScored" in err.detail
    # Still serving real work after all that:
    sock.send_multipart(encode(Credit(n=5)))
    work = reply(sock)
    assert isinstance(work, DispatchGroups) and len(work.groups) == 2
    status_sock = client(endpoint, b"status")
    status_sock.send_multipart(encode(StatusRequest()))
    status = reply(status_sock)
    assert isinstance(status, StatusReply)
    assert status.status["counters"]["bad_messages"] == 4
    assert status.status["queues"]["generating"] == 2
    sock.close()
    status_sock.close()


def test_query_status_helper_and_unreachable_broker() -> None:
    from vime.broker.client import query_status

    started = time.monotonic()
    with pytest.raises(TimeoutError):
        query_status("tcp://127.0.0.1:1", timeout_s=0.5)
    assert time.monotonic() - started < 5


def test_vime_status_json_against_a_live_broker(broker, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from vime.cli import main

    endpoint, _ = broker
    with pytest.raises(SystemExit) as exit_info:
        main(["status", "--json", "--broker-address", endpoint])
    assert exit_info.value.code == 0
    status = json.loads(capsys.readouterr().out)
    assert set(status["counters"]) >= {"groups_dispatched", "groups_generated", "groups_scored", "groups_trained", "groups_dropped_stale"}
    assert status["weight_version"] == 0 and status["step"] == 0


def test_vime_status_reports_an_unreachable_broker(capsys: pytest.CaptureFixture[str]) -> None:
    from vime.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["status", "--broker-address", "tcp://127.0.0.1:1", "--timeout", "0.5"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "tcp://127.0.0.1:1" in err and ("did not answer" in err or "not reachable" in err)
