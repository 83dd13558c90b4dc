"""Step time of a Qwen3-30B-A3B-like GRPO job from 8 to 512 H200s, async against sync, simulated.

A discrete-event simulation (`vime.bench.cluster_sim`) that drives the real broker logic
(`vime.broker.state.BrokerState`: admission, the staleness gate, earliest-deadline batches) with
simulated rollout engines, reward workers and a trainer. For each GPU count it runs:
- sync, colocated: every GPU hosts an engine (TP `--engine-tp`) and a trainer rank; generation and
  training alternate (max_staleness 0), weights move over CUDA IPC;
- sync, split: separate engine and trainer pools, max_staleness 0;
- async, split: the same pools, max_staleness each of `--staleness`;
split layouts at each rollout fraction of `--fractions` (rounded to whole engines), keeping the best.
It reports the steady-state step time (steps after the pipeline fills, before it drains), the async
gain against the better sync layout, GPU idle fractions and the staleness each bound gives.

Assumptions (the module docstring of `vime.bench.cluster_sim` has the calibration and its sources):
decode step time fitted on vLLM 0.26 alone on one H200 (0.6B/1.7B/4B, residuals within 6 %) and applied
to the 30B-A3B shape with TP 4 at 0.8 efficiency; trainer at `--train-mfu` model-FLOPs MFU (default
0.15, assumed: the MoE trainer was not measured), losing 5 % per doubling of trainer GPUs beyond 8;
weight updates per GB as measured (ZeroMQ chunks split, CUDA IPC colocated); responses lognormal
(per-prompt median around `--response-median`, spread 0.5 + 0.5 in log space), capped at
`--max-response-len`; 512-token prompts; 32 prompts x 8 samples per step (`--scaling weak`: 32 prompts
per 8 GPUs). Deterministic given `--seed`.

    python bench/cluster_sim.py --json                        # 8..512 GPUs, seed batch (about 30 s)
    python bench/cluster_sim.py --scaling weak --gpus 8,16,32,64,128 --json
    python bench/cluster_sim.py --quick --json                # 8 and 32 GPUs, a few steps (seconds)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from vime.bench import cluster_sim as cs  # noqa: E402

SEED_S_PER_STEP = 252.0  # the seed documents: Qwen3-30B-A3B GRPO on 8 H200 (from the issue)
AREAL_ASYNC_GAIN = 2.77  # ../shared/reference/peers.md


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def _fmt(x: Any, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def print_tables(rows: list[dict[str, Any]], staleness: list[int]) -> None:
    head = f"{'GPUs':>5} {'batch':>6} {'sync coloc':>10} {'sync split':>14}"
    head += "".join(f" {'async s=' + str(s):>14}" for s in staleness) + f" {'gain':>6}"
    print("step time, s (split layouts: rollout GPUs in brackets); gain = better sync / best async")
    print(head)
    for r in rows:
        line = f"{r['gpus']:>5} {r['rollout_batch_size']:>6} {_fmt(r['sync_colocated_s']):>10}"
        line += f" {_fmt(r['sync_split_s']) + ' [' + str(r['sync_split_rollout_gpus']) + ']':>14}"
        for s in staleness:
            line += f" {_fmt(r.get(f'async{s}_s')) + ' [' + str(r.get(f'async{s}_rollout_gpus')) + ']':>14}"
        line += f" {_fmt(r.get('async_gain'), 2):>6}"
        print(line)
    print()
    print("idle fractions (rollout / trainer / all GPUs), staleness (mean / max) and sequences per engine while generating")
    head = f"{'GPUs':>5} {'coloc idle':>10} {'seqs':>5}" + "".join(
        f" {'s=' + str(s) + ' idle':>15} {'stale':>8} {'seqs':>5}" for s in staleness)
    print(head)
    for r in rows:
        line = f"{r['gpus']:>5} {_fmt(r['sync_colocated_gpu_idle'], 2):>10} {_fmt(r['sync_colocated_engine_sequences'], 0):>5}"
        for s in staleness:
            idle = "/".join(_fmt(r.get(f"async{s}_{k}_idle"), 2) for k in ("rollout", "trainer", "gpu"))
            stale = f"{_fmt(r.get(f'async{s}_staleness_mean'), 2)}/{_fmt(r.get(f'async{s}_staleness_max'), 0)}"
            line += f" {idle:>15} {stale:>8} {_fmt(r.get(f'async{s}_engine_sequences'), 0):>5}"
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpus", type=_ints, default=None, help="GPU counts (default 8,16,32,64,128,256,512)")
    parser.add_argument("--staleness", type=_ints, default=None, help="async bounds (default 1,2,4)")
    parser.add_argument("--fractions", type=_floats, default=[0.25, 0.5, 0.75], help="rollout share of the GPUs to try")
    parser.add_argument("--scaling", choices=["fixed", "weak"], default="fixed",
                        help="fixed: the seed's 32 prompts per step at every size; weak: 32 prompts per 8 GPUs")
    parser.add_argument("--max-response-len", type=int, default=8192)
    parser.add_argument("--response-median", type=float, default=3000.0)
    parser.add_argument("--engine-tp", type=int, default=4)
    parser.add_argument("--train-mfu", type=float, default=0.15)
    parser.add_argument("--weight-update-scale", type=float, default=1.0, help="0: free weight updates")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per run (default 8; quick 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="8 and 32 GPUs, bounds 1 and 2, 3 measured steps")
    parser.add_argument("--json", action="store_true", help="end with one JSON object")
    args = parser.parse_args()
    gpus = args.gpus or ([8, 32] if args.quick else [8, 16, 32, 64, 128, 256, 512])
    staleness = args.staleness or ([1, 2] if args.quick else [1, 2, 4])
    steps = args.steps or (3 if args.quick else 8)
    calibration = cs.calibrate_decode()
    costs = cs.EngineCosts(cs.shape("30b-a3b"), args.engine_tp, calibration)
    print(f"decode step = {calibration.overhead_s * 1e3:.2f} ms + {calibration.roofline_scale:.3f} x roofline "
          f"(residuals {', '.join(f'{k} {v:+.1%}' for k, v in calibration.residuals.items())})")  # fmt: skip
    engine_tps = {b: costs.tokens_per_s(b, 512 + args.response_median) for b in (8, 64, 256, 512)}
    print("30B-A3B engine (TP %d) tokens/s at %s sequences" % (args.engine_tp, ", ".join(f"{b}: {v:,.0f}" for b, v in engine_tps.items())))
    rows, runs = [], []
    started = time.monotonic()
    for n in gpus:
        batch = 32 * max(1, n // 8) if args.scaling == "weak" else 32
        base = cs.SimConfig(
            gpus=n, rollout_batch_size=batch, max_response_len=args.max_response_len, response_median=args.response_median,
            engine_tp=args.engine_tp, train_mfu=args.train_mfu, weight_update_scale=args.weight_update_scale,
            steps_measured=steps, seed=args.seed,
        )  # fmt: skip
        out = cs.compare(base, n, staleness, args.fractions, calibration)
        rows.append(out["row"])
        runs.extend(out["runs"])
        print(f"  {n} GPUs done ({time.monotonic() - started:.0f} s)", file=sys.stderr)
    print()
    print_tables(rows, staleness)
    at8 = next((r for r in rows if r["gpus"] == 8), None)
    comparison = {
        "seed_s_per_step_8_h200": SEED_S_PER_STEP,
        "sim_sync_colocated_s_per_step_8": at8["sync_colocated_s"] if at8 else None,
        "areal_async_gain": AREAL_ASYNC_GAIN,
        "sim_max_async_gain": max((r.get("async_gain") or 0.0) for r in rows),
    }
    print()
    print(f"seeds: {SEED_S_PER_STEP:.0f} s/step on 8 H200; simulated sync colocated at 8: {_fmt(comparison['sim_sync_colocated_s_per_step_8'])} s")
    print(f"AReaL: {AREAL_ASYNC_GAIN}x async gain; simulated best: {comparison['sim_max_async_gain']:.2f}x")
    if args.json:
        assumptions = {
            "hardware": asdict(cs.H200), "tp_efficiency": cs.TP_EFFICIENCY, "prefill_mfu": cs.PREFILL_MFU,
            "publish_chunks_s_per_gb": cs.PUBLISH_CHUNKS_S_PER_GB, "fetch_chunks_s_per_gb": cs.FETCH_CHUNKS_S_PER_GB,
            "load_paused_s_per_gb": cs.LOAD_PAUSED_S_PER_GB, "publish_ipc_s_per_gb": cs.PUBLISH_IPC_S_PER_GB,
            "wake_load_ipc_s_per_gb": cs.WAKE_LOAD_IPC_S_PER_GB, "model_weight_bytes": cs.shape("30b-a3b").weight_bytes,
            "scaling": args.scaling, "base_config": asdict(cs.SimConfig(
                max_response_len=args.max_response_len, response_median=args.response_median, engine_tp=args.engine_tp,
                train_mfu=args.train_mfu, weight_update_scale=args.weight_update_scale, steps_measured=steps, seed=args.seed)),
        }  # fmt: skip
        print(json.dumps({
            "calibration": asdict(calibration), "engine_tokens_per_s": {str(k): v for k, v in engine_tps.items()},
            "assumptions": assumptions, "rows": rows, "comparison": comparison,
            "runs": [{k: v for k, v in r.items() if k != "counters"} for r in runs],
        }))  # fmt: skip


if __name__ == "__main__":
    main()
