"""The chaos test in its short CI form (`bench/chaos.py --preset ci`).

One epoch of the demo (80 steps x 8 prompt groups, the transformers rollout engine, a random tiny
Qwen3 and a reward it learns within a few steps) with 2 rollout and 2 reward workers, while the harness
SIGKILLs random rollout and reward workers (restarting each a moment later) and kills the broker once
(restarted with the same command line; it resumes from its journal). Afterwards the broker must report
no group lost and none trained twice, the trainer's record must show every prompt of the epoch trained
exactly once, every fault must have been survived, and the reward must still have risen. About a
minute on 2 cores; docs/reliability.md ("Chaos test") has the details and the full form.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_env

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_random_worker_kills_and_a_broker_kill_lose_nothing_and_train_nothing_twice(tmp_path: Path) -> None:
    from vime.demo.model_factory import make_tiny_qwen3

    model = make_tiny_qwen3(tmp_path / "tiny", seed=0)
    run_dir = tmp_path / "run"
    env = run_env(VIME_LOG_LEVEL="INFO")  # the checks read info events
    result = subprocess.run(
        [sys.executable, str(REPO / "bench" / "chaos.py"), "--preset", "ci", "--seed", "0", "--run-dir", str(run_dir),
         "--hf-checkpoint", str(model), "--timeout", "200", "--quiet"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    summary_path = run_dir / "chaos_summary.json"
    assert summary_path.exists(), f"no summary (exit code {result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    summary = json.loads(summary_path.read_text())
    failed = [f"{c['name']}: {c['detail']}" for c in summary["checks"] if not c["passed"]]
    assert not failed, "chaos checks failed:\n" + "\n".join(failed) + f"\n\n{result.stdout[-2500:]}"
    assert result.returncode == 0, result.stdout[-3000:]

    names = {c["name"] for c in summary["checks"]}
    for name in ("job_finished", "groups_lost_zero", "groups_trained_twice_zero", "every_prompt_trained_once",
                 "no_unexpected_exits", "faults_survived", "broker_kill_injected", "reward_rises"):  # fmt: skip
        assert name in names, f"check {name} did not run"
    injected, survived = summary["faults_injected"], summary["faults_survived"]
    assert injected.get("broker") == 1, injected
    assert injected.get("rollout", 0) + injected.get("reward", 0) >= 3, injected
    assert survived == injected
    assert summary["broker"]["broker_restarts"] == 1
    assert summary["broker"]["groups_lost"] == 0 and summary["broker"]["groups_trained_twice"] == 0

    leftovers = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True)
    assert leftovers.stdout.strip() == "", "processes of the job survived the harness"
