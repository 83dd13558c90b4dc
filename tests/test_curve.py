"""Authentication and encryption: CURVE on every vime socket, an allow-list of client keys, and the
plaintext rule (loopback only, unless --allow-insecure).

Everything runs over real ZeroMQ sockets on this machine's own addresses: a broker and a weight
publisher with the job's keys, and clients holding the right key, a key the servers do not know, the
keys of another job, or none. Checked: only allowed clients can register, submit, receive work or read
weights; refused ones fail fast with the reason; every refusal is logged on the server; plaintext on a
network address is refused before anything binds; `vime keys`, `vime status`, `vime run` and
`vime slurm` use the keys; a short `vime run` with --curve-keys-dir trains end to end.
"""

from __future__ import annotations

import asyncio
import fcntl
import ipaddress
import json
import shutil
import socket
import stat
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
import zmq
from conftest import run_env
from helpers_sockets import Recorder, bare_context, dealer, free_port, start_broker, stop_broker

import vime.security
from vime.broker.client import BrokerClient, BrokerGone, query_status
from vime.broker.server import BrokerServer
from vime.protocol.codec import decode, encode
from vime.protocol.messages import Credit, DispatchGroups, ErrorReply, GroupsGenerated, Hello, Welcome
from vime.protocol.weights import WeightFetch
from vime.security import (
    HandshakeRejected,
    HandshakeWatch,
    KeyPaths,
    Security,
    SecurityError,
    create_keys,
    is_local_endpoint,
    load_client_keys,
)
from vime.weights import WeightFetcher, WeightFetchError, WeightPublisher

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture()
def security_log(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    recorder = Recorder()
    monkeypatch.setattr(vime.security, "log", recorder)
    return recorder


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Security]:
    """The job's keys, another job's keys, and an intruder who knows the job's server key but whose
    own key is not on the allow-list."""
    root = tmp_path_factory.mktemp("keys")
    create_keys(root / "job")
    create_keys(root / "other")
    create_keys(root / "intruder")
    shutil.copyfile(root / "job" / "server.key", root / "intruder" / "server.key")
    return {name: Security(root / name) for name in ("job", "other", "intruder")}


@pytest.fixture()
def curve_broker(keys: dict[str, Security]) -> Iterator[tuple[str, BrokerServer]]:
    endpoint, server, thread = start_broker(keys["job"])
    yield endpoint, server
    assert stop_broker(server, thread), "the broker did not stop (ZAP thread left in its context?)"


def non_loopback_ipv4() -> str | None:
    """An IPv4 address of one of this machine's own non-loopback interfaces, if it has one."""
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue
        address = socket.inet_ntoa(packed[20:24])
        if not ipaddress.ip_address(address).is_loopback:
            return address
    return None


def small_state() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [("w", torch.randn(300, 300, generator=g)), ("b", torch.randn(7, generator=g).to(torch.bfloat16))]


# --- keys ---------------------------------------------------------------------------------------------


def test_vime_keys_writes_the_documented_layout_owner_only_and_keeps_existing_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from vime.cli import main

    root = tmp_path / "keys"
    with pytest.raises(SystemExit) as exit_info:
        main(["keys", str(root)])
    assert exit_info.value.code == 0
    paths = KeyPaths(root)
    assert paths.server_secret.is_file() and paths.server_public.is_file()
    assert sorted(p.name for p in paths.authorized.iterdir()) == [
        "reward.key",
        "rollout.key",
        "status.key",
        "trainer.key",
    ]
    for role in ("reward", "rollout", "status", "trainer"):
        assert paths.client_secret(role).is_file()
        # The allow-list holds the client's public key, never its secret.
        assert "secret-key" not in (paths.authorized / f"{role}.key").read_text()
    for d in (root, paths.clients, paths.authorized):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    for secret in [paths.server_secret, *paths.clients.glob("*.key_secret")]:
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600, secret
    assert "allowed clients: reward, rollout, status, trainer" in capsys.readouterr().out

    before = paths.server_secret.read_bytes()
    with pytest.raises(SystemExit):
        main(["keys", str(root), "--client", "node7"])  # adds one client, keeps the rest
    assert paths.server_secret.read_bytes() == before
    assert (paths.authorized / "node7.key").is_file()
    with pytest.raises(SystemExit):
        main(["keys", str(root), "--force"])
    assert paths.server_secret.read_bytes() != before
    with pytest.raises(SystemExit) as exit_info:
        main(["keys", str(root), "--client", "../escape"])
    assert exit_info.value.code == 2


def test_missing_or_broken_keys_are_named_before_any_socket_exists(tmp_path: Path) -> None:
    with pytest.raises(SecurityError, match=r"server.key_secret does not exist .*vime keys"):
        WeightPublisher(security=Security(tmp_path / "nowhere"))
    create_keys(tmp_path / "k", clients=["reward"])
    with pytest.raises(SecurityError, match=r"clients/rollout.key_secret does not exist"):
        WeightFetcher("tcp://127.0.0.1:1", security=Security(tmp_path / "k"))
    (tmp_path / "k" / "server.key_secret").write_text("garbage\n")
    with pytest.raises(SecurityError, match=r"server.key_secret"):
        start_broker(Security(tmp_path / "k"))
    for key in (tmp_path / "k" / "authorized").glob("*.key"):
        key.unlink()
    create_keys(tmp_path / "k", force=True, clients=[])
    with pytest.raises(SecurityError, match=r"no client keys in .*authorized"):
        start_broker(Security(tmp_path / "k"))


# --- the plaintext rule -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "local"),
    [
        ("tcp://127.0.0.1:5555", True), ("tcp://127.0.1.1:*", True), ("tcp://localhost:5555", True),
        ("tcp://[::1]:5555", True), ("tcp://lo:5555", True), ("ipc:///tmp/vime.sock", True),
        ("inproc://vime", True), ("tcp://eth7;127.0.0.1:5555", True),
        ("tcp://*:5555", False), ("tcp://0.0.0.0:*", False), ("tcp://[::]:5555", False),
        ("tcp://10.1.2.3:5555", False), ("tcp://no-such-host.invalid:5555", False), ("udp://127.0.0.1:5", False),
        ("not an endpoint", False),
    ],
)  # fmt: skip
def test_which_endpoints_count_as_loopback(endpoint: str, local: bool) -> None:
    assert is_local_endpoint(endpoint) is local


def test_plaintext_on_a_network_address_is_refused_at_start_by_every_socket() -> None:
    hint = r"not a loopback address.*vime keys DIR.*--curve-keys-dir DIR.*--allow-insecure"
    with pytest.raises(SecurityError, match=r"the broker listens on tcp://\*:\d+, which is " + hint):
        start_broker(None, bind=f"tcp://*:{free_port()}")
    with pytest.raises(SecurityError, match=r"the weight publisher listens on tcp://0.0.0.0:\*, which is " + hint):
        WeightPublisher("tcp://0.0.0.0:*")
    with pytest.raises(SecurityError, match=r"the rollout broker client connects to tcp://10.9.9.9:5555"):
        BrokerClient("tcp://10.9.9.9:5555", "rollout")
    with pytest.raises(SecurityError, match=r"the weight fetcher connects to tcp://10.9.9.9:5555"):
        WeightFetcher("tcp://10.9.9.9:5555", security=Security())
    with pytest.raises(SecurityError, match=r"the status client connects to"):
        query_status("tcp://10.9.9.9:5555")


def test_allow_insecure_serves_plaintext_on_a_network_address_with_a_warning(security_log: Recorder) -> None:
    address = non_loopback_ipv4()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    insecure = Security(allow_insecure=True)
    with WeightPublisher(f"tcp://{address}:*", security=insecure) as pub:
        pub.publish(1, small_state())
        warning = security_log.wait_for("plaintext_zmq_on_network", what="weight publisher")
        assert warning["endpoint"] == f"tcp://{address}:*"
        with WeightFetcher(pub.endpoint, timeout_s=30.0, security=insecure) as fetcher:
            assert fetcher.fetch().version == 1
        security_log.wait_for("plaintext_zmq_on_network", what="weight fetcher")


def test_curve_serves_a_network_address_without_any_insecure_flag(keys: dict[str, Security]) -> None:
    address = non_loopback_ipv4()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    endpoint, server, thread = start_broker(keys["job"], bind=f"tcp://{address}:*")
    try:
        assert query_status(endpoint, security=keys["job"])["step"] == 0
    finally:
        stop_broker(server, thread)


# --- CURVE on the broker --------------------------------------------------------------------------


async def _join(endpoint: str, security: Security | None) -> str:
    """Hello + Credit as a rollout worker; returns the type of what came back, or why it was refused."""
    client = BrokerClient(endpoint, "rollout", security=security, broker_timeout_s=20.0)
    try:
        await client.hello(timeout_s=20.0)
        await client.send(Credit(n=2))
        msg = await client.recv(timeout_s=20.0)
        return type(msg).__name__
    except BrokerGone as exc:
        return f"refused: {exc}"
    finally:
        client.close()


def test_only_clients_with_an_allowed_key_can_join_submit_or_get_work(
    curve_broker: tuple[str, BrokerServer], keys: dict[str, Security], security_log: Recorder
) -> None:
    endpoint, server = curve_broker
    assert server.socket.getsockopt(zmq.CURVE_SERVER) == 1
    assert server.socket.getsockopt(zmq.ZAP_ENFORCE_DOMAIN) == 1  # no ZAP handler -> nobody gets in

    # Refused clients fail on the refusal itself, with the reason (not on the 20 s Hello timeout,
    # whose message would be "did not answer Hello").
    for who, reason in [
        ("intruder", "ZAP handler refused this client's CURVE key"),
        ("other", "wrong server public key"),
        (None, "no CURVE keys"),
    ]:
        outcome = asyncio.run(_join(endpoint, keys[who] if who else None))
        assert outcome.startswith(f"refused: {endpoint} refused the rollout broker client's connection"), (who, outcome)
        assert reason in outcome, (who, outcome)
    security_log.wait_for("zap_denied", socket="broker", address="127.0.0.1")
    security_log.wait_for("zmq_handshake_failed", socket="broker", reason="cryptographic")
    security_log.wait_for("zmq_handshake_failed", socket="broker", reason="mechanism mismatch")

    # Bare sockets with a refused key (or none) that try to register, take work and submit results:
    # nothing reaches the broker and nothing comes back.
    with bare_context() as ctx:
        intruders = [dealer(ctx, endpoint, keys[k].keys_dir) for k in ("intruder", "other")] + [
            dealer(ctx, endpoint, None)
        ]
        for i, sock in enumerate(intruders):
            sock.setsockopt(zmq.SNDTIMEO, 0)
            for msg in (Hello(role="rollout", worker_id=f"evil-{i}"), Credit(n=8), GroupsGenerated(groups=[])):
                try:
                    sock.send_multipart(encode(msg))
                except zmq.Again:
                    pass  # not even queued: there is no connection to queue it on
        assert not any(sock.poll(1000) for sock in intruders), "a refused client received something"

    # An allowed client is served, and sees the broker untouched by all of the above.
    outcome = asyncio.run(_join(endpoint, keys["job"]))
    assert outcome == DispatchGroups.__name__
    status = query_status(endpoint, security=keys["job"])
    assert [w["worker_id"].split("-")[0] for w in status["workers"]] == ["rollout"]
    assert status["counters"]["bad_messages"] == 0
    assert status["counters"]["groups_generated"] == 0


def test_a_forged_secret_for_an_allowed_public_key_is_refused_and_logged_without_a_false_reason(
    curve_broker: tuple[str, BrokerServer], keys: dict[str, Security], security_log: Recorder
) -> None:
    """Issue 15: a client presenting an allowed public key with a secret key that is not its own was
    logged as "does not have this server's public key". libzmq fails that handshake (the INITIATE
    vouch does not open) before ZAP sees the key, with the same event and code as a wrong server key
    (measured, libzmq 4.3.5: server PROTOCOL/ZMTP_CRYPTOGRAPHIC, client NO_DETAIL), so both sides must
    name both possibilities."""
    endpoint, server = curve_broker
    job = load_client_keys(keys["job"].keys_dir, "rollout")  # type: ignore[arg-type]
    _, forged_secret = zmq.curve_keypair()
    with bare_context() as ctx:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = job.server_public, job.public, forged_secret
        watch = HandshakeWatch(sock, name="forger", side="client")
        sock.connect(endpoint)
        sock.send_multipart(encode(Hello(role="rollout", worker_id="forger")))
        assert not sock.poll(1000), "a client with a forged secret key received something"
        failed = security_log.wait_for("zmq_handshake_failed", socket="broker", side="server")
        deadline = time.monotonic() + 10  # a refusal repeats on every reconnect: a few hang-ups make it one
        while watch.rejection is None and time.monotonic() < deadline:
            time.sleep(0.05)
        client_reason = watch.rejection
    for reason in (failed["reason"], client_reason):
        assert reason is not None
        assert "secret key does not match" in reason and "wrong server public key" in reason, reason
    assert "does not have this server's public key" not in failed["reason"]
    assert security_log.events("zap_denied") == [], "ZAP never sees a key whose handshake failed"
    assert server.state.workers == {} and server.state.counters["bad_messages"] == 0


def test_a_client_key_named_for_a_role_can_only_join_in_that_role(
    curve_broker: tuple[str, BrokerServer], keys: dict[str, Security]
) -> None:
    """A leaked rollout key must not let its holder pose as the trainer (which receives the training
    data and publishes weights) or as a reward worker (which decides the rewards)."""
    endpoint, server = curve_broker
    with bare_context() as ctx:
        for key_role_name, claimed in [("rollout", "trainer"), ("rollout", "reward"), ("status", "rollout"), ("reward", "reward")]:
            sock = dealer(ctx, endpoint, keys["job"].keys_dir, role=key_role_name)
            sock.send_multipart(encode(Hello(role=claimed, worker_id=f"{claimed}-via-{key_role_name}")))  # type: ignore[arg-type]
            assert sock.poll(5000), "no reply"
            reply = decode(sock.recv_multipart())
            if key_role_name == claimed:
                assert isinstance(reply, Welcome)
            else:
                assert isinstance(reply, ErrorReply), (key_role_name, claimed, reply)
                assert f"the client key '{key_role_name}' is a {key_role_name} key; it may not join as {claimed}" in reply.detail
            sock.close()
    joined = sorted(w.worker_id for w in server.state.workers.values())
    assert joined == ["reward-via-reward"]


def test_vime_status_needs_the_status_key(
    curve_broker: tuple[str, BrokerServer], keys: dict[str, Security], capsys: pytest.CaptureFixture[str]
) -> None:
    from vime.cli import main

    endpoint, _ = curve_broker
    with pytest.raises(SystemExit) as exit_info:
        main(["status", "--json", "--broker-address", endpoint, "--curve-keys-dir", str(keys["job"].keys_dir)])
    assert exit_info.value.code == 0
    assert json.loads(capsys.readouterr().out)["step"] == 0
    with pytest.raises(SystemExit) as exit_info:
        main(["status", "--broker-address", endpoint, "--timeout", "10"])
    assert exit_info.value.code == 2
    assert f"{endpoint} refused the status client's connection" in capsys.readouterr().err
    with pytest.raises(HandshakeRejected, match="refused this client's CURVE key"):
        query_status(endpoint, 10.0, security=keys["intruder"])


# --- CURVE on the weight channel --------------------------------------------------------------------


def test_only_allowed_fetchers_can_read_weights(keys: dict[str, Security], security_log: Recorder) -> None:
    state = small_state()
    with WeightPublisher(security=keys["job"]) as pub:
        pub.publish(3, state)
        with WeightFetcher(pub.endpoint, timeout_s=10.0, security=keys["job"]) as fetcher:
            got = fetcher.fetch()
        assert got.version == 3
        for (name, sent), (got_name, received) in zip(state, got.tensors):
            assert name == got_name and torch.equal(sent, received)

        for who, reason in [("intruder", "ZAP handler refused"), ("other", "wrong server public key"), (None, "")]:
            security = keys[who] if who else Security()
            # Failed on the refusal itself (not on the 20 s timeout, which says "could not connect").
            with WeightFetcher(pub.endpoint, timeout_s=20.0, security=security) as fetcher:
                with pytest.raises(
                    WeightFetchError, match=f"weight publisher at {pub.endpoint} refused the connection: .*{reason}"
                ):
                    fetcher.fetch()
        security_log.wait_for("zap_denied", socket="weight publisher")

        # A bare socket with a refused key asking for the manifest gets nothing at all.
        with bare_context() as ctx:
            sock = dealer(ctx, pub.endpoint, keys["intruder"].keys_dir)
            sock.send_multipart(encode(WeightFetch(fetch_id=1)))
            assert not sock.poll(1000)
        assert pub.completed_fetches(3) == 1


def test_without_its_zap_handler_a_curve_server_refuses_everyone(
    keys: dict[str, Security], security_log: Recorder
) -> None:
    """Fail closed: libzmq admits any key when a CURVE socket has no ZAP handler, unless the socket
    sets a ZAP domain and ZAP_ENFORCE_DOMAIN, as vime's do."""
    with WeightPublisher(security=keys["job"]) as pub:
        pub.publish(1, small_state())
        pub._guard.close()  # the ZAP thread stops; the socket keeps listening
        with WeightFetcher(pub.endpoint, timeout_s=3.0, security=keys["job"]) as fetcher:
            with pytest.raises(WeightFetchError, match="could not connect"):
                fetcher.fetch()
        security_log.wait_for("zmq_handshake_failed", socket="weight publisher", reason="no ZAP handler")


def test_a_fetcher_in_a_process_vime_did_not_start_reads_its_keys_from_the_environment(
    keys: dict[str, Security],
) -> None:
    """vLLM's worker processes build fetchers with only an endpoint; the rollout worker exports
    VIME_CURVE_KEYS_DIR before starting the engine, and a child process inherits it."""
    with WeightPublisher(security=keys["job"]) as pub:
        pub.publish(5, small_state())
        code = f"from vime.weights import WeightFetcher\nprint(WeightFetcher({pub.endpoint!r}, timeout_s=20).fetch().version)"
        env = run_env(**keys["job"].env())
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.strip().splitlines()[-1] == "5"
        env = run_env(**keys["intruder"].env())
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert result.returncode != 0 and "refused the connection" in result.stderr


# --- vime run / vime slurm -------------------------------------------------------------------------


def test_vime_run_refuses_plaintext_on_a_network_address_before_starting_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from vime.cli import main

    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(REPO / "configs" / "demo.yaml"), "--run-dir", str(run_dir), "--broker-address",
              "tcp://10.9.9.9:5555", "--no-progress"])  # fmt: skip
    assert exit_info.value.code == 2
    assert "is not a loopback address" in capsys.readouterr().err
    assert not run_dir.exists()
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(REPO / "configs" / "demo.yaml"), "--run-dir", str(run_dir), "--curve-keys-dir",
              str(tmp_path / "no-keys"), "--no-progress"])  # fmt: skip
    assert exit_info.value.code == 2
    assert "no-keys/server.key_secret does not exist" in capsys.readouterr().err


def test_vime_slurm_gives_the_job_its_own_keys_unless_told_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from vime.slurm.command import main as slurm_main

    monkeypatch.chdir(tmp_path)
    demo = str(REPO / "configs" / "demo.yaml")
    assert slurm_main([demo, "--run-dir", "a", "--output", "-"]) == 0
    written = yaml.safe_load((tmp_path / "a" / "config.yaml").read_text())
    assert written["curve_keys_dir"] == str(tmp_path / "a" / "keys")
    assert (tmp_path / "a" / "keys" / "server.key_secret").is_file()
    assert capsys.readouterr().out.startswith("#!/bin/bash")  # the script alone on stdout
    assert slurm_main([demo, "--run-dir", "b", "--output", "-", "--allow-insecure"]) == 0
    written = yaml.safe_load((tmp_path / "b" / "config.yaml").read_text())
    assert written["curve_keys_dir"] is None and written["allow_insecure"] is True
    assert not (tmp_path / "b" / "keys").exists()
    create_keys(tmp_path / "mine")
    assert slurm_main([demo, "--run-dir", "c", "--output", "-", "--curve-keys-dir", str(tmp_path / "mine")]) == 0
    assert yaml.safe_load((tmp_path / "c" / "config.yaml").read_text())["curve_keys_dir"] == str(tmp_path / "mine")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vime.demo.model_factory import make_tiny_qwen3

    return Path(make_tiny_qwen3(tmp_path_factory.mktemp("model") / "tiny", seed=0))


def _events(log: Path, event: str) -> list[dict[str, Any]]:
    return [
        r
        for line in log.read_text().splitlines()
        if line.startswith("{") and (r := json.loads(line)).get("event") == event
    ]


@pytest.mark.e2e
def test_vime_run_with_curve_keys_trains_end_to_end(tiny_model: Path, tmp_path: Path) -> None:
    """`vime keys DIR` then `vime run ... --curve-keys-dir DIR`: every process (broker, reward,
    rollout with its weight fetcher, trainer with its weight publisher) uses CURVE, and the job trains."""
    env = run_env(VIME_LOG_LEVEL="INFO")
    keys = tmp_path / "keys"
    made = subprocess.run(
        [sys.executable, "-m", "vime.cli", "keys", str(keys)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert made.returncode == 0, made.stderr
    run_dir, steps = tmp_path / "run", 3
    argv = [
        sys.executable, "-m", "vime.cli", "run", str(REPO / "configs" / "demo.yaml"), "--run-dir", str(run_dir),
        "--hf-checkpoint", str(tiny_model), "--no-make-demo-model", "--broker-address", f"tcp://127.0.0.1:{free_port()}",
        "--no-progress", "--timeout", "150", "--num-rollout", str(steps), "--rollout-batch-size", "4",
        "--n-samples-per-prompt", "4", "--rollout-engine", "hf", "--curve-keys-dir", str(keys), "--no-torch-compile",
    ]  # fmt: skip
    result = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, f"vime run failed:\n{result.stderr[-4000:]}"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "rollout/raw_reward" in m] == list(range(steps))
    logs = run_dir / "logs"
    assert [e["socket"] for e in _events(logs / "broker.log", "curve_server")] == ["broker"]
    assert [e["socket"] for e in _events(logs / "trainer-0.log", "curve_server")] == ["weight publisher"]
    assert _events(logs / "rollout-0.log", "weights_loaded"), "the rollout worker never loaded weights over CURVE"
    for log in logs.glob("*.log"):
        for bad in ("zap_denied", "zmq_handshake_failed", "plaintext_zmq_on_network"):
            assert not _events(log, bad), f"{bad} in {log.name}"
