"""How long an in-flight weight update stops generation inside a rollout engine.

Starts a rollout engine (vLLM by default, `--engine hf` for the transformers one) on a tiny random
Qwen3 with a `WeightPublisher` next to it, and times `update_weights` while requests are generating
(2 requests x n=4, `ignore_eos`, each update issued once all 8 sequences have sampled a token):

- `first`: the first update after `start()`, during the first generations. Before the engine warm-up
  existed this pause waited ~2 s for vLLM to compile a sampler op on the first logprob step;
- `steady`: `--repeats` more updates, each on fresh requests; medians and maxima.

Reported per update (see `WeightUpdateResult`): `pause_s` (stopping the scheduler), `paused_s` (the
whole window with no tokens produced), `total_s` (fetch included; the fetch overlaps generation).
Goals (the thresholds the rollout tests used to assert; timing goals live here, not in tests):
first `pause_s` < 0.5 s and first `paused_s` < 1.0 s, steady `paused_s` max < 1.0 s. `goals_met` says
whether this run met them; the exit code is 0 either way unless `--check` is given.

    .venv/bin/python bench/inflight_update.py                 # vLLM, human readable
    .venv/bin/python bench/inflight_update.py --json --repeats 10
    .venv/bin/python bench/inflight_update.py --engine hf --check
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("VIME_LOG_LEVEL", "WARNING")  # per-update info lines would drown the report
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM logs to stdout, where --json prints

PROMPT = [5, 6, 7, 8, 9]
GOALS = {"first_pause_s": 0.5, "first_paused_s": 1.0, "steady_paused_s_max": 1.0}


def new_weights(model_dir: Path, seed: int) -> list[tuple[str, Any]]:
    """A random state dict with the checkpoint's names and shapes, in bf16 (what a trainer publishes)."""
    import torch
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(seed)
    return [(name, (0.05 * torch.randn(t.shape, generator=g)).to(torch.bfloat16))
            for name, t in load_file(str(model_dir / "model.safetensors")).items()]  # fmt: skip


async def timed_update(engine: Any, publisher: Any, model_dir: Path, version: int, max_tokens: int) -> dict[str, float]:
    """One update while 8 sequences generate; returns its timings once the requests finished."""
    from vime.rollout import SamplingConfig

    start = engine.progress
    cfg = SamplingConfig(max_tokens=max_tokens, ignore_eos=True)
    tasks = [asyncio.create_task(engine.generate(PROMPT, n=4, sampling=cfg)) for _ in range(2)]
    deadline = time.monotonic() + 120
    while engine.progress.sequences - start.sequences < 8:  # running, not merely queued
        if time.monotonic() > deadline:
            raise RuntimeError("generation did not start within 120 s")
        await asyncio.sleep(0.001)
    publisher.publish(version, new_weights(model_dir, seed=version))
    result = await engine.update_weights(version)
    groups = await asyncio.gather(*tasks)
    in_flight = sum(len(set(s.token_versions.tolist())) > 1 for g in groups for s in g)
    return {"pause_s": result.pause_s, "paused_s": result.paused_s, "total_s": result.total_s,
            "fetch_s": result.fetch_s, "sequences_spanning_the_update": in_flight}  # fmt: skip


async def run(engine_kind: str, repeats: int, max_tokens: int) -> dict[str, Any]:
    from vime.demo.model_factory import make_tiny_qwen3
    from vime.rollout import build_engine
    from vime.weights import WeightPublisher

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    with tempfile.TemporaryDirectory(prefix="vime-bench-update-") as tmp:
        model_dir = Path(make_tiny_qwen3(Path(tmp) / "m", seed=0, max_position_embeddings=2048))
        args = {"dtype": "bfloat16", "max-model-len": 2048} if engine_kind == "vllm" else {"dtype": "float32"}
        with WeightPublisher(bind="tcp://127.0.0.1:*") as publisher:
            kind: Any = engine_kind
            engine = build_engine(kind, str(model_dir), engine_args=args, weight_endpoint=publisher.endpoint)
            started = time.perf_counter()
            await engine.start()
            start_s = time.perf_counter() - started
            try:
                first = await timed_update(engine, publisher, model_dir, 1, max_tokens)
                steady = [await timed_update(engine, publisher, model_dir, 2 + i, max_tokens) for i in range(repeats)]
            finally:
                await engine.shutdown()
    summary = {
        key: {"median": statistics.median(u[key] for u in steady), "max": max(u[key] for u in steady)}
        for key in ("pause_s", "paused_s", "total_s", "fetch_s")
    }
    goals_met = {
        "first_pause_s": first["pause_s"] < GOALS["first_pause_s"],
        "first_paused_s": first["paused_s"] < GOALS["first_paused_s"],
        "steady_paused_s_max": summary["paused_s"]["max"] < GOALS["steady_paused_s_max"],
    }
    return {"engine": engine_kind, "start_s": start_s, "max_tokens": max_tokens, "repeats": repeats,
            "first": first, "steady": summary, "goals": GOALS, "goals_met": goals_met}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=["vllm", "hf"], default="vllm")
    parser.add_argument("--repeats", type=int, default=5, help="steady-state updates after the first")
    parser.add_argument("--max-tokens", type=int, default=400, help="response length of the requests in flight")
    parser.add_argument("--json", action="store_true", help="print one JSON object (the last stdout line: vLLM warns there)")
    parser.add_argument("--check", action="store_true", help="exit 1 when a goal is missed")
    args = parser.parse_args()
    r = asyncio.run(run(args.engine, max(1, args.repeats), args.max_tokens))
    if args.json:
        print(json.dumps(r))
    else:
        f, s = r["first"], r["steady"]
        print(f"{r['engine']} engine, start {r['start_s']:.1f} s; 2 requests x n=4 x {r['max_tokens']} tokens in flight")
        print(f"  first update:  pause {f['pause_s']:.4f} s  paused {f['paused_s']:.4f} s  total {f['total_s']:.4f} s")
        print(f"  steady ({r['repeats']}x):   pause {s['pause_s']['median']:.4f} s (max {s['pause_s']['max']:.4f})  "
              f"paused {s['paused_s']['median']:.4f} s (max {s['paused_s']['max']:.4f})  "
              f"total {s['total_s']['median']:.4f} s")  # fmt: skip
        print("  goals: " + ", ".join(f"{k} < {GOALS[k]} s: {'met' if ok else 'MISSED'}" for k, ok in r["goals_met"].items()))
    return 1 if args.check and not all(r["goals_met"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
