"""Reading a run's metrics.jsonl: summaries for the terminal and a reward-curve plot.

The file holds one line per training step and, with `--eval-interval`, one line per eval run (its
`eval/...` keys, at the step whose weights were evaluated; written when the run finishes, so it may
follow later steps' lines). `training_records` and `eval_records` tell them apart.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All complete JSON lines of a metrics file (a partly written last line is ignored)."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def is_eval_record(record: dict[str, Any]) -> bool:
    return any(key.startswith("eval/") for key in record)


def training_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per training step in step order; a step a restarted trainer replayed counts once (its last line)."""
    by_step = {r["step"]: r for r in records if not is_eval_record(r)}
    return [by_step[step] for step in sorted(by_step)]


def eval_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Eval lines in step order."""
    return sorted((r for r in records if is_eval_record(r)), key=lambda r: r["step"])


def summarize(records: list[dict[str, Any]], window: int = 5) -> dict[str, Any]:
    """Reward at the start and end of a run, the average step-time breakdown, and eval pass rates."""
    evals = eval_records(records)
    records = training_records(records)
    rewards = [r["rollout/raw_reward"] for r in records]
    first = float(np.mean(rewards[:window]))
    last = float(np.mean(rewards[-window:]))
    keys = ["perf/step_time", "perf/wait_time", "perf/train_time", "perf/weight_sync_time", "train/train_rollout_logprob_abs_diff", "rollout/staleness_mean"]
    means = {k: float(np.mean([r[k] for r in records if k in r])) for k in keys if any(k in r for r in records)}
    return {
        "steps": len(records),
        "wall_time_s": float(records[-1]["time"] - records[0]["time"] + records[0].get("perf/step_time", 0.0)),
        "reward_first5": first,
        "reward_last5": last,
        "reward_gain": last - first,
        "mean": means,
        "eval": [
            {k: v for k, v in r.items() if k in ("step", "weight_version") or "/pass@" in k or k.endswith("/reward_mean")}
            for r in evals
        ],
    }


def plot_metrics(metrics_path: Path, out_png: Path) -> Path:
    """Reward, logprob mismatch and step time against step, one panel each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    everything = read_metrics(metrics_path)
    records, evals = training_records(everything), eval_records(everything)
    panels = [
        ("rollout/raw_reward", "reward"),
        ("train/train_rollout_logprob_abs_diff", "|logp train - rollout|"),
        ("perf/step_time", "step time (s), after step 0"),
    ]
    fig, axes = plt.subplots(1, len(panels) + bool(evals), figsize=(13 + 4 * bool(evals), 3.6))
    if evals:
        ax = axes[-1]
        for key in sorted({k for r in evals for k in r if "/pass@" in k}):
            shown = [r for r in evals if key in r]
            ax.plot([r["step"] for r in shown], [r[key] for r in shown], marker="o", linewidth=1, label=key[len("eval/"):])
        ax.set_xlabel("step (-1: before training)")
        ax.set_title("eval pass@k")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    for ax, (key, label) in zip(axes, panels):
        # Step 0's time includes engine start-up; it would flatten the rest of the step-time panel.
        shown = records[1:] if key == "perf/step_time" and len(records) > 1 else records
        ax.plot([r["step"] for r in shown], [r.get(key, np.nan) for r in shown], marker=".", linewidth=1)
        ax.set_xlabel("step")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    fig.suptitle(f"vime run: {metrics_path.parent.name}")
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png


class BusyTimer:
    """Wall time during which at least one task was in flight (overlapping tasks count once)."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.busy_s = 0.0
        self._since: float | None = None

    def _fold(self) -> None:
        now = time.perf_counter()
        if self._since is not None:
            self.busy_s += now - self._since
        self._since = now if self.in_flight > 0 else None

    def begin(self) -> None:
        self._fold()
        self.in_flight += 1
        self._since = self._since or time.perf_counter()

    def end(self) -> None:
        self._fold()
        self.in_flight -= 1
        if self.in_flight == 0:
            self._since = None

    def total(self) -> float:
        """Busy seconds so far, including the current busy stretch."""
        self._fold()
        return self.busy_s
