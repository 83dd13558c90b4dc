"""bench/inprocess_loop.py: issue 16's in-process GRPO loop (response lengths; a short run end to end)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from vime.config import load_config

from conftest import REPO, load_bench

ipl = load_bench("inprocess_loop")


def test_response_lengths_count_up_to_and_including_the_first_eos() -> None:
    eos = 1
    responses = torch.tensor([[5, 6, 1, 0, 0], [5, 1, 7, 1, 0], [5, 6, 7, 8, 9], [1, 0, 0, 0, 0]])
    assert ipl._response_lengths(responses, eos).tolist() == [3, 2, 5, 1]


def test_a_short_run_generates_scores_and_trains(demo_model: Path) -> None:
    cfg = load_config(REPO / "configs" / "demo.yaml", {"hf_checkpoint": str(demo_model), "rollout_batch_size": 4, "n_samples_per_prompt": 4})
    result = ipl.run_loop(cfg, steps=3, compile_layers=False, skip=1)
    assert result["steps"] == 3 and result["threads"] >= 1
    # each step's reward is the mean of 16 exact-match scores, so the five-step window of three steps
    # is a multiple of 1/48
    for key in ("reward_first5", "reward_last5"):
        assert 0.0 <= result[key] <= 1.0
        assert math.isclose(result[key] * 48, round(result[key] * 48), abs_tol=1e-6)
    assert 0.0 < result["median_generate_s"] < result["median_step_s"]
    assert 0.0 < result["median_train_s"] < result["median_step_s"]
    assert result["peak_rss_mib"] > 100
