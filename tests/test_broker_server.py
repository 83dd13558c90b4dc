"""The broker over a real ROUTER socket: malformed input gets an error reply, the broker keeps going."""

from __future__ import annotations

import threading
import time

import msgspec
import numpy as np
import pytest
import zmq

from vime.broker.server import BrokerServer
from vime.broker.settings import BrokerSettings
from vime.broker.state import BrokerState
from vime.data.prompts import Prompt, PromptCursor
from vime.protocol.codec import PROTOCOL_VERSION, decode, encode
from vime.protocol.messages import Bye, Credit, DispatchGroups, ErrorReply, GroupsScored, Hello, StatusReply, StatusRequest, Welcome


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


def test_a_broker_killed_during_a_workers_handshake_is_not_a_refusal() -> None:
    """CI, chaos: a reward worker restarted just before the broker was killed exited 1. The broker
    died during the worker's handshake; libzmq reports that to the client as the same hang-up a
    refused key gives, and `hello` took it as a refusal. A restarted broker must find the worker
    still saying Hello: here a listener hangs up on the first connection and goes away, then a real
    broker comes up on the same port."""
    import asyncio
    import socket

    from vime.broker.client import BrokerClient

    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    endpoint = f"tcp://127.0.0.1:{port}"
    prompts = [Prompt(i, "1+1=", np.array([1, 2], dtype=np.int32), "2") for i in range(4)]
    settings = BrokerSettings(2, 2, 0, 1, 10, 30.0, {"temperature": 1.0, "top_p": 1.0, "max_tokens": 4})
    servers: list[BrokerServer] = []

    def die_during_the_handshake_then_restart() -> None:
        connection, _ = listener.accept()
        # Reset only once the worker's greeting has begun to arrive: its libzmq is then mid-handshake
        # on any machine (a reset that beat the greeting was reported as a disconnect, not a failure).
        connection.settimeout(10)
        assert connection.recv(1)
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        connection.close()  # a reset before the broker's greeting: the broker is gone mid-handshake
        listener.close()
        time.sleep(1.5)  # long enough for the worker to have checked for a refusal several times
        server = BrokerServer(BrokerState(settings, PromptCursor(prompts, shuffle=False, seed=0)), endpoint)
        servers.append(server)
        server.serve()

    broker_thread = threading.Thread(target=die_during_the_handshake_then_restart, daemon=True)
    broker_thread.start()
    worker = BrokerClient(endpoint, "reward", "reward-0")

    async def join() -> str:
        try:
            job = await worker.hello(timeout_s=20.0)
            return f"welcome {job is not None} after {worker.guard.watch.failures} failed handshake(s)"  # type: ignore[union-attr]
        finally:
            worker.close()

    try:
        outcome = asyncio.run(join())
    finally:
        deadline = time.monotonic() + 10
        while not servers and time.monotonic() < deadline:
            time.sleep(0.05)
        for server in servers:
            server.stop()
        broker_thread.join(timeout=10)
    assert outcome == "welcome True after 1 failed handshake(s)"


class LogRecorder:
    """Stands in for the server module's structlog logger; keeps (level, event, fields)."""

    def __init__(self) -> None:
        self.records: list[tuple[str, str, dict]] = []

    def __getattr__(self, level: str):  # type: ignore[no-untyped-def]
        return lambda event, *args, **fields: self.records.append((level, event, fields))

    def events(self, name: str) -> list[dict]:
        return [fields for _, event, fields in self.records if event == name]


@pytest.fixture()
def server_log(monkeypatch: pytest.MonkeyPatch) -> LogRecorder:
    import vime.broker.bad_messages as bad_messages_module
    import vime.broker.server as server_module

    recorder = LogRecorder()
    monkeypatch.setattr(server_module, "log", recorder)
    monkeypatch.setattr(bad_messages_module, "log", recorder)
    return recorder


def idle_server(**kwargs) -> BrokerServer:  # type: ignore[no-untyped-def]
    """A BrokerServer whose loop is not running: the test calls its handlers itself."""
    prompts = [Prompt(i, "1+1=", np.array([1, 2], dtype=np.int32), "2") for i in range(8)]
    settings = BrokerSettings(2, 2, 1, 1, 10, 30.0, {"temperature": 1.0, "top_p": 1.0, "max_tokens": 4})
    return BrokerServer(BrokerState(settings, PromptCursor(prompts, shuffle=False, seed=0)), "tcp://127.0.0.1:*", **kwargs)


def close_idle(server: BrokerServer) -> None:
    server.socket.close(linger=0)
    server.guard.close()
    server.context.term()


def test_worker_expired_and_worker_left_log_how_many_groups_were_requeued(server_log: LogRecorder) -> None:
    """Issue 15: `worker_expired` logged requeued=0 while its groups were requeued (the count was read
    after the leases had been released)."""
    server = idle_server()
    try:
        state = server.state
        for identity, worker_id in ((b"r1", "rollout-1"), (b"r2", "rollout-2")):
            state.register(identity, worker_id, "rollout", now=0.0)
            state.add_credit(identity, 2)
        state.dispatch()
        leased = {w.worker_id: len(w.leased) for w in state.workers.values()}
        assert leased == {"rollout-1": 2, "rollout-2": 2}
        server._dispatch_message(b"r2", Bye(reason="sigterm"), now=1.0)
        state.touch(b"r1", 0.0)
        server._housekeeping(now=100.0)  # rollout-1 silent for 100 s > worker_timeout_s
        [expired] = server_log.events("worker_expired")
        assert (expired["worker"], expired["requeued"]) == ("rollout-1", 2)
        [left] = server_log.events("worker_left")
        assert (left["worker"], left["requeued"]) == ("rollout-2", 2)
        assert state.counters["groups_requeued"] == 4
    finally:
        close_idle(server)


def test_bad_message_lines_are_rate_limited_with_a_count_of_the_rest(
    server_log: LogRecorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 15: 20,000 bad messages wrote 20,000 `bad_message` lines (6.2 MB). Now: the first few of
    an interval each, then one `bad_message_suppressed` line per interval with the count; every one
    is still answered and counted."""
    import vime.broker.server as server_module

    clock = [1000.0]
    monkeypatch.setattr(server_module.time, "monotonic", lambda: clock[0])
    server = idle_server()
    sent: list = []
    monkeypatch.setattr(server.outbox, "send", lambda outgoing: sent.extend(outgoing))
    try:
        garbage = [zmq.Frame(b"peer"), zmq.Frame(b"\x00garbage")]
        for _ in range(20_000):
            server._handle(garbage, clock[0])
        assert server.state.counters["bad_messages"] == 20_000
        assert len(sent) == 20_000 and all(isinstance(m, ErrorReply) for _, m in sent)
        logged = len(server_log.events("bad_message"))
        assert 1 <= logged <= 20, logged
        clock[0] += 11.0  # the next interval: the count of what was not logged comes first
        server._handle(garbage, clock[0])
        [summary] = server_log.events("bad_message_suppressed")
        assert summary["suppressed"] == 20_000 - logged
        assert summary["by_code"] == {"malformed": 20_000 - logged}
        assert len(server_log.events("bad_message")) == logged + 1
        server._handle(garbage, clock[0])  # a few more in the new interval are logged again
        server._flush_log_limits()  # at shutdown: nothing suppressed goes unmentioned
        assert len(server_log.events("bad_message")) == logged + 2
        assert len(server_log.events("bad_message_suppressed")) == 1
    finally:
        close_idle(server)


def test_a_worker_of_another_job_is_refused_and_its_client_stops_with_the_reason() -> None:
    """Two jobs given one broker address: a worker naming another job gets `wrong_job` and is not
    registered; the real BrokerClient turns that into BrokerRefused (exit, not retry). Workers of this
    job, and clients that name no job, are welcomed."""
    import asyncio

    from vime.broker.client import BrokerClient, BrokerRefused

    prompts = [Prompt(i, "1+1=", np.array([1, 2], dtype=np.int32), "2") for i in range(4)]
    settings = BrokerSettings(2, 2, 0, 1, 10, 30.0, {"temperature": 1.0, "top_p": 1.0, "max_tokens": 4})
    server = BrokerServer(BrokerState(settings, PromptCursor(prompts, shuffle=False, seed=0)), "tcp://127.0.0.1:*",
                          job_name="/runs/job-a")  # fmt: skip
    endpoint = server.socket.getsockopt(zmq.LAST_ENDPOINT).decode()
    thread = threading.Thread(target=_serve, args=(server,), daemon=True)
    thread.start()
    try:
        stranger = client(endpoint, b"reward-0")
        stranger.send_multipart(encode(Hello(role="reward", worker_id="reward-0", job="/runs/job-b")))
        err = reply(stranger)
        assert isinstance(err, ErrorReply) and err.code == "wrong_job"
        assert "'/runs/job-a'" in err.detail and "'/runs/job-b'" in err.detail and "--broker-address" in err.detail
        for identity, job in ((b"reward-1", "/runs/job-a"), (b"reward-2", "")):
            member = client(endpoint, identity)
            member.send_multipart(encode(Hello(role="reward", worker_id=identity.decode(), job=job)))
            assert isinstance(reply(member), Welcome)
            member.close()
        assert sorted(w.worker_id for w in server.state.workers.values()) == ["reward-1", "reward-2"]

        async def hello_from_job_b() -> None:
            broker_client = BrokerClient(endpoint, "rollout", "rollout-0", job_name="/runs/job-b")
            try:
                await broker_client.hello(timeout_s=10)
            finally:
                broker_client.close()

        with pytest.raises(BrokerRefused, match="belongs to job '/runs/job-b'"):
            asyncio.run(hello_from_job_b())
        stranger.close()
    finally:
        server.stop()
        thread.join(timeout=10)
