"""The rollout dtype on the CPU: float32 where bf16 would be emulated, the trainer publishing the same."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch
from structlog.testing import capture_logs

from vime.logging import configure_logging
from vime.rollout import vllm_environment
from vime.rollout.vllm_environment import cpu_engine_dtype, default_rollout_dtype, rollout_weight_dtype


@pytest.fixture(autouse=True)
def _logging_configured() -> None:
    configure_logging()  # first, or its structlog.configure() would replace capture_logs' processors


@pytest.fixture
def cpu_without_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_environment, "cpu_runs_bf16_natively", lambda: False)


@pytest.fixture
def cpu_with_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_environment, "cpu_runs_bf16_natively", lambda: True)


def test_the_probe_answers_from_torch_on_this_machine() -> None:
    assert vllm_environment.cpu_runs_bf16_natively() == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@pytest.mark.usefixtures("cpu_without_bf16")
def test_an_emulating_cpu_gets_float32_and_the_trainer_publishes_float32() -> None:
    with capture_logs() as logs:
        args = cpu_engine_dtype({"max_model_len": 64})
    assert args == {"max_model_len": 64, "dtype": "float32"}
    assert [entry["event"] for entry in logs] == ["rollout dtype chosen"]
    assert cpu_engine_dtype({"dtype": "auto"})["dtype"] == "float32"
    assert rollout_weight_dtype({}, on_cpu=True) == "float32"
    assert rollout_weight_dtype({"dtype": "auto"}, on_cpu=True) == "float32"
    # a GPU trainer is not asked about the CPU it runs beside
    assert rollout_weight_dtype({}, on_cpu=False) == "bfloat16" and default_rollout_dtype(on_cpu=False) is None


@pytest.mark.usefixtures("cpu_without_bf16")
def test_an_explicit_bf16_is_kept_with_a_warning_on_an_emulating_cpu() -> None:
    with capture_logs() as logs:
        args = cpu_engine_dtype({"dtype": "bfloat16"})
    assert args == {"dtype": "bfloat16"}
    assert [(entry["event"], entry["log_level"]) for entry in logs] == [("rollout dtype slow on this cpu", "warning")]
    assert rollout_weight_dtype({"dtype": "bfloat16"}, on_cpu=True) == "bfloat16"


@pytest.mark.usefixtures("cpu_with_bf16")
def test_a_cpu_with_bf16_leaves_vllm_its_own_choice() -> None:
    with capture_logs() as logs:
        assert cpu_engine_dtype({"max_model_len": 64}) == {"max_model_len": 64}
        assert cpu_engine_dtype({"dtype": "bfloat16"}) == {"dtype": "bfloat16"}
    assert logs == []
    assert rollout_weight_dtype({}, on_cpu=True) == "bfloat16"
    assert rollout_weight_dtype({"dtype": "float16"}, on_cpu=True) == "float16"


def test_an_engine_given_no_dtype_runs_float32_on_an_emulating_cpu_and_loads_the_trainers_float32_weights(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The path an AVX2-only machine runs, on any machine: vLLM-CPU started with no dtype, a trainer's
    update in the dtype `rollout_weight_dtype` picks, and the engine's logprobs those of float32 weights."""
    pytest.importorskip("vllm")
    if torch.cuda.is_available():
        pytest.skip("the rule is vLLM-CPU's")
    from helpers_engines import started_vllm_engine
    from safetensors.torch import load_file
    from test_rollout_vllm import reference_logprobs

    from vime.demo.model_factory import make_tiny_qwen3
    from vime.weights import WeightPublisher

    monkeypatch.setattr(vllm_environment, "cpu_runs_bf16_natively", lambda: False)
    model_dir = Path(make_tiny_qwen3(tmp_path / "m", seed=0, max_position_embeddings=64))
    dtype = getattr(torch, rollout_weight_dtype({}, on_cpu=True))
    g = torch.Generator().manual_seed(1)
    weights = [(name, (old.float() + 0.05 * torch.randn(old.shape, generator=g)).to(dtype))
               for name, old in load_file(str(model_dir / "model.safetensors")).items()]  # fmt: skip
    prompt, response = [5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15]
    publisher = WeightPublisher(bind="tcp://127.0.0.1:*")
    loop = asyncio.new_event_loop()
    try:
        with started_vllm_engine(loop, model_dir, 64, eager=True, dtype=None, weight_endpoint=publisher.endpoint) as engine:
            assert engine._llm.model_config.dtype == torch.float32
            publisher.publish(1, weights)
            assert loop.run_until_complete(engine.update_weights(1)).version == 1
            got = loop.run_until_complete(engine.score(prompt, response))
    finally:
        publisher.close()
        loop.close()
    diff = np.abs(got - reference_logprobs(model_dir, weights, prompt, response))
    # float32 on both sides; a bf16 engine differs from this recompute by 0.002-0.005 on average
    assert diff.mean() < 5e-4 and diff.max() < 2e-3, (diff.mean(), diff.max())
