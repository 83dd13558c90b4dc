"""bench/length_bias.py: the simulation's accounting, per-token versions and statistics (small runs)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from vime.protocol.messages import Group, GroupsGenerated
from vime.workers.rollout import to_sample

from conftest import load_bench

lb = load_bench("length_bias")

SMALL = lb.SimConfig(steps=25, batch=8, n_samples=4, workers=2, concurrency=6, num_prompts=2000)


def test_length_stats_on_a_hand_made_case() -> None:
    stats = lb.length_stats([40, 10, 8192, 30, 20], max_len=8192)
    assert stats.n == 5
    assert stats.mean == pytest.approx((10 + 20 + 30 + 40 + 8192) / 5)
    assert stats.p50 == 30
    # linear interpolation between the 4th (40) and 5th (8192) sorted values at ranks 3.6 and 3.96
    assert stats.p90 == pytest.approx(40 + 0.6 * 8152)
    assert stats.p99 == pytest.approx(40 + 0.96 * 8152)
    assert stats.frac_at_max == pytest.approx(0.2)
    assert lb.length_stats([], max_len=10).n == 0


def test_partial_rollout_tokens_carry_the_version_that_produced_them() -> None:
    group = Group(group_id="g", prompt_index=0, epoch=0, prompt_tokens=np.array([1], dtype=np.int32), prompt_text="", n_samples=3)
    gen = lb.Generation(group, np.array([3, 8, 10]), spans=[(0, 3), (5, 4), (7, 6)], max_len=10)
    group.samples = [to_sample(i, s) for i, s in enumerate(gen.samples())]
    GroupsGenerated(groups=[group]).validate()  # what the broker's server checks
    assert group.samples[0].token_versions.tolist() == [3, 3, 3]
    assert group.samples[1].token_versions.tolist() == [3, 3, 3, 3, 3, 4, 4, 6]
    assert group.samples[2].token_versions.tolist() == [3] * 5 + [4, 4] + [6] * 3
    assert [s.finish_reason for s in group.samples] == ["stop", "stop", "length"]
    assert group.oldest_version == 3  # what the staleness gate uses


@pytest.mark.parametrize("partial", [True, False])
def test_every_generated_group_is_trained_or_dropped(partial: bool) -> None:
    sim = lb.Simulation(replace(SMALL, partial_rollout=partial, max_staleness=1)).run()
    lb.check_accounting(sim)
    rec = sim.records
    assert len(rec.trained) == SMALL.steps * SMALL.batch
    assert set(rec.generated) == set(rec.trained) | set(rec.dropped)
    assert sim.state.counters["groups_dropped_stale"] == len(rec.dropped)
    assert max(rec.group_staleness) <= 1, "the gate holds"
    # per-token versions: only partial rollouts mix versions inside one sample
    assert (rec.multi_version_samples > 0) == partial
    # the trained lengths are exactly the generated lengths minus the dropped groups
    gen = sorted(np.concatenate(list(rec.generated.values())).tolist())
    kept = sorted(np.concatenate(list(rec.trained.values()) + list(rec.dropped.values())).tolist())
    assert gen == kept


def test_check_accounting_catches_a_lost_group() -> None:
    sim = lb.Simulation(replace(SMALL, max_staleness=0)).run()
    lost = next(iter(sim.records.trained))
    del sim.records.trained[lost]
    with pytest.raises(AssertionError, match="generated"):
        lb.check_accounting(sim)


@pytest.mark.parametrize("partial", [True, False])
def test_real_broker_drops_no_long_group_where_the_eager_rule_did(partial: bool) -> None:
    """Regression test for the length bias (docs/length-bias.md): heavy-tailed lengths (the default
    log-sd 0.6 + 0.6, up to 8192 tokens) and max_staleness 1. vime's broker must train every generated
    group; the broker's batch rule from before the fix (the bench's EagerFillState) dropped long ones."""
    cfg = replace(SMALL, partial_rollout=partial, max_staleness=1)
    assert cfg.prompt_sigma >= 0.6 and cfg.sample_sigma >= 0.6  # a heavy tail
    broker_sim = lb.Simulation(cfg).run()
    assert type(broker_sim.state) is lb.BrokerState  # production code, not a bench subclass
    lb.check_accounting(broker_sim)
    assert broker_sim.state.counters["groups_dropped_stale"] == 0
    assert not broker_sim.records.dropped
    assert set(broker_sim.records.trained) == set(broker_sim.records.generated)
    assert max(broker_sim.records.group_staleness) <= 1, "the gate still holds"

    broker, eager = lb.run_settings([cfg, replace(cfg, fill="eager")], seeds=[0], jobs=1)
    assert broker.groups_dropped_stale == 0
    assert broker.trained.mean == pytest.approx(broker.generated.mean, rel=1e-12)
    assert broker.trained == broker.generated  # same samples, same statistics
    # the eager rule: groups dropped as stale, and they are the long ones
    assert eager.groups_dropped_stale > 0
    assert eager.dropped.mean > 1.5 * eager.generated.mean
    assert eager.dropped_fraction_longest10 > 0.2 > eager.dropped_fraction_shortest50
    assert eager.trained_over_generated_mean < 0.95


def test_synchronous_training_has_no_staleness() -> None:
    [sync] = lb.run_settings([replace(SMALL, max_staleness=0)], seeds=[0], jobs=1)
    assert sync.groups_dropped_stale == 0 and sync.trained == sync.generated
    assert sync.staleness_mean == 0.0


def test_main_prints_json(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    # main() quiets the logs of its own process through the environment; undone after the test, so the
    # servers later tests start in this worker still announce their ports in info lines.
    monkeypatch.setenv("VIME_LOG_LEVEL", "WARNING")
    args = ["--json", "--seeds", "1", "--jobs", "1", "--partial", "on", "--staleness", "1", "--eager-fill", "",
            "--steps", "10", "--batch", "4", "--n-samples", "2", "--workers", "1", "--num-prompts", "500"]  # fmt: skip
    assert lb.main(args) == 0
    out = json.loads(capsys.readouterr().out)
    [result] = out["results"]
    assert result["partial_rollout"] is True and result["max_staleness"] == "1"
    assert result["groups_generated"] == 10 * 4 + result["groups_dropped_stale"]
