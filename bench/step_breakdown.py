"""Step-time breakdown of the CPU demo, fully asynchronous vs synchronous, on the same config.

Runs `vime run configs/demo.yaml` once per staleness setting (default: --max-staleness 2, then 0),
then reads each run's metrics.jsonl and reports, over the steady state (steps after the first, whose
wait includes engine start-up):
- mean step time and its parts as the trainer sees them: waiting for a batch, training, weight sync;
- generation and reward work per step (busy seconds of the rollout / reward workers);
- the fraction of wall time the rollout engine sat idle (no request in flight);
- the weight-update time inside the rollout engine per step;
- reward at the start and end of the run.

    python bench/step_breakdown.py --num-rollout 40 --json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from vime.metrics import read_metrics, summarize  # noqa: E402


def breakdown(records: list[dict[str, Any]]) -> dict[str, float]:
    steady = records[1:]
    first, last = records[0], records[-1]
    window = last["time"] - first["time"]  # from the end of step 0 to the end of the last step
    rollout_busy = last["perf/rollout_busy_s_total"] - first["perf/rollout_busy_s_total"]
    reward_busy = last["perf/reward_busy_s_total"] - first["perf/reward_busy_s_total"]
    updates = last["perf/rollout_update_s_total"] - first["perf/rollout_update_s_total"]
    n = len(steady)

    def mean(key: str) -> float:
        return float(np.mean([r[key] for r in steady]))

    return {
        "steps_measured": n,
        "window_s": window,
        "step_time_s": mean("perf/step_time"),
        "trainer_wait_for_batch_s": mean("perf/wait_time"),
        "trainer_train_s": mean("perf/train_time"),
        "trainer_weight_publish_s": mean("perf/weight_sync_time"),
        "generation_busy_s_per_step": rollout_busy / n,
        "reward_busy_s_per_step": reward_busy / n,
        "rollout_weight_update_s_per_step": updates / n,
        "rollout_idle_fraction": max(0.0, 1.0 - rollout_busy / window) if window > 0 else float("nan"),
        "staleness_mean": mean("rollout/staleness_mean"),
        "logprob_abs_diff_mean": mean("train/train_rollout_logprob_abs_diff"),
        "steps_per_s": n / window if window > 0 else float("nan"),
    }


def run(label: str, staleness: int, args: argparse.Namespace) -> dict[str, Any]:
    run_dir = Path(args.out) / label
    argv = [
        sys.executable, "-m", "vime.cli", "run", args.config, "--run-dir", str(run_dir),
        "--max-staleness", str(staleness), "--num-rollout", str(args.num_rollout), "--no-progress",
        "--broker-address", f"tcp://127.0.0.1:{args.port}", *args.extra,
    ]  # fmt: skip
    result = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{label} run failed ({result.returncode}):\n{result.stderr[-3000:]}")
    records = read_metrics(run_dir / "metrics.jsonl")
    summary = summarize(records)
    return {
        "max_staleness": staleness,
        "reward_first5": summary["reward_first5"],
        "reward_last5": summary["reward_last5"],
        **breakdown(records),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--num-rollout", type=int, default=40)
    parser.add_argument("--async-staleness", type=int, default=2)
    parser.add_argument("--out", default="runs/bench-step-breakdown")
    parser.add_argument("--port", type=int, default=5577)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("extra", nargs="*", help="more vime run flags (after --)")
    args = parser.parse_args()
    results = {
        "async": run("async", args.async_staleness, args),
        "sync": run("sync", 0, args),
    }
    results["async_speedup_steps_per_s"] = results["async"]["steps_per_s"] / results["sync"]["steps_per_s"]
    if args.json:
        print(json.dumps(results, indent=1))
        return
    for label in ("async", "sync"):
        r = results[label]
        print(f"{label:5s} staleness<={r['max_staleness']}: step {r['step_time_s']:.3f}s = wait {r['trainer_wait_for_batch_s']:.3f} + "
              f"train {r['trainer_train_s']:.3f} + publish {r['trainer_weight_publish_s']:.3f}; gen busy {r['generation_busy_s_per_step']:.3f}s/step, "
              f"reward busy {r['reward_busy_s_per_step']:.3f}s/step, engine idle {r['rollout_idle_fraction']:.1%}")
    print(f"async/sync steps per second: {results['async_speedup_steps_per_s']:.2f}x")


if __name__ == "__main__":
    main()
