"""Does the demo model's supervised warm start reach its target for every seed on this processor?

Builds the CPU demo's policy (`vime.demo.model_factory.make_demo_model`) once per seed, from scratch,
in parallel worker processes with one torch thread each (what `make demo` uses), and reports per seed
the steps the warm start ran (over all its attempts), whether it met its stop criterion, the sampled (temperature 1) and greedy
accuracy of the saved bf16 weights, and the seconds it took. Floating-point order differs between
processors (AVX2, AVX-512, AMX kernels), which changes each seed's trajectory, so run it on each new
kind of machine; results and their commands: docs/benchmarks.md.

    .venv/bin/python bench/warm_start.py --seeds 0-4                # the default recipe, 2 at a time
    .venv/bin/python bench/warm_start.py --seeds 0-15 --jobs 16 --json
    .venv/bin/python bench/warm_start.py --seeds 0-3 --recipe '{"batch_size": 128}'

The last line of `--json` output is one JSON object: the processor, the recipe overrides, one row per
seed and a summary (`all_reached`, steps min/median/max).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def processor() -> dict[str, Any]:
    """Model name and the vector-instruction families that change torch's CPU kernels."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    families = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return {"model": name, "isa": families, "cores": os.cpu_count()}


def parse_seeds(text: str) -> list[int]:
    """`0-4` or `0,3,7` or a mix: `0-2,9`."""
    seeds: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        seeds.extend(range(int(low), int(high) + 1) if high else [int(low)])
    return seeds


def build_one(seed: int, overrides: dict[str, Any], out_root: str) -> dict[str, Any]:
    os.environ.setdefault("VIME_LOG_LEVEL", "WARNING")
    from vime.demo.model_factory import DemoModelError, make_demo_model, read_meta

    started = time.perf_counter()
    out = Path(out_root) / f"seed{seed}"
    try:
        make_demo_model(out, seed=seed, force=True, **overrides)
        error = None
    except DemoModelError as exc:
        error = str(exc)
    meta = read_meta(out) if error is None else json.loads((out / "vime_demo_failed.json").read_text())
    training = meta["training"]
    return {
        "seed": seed,
        "reached": error is None,
        "steps": training["total_steps"],
        "attempts": training["attempt"] + 1,
        "final_loss": round(training["final_loss"], 4),
        "sampled_accuracy": meta["sampled_accuracy"],
        "greedy_accuracy": meta["greedy_accuracy"],
        "seconds": round(time.perf_counter() - started, 1),
        "checks": training["accuracy_checks"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="0-4", help="e.g. 0-4 or 0,3,7 (default 0-4)")
    parser.add_argument("--jobs", type=int, default=2, help="seeds built at once, one torch thread each")
    parser.add_argument("--recipe", default="{}", help="DemoRecipe overrides as a JSON object")
    parser.add_argument("--json", action="store_true", help="end with one JSON object on stdout")
    args = parser.parse_args(argv)
    overrides = json.loads(args.recipe)
    seeds = parse_seeds(args.seeds)
    cpu = processor()
    print(f"processor: {cpu['model']} ({', '.join(cpu['isa'])}; {cpu['cores']} cores); recipe overrides {overrides}")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="vime-warm-start-") as root:
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            futures = [pool.submit(build_one, seed, overrides, root) for seed in seeds]
            rows = []
            for future in futures:
                row = future.result()
                rows.append(row)
                print(
                    f"seed {row['seed']:>3}: {'reached' if row['reached'] else 'MISSED '} the target in "
                    f"{row['steps']:>5} steps ({row['attempts']} attempt{'s' if row['attempts'] > 1 else ' '}), sampled accuracy {row['sampled_accuracy']:.3f}, greedy "
                    f"{row['greedy_accuracy']:.3f}, loss {row['final_loss']:.3f}, {row['seconds']:.0f} s",
                    flush=True,
                )
    steps = [r["steps"] for r in rows]
    summary = {
        "all_reached": all(r["reached"] for r in rows),
        "reached": sum(r["reached"] for r in rows),
        "seeds": len(rows),
        "steps_min": min(steps),
        "steps_median": statistics.median(steps),
        "steps_max": max(steps),
        "sampled_accuracy_min": min(r["sampled_accuracy"] for r in rows),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    print(
        f"{summary['reached']}/{summary['seeds']} seeds reached the target; steps {summary['steps_min']}-"
        f"{summary['steps_max']} (median {summary['steps_median']}); lowest sampled accuracy "
        f"{summary['sampled_accuracy_min']:.3f}; {summary['wall_s']:.0f} s"
    )
    if args.json:
        print(json.dumps({"processor": cpu, "recipe": overrides, "rows": rows, "summary": summary}))
    return 0 if summary["all_reached"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
