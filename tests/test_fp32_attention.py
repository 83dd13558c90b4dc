"""bf16 training on the CPU (`--train-dtype bfloat16`): matrix products in bf16 under autocast, attention
in float32 (`vime.trainer.fp32_attention`), master weights in float32."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.test_torch_backend import checkpoints, config, make_batch  # noqa: F401 - the fixture
from vime.config import VimeConfig
from vime.trainer import fp32_attention
from vime.trainer.torch_backend import TorchTrainer, TorchTrainerConfig


def test_attention_runs_in_float32_and_answers_in_the_query_dtype() -> None:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(0)
    module = SimpleNamespace(is_causal=True, num_key_value_groups=1, training=False)
    q, k, v = (torch.randn(2, 2, 9, 16) for _ in range(3))
    mask = torch.ones(2, 1, 9, 9, dtype=torch.bool).tril()
    reference, _ = sdpa_attention_forward(module, q, k, v, mask)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = fp32_attention.fp32_sdpa_attention_forward(module, q.bfloat16(), k.bfloat16(), v.bfloat16(), mask)
    assert out.dtype == torch.bfloat16
    # inputs rounded to bf16, the attention itself in fp32: within bf16's rounding of the fp32 result
    torch.testing.assert_close(out.float(), reference, atol=2e-2, rtol=2e-2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16, _ = sdpa_attention_forward(module, q.bfloat16(), k.bfloat16(), v.bfloat16(), mask)
    ours = (out.float() - reference).abs().mean()
    assert ours < (bf16.float() - reference).abs().mean()


def test_the_job_flag_reaches_the_trainer() -> None:
    cfg = VimeConfig(train_dtype="bfloat16")
    assert TorchTrainerConfig.from_vime_config(cfg).dtype == "bfloat16"
    assert TorchTrainerConfig.from_vime_config(VimeConfig()).dtype == "auto"


def test_cpu_bf16_training_matches_fp32_logprobs_and_learns(checkpoints) -> None:  # noqa: F811
    trainer = TorchTrainer(config(checkpoints["dense"], dtype="bfloat16", use_tis=True, micro_batch_size=2))
    assert trainer.compute_dtype == torch.bfloat16
    assert trainer.hf_model.config._attn_implementation == fp32_attention.ATTENTION_NAME
    assert next(trainer.hf_model.parameters()).dtype == torch.float32  # fp32 master weights
    batch = make_batch()
    fp32 = TorchTrainer(config(checkpoints["dense"])).compute_logprobs(batch)
    bf16 = trainer.compute_logprobs(batch)
    assert max(float(np.abs(a - b).max()) for a, b in zip(fp32, bf16)) < 0.1
    metrics = trainer.train_step(batch)
    assert all(math.isfinite(v) for v in metrics.values())
    after = trainer.compute_logprobs(batch)
    assert any(not np.allclose(a, b) for a, b in zip(after, bf16))  # the weights moved


@pytest.mark.parametrize("dtype", ["auto", "float32"])
def test_float32_training_keeps_transformers_sdpa(checkpoints, dtype: str) -> None:  # noqa: F811
    trainer = TorchTrainer(config(checkpoints["dense"], dtype=dtype))
    assert trainer.compute_dtype == torch.float32
    assert trainer.hf_model.config._attn_implementation == "sdpa"
