"""The rollout dtype on the CPU: float32 where bf16 would be emulated, the trainer publishing the same."""

from __future__ import annotations

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
