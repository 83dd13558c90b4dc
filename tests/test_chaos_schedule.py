"""bench/chaos.py's fault schedule is counted in training steps: the same seed injects the same faults
at the same steps into a job that trains a step in 0.2 s and one that takes 5 s (a
schedule in seconds let a fast job finish before its later faults fired)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import load_bench

chaos = load_bench("chaos")


class RecordingChaos(chaos.Chaos):
    """Fires nothing: records the step of each fault, and holds the schedule after a broker or trainer
    kill as the real harness does."""

    def __init__(self, args) -> None:  # type: ignore[no-untyped-def]
        super().__init__(args)
        self.fired: list[tuple[str, int]] = []

    def _fire(self, fault, now: float, steps: int) -> bool:  # type: ignore[no-untyped-def]
        self.fired.append((fault.kind, steps))
        fault.fired_at_s, fault.steps_at_fire = now, steps
        if fault.kind not in chaos.WORKER_KINDS:
            self._quiet_after(steps)
        return True


def simulate(tmp_path: Path, step_s: float, seed: int) -> tuple[list[tuple[str, int]], list]:
    """A job that trains one step every `step_s` seconds of simulated time, polled as the harness does."""
    args = chaos.parse_args(["--preset", "ci", "--seed", str(seed), "--run-dir", str(tmp_path / f"run-{step_s}")])
    harness = RecordingChaos(args)
    faults = chaos.plan_faults(args, harness.rng)
    pending = list(faults)
    now = 0.0
    while (steps := int(now / step_s)) < args.num_rollout:
        harness.step_clock.observe(steps, now)
        harness._fire_due(pending, now, steps)
        now += chaos.POLL_S
    return harness.fired, faults


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_same_faults_fire_at_their_steps_however_fast_the_job_trains(tmp_path: Path, seed: int) -> None:
    settle = chaos.parse_args(["--preset", "ci"]).settle_steps
    runs = {step_s: simulate(tmp_path, step_s, seed) for step_s in (0.2, 1.0, 5.0)}
    for step_s, (fired, faults) in runs.items():
        assert len(fired) == len(faults), f"only {len(fired)} of {len(faults)} faults fired at {step_s} s per step: {fired}"
        assert [kind for kind, _ in fired] == [f.kind for f in faults]
        # Each fires at a random moment within its step, or within the step the schedule was held to
        # after a broker or trainer kill; seen a poll late, that moment can fall just past the step.
        held_to = 0
        for (kind, step), fault in zip(fired, faults):
            due = max(fault.at_step, held_to)
            assert due <= step <= due + 1, (step_s, kind, step, due, fired)
            if kind not in chaos.WORKER_KINDS:
                held_to = step + settle


def test_nothing_fires_until_the_steps_after_a_broker_or_trainer_kill_are_trained(tmp_path: Path) -> None:
    fired, _ = simulate(tmp_path, 0.5, 0)
    settle = chaos.parse_args(["--preset", "ci"]).settle_steps
    holds = [(i, step) for i, (kind, step) in enumerate(fired) if kind not in chaos.WORKER_KINDS]
    assert holds, fired
    for i, hold_step in holds:
        assert all(step >= hold_step + settle for _, step in fired[i + 1 :]), fired


def test_the_step_clock_ignores_a_stall() -> None:
    clock = chaos.StepClock(window=8)
    t = 0.0
    for steps in range(1, 10):
        t += 0.3 if steps != 5 else 30.0  # one step stalled by a restart
        clock.observe(steps, t)
    assert clock.step_s() == pytest.approx(0.3)
    assert chaos.StepClock(initial_s=1.0).step_s() == 1.0
