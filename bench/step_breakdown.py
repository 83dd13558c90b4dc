"""Step-time breakdown of the CPU demo, fully asynchronous vs synchronous, on the same config.

Runs `vime run configs/demo.yaml` once per mode of `--modes` (default `async,sync`: --max-staleness 2,
then 0; `colocate` is a sync run with `--colocate`, the engine asleep while the trainer steps), then
reads each run's metrics.jsonl and reports, over the steady state (steps after the first, whose wait
includes engine start-up):
- mean step time and its parts as the trainer sees them: waiting for a batch, training, weight sync;
- generation and reward work per step (busy seconds of the rollout / reward workers);
- the fraction of wall time the rollout engine sat idle (no request in flight);
- the weight-update time inside the rollout engine per step;
- reward at the start and end of the run;
- rollout tokens/s (generated tokens per second of wall time, all rollout workers);
- trainer tokens/s per GPU, the model FLOPs per token of the run's `--hf-checkpoint` (vime.bench.flops)
  and MFU against `--peak-tflops` (None without CUDA: a CPU run's MFU against a GPU peak means nothing);
- the weight update's cost inside each engine: fetch, load and paused seconds per update and per GB;
- colocated runs: the engine's turns per step (falling asleep, waking on the new weights).

At a real Qwen3 size on a GPU (vime.demo.model_factory --kind qwen3 makes the checkpoint):

    python bench/step_breakdown.py --num-rollout 40 --json
    python bench/step_breakdown.py --num-rollout 6 --json -- --hf-checkpoint /tmp/qwen3-0.6b \
        --no-make-demo-model --rollout-engine vllm
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from vime.bench.flops import H200_BF16_PEAK_FLOPS, training_flops_per_token  # noqa: E402
from vime.logging import get_logger  # noqa: E402
from vime.metrics import read_metrics, summarize, training_records  # noqa: E402

log = get_logger(__name__)

BYTES_PER_GB = 1e9


def _delta(first: dict[str, Any], last: dict[str, Any], key: str) -> float | None:
    """Growth of a cumulative total over the window; None where the metrics predate the key."""
    if key not in first or key not in last:
        return None
    return float(last[key] - first[key])


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def rollout_throughput(records: list[dict[str, Any]]) -> dict[str, float | None]:
    """Generated tokens per second of wall time over the steady window, summed over rollout workers."""
    first, last = records[0], records[-1]
    window = last["time"] - first["time"]
    return {"rollout_tokens_per_s": _ratio(_delta(first, last, "perf/rollout_tokens_total"), window)}


def trainer_throughput(records: list[dict[str, Any]], trainer_world_size: int) -> dict[str, float | None]:
    """Trainer tokens (prompt + response) per GPU per second of training, and the mean sequence length.

    The per-GPU rate is total tokens over total train time of the steady steps (each step's
    `perf/tokens_per_gpu_per_sec` weighted by its `perf/train_time`), so a short step does not count as
    much as a long one. The mean sequence length is those tokens (times the trainer's ranks, as the
    rate is per GPU) over `rollout/num_samples`; that count includes samples without a reward, which
    the trainer drops, so it may understate a little. Without `rollout/num_samples` it falls back to
    `rollout/response_len`, which leaves the prompt out.
    """
    steady = records[1:]
    if not all("perf/tokens_per_gpu_per_sec" in r and "perf/train_time" in r for r in steady):
        return {"trainer_tokens_per_gpu_per_s": None, "trainer_seq_len_mean": None}
    tokens_per_gpu = sum(r["perf/tokens_per_gpu_per_sec"] * r["perf/train_time"] for r in steady)
    train_s = sum(r["perf/train_time"] for r in steady)
    if all("rollout/num_samples" in r for r in steady):
        seq_len = _ratio(tokens_per_gpu * trainer_world_size, sum(r["rollout/num_samples"] for r in steady))
    elif all("rollout/response_len" in r for r in steady):
        seq_len = float(np.mean([r["rollout/response_len"] for r in steady]))
    else:
        seq_len = None
    return {"trainer_tokens_per_gpu_per_s": _ratio(tokens_per_gpu, train_s), "trainer_seq_len_mean": seq_len}


def model_flops_utilization(
    tokens_per_gpu_per_s: float | None, seq_len: float | None, model_config: dict[str, Any] | None, peak_flops: float | None
) -> dict[str, float | None]:
    """Model FLOPs per token (vime.bench.flops, at the mean sequence length), achieved TFLOP/s per GPU,
    and MFU = achieved / peak_flops. MFU is None without a peak (no CUDA), the rest None without the
    model config or the throughput."""
    if model_config is None or seq_len is None:
        return {"model_flops_per_token": None, "trainer_tflops_per_gpu": None, "mfu": None}
    flops_per_token = training_flops_per_token(model_config, seq_len)
    achieved = None if tokens_per_gpu_per_s is None else tokens_per_gpu_per_s * flops_per_token
    return {
        "model_flops_per_token": flops_per_token,
        "trainer_tflops_per_gpu": None if achieved is None else achieved / 1e12,
        "mfu": _ratio(achieved, peak_flops),
    }


def engine_weight_update_cost(records: list[dict[str, Any]], num_rollout_workers: int) -> dict[str, float | None]:
    """The weight update's parts inside the rollout engines over the window: fetching the tensors,
    loading them into the engine, and generation paused for it. Per update and per engine, and per GB
    of update bytes (the totals are summed over engines).

    The engines count the updates they applied (`perf/rollout_updates_total`): an engine that finds two
    versions waiting loads only the newer, so in an asynchronous run it applies fewer updates than the
    trainer published. Metrics from before that counter estimate it from the publishes: a record's
    totals were read when its step's batch was handed out, before the step trained and published, so
    the updates inside the window are those published by the steps before the last, each applied by
    every engine. `weight_updates` stays the trainer's publishes inside the window.
    """
    first, last = records[0], records[-1]
    updates = sum(1 for r in records[:-1] if r.get("perf/weight_sync_time", 0.0) > 0)
    update_bytes = _delta(first, last, "perf/rollout_update_bytes_total")
    gigabytes = None if update_bytes is None else update_bytes / BYTES_PER_GB
    engine_updates = _delta(first, last, "perf/rollout_updates_total")
    if engine_updates is None:
        engine_updates = float(updates * num_rollout_workers)
    out: dict[str, float | None] = {
        "weight_updates": updates,
        "engine_updates": engine_updates,
        "engine_update_gb_per_update": _ratio(gigabytes, engine_updates),
    }
    for part in ("fetch", "load", "paused"):
        seconds = _delta(first, last, f"perf/rollout_{part}_s_total")
        out[f"engine_update_{part}_s_per_update"] = _ratio(seconds, engine_updates)
        out[f"engine_update_{part}_s_per_gb"] = _ratio(seconds, gigabytes)
    return out


def _steady_mean(records: list[dict[str, Any]], key: str) -> float | None:
    """The mean of `key` over the steady steps (all but the first); None if any of them lacks it."""
    steady = records[1:]
    return float(np.mean([r[key] for r in steady])) if all(key in r for r in steady) else None


def publish_parts(records: list[dict[str, Any]]) -> dict[str, float | None]:
    """The trainer's weight publish by part, mean seconds per steady step: exporting the tensors from
    the model, copying them into the snapshot, checksumming its chunks. None for metrics from before
    the parts were logged."""
    parts = ("export", "copy", "checksum")
    return {f"trainer_weight_{part}_s": _steady_mean(records, f"perf/weight_{part}_time") for part in parts}


def colocate_turns(records: list[dict[str, Any]]) -> dict[str, float | None]:
    """A colocated run's turns, mean seconds per steady step: the engines falling asleep before the
    trainer steps, and waking on the new weights after it (of which the hand-over's fetch and load).
    None for a run without `--colocate`."""
    parts = ("sleep", "wake", "weight_fetch", "weight_load")
    return {f"colocate_{part}_s": _steady_mean(records, f"perf/colocate_{part}_s") for part in parts}


def run_settings(run_dir: Path) -> tuple[dict[str, Any] | None, int, int]:
    """(the policy's HF config.json or None, trainer ranks, rollout workers) from the run's resolved
    config (RUN_DIR/config.yaml, which includes the flags passed after --)."""
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    checkpoint = Path(cfg["hf_checkpoint"])
    if not checkpoint.is_absolute():  # relative to where `vime run` ran
        checkpoint = REPO / checkpoint
    config_json = checkpoint / "config.json"
    model_config = json.loads(config_json.read_text()) if config_json.exists() else None
    if model_config is None:
        log.warning("model_config_missing", path=str(config_json), effect="no FLOPs or MFU")
    return model_config, int(cfg.get("trainer_world_size", 1)), int(cfg.get("num_rollout_workers", 1))


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


def mode_flags(mode: str, async_staleness: int) -> tuple[int, list[str]]:
    """A mode's (max staleness, extra `vime run` flags)."""
    if mode == "async":
        return async_staleness, []
    if mode == "sync":
        return 0, []
    if mode == "colocate":  # the engine sleeps while the trainer steps: nothing to overlap
        return 0, ["--colocate"]
    raise ValueError(f"unknown mode {mode!r}: async, sync or colocate")


def run(label: str, args: argparse.Namespace) -> dict[str, Any]:
    staleness, flags = mode_flags(label, args.async_staleness)
    run_dir = Path(args.out) / label
    argv = [
        sys.executable, "-m", "vime.cli", "run", args.config, "--run-dir", str(run_dir),
        "--max-staleness", str(staleness), "--num-rollout", str(args.num_rollout), "--no-progress",
        "--broker-address", f"tcp://127.0.0.1:{args.port}", *flags, *args.extra,
    ]  # fmt: skip
    result = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{label} run failed ({result.returncode}):\n{result.stderr[-3000:]}")
    figures = report(run_dir, staleness, args.peak_flops)
    if not args.keep_checkpoints:
        # A run's final resumable checkpoint (weights + AdamW state: 12 bytes per parameter and up) is
        # not part of the report; at 4B two of them fill a 64 GB disk before the second run ends.
        saved_to = yaml.safe_load((run_dir / "config.yaml").read_text()).get("save") or run_dir / "checkpoints"
        shutil.rmtree(saved_to, ignore_errors=True)
    return figures


def report(run_dir: Path, staleness: int, peak_flops: float | None) -> dict[str, Any]:
    """One finished run's figures, from RUN_DIR/metrics.jsonl and RUN_DIR/config.yaml. `peak_flops`
    None (no CUDA) leaves MFU out."""
    all_records = read_metrics(run_dir / "metrics.jsonl")
    records = training_records(all_records)  # eval lines (--eval-interval) carry no step timings
    summary = summarize(all_records)
    model_config, trainer_world_size, num_rollout_workers = run_settings(run_dir)
    trainer = trainer_throughput(records, trainer_world_size)
    try:
        mfu = model_flops_utilization(trainer["trainer_tokens_per_gpu_per_s"], trainer["trainer_seq_len_mean"],
                                      model_config, peak_flops)  # fmt: skip
    except ValueError as exc:  # a config the FLOP formula does not model (mixture of experts)
        log.warning("model_flops_unknown", reason=str(exc))
        mfu = model_flops_utilization(None, None, None, None)
    return {
        "max_staleness": staleness,
        "reward_first5": summary["reward_first5"],
        "reward_last5": summary["reward_last5"],
        **breakdown(records),
        **publish_parts(records),
        **colocate_turns(records),
        **rollout_throughput(records),
        **trainer,
        **mfu,
        "peak_tflops": None if peak_flops is None else peak_flops / 1e12,
        **engine_weight_update_cost(records, num_rollout_workers),
    }


def _show(value: float | None, spec: str, unit: str = "") -> str:
    """A figure for the text report; "n/a" where the metrics lacked it."""
    return "n/a" if value is None else format(value, spec) + unit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--num-rollout", type=int, default=40)
    parser.add_argument("--async-staleness", type=int, default=2)
    parser.add_argument("--modes", default="async,sync", help="comma-separated runs, in order: async, sync, colocate")
    parser.add_argument("--out", default="runs/bench-step-breakdown")
    parser.add_argument("--port", type=int, default=5577)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--keep-checkpoints", action="store_true", help="keep each run's final checkpoint (deleted after its report by default)")
    parser.add_argument("--peak-tflops", type=float, default=H200_BF16_PEAK_FLOPS / 1e12,
                        help="the GPU's peak bf16 TFLOP/s for MFU (default: H200 dense bf16; without CUDA MFU is not reported)")  # fmt: skip
    parser.add_argument("extra", nargs="*", help="more vime run flags (after --)")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    for mode in modes:
        try:
            mode_flags(mode, args.async_staleness)
        except ValueError as exc:
            parser.error(str(exc))
    import torch

    # MFU compares with a GPU's peak; a run without CUDA trained on the CPU, where that ratio means nothing.
    args.peak_flops = args.peak_tflops * 1e12 if torch.cuda.is_available() else None
    results: dict[str, Any] = {mode: run(mode, args) for mode in modes}
    for mode in ("async", "colocate"):
        if mode in results and "sync" in results:
            results[f"{mode}_speedup_steps_per_s"] = results[mode]["steps_per_s"] / results["sync"]["steps_per_s"]
    if args.json:
        print(json.dumps(results, indent=1))
        return
    for label in modes:
        r = results[label]
        print(f"{label:5s} staleness<={r['max_staleness']}: step {r['step_time_s']:.3f}s = wait {r['trainer_wait_for_batch_s']:.3f} + "
              f"train {r['trainer_train_s']:.3f} + publish {r['trainer_weight_publish_s']:.3f}; gen busy {r['generation_busy_s_per_step']:.3f}s/step, "
              f"reward busy {r['reward_busy_s_per_step']:.3f}s/step, engine idle {r['rollout_idle_fraction']:.1%}")
        print(f"      rollout {_show(r['rollout_tokens_per_s'], '.1f')} tok/s; trainer "
              f"{_show(r['trainer_tokens_per_gpu_per_s'], '.1f')} tok/s/GPU at mean seq {_show(r['trainer_seq_len_mean'], '.0f')}, "
              f"{_show(r['trainer_tflops_per_gpu'], '.2f')} TFLOP/s/GPU, MFU {_show(r['mfu'], '.1%')}")
        print(f"      {r['weight_updates']} weight updates, per update per engine {_show(r['engine_update_gb_per_update'], '.3f', ' GB')}: "
              f"fetch {_show(r['engine_update_fetch_s_per_update'], '.3f', 's')}, load {_show(r['engine_update_load_s_per_update'], '.3f', 's')}, "
              f"paused {_show(r['engine_update_paused_s_per_update'], '.3f', 's')}; per GB: fetch {_show(r['engine_update_fetch_s_per_gb'], '.3f', 's')}, "
              f"load {_show(r['engine_update_load_s_per_gb'], '.3f', 's')}, paused {_show(r['engine_update_paused_s_per_gb'], '.3f', 's')}")
        if r["colocate_sleep_s"] is not None:
            print(f"      colocated turns: sleep {r['colocate_sleep_s']:.3f}s, wake {r['colocate_wake_s']:.3f}s "
                  f"(weights fetch {_show(r['colocate_weight_fetch_s'], '.3f', 's')}, load {_show(r['colocate_weight_load_s'], '.3f', 's')})")
    for mode in ("async", "colocate"):
        if f"{mode}_speedup_steps_per_s" in results:
            print(f"{mode}/sync steps per second: {results[f'{mode}_speedup_steps_per_s']:.2f}x")


if __name__ == "__main__":
    main()
