"""Every shipped config under configs/ loads with the current VimeConfig (no unknown keys)."""

from pathlib import Path

import pytest

from vime.config import load_config

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))


def test_there_are_configs():
    assert CONFIGS


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_loads(path):
    cfg = load_config(path)
    assert cfg.samples_per_step >= 1


def test_r3_recipe():
    cfg = load_config(Path(__file__).resolve().parent.parent / "configs" / "qwen3-30b-a3b-grpo-r3.yaml")
    assert cfg.use_rollout_routing_replay and cfg.rm_type == "dapo" and cfg.advantage_estimator == "grpo"
    assert cfg.samples_per_step % cfg.global_batch_size == 0
