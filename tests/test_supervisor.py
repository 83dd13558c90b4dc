"""The supervisor's rule for workers that exit with code 0 (they left the job), with real child processes:
restarted once the grace has passed while the broker's status.json says the job is not finished, never
when it says finished or cannot be read, and a stopped job rather than a hang under --no-supervise."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

import vime.supervisor as supervisor_module
from vime.config import load_config
from vime.process import Child
from vime.supervisor import JobFailed, Supervisor


def job(tmp_path: Path, status: dict | str | None, **overrides: object) -> tuple[Supervisor, Child, list[str]]:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    if isinstance(status, dict):
        (run_dir / "status.json").write_text(json.dumps(status))
    elif isinstance(status, str):
        (run_dir / "status.json").write_text(status)
    cfg = load_config(None, {"run_dir": str(run_dir), "restart_backoff_s": 0.0, **overrides})
    leaver = Child("reward-0", [sys.executable, "-c", "pass"], dict(os.environ), run_dir / "reward-0.log")
    said: list[str] = []
    supervisor = Supervisor([leaver], cfg, say=said.append, new_rendezvous_port=lambda: 0, has_checkpoint=lambda: False)
    return supervisor, leaver, said


def run_until_left(supervisor: Supervisor, leaver: Child) -> float:
    supervisor.start(time.monotonic())
    leaver.process.wait(timeout=30)  # type: ignore[union-attr]
    now = time.monotonic()
    supervisor.check(now)  # seen to have left: the grace starts
    return now


def test_a_worker_that_left_an_unfinished_job_is_restarted_after_the_grace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervisor_module, "LEFT_GRACE_S", 5.0)
    supervisor, leaver, said = job(tmp_path, {"finished": False})
    now = run_until_left(supervisor, leaver)
    supervisor.check(now + 4.9)
    assert said == [] and supervisor.restarts() == {}  # within the grace: the job may be ending
    supervisor.check(now + 5.0)
    assert len(said) == 1 and "reward-0 left the job (exit code 0) before it finished" in said[0]
    supervisor.check(now + 5.1)  # the restart is due (no backoff here)
    assert supervisor.restarts() == {"reward-0": 1} and leaver.poll() in (None, 0)
    leaver.process.wait(timeout=30)  # type: ignore[union-attr]


@pytest.mark.parametrize("status", [{"finished": True}, "{not json", None])
def test_a_worker_that_left_a_finished_job_or_on_no_word_is_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, status: dict | str | None
) -> None:
    monkeypatch.setattr(supervisor_module, "LEFT_GRACE_S", 5.0)
    supervisor, leaver, said = job(tmp_path, status)
    now = run_until_left(supervisor, leaver)
    supervisor.check(now + 60.0)
    assert said == [] and supervisor.restarts() == {}


def test_without_supervision_a_worker_that_left_stops_the_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervisor_module, "LEFT_GRACE_S", 5.0)
    supervisor, leaver, _ = job(tmp_path, {"finished": False}, supervise=False)
    now = run_until_left(supervisor, leaver)
    with pytest.raises(JobFailed, match=r"reward-0 left the job .*\(--no-supervise"):
        supervisor.check(now + 5.0)
