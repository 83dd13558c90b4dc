"""Multi-turn rollouts through the whole pipeline (`vime run`, real processes): the environment's turns
reach the trainer masked, the environment's reward is the one trained on, the metrics say how many
turns and masked tokens there were, and a generate function that raises fails its group, not the job."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, run_env, start_tool_server
from test_e2e import free_port, logged_events, read_jsonl

STEPS, GROUPS, SAMPLES = 3, 4, 4


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vime.demo.model_factory import make_tiny_qwen3

    return Path(make_tiny_qwen3(tmp_path_factory.mktemp("model") / "tiny", seed=0))


def run_multiturn(run_dir: Path, model: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    argv = [
        sys.executable, "-m", "vime.cli", "run", str(REPO / "configs" / "demo-multiturn.yaml"),
        "--run-dir", str(run_dir), "--hf-checkpoint", str(model), "--no-make-demo-model", "--rollout-engine", "hf",
        "--num-rollout", str(STEPS), "--rollout-batch-size", str(GROUPS), "--n-samples-per-prompt", str(SAMPLES),
        "--no-torch-compile", "--broker-address", f"tcp://127.0.0.1:{free_port()}", "--no-progress", "--timeout", "200",
        *extra,
    ]  # fmt: skip
    return subprocess.run(argv, cwd=REPO, env=run_env(VIME_LOG_LEVEL="INFO"), capture_output=True, text=True, timeout=240)


@pytest.mark.e2e
def test_environment_turns_reach_the_trainer_masked_with_the_environments_reward(tiny_model: Path, tmp_path: Path) -> None:
    from vime.broker.journal import JournalBuffered, read_journal
    from vime.demo.tokenizer import id_to_token

    run_dir = tmp_path / "run"
    result = run_multiturn(run_dir, tiny_model)
    assert result.returncode == 0, f"vime run failed:\n{result.stderr[-4000:]}"
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(STEPS))
    for m in metrics:
        assert m["rollout/turns"] == 2.0 and m["rollout/engine_calls"] == 2.0  # the environment ends after two turns
        assert m["rollout/masked_tokens"] == 3.0  # "+c=" for a one-digit operand
        assert 0 < m["rollout/masked_token_ratio"] < 1

    symbols = id_to_token()
    records, _ = read_journal(run_dir / "broker.journal")
    groups = [r.group for r in records if isinstance(r, JournalBuffered)]
    assert len(groups) >= STEPS * GROUPS
    for group in groups:
        operand = group.metadata["operands"][0]
        for sample in group.samples:
            text = [symbols[t] for t in sample.response_tokens.tolist()]
            env = [t for t, m in zip(text, sample.loss_mask.tolist()) if m == 0]
            assert "".join(env) == f"+{operand}=", (text, sample.loss_mask)
            assert sample.rollout_logprobs[sample.loss_mask == 0].tolist() == [0.0] * 3
            final = "".join(text).split("=")[-1].replace("<eos>", "")
            assert sample.reward == float(final == group.label)  # the environment's verdict, kept
    counters = json.loads((run_dir / "status.json").read_text())["counters"]
    assert counters["groups_trained"] == STEPS * GROUPS and counters["groups_failed"] == 0


FLAKY_FUNCTION = '''
from vime.agent.multiturn import generate as multiturn


async def generate(args, sample, sampling_params):
    """slime's signature; the environment's loop, except for prompts whose first operand is even."""
    if sample.metadata["a"] % 2 == 0:
        raise RuntimeError(f"no sandbox for {sample.prompt}")
    return await multiturn(args, sample, sampling_params)
'''


@pytest.mark.e2e
def test_a_generate_function_that_raises_fails_its_groups_and_the_job_goes_on(tiny_model: Path, tmp_path: Path) -> None:
    function = tmp_path / "flaky.py"
    function.write_text(FLAKY_FUNCTION)
    run_dir = tmp_path / "run"
    result = run_multiturn(run_dir, tiny_model, "--custom-generate-function-path", f"{function}:generate")
    assert result.returncode == 0, f"vime run failed:\n{result.stderr[-4000:]}"
    assert len(read_jsonl(run_dir / "metrics.jsonl")) == STEPS
    counters = json.loads((run_dir / "status.json").read_text())["counters"]
    assert counters["groups_failed"] > 0 and counters["groups_trained"] == STEPS * GROUPS
    failures = logged_events(run_dir / "logs" / "rollout-0.log", "generate_function_failed")
    assert failures and "no sandbox for" in failures[0]["error"]
    assert "in generate" in failures[0]["traceback"]
    assert '"child_started"' in result.stderr and '"child_died"' not in result.stderr  # no worker went down


@pytest.fixture(scope="module")
def moe_r3_job_with_the_environment_on_a_server(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """One job for the last two tests (each job costs about half a minute of process starts on 2 cores):
    R3 on a tiny MoE, with the environment in a `vime-tool-server` process. Their checks do not
    conflict: what R3 replays does not depend on where the environment's tokens come from, and the
    environment server's trajectories do not depend on the model behind the engine."""
    from vime.demo.model_factory import make_tiny_qwen3_moe

    tmp_path = tmp_path_factory.mktemp("moe_r3_server")
    moe = make_tiny_qwen3_moe(tmp_path / "moe", seed=0, num_experts=64, num_experts_per_tok=4, moe_intermediate_size=16)
    environment = "running_sum=vime.demo.running_sum:make_environment"
    server, url = start_tool_server(tmp_path / "server.log", "--environment", environment)
    try:
        run_dir = tmp_path / "run"
        result = run_multiturn(
            run_dir, Path(moe), "--use-rollout-routing-replay", "--no-share-prompts", "--rollout-dtype", "bfloat16",
            "--environment-url", f"{url}/environments/running_sum", "--environment-path", "",
        )  # fmt: skip
    finally:
        server.terminate()
        server.wait(timeout=10)
    return run_dir, result


@pytest.mark.e2e
def test_multi_turn_trajectories_carry_r3_traces_the_trainer_replays(
    moe_r3_job_with_the_environment_on_a_server: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    """R3 on a tiny MoE (the hf engine records routing on the CPU): each trajectory's trace is its last
    engine call's, covering the earlier turns and the environment's tokens; the trainer replays it."""
    run_dir, result = moe_r3_job_with_the_environment_on_a_server
    assert result.returncode == 0, f"vime run failed:\n{result.stderr[-4000:]}"
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert len(metrics) == STEPS
    for m in metrics:
        assert m["rollout/turns"] == 2.0
        assert m["train/routing_agreement"] == 1.0, m  # the trainer used the rollout's experts everywhere
    counters = json.loads((run_dir / "status.json").read_text())["counters"]
    assert counters["groups_failed"] == 0 and counters["bad_messages"] == 0


@pytest.mark.e2e
def test_the_pipeline_with_the_environment_on_an_environment_server(
    moe_r3_job_with_the_environment_on_a_server: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    """`--environment-url` (and no in-process environment): the same trajectories with the environment in
    a `vime-tool-server` process."""
    run_dir, result = moe_r3_job_with_the_environment_on_a_server
    assert result.returncode == 0, f"vime run failed:\n{result.stderr[-4000:]}"
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert len(metrics) == STEPS and all(m["rollout/turns"] == 2.0 and m["rollout/masked_tokens"] == 3.0 for m in metrics)
    counters = json.loads((run_dir / "status.json").read_text())["counters"]
    assert counters["groups_trained"] == STEPS * GROUPS and counters["groups_failed"] == 0
