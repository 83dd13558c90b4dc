"""Elastic rollout workers: they may join a running job and leave it at any time.

A worker that joins gets the current weight version and the weight channel's endpoint in its Welcome,
loads those weights, and takes work; one that leaves (SIGTERM: scancel, `kill`) says Bye, so the broker
re-dispatches its leased groups at once instead of waiting for its lease to expire. Checked once on the
broker's socket with scripted workers, and once with real processes: a `vime run` job and a rollout
worker started by hand mid-run, then stopped. That job is then stopped by Ctrl-C (SIGINT), which must end
it with exit code 130 and leave no process of it running: this is the suite's Ctrl-C test.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from vime.broker.server import BrokerServer
from vime.broker.settings import BrokerSettings
from vime.broker.state import BrokerState
from vime.data.prompts import Prompt, PromptCursor
from vime.protocol.codec import decode, encode
from vime.protocol.messages import (
    Ack,
    Bye,
    Credit,
    DispatchGroups,
    Hello,
    StatusReply,
    StatusRequest,
    WeightsPublished,
    WeightVersionAnnounce,
    Welcome,
)

from conftest import run_env

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture()
def broker() -> tuple[str, BrokerServer]:
    prompts = [Prompt(i, "1+1=", np.array([1, 2], dtype=np.int32), "2") for i in range(8)]
    settings = BrokerSettings(2, 2, 1, 1, 10, 30.0, {"temperature": 1.0, "top_p": 1.0, "max_tokens": 4})
    server = BrokerServer(BrokerState(settings, PromptCursor(prompts, shuffle=False, seed=0)), "tcp://127.0.0.1:*")
    endpoint = server.socket.getsockopt(zmq.LAST_ENDPOINT).decode()
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    yield endpoint, server
    server.stop()
    thread.join(timeout=10)


def connect(endpoint: str, identity: bytes) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def receive(sock: zmq.Socket, kind: type, timeout_s: float = 5.0):
    """The next message of type `kind` (announcements and acks in between are skipped)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sock.poll(100):
            msg = decode(sock.recv_multipart(copy=False))
            if isinstance(msg, kind):
                return msg
            assert isinstance(msg, (Ack, WeightVersionAnnounce)), f"unexpected {type(msg).__name__}"
    raise AssertionError(f"no {kind.__name__} from the broker within {timeout_s} s")


def test_a_joining_worker_gets_the_current_weights_and_a_leaving_one_gives_its_work_back(broker) -> None:
    endpoint, _ = broker
    trainer, first = connect(endpoint, b"t0"), connect(endpoint, b"r1")
    trainer.send_multipart(encode(Hello(role="trainer", worker_id="trainer-0")))
    receive(trainer, Welcome)
    first.send_multipart(encode(Hello(role="rollout", worker_id="rollout-1")))
    assert receive(first, Welcome).job.weight_version == 0
    first.send_multipart(encode(Credit(n=2)))  # room for exactly two leases
    leased = {g.group_id for g in receive(first, DispatchGroups).groups}
    assert len(leased) == 2

    # The trainer publishes version 1; a worker that joins now is told that version and where it is.
    trainer.send_multipart(encode(WeightsPublished(version=1, endpoint="tcp://10.0.0.1:4242", step=0)))
    joined = connect(endpoint, b"r2")
    joined.send_multipart(encode(Hello(role="rollout", worker_id="rollout-joined")))
    job = receive(joined, Welcome).job
    assert (job.weight_version, job.weight_endpoint) == (1, "tcp://10.0.0.1:4242")

    # The first worker leaves: its leased groups go to the new worker at once, not after its 30 s worker
    # timeout. The two sockets' messages may reach the broker in either order, so the new worker's credit
    # may first buy other groups; the left worker's follow as soon as its Bye is handled (within seconds).
    first.send_multipart(encode(Bye(reason="SIGTERM: leaving the job")))
    joined.send_multipart(encode(Credit(n=10)))
    min_versions: dict[str, int] = {}  # group id -> the weight version its dispatch asks for
    deadline = time.monotonic() + 5.0
    while not leased <= min_versions.keys():
        for g in receive(joined, DispatchGroups, timeout_s=max(0.1, deadline - time.monotonic())).groups:
            min_versions[g.group_id] = g.min_weight_version
    assert all(min_versions[group_id] == 1 for group_id in leased)

    status_sock = connect(endpoint, b"status")
    status_sock.send_multipart(encode(StatusRequest()))
    status = receive(status_sock, StatusReply).status
    assert status["counters"]["groups_requeued"] == len(leased)
    assert {w["worker_id"] for w in status["workers"]} == {"trainer-0", "rollout-joined"}
    for sock in (trainer, first, joined, status_sock):
        sock.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for(what: str, condition, timeout_s: float = 120.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def _events(log: Path, event: str) -> list[dict]:
    if not log.exists():
        return []
    return [r for line in log.read_text().splitlines() if line.startswith("{") and (r := json.loads(line)).get("event") == event]


def _steps(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    return metrics.read_text().count("\n") if metrics.exists() else 0


def _worker(run_dir: Path, worker_id: str) -> dict | None:
    try:
        status = json.loads((run_dir / "status.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None  # not written yet, or caught mid-replace
    return next((w for w in status["workers"] if w["worker_id"] == worker_id), None)


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_rollout_worker_joins_a_running_job_takes_work_and_leaves_cleanly(tmp_path: Path) -> None:
    from vime.demo.model_factory import make_tiny_qwen3

    model = make_tiny_qwen3(tmp_path / "tiny", seed=0)
    run_dir = tmp_path / "run"
    env = run_env(VIME_LOG_LEVEL="INFO")  # the checks read info events
    # The transformers engine and no torch.compile: joining, leaving and Ctrl-C do not depend on either.
    job = subprocess.Popen(
        [sys.executable, "-m", "vime.cli", "run", str(REPO / "configs" / "demo.yaml"), "--run-dir", str(run_dir),
         "--hf-checkpoint", str(model), "--no-make-demo-model", "--rollout-engine", "hf", "--num-rollout", "100000",
         "--rollout-batch-size", "8", "--rollout-concurrency", "4", "--broker-address", f"tcp://127.0.0.1:{_free_port()}",
         "--no-progress", "--no-torch-compile"],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    joined: subprocess.Popen[str] | None = None
    try:
        _wait_for("two training steps", lambda: _steps(run_dir) >= 2)
        version_at_join = _steps(run_dir)  # one published version per step; at least this one is out
        # Started by hand, as on another node: the same config, a broker address, nothing else.
        joined_log = tmp_path / "joined.log"
        with joined_log.open("w") as log:
            joined = subprocess.Popen(
                [sys.executable, "-m", "vime.workers.main", "--role", "rollout", "--config", str(run_dir / "config.yaml"),
                 "--worker-id", "rollout-joined"],
                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        _wait_for("the joined worker to load weights", lambda: _events(joined_log, "weights_loaded"))
        assert _events(joined_log, "weights_loaded")[0]["version"] >= version_at_join
        _wait_for(
            "the joined worker to generate groups",
            lambda: (w := _worker(run_dir, "rollout-joined")) is not None and w["stats"].get("groups", 0) >= 1,
        )

        joined.send_signal(signal.SIGTERM)
        assert joined.wait(timeout=60) == 0, joined_log.read_text()[-3000:]
        left = [e for e in _events(run_dir / "logs" / "broker.log", "worker_left") if e["worker"] == "rollout-joined"]
        assert left and "SIGTERM" in left[0]["reason"]
        steps_when_left = _steps(run_dir)
        _wait_for("training to go on without it", lambda: _steps(run_dir) >= steps_when_left + 2)
        assert _worker(run_dir, "rollout-joined") is None
    finally:
        if joined is not None and joined.poll() is None:
            joined.kill()
        job.send_signal(signal.SIGINT)  # Ctrl-C: the launcher stops every child and exits 130
        _, err = job.communicate(timeout=60)
    assert job.returncode == 130, err[-2000:]
    status = json.loads((run_dir / "status.json").read_text())
    assert status["counters"]["bad_messages"] == 0
    leftovers = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True)
    assert leftovers.stdout.strip() == "", "processes survived the job (Ctrl-C)"
