"""The chaos test in its short CI form (`bench/chaos.py --preset ci`), by hand and under `vime run`.

One epoch of the demo (the transformers rollout engine, a random tiny Qwen3 and a reward it learns
within a few steps) with 2 rollout and 2 reward workers, while the harness SIGKILLs random rollout and
reward workers, the broker once (by hand), and the broker and the trainer together once, off a
checkpoint step.
By hand the harness restarts each (the trainer with --load latest); under `vime run` it only kills, and
the launcher's supervisor must restart them. Afterwards the broker must report no group lost and none
trained twice, the trainer's record must show every prompt of the epoch trained exactly once, every
fault must have been survived, and the reward must still have risen. docs/reliability.md ("Chaos
test") has the details and the full form.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_env

REPO = Path(__file__).resolve().parent.parent


def _run_chaos(tmp_path: Path, *extra: str, broker_kills: int = 1) -> dict:
    from vime.demo.model_factory import make_tiny_qwen3

    model = make_tiny_qwen3(tmp_path / "tiny", seed=0)
    run_dir = tmp_path / "run"
    env = run_env(VIME_LOG_LEVEL="INFO")  # the checks read info events
    result = subprocess.run(
        [sys.executable, str(REPO / "bench" / "chaos.py"), "--preset", "ci", "--seed", "0", "--run-dir", str(run_dir),
         "--hf-checkpoint", str(model), "--timeout", "260", "--quiet", "--broker-kills", str(broker_kills), *extra],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=380,
    )  # fmt: skip
    summary_path = run_dir / "chaos_summary.json"
    assert summary_path.exists(), f"no summary (exit code {result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    summary = json.loads(summary_path.read_text())
    failed = [f"{c['name']}: {c['detail']}" for c in summary["checks"] if not c["passed"]]
    assert not failed, "chaos checks failed:\n" + "\n".join(failed) + f"\n\n{result.stdout[-2500:]}"
    assert result.returncode == 0, result.stdout[-3000:]

    names = {c["name"] for c in summary["checks"]}
    for name in ("job_finished", "groups_lost_zero", "groups_trained_twice_zero", "every_prompt_trained_once",
                 "no_unexpected_exits", "faults_survived", "job_kill_injected", "reward_rises"):  # fmt: skip
        assert name in names, f"check {name} did not run"
    injected, survived = summary["faults_injected"], summary["faults_survived"]
    assert injected.get("broker", 0) == broker_kills and injected.get("job") == 1, injected
    assert injected.get("rollout", 0) + injected.get("reward", 0) >= 3, injected
    assert survived == injected
    # The broker alone, then with the trainer: broker_kills + 1 restarts, unless a kill found the broker
    # still starting (on a loaded machine the job kill can land on the broker the first kill restarted,
    # before it read its journal). Every restart that restored the journal is counted, once.
    resumed = (run_dir / "logs" / "broker.log").read_text().count('"event": "broker_resumed"')
    assert 1 <= resumed <= broker_kills + 1
    assert summary["broker"]["broker_restarts"] == resumed
    assert summary["broker"]["groups_lost"] == 0 and summary["broker"]["groups_trained_twice"] == 0

    leftovers = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True)
    assert leftovers.stdout.strip() == "", "processes of the job survived the harness"
    return summary


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_random_kills_by_hand_lose_nothing_and_train_nothing_twice(tmp_path: Path) -> None:
    _run_chaos(tmp_path)
