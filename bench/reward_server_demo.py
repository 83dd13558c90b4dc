"""The CPU demo scored by a standard-library reward server (bench/stdlib_reward_server.py) against the
in-process reward, and the same with the server down for a while in the middle of the run.

Three `vime run configs/demo.yaml` runs with default flags, one after another:
- `inproc`: `--rm-type arithmetic` (the reward in the reward worker's process);
- `server`: `--rm-type remote_rm` against the server, up throughout;
- `outage`: the same, with the server killed once the trainer has finished `--outage-at` steps and
  started again `--outage-s` seconds later.
For each: the median and mean step time after step 0, the longest step, reward first 5 -> last 5,
and from the run's own files the data audit: groups and samples failed, groups dropped as stale, and
whether every trained group id is distinct (`trained_groups.jsonl`).

    python bench/reward_server_demo.py --num-rollout 20 --outage-s 60 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.stdlib_reward_server import StdlibServer  # noqa: E402
from vime.metrics import read_metrics, summarize, training_records  # noqa: E402


def steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(training_records(read_metrics(path))) if path.exists() else 0


def run_demo(run_dir: Path, args: argparse.Namespace, *extra: str, outage: bool = False) -> dict[str, Any]:
    argv = [sys.executable, "-m", "vime.cli", "run", "configs/demo.yaml", "--run-dir", str(run_dir), "--num-rollout",
            str(args.num_rollout), "--no-progress", *extra]  # fmt: skip
    server = StdlibServer(args.port) if extra else None
    job = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    down = None
    try:
        while outage and job.poll() is None and down is None:
            if steps_done(run_dir) >= args.outage_at:
                assert server is not None
                server.stop()
                down = time.monotonic()
                time.sleep(args.outage_s)
                server = StdlibServer(args.port)
            time.sleep(0.2)
        _, stderr = job.communicate(timeout=args.timeout)
    finally:
        if job.poll() is None:
            job.kill()
        if server is not None:
            server.stop()
    if job.returncode != 0:
        raise SystemExit(f"{run_dir.name}: vime run exited {job.returncode}:\n{stderr[-3000:]}")
    return audit(run_dir, outage_s=args.outage_s if down is not None else None, console=stderr)


def audit(run_dir: Path, outage_s: float | None, console: str) -> dict[str, Any]:
    records = training_records(read_metrics(run_dir / "metrics.jsonl"))
    steps = [r["perf/step_time"] for r in records[1:]]
    summary = summarize(records)
    counters = json.loads((run_dir / "status.json").read_text())["counters"]
    trained = [g for line in (run_dir / "trained_groups.jsonl").read_text().splitlines() for g in json.loads(line)["group_ids"]]
    return {
        "steps": len(records),
        "step_time_median_s": statistics.median(steps),
        "step_time_mean_s": statistics.fmean(steps),
        "step_time_max_s": max(steps),
        "reward_first5": summary["reward_first5"],
        "reward_last5": summary["reward_last5"],
        "outage_s": outage_s,
        "groups_failed": counters.get("groups_failed"),
        "samples_failed": counters.get("samples_failed"),
        "groups_dropped_stale": counters.get("groups_dropped_stale"),
        "groups_trained": len(trained),
        "groups_trained_distinct": len(set(trained)),
        "console_unavailable_lines": console.count("reward_server_unavailable"),
        "console_back_lines": console.count("reward_server_back"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-rollout", type=int, default=20)
    parser.add_argument("--outage-at", type=int, default=5, help="kill the server once this many steps are done")
    parser.add_argument("--outage-s", type=float, default=60.0)
    parser.add_argument("--port", type=int, default=18777)
    parser.add_argument("--out", default="runs/bench-reward-server-demo")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take")
    parser.add_argument("--only", nargs="*", choices=("inproc", "server", "outage"), default=["inproc", "server", "outage"])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("extra", nargs="*", help="more vime run flags for the server runs (after --)")
    args = parser.parse_args()
    out = Path(args.out)
    remote = ("--rm-type", "remote_rm", "--rm-url", f"http://127.0.0.1:{args.port}/slime/arithmetic", *args.extra)
    results: dict[str, Any] = {}
    for name in args.only:
        extra = () if name == "inproc" else remote
        results[name] = run_demo(out / name, args, *extra, outage=name == "outage")
    if "inproc" in results and "server" in results:
        base, srv = results["inproc"], results["server"]
        results["server_vs_inproc_median"] = srv["step_time_median_s"] / base["step_time_median_s"]
        results["server_vs_inproc_mean"] = srv["step_time_mean_s"] / base["step_time_mean_s"]
    print(json.dumps(results, indent=1 if args.json else None))


if __name__ == "__main__":
    main()
