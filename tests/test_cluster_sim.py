"""The cluster-scale simulator (vime.bench.cluster_sim): invariants of the broker it drives and of its
cost model, not its numbers (those are assumptions, stated in the module and docs/_draft_cluster_sim.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from vime.bench.cluster_sim import (
    EngineCosts, SimConfig, Simulation, calibrate_decode, response_lengths, rollout_splits, shape, simulate,
)

REPO = Path(__file__).resolve().parent.parent
CAL = calibrate_decode()
# Small and short: 8 GPUs (one TP-4 engine, four trainer GPUs), 8 prompts x 4 samples, 2k-token cap.
SMALL = SimConfig(
    gpus=8, rollout_gpus=4, rollout_batch_size=8, n_samples_per_prompt=4, max_response_len=2048,
    response_median=600.0, engine_groups=16, steps_measured=3,
)  # fmt: skip


def test_the_decode_fit_reproduces_the_measured_vllm_points() -> None:
    assert CAL.overhead_s > 0 and CAL.roofline_scale > 0
    assert all(abs(r) < 0.1 for r in CAL.residuals.values()), CAL.residuals


def test_engine_throughput_grows_with_concurrency_and_each_sequence_slows() -> None:
    costs = EngineCosts(shape("30b-a3b"), 4, CAL)
    batches = [1, 8, 64, 256, 1024]
    total = [costs.tokens_per_s(b, 2048) for b in batches]
    per_seq = [t / b for t, b in zip(total, batches)]
    assert total == sorted(total)
    assert per_seq == sorted(per_seq, reverse=True)


@pytest.mark.parametrize(
    "layout",
    [dict(colocate=True, rollout_gpus=None, max_staleness=0), dict(max_staleness=0), dict(max_staleness=1),
     dict(max_staleness=2), dict(max_staleness=4)],
)  # fmt: skip
def test_every_admitted_group_is_trained_and_staleness_stays_within_the_bound(layout: dict) -> None:
    cfg = replace(SMALL, **layout)
    result = simulate(cfg, CAL)
    c = result.counters
    assert result.groups_lost == 0
    assert result.groups_trained_twice == 0
    assert c["groups_trained"] == cfg.num_rollout * cfg.rollout_batch_size
    # Nothing is left in flight once the last step is trained (admission stops at the job's end).
    assert c["groups_admitted"] == c["groups_trained"] + c["groups_dropped_stale"] + c["groups_failed"] + c["groups_filtered"]
    assert result.staleness_max <= cfg.max_staleness
    assert all(0 <= s <= cfg.max_staleness for s in result.staleness_mean_per_step)
    assert 0.0 <= result.rollout_idle <= 1.0 and 0.0 <= result.trainer_idle <= 1.0 and 0.0 <= result.gpu_idle <= 1.0


def test_admission_makes_the_gate_drop_nothing() -> None:
    for s in (1, 2):
        assert simulate(replace(SMALL, max_staleness=s, seed=3), CAL).groups_dropped_stale == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("gpus,rollout", [(8, 4), (16, 8), (16, 4)])
def test_async_with_free_updates_and_no_bound_is_never_slower_than_sync(seed: int, gpus: int, rollout: int) -> None:
    # Same pools, same prompts (lengths depend on the seed and prompt only), same number of steps:
    # generating ahead can only fill idle time when updates cost nothing and nothing turns stale.
    unbounded = 10**6
    sync = replace(SMALL, gpus=gpus, rollout_gpus=rollout, seed=seed, weight_update_scale=0.0, max_staleness=0)
    free = replace(sync, max_staleness=unbounded)
    sync = replace(sync, steps_measured=free.num_rollout - sync.head_steps - sync.tail_steps)
    assert sync.num_rollout == free.num_rollout
    a, s = simulate(free, CAL), simulate(sync, CAL)
    assert a.total_s <= s.total_s


def test_the_same_seed_gives_the_same_run_and_prompts_keep_their_lengths() -> None:
    a, b = simulate(replace(SMALL, max_staleness=1), CAL), simulate(replace(SMALL, max_staleness=1), CAL)
    assert a.step_times == b.step_times and a.staleness_mean_per_step == b.staleness_mean_per_step
    short, long = response_lengths(SMALL, 100), response_lengths(SMALL, 3000)
    assert np.array_equal(short, long[:100])
    assert long.max() <= SMALL.max_response_len and long.min() >= 1


def test_impossible_layouts_are_refused() -> None:
    with pytest.raises(ValueError, match="trainer GPUs"):
        Simulation(replace(SMALL, rollout_gpus=8))
    with pytest.raises(ValueError, match="max_staleness must be 0"):
        Simulation(replace(SMALL, colocate=True, rollout_gpus=None, max_staleness=1))
    with pytest.raises(ValueError, match="multiple of the engine size"):
        Simulation(replace(SMALL, gpus=16, rollout_gpus=6))
    assert rollout_splits(8, 4, [0.25, 0.5, 0.75], 4) == [4]
    assert rollout_splits(64, 4, [0.25, 0.5, 0.75], 4) == [16, 32, 48]


def test_quick_mode_ends_with_one_json_object_with_the_reported_keys() -> None:
    out = subprocess.run(
        [sys.executable, str(REPO / "bench" / "cluster_sim.py"), "--quick", "--json"],
        capture_output=True, text=True, check=True, cwd=REPO,
    )  # fmt: skip
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"calibration", "assumptions", "rows", "comparison", "runs"} <= report.keys()
    for row in report["rows"]:
        assert {"gpus", "sync_colocated_s", "sync_split_s", "async1_s", "async2_s", "async_gain",
                "async1_staleness_max", "async2_gpu_idle"} <= row.keys()  # fmt: skip
        assert row["async1_staleness_max"] <= 1 and row["async2_staleness_max"] <= 2
    assert all(r["groups_lost"] == 0 for r in report["runs"])
