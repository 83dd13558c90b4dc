"""Megatron backend on a GPU: logits vs transformers and R3 metrics vs the torch backend.

Megatron-core does not run on CPU (rotary embeddings and the MoE token dispatcher touch CUDA), and
0.17+ needs Python >= 3.12; so these tests skip on the CPU machines and CI, saying why. The full GPU
verification, with training, export and timings, is `scripts/gpu_check.sh` (see docs/benchmarks.md).
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("Megatron backend tests need a CUDA GPU (megatron-core does not run on CPU)", allow_module_level=True)
pytest.importorskip("megatron.core", reason="megatron-core is not installed (GPU machines: scripts/gpu_check.sh)")

from vime.bench import megatron_check  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _process_groups():
    megatron_check._setup()


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_logits_match_transformers(family, tmp_path):
    for rec in megatron_check.check_logits(family, tmp_path):
        assert rec["passed"], rec


def test_r3_metrics_match_torch_backend_and_replay_agrees(tmp_path):
    (rec,) = megatron_check.check_r3(tmp_path)
    assert rec["routing_agreement_megatron_r3"] == 1.0, rec
    assert rec["backends_agree_within_10pct"], rec
    assert rec["abs_diff_megatron_r3"] < rec["abs_diff_megatron_no_r3"], rec


def test_the_chunked_head_trains_like_full_logits(tmp_path):
    for rec in megatron_check.check_chunked_head(tmp_path):
        assert rec["passed"], rec
