"""`vime report RUN_DIR`: a run directory rendered as one page a person reads at a glance.

The page (RUN_DIR/report.png, and report.html embedding it with a table of the numbers) has a header
with the run's essentials and one panel each for: reward, eval pass@k, the train/rollout logprob diff,
staleness, the trainer's step time by part, rollout engine idle time, and faults and restarts. It reads
only files: metrics.jsonl (one line per step, eval lines), config.yaml, status.json (the broker's
counters) and logs/*.log, so it works on a finished run, one still in progress, one
that stopped with an error and a resumed one (a replayed step counts once). A panel without data says
what is missing inside the panel; `render` returns which panels had data.
"""

from __future__ import annotations

import base64
import datetime
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from vime.config import STATUS_FILE
from vime.logging import get_logger
from vime.metrics import eval_records, read_metrics, training_records

log = get_logger(__name__)

# Panel names, in page order; `Report.panels` is keyed by these.
PANELS = ("reward", "eval", "logprob_diff", "staleness", "step_time", "engine_idle", "faults")
# Engine busy time reaches the metrics through worker heartbeats (every `heartbeat_interval_s`), so
# idle time is only meaningful over windows of several heartbeats.
IDLE_WINDOW_HEARTBEATS = 10
ROLE_ORDER = {"broker": 0, "rollout": 1, "reward": 2, "trainer": 3}
START_MARKER = re.compile(r"^--- vime: (?P<name>\S+) started (?P<when>\S+): ")
TIMESTAMP = re.compile(r'"timestamp": "([^"]+)"')
# Broker counters that count a fault or its repair (vime.broker.state.COUNTERS), with their labels.
FAULT_COUNTERS = {
    "broker_restarts": "broker resumed from journal",
    "groups_failed": "groups failed",
    "groups_dropped_stale": "groups dropped (too stale)",
    "groups_requeued": "groups requeued",
    "samples_failed": "samples failed",
    "steps_replayed": "steps replayed",
    "late_results_dropped": "late results dropped",
    "bad_messages": "bad messages",
}
# Log events (any process) that mark a fault, with their labels.
FAULT_EVENTS = {
    "worker_expired": "workers expired (no heartbeat)",
    "broker_gone": "broker lost by a worker",
    "reward_failed": "reward calls failed",
    "weight_update_failed": "weight updates failed",
}


class ReportError(Exception):
    """RUN_DIR cannot be reported on: it is not a run directory, or no training step is recorded yet."""


@dataclass(frozen=True)
class PanelResult:
    name: str
    title: str
    has_data: bool
    note: str  # without data: what is missing; with data: a one-line reading of the panel


@dataclass(frozen=True)
class Report:
    png: Path
    html: Path | None
    panels: dict[str, PanelResult]
    numbers: dict[str, str]

    @property
    def empty_panels(self) -> list[str]:
        return [name for name, panel in self.panels.items() if not panel.has_data]


@dataclass
class Faults:
    """What went wrong in a run and when, from the broker's counters and the processes' logs."""

    counts: dict[str, int] = field(default_factory=dict)  # label -> count, in display order
    restarts: list[tuple[float, str]] = field(default_factory=list)  # (unix time, what restarted)
    lives: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # process -> (started, last log line) per start
    events: list[tuple[float, str, str]] = field(default_factory=list)  # (unix time, process, what) of fault events
    sources: list[str] = field(default_factory=list)  # the files these came from

    @property
    def total(self) -> int:
        return sum(self.counts.values())


@dataclass
class RunData:
    run_dir: Path
    config: dict[str, Any]
    steps: list[dict[str, Any]]
    evals: list[dict[str, Any]]
    replayed_lines: int
    status: dict[str, Any] | None
    faults: Faults


def load_run(run_dir: Path) -> RunData:
    """Read what a report needs. Raises `ReportError` for a directory without metrics.jsonl or
    config.yaml, or whose metrics hold no training step yet."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir} is not a directory")
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists() and not (run_dir / "config.yaml").exists():
        raise ReportError(f"{run_dir} is not a run directory (no metrics.jsonl or config.yaml; `vime run --run-dir` makes one)")
    if not metrics.exists():
        raise ReportError(f"{metrics} does not exist: the run has not finished a training step yet (see {run_dir / 'logs'})")
    records = read_metrics(metrics)
    steps = training_records(records)
    if not steps:
        raise ReportError(f"{metrics} holds no training step yet (see {run_dir / 'logs'})")
    evals = eval_records(records)
    config = _read_yaml(run_dir / "config.yaml")
    status = _read_json(run_dir / STATUS_FILE)
    return RunData(run_dir, config, steps, evals, len(records) - len(steps) - len(evals), status, read_faults(run_dir, status))


def read_faults(run_dir: Path, status: dict[str, Any] | None) -> Faults:
    """Restarts (the supervisor's, from each log's start markers and logs/launcher.log), broker fault
    counters (status.json) and fault events in the logs, with when each process lived. Empty
    `sources`: none of these files exist."""
    faults = Faults()
    launcher = run_dir / "logs" / "launcher.log"
    starts: dict[str, list[float]] = {}
    events: dict[str, int] = dict.fromkeys(FAULT_EVENTS, 0)
    tracebacks = errors = 0
    launches: list[float] = []
    restarted: list[tuple[float, str]] = []
    for path in sorted((run_dir / "logs").glob("*.log")):
        faults.sources.append(f"logs/{path.name}")
        name = path.stem
        last_json = ""  # the latest JSON line: its timestamp is when the process was last heard of

        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("--- vime: "):
                if match := START_MARKER.match(line):
                    if name in faults.lives and faults.lives[name]:
                        begun = faults.lives[name][-1][0]
                        faults.lives[name][-1] = (begun, _heard_last(last_json, begun))
                    when = _unix_time(match["when"])
                    starts.setdefault(match["name"], []).append(when)
                    faults.lives.setdefault(name, []).append((when, when))
                    last_json = ""
                continue
            if line.startswith("Traceback (most recent call last)"):
                tracebacks += 1
                faults.events.append((_heard_last(last_json, float("nan")), name, "traceback"))
                continue
            if not line.startswith("{"):
                continue
            last_json = line
            is_error = '"level": "error"' in line
            if not is_error and not any(f'"event": "{event}"' in line for event in (*FAULT_EVENTS, "job_started", "child_restarted")):
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            event, when = record.get("event"), _unix_time(record.get("timestamp", ""))
            if is_error:
                errors += 1
                faults.events.append((when, name, f"error: {event}"))
            if event in events:
                events[event] += 1
                faults.events.append((when, name, FAULT_EVENTS[event]))
            elif path == launcher and event == "job_started":
                launches.append(when)
            elif path == launcher and event == "child_restarted":
                restarted.append((when, str(record.get("name"))))
        if faults.lives.get(name):
            begun = faults.lives[name][-1][0]
            faults.lives[name][-1] = (begun, _heard_last(last_json, begun))
    faults.lives.pop("launcher", None)
    # Every launch (the first, and each `--load` resume) starts every process once; the launcher's own
    # log says how many launches there were, else the least-started process does.
    sessions = len(launches) or min((len(times) for times in starts.values()), default=1)
    by_process = {name: max(0, len(times) - sessions) for name, times in starts.items()}
    if launches:
        faults.restarts = restarted + [(t, "resumed launch") for t in launches[1:]]
    else:  # a run without launcher.log: take the last start markers beyond the first per launch
        faults.restarts = [(t, name) for name, times in starts.items() for t in times[len(times) - by_process[name] :] if by_process[name]]
    faults.restarts.sort()
    faults.events = sorted(e for e in faults.events if np.isfinite(e[0]))
    faults.counts["process restarts (supervisor)"] = sum(by_process.values())
    faults.counts["resumed launches (--load)"] = max(0, sessions - 1)
    counters = (status or {}).get("counters", {})
    if status is not None:
        faults.sources.append(STATUS_FILE)
    for key, label in FAULT_COUNTERS.items():
        faults.counts[label] = int(counters.get(key, 0))
    for key, label in FAULT_EVENTS.items():
        faults.counts[label] = events[key]
    faults.counts["tracebacks in logs"] = tracebacks
    faults.counts["error log lines"] = errors
    return faults


def render(run_dir: Path, out: Path | None = None, *, html: bool = True) -> Report:
    """Write the report PNG (`out`, default RUN_DIR/report.png) and, with `html`, an HTML page beside it
    (same name, .html) embedding it. Raises `ReportError` (see `load_run`)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    data = load_run(run_dir)
    out = Path(out) if out is not None else data.run_dir / "report.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    numbers = key_numbers(data)
    fig = Figure(figsize=(18, 14.5), dpi=100)
    grid = fig.add_gridspec(4, 3, height_ratios=[0.34, 1, 1, 1], hspace=0.4, wspace=0.22, left=0.065, right=0.98, top=0.98, bottom=0.04)
    header = fig.add_subplot(grid[0, :])
    axes = {
        "reward": fig.add_subplot(grid[1, 0]), "eval": fig.add_subplot(grid[1, 1]), "logprob_diff": fig.add_subplot(grid[1, 2]),
        "staleness": fig.add_subplot(grid[2, 0]), "step_time": fig.add_subplot(grid[2, 1]), "engine_idle": fig.add_subplot(grid[2, 2]),
    }  # fmt: skip
    fault_grid = grid[3, :2].subgridspec(1, 2, width_ratios=[2.3, 1], wspace=0.12)
    axes["faults"] = (fig.add_subplot(fault_grid[0]), fig.add_subplot(fault_grid[1]))
    numbers_ax = fig.add_subplot(grid[3, 2])
    drawers = {
        "reward": _reward, "eval": _eval, "logprob_diff": _logprob_diff, "staleness": _staleness,
        "step_time": _step_time, "engine_idle": _engine_idle, "faults": _faults,
    }  # fmt: skip
    panels = {}
    for name in PANELS:
        ax = axes[name]
        title, has_data, note = drawers[name](ax, data)
        first = ax[0] if isinstance(ax, tuple) else ax
        first.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps (and the timeline's units) are whole
        first.set_title(title, fontsize=12, loc="left", fontweight="bold")
        if not has_data:
            _say_empty(first, note)
        panels[name] = PanelResult(name, title, has_data, note)
    _header(header, data, numbers)
    _numbers(numbers_ax, numbers)
    fig.savefig(out)
    html_path = None
    if html:
        html_path = out.with_suffix(".html")
        html_path.write_text(_html(data, out, panels, numbers))
    empty = [name for name, panel in panels.items() if not panel.has_data]
    log.debug("report_written", png=str(out), html=str(html_path) if html_path else None, empty_panels=empty)
    return Report(out, html_path, panels, numbers)


# --- panels: each draws on its axes and returns (title, has data, note) ------------------------------


def _series(steps: list[dict[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    shown = [r for r in steps if key in r and r[key] is not None]
    return np.array([r["step"] for r in shown], dtype=float), np.array([r[key] for r in shown], dtype=float)


def _missing(key: str) -> str:
    return f"no {key} in metrics.jsonl"


def _reward(ax: Any, data: RunData) -> tuple[str, bool, str]:
    x, y = _series(data.steps, "rollout/raw_reward")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward of the step's samples")
    if not len(x):
        return "reward", False, _missing("rollout/raw_reward")
    ax.plot(x, y, ".", color="tab:blue", alpha=0.45, label="per step")
    window = min(len(y), max(3, len(y) // 15))
    if window > 1:
        smooth = np.convolve(y, np.ones(window) / window, mode="valid")
        ax.plot(x[window - 1 :], smooth, color="tab:blue", linewidth=2, label=f"mean of the last {window} steps")
    _mark_restarts(ax, data)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    first, last = float(np.mean(y[:5])), float(np.mean(y[-5:]))
    return f"reward: {first:.3f} -> {last:.3f} (first / last 5 steps)", True, f"{first:.3f} -> {last:.3f}"


def _mark_restarts(ax: Any, data: RunData) -> None:
    """A dashed line at the step in progress when a process restarted (or the job was resumed)."""
    if not data.faults.restarts:
        return
    times = np.array([r["time"] for r in data.steps if "time" in r], dtype=float)
    steps = np.array([r["step"] for r in data.steps if "time" in r], dtype=float)
    if not len(times):
        return
    order = np.argsort(times)
    for i, (when, what) in enumerate(r for r in data.faults.restarts if np.isfinite(r[0])):
        at = float(np.interp(when, times[order], steps[order]))
        ax.axvline(at, color="tab:red", linestyle="--", linewidth=1, label="restart" if i == 0 else None)
        ax.annotate(what, (at, 1.0), xycoords=("data", "axes fraction"), rotation=90, va="top", ha="right", fontsize=7, color="tab:red")


def _eval(ax: Any, data: RunData) -> tuple[str, bool, str]:
    ax.set_xlabel("step whose weights were evaluated (-1: before training)")
    ax.set_ylabel("pass@k")
    keys = sorted({k for r in data.evals for k in r if "/pass@" in k}, key=_pass_key_order)
    if not keys:
        hint = "" if data.config.get("eval_interval") else "\n(run with --eval-interval N --eval-prompt-data NAME PATH)"
        return "eval", False, "no eval lines in metrics.jsonl" + hint
    for key in keys:
        shown = [r for r in data.evals if key in r]
        ax.plot([r["step"] for r in shown], [r[key] for r in shown], marker="o", linewidth=1.5, label=key[len("eval/") :])
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=8, loc="best")
    ax.grid(alpha=0.3)
    last = data.evals[-1]
    first_key = keys[0]
    reading = f"{first_key[len('eval/'):]} {last.get(first_key, float('nan')):.3f} at step {last['step']}"
    return f"eval: {reading}", True, reading


def _pass_key_order(key: str) -> tuple[str, int]:
    name, _, k = key.rpartition("/pass@")
    return name, int(k) if k.isdigit() else 0


def _logprob_diff(ax: Any, data: RunData) -> tuple[str, bool, str]:
    key = "train/train_rollout_logprob_abs_diff"
    x, y = _series(data.steps, key)
    ax.set_xlabel("step")
    ax.set_ylabel("mean |logp trainer - logp rollout| per token")
    if not len(x):
        return "train / rollout logprob diff", False, _missing(key)
    ax.plot(x, y, marker=".", linewidth=1, color="tab:purple")
    ax.grid(alpha=0.3)
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    return f"train / rollout logprob diff: mean {np.mean(y):.2e}", True, f"mean {np.mean(y):.2e}, max {np.max(y):.2e}"


def _staleness(ax: Any, data: RunData) -> tuple[str, bool, str]:
    x, mean = _series(data.steps, "rollout/staleness_mean")
    x_max, worst = _series(data.steps, "rollout/staleness_max")
    ax.set_xlabel("step")
    ax.set_ylabel("trainer version - sampling version")
    if not len(x):
        return "staleness", False, _missing("rollout/staleness_mean")
    ax.plot(x, mean, marker=".", linewidth=1.5, color="tab:green", label="mean over the batch")
    if len(x_max):
        ax.plot(x_max, worst, "_", markersize=12, markeredgewidth=2, color="tab:orange", label="max in the batch")
    bound = data.config.get("max_staleness")
    if bound is not None:
        ax.axhline(bound, color="tab:red", linestyle=":", linewidth=1.5, label=f"--max-staleness {bound}")
    ax.set_ylim(bottom=-0.05, top=max(float(np.max(worst)) if len(worst) else 0.0, float(bound or 0), 1.0) * 1.15 + 0.05)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    return f"staleness: mean {np.mean(mean):.2f}, max {np.max(worst) if len(worst) else np.max(mean):.0f}", True, f"mean {np.mean(mean):.2f}"


STEP_PARTS = (("perf/wait_time", "wait for batch", "tab:gray"), ("perf/train_time", "train", "tab:blue"),
              ("perf/weight_sync_time", "weight sync (publish)", "tab:orange"))  # fmt: skip


def _step_time(ax: Any, data: RunData) -> tuple[str, bool, str]:
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    rows = [r for r in data.steps if "perf/step_time" in r]
    if not rows:
        return "step time", False, _missing("perf/step_time")
    total = np.array([r["perf/step_time"] for r in rows], dtype=float)
    note = ""
    # A first step far slower than the rest (compilation, engine start-up) would flatten every other bar.
    if len(rows) > 2 and total[0] > 3 * np.median(total[1:]):
        note = f"step {rows[0]['step']} ({total[0]:.1f} s, start-up) not shown"
        rows, total = rows[1:], total[1:]
    x = np.array([r["step"] for r in rows], dtype=float)
    bottom = np.zeros(len(rows))
    for key, label, color in STEP_PARTS:
        part = np.array([r.get(key, 0.0) for r in rows], dtype=float)
        ax.bar(x, part, bottom=bottom, width=1.0 if len(x) > 40 else 0.8, color=color, linewidth=0, label=f"{label} {np.mean(part):.3f} s")
        bottom += part
    other = np.clip(total - bottom, 0.0, None)
    ax.bar(x, other, bottom=bottom, width=1.0 if len(x) > 40 else 0.8, color="tab:olive", linewidth=0, label=f"other {np.mean(other):.3f} s")
    ax.legend(fontsize=8, loc="upper right", title="mean per step", title_fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    if note:
        ax.annotate(note, (0.01, 0.98), xycoords="axes fraction", va="top", fontsize=8, color="dimgray")
    ax.set_ylim(top=float(np.max(total)) * 1.45)  # room for the legend above the bars
    return f"step time: mean {np.mean(total):.2f} s", True, f"mean {np.mean(total):.2f} s"


def engine_idle(data: RunData) -> tuple[list[tuple[int, int, float]], float | None]:
    """Rollout engine idle fraction per window of steps ((first step, last step, idle)) and over the
    whole run, from the busy-time totals the workers' heartbeats carry into each step's line
    (`perf/rollout_busy_s_total`: seconds with a request in flight, summed over rollout workers).
    Windows span at least `IDLE_WINDOW_HEARTBEATS` heartbeats, and never a restart, a resumed launch
    (the time between launches is no engine's idle time) or a total that goes down (a restarted worker
    counts from zero again): such a cut ends the window where it is."""
    workers = max(1, int(data.config.get("num_rollout_workers", 1) or 1))
    min_span = IDLE_WINDOW_HEARTBEATS * float(data.config.get("heartbeat_interval_s", 2.0) or 2.0)
    rows = [r for r in data.steps if "perf/rollout_busy_s_total" in r and "time" in r]
    windows: list[tuple[int, int, float]] = []
    busy_sum = span_sum = 0.0

    def measure(first: dict[str, Any], last: dict[str, Any]) -> None:
        nonlocal busy_sum, span_sum
        busy = last["perf/rollout_busy_s_total"] - first["perf/rollout_busy_s_total"]
        span = last["time"] - first["time"]
        if busy >= 0 and span > 0:
            windows.append((first["step"], last["step"], float(np.clip(1.0 - busy / (span * workers), 0.0, 1.0))))
            busy_sum += busy
            span_sum += span * workers

    cuts = sorted(t for t, _ in data.faults.restarts if np.isfinite(t))
    start = 0
    for i in range(1, len(rows)):
        before, now = rows[i - 1], rows[i]
        cut = before["perf/rollout_busy_s_total"] > now["perf/rollout_busy_s_total"] or any(before["time"] < t <= now["time"] for t in cuts)
        if cut:  # what was measured so far counts; nothing across the cut does
            if i - 1 > start:
                measure(rows[start], before)
            start = i
        elif now["time"] - rows[start]["time"] >= min_span or i == len(rows) - 1:
            measure(rows[start], now)
            start = i
    overall = float(np.clip(1.0 - busy_sum / span_sum, 0.0, 1.0)) if span_sum > 0 else None
    return windows, overall


def _engine_idle(ax: Any, data: RunData) -> tuple[str, bool, str]:
    ax.set_xlabel("step")
    ax.set_ylabel("fraction of wall time with no request in flight")
    windows, overall = engine_idle(data)
    if overall is None:
        return "rollout engine idle", False, "no perf/rollout_busy_s_total over 2+ steps in metrics.jsonl"
    for i, (first, last, idle) in enumerate(windows):
        ax.hlines(idle, first, last, color="tab:brown", linewidth=3, label="per window" if i == 0 else None)
    ax.axhline(overall, color="black", linestyle=":", linewidth=1, label=f"whole run {overall:.0%}")
    ax.set_ylim(-0.02, 1.02)
    ax.yaxis.set_major_formatter(lambda v, _pos: f"{v:.0%}")
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(alpha=0.3)
    workers = int(data.config.get("num_rollout_workers", 1) or 1)
    ax.annotate(f"{workers} rollout worker(s); windows of >= {IDLE_WINDOW_HEARTBEATS} heartbeats", (0.01, 0.02),
                xycoords="axes fraction", fontsize=8, color="dimgray")  # fmt: skip
    return f"rollout engine idle: {overall:.0%} of the run", True, f"{overall:.0%}"


def _faults(axes: tuple[Any, Any], data: RunData) -> tuple[str, bool, str]:
    """A timeline (each process's lives, restarts, fault events, the trainer's steps) and the counts."""
    timeline, table = axes
    faults = data.faults
    table.axis("off")
    if not faults.sources:
        return "faults and restarts", False, "no status.json or logs/*.log in the run directory"
    lanes = sorted(faults.lives, key=lambda n: (ROLE_ORDER.get(n.split("-")[0], 9), n))
    times = [t for lives in faults.lives.values() for life in lives for t in life if np.isfinite(t)]
    step_times = [r["time"] for r in data.steps if "time" in r]
    origin = min(times + step_times, default=0.0)
    span = max(times + step_times, default=origin) - origin
    unit, scale = ("seconds", 1.0) if span < 300 else ("minutes", 60.0) if span < 3 * 3600 else ("hours", 3600.0)
    timeline.set_xlabel(f"{unit} since the first process started")
    y_of = {name: i for i, name in enumerate(["trainer steps", *lanes])}

    def at(t: float) -> float:  # on the x axis
        return (t - origin) / scale

    timeline.plot([at(t) for t in step_times], [0] * len(step_times), "|", color="tab:blue", markersize=9, label="training step done")
    for name in lanes:
        for i, (begun, last) in enumerate(faults.lives[name]):
            timeline.hlines(y_of[name], at(begun), at(last), color="tab:green", linewidth=5, alpha=0.6,
                            label="process alive (start to last log line)" if (name, i) == (lanes[0], 0) else None)  # fmt: skip
    labelled: set[str] = set()

    def mark(when: float, lane: str, kind: str, **style: Any) -> None:
        timeline.plot(at(when), y_of[lane], linestyle="none", markersize=9, label=None if kind in labelled else kind, **style)
        labelled.add(kind)

    for when, what in faults.restarts:
        restarted = [n for n in lanes if n == what or n.startswith(f"{what}-")]  # "trainer": all its ranks
        for lane in restarted:
            mark(when, lane, "restart", marker="X", color="tab:red")
        if not restarted:  # a resumed launch starts every process
            for lane in lanes:
                mark(when, lane, "resumed launch", marker="D", color="black")
    for when, process, _what in faults.events:
        if process in y_of:
            mark(when, process, "fault event / error line", marker="v", color="tab:orange")
    timeline.set_yticks(list(y_of.values()), list(y_of), fontsize=9)
    timeline.set_ylim(len(y_of) - 0.4, -1.5)  # top down, with a band above the lanes for the legend
    timeline.grid(alpha=0.3, axis="x")
    timeline.legend(fontsize=8, loc="upper right", ncol=4)
    rows = [f"{count:5d}  {label}" for label, count in faults.counts.items()]
    table.text(0.0, 1.0, "\n".join(rows), fontsize=9, va="top", family="monospace", transform=table.transAxes, linespacing=1.45)
    for i, (label, count) in enumerate(faults.counts.items()):
        if count:  # the counts that are not zero, again in red over their row
            table.text(0.0, 1.0, "\n" * i + f"{count:5d}  {label}", fontsize=9, va="top", family="monospace", color="tab:red",
                       fontweight="bold", transform=table.transAxes, linespacing=1.45)  # fmt: skip
    source = " + ".join(s for s in faults.sources if not s.startswith("logs/"))
    logs = sum(s.startswith("logs/") for s in faults.sources)
    table.text(0.0, 0.0, f"from {source + ' + ' if source else ''}{logs} log file(s)", fontsize=8, color="dimgray", transform=table.transAxes)
    errors = faults.counts.get("error log lines", 0)
    if faults.total == 0:
        return "faults and restarts: none recorded", True, "none"
    reading = f"{faults.total - errors} fault(s) and restart(s), {errors} error line(s)"
    return f"faults and restarts: {reading}", True, reading


def _say_empty(ax: Any, note: str) -> None:
    ax.set_facecolor("#f6f6f6")
    ax.annotate(f"NO DATA\n{note}", (0.5, 0.5), xycoords="axes fraction", ha="center", va="center", fontsize=11, color="tab:red", wrap=True)
    ax.set_xticks([])
    ax.set_yticks([])


# --- header and numbers -----------------------------------------------------------------------------


def key_numbers(data: RunData) -> dict[str, str]:
    """The run's figures as display strings, in reading order (the header, the numbers panel, HTML)."""
    steps, cfg = data.steps, data.config
    rewards = [r["rollout/raw_reward"] for r in steps if "rollout/raw_reward" in r]
    wall = steps[-1]["time"] - steps[0]["time"] + steps[0].get("perf/step_time", 0.0) if "time" in steps[0] else float("nan")
    out: dict[str, str] = {}
    total = cfg.get("num_rollout")
    finished = bool((data.status or {}).get("finished")) or (total is not None and len(steps) >= int(total))
    out["steps"] = f"{len(steps)} of {total}" if total else str(len(steps))
    out["state"] = "finished" if finished else "in progress (or stopped early)"
    if data.replayed_lines:
        out["steps replayed after a restart"] = str(data.replayed_lines)
    lives = [t for spans in data.faults.lives.values() for span in spans for t in span if np.isfinite(t)]
    if lives and "time" in steps[-1]:  # from the first process's start to the last sign of life
        out["wall time (job)"] = _duration(max(lives + [steps[-1]["time"]]) - min(lives))
    out["training time (step 0 to last)"] = _duration(wall)
    if rewards:
        out["reward first 5 -> last 5"] = f"{np.mean(rewards[:5]):.3f} -> {np.mean(rewards[-5:]):.3f}"
        out["final reward (last 5 mean)"] = f"{np.mean(rewards[-5:]):.3f}"
    for key in sorted({k for r in data.evals[-1:] for k in r if "/pass@" in k}, key=_pass_key_order):
        out[f"final {key}"] = f"{data.evals[-1][key]:.3f} (step {data.evals[-1]['step']})"
    for key, label in (("perf/step_time", "step time"), ("perf/wait_time", "  wait for batch"), ("perf/train_time", "  train"),
                       ("perf/weight_sync_time", "  weight sync")):  # fmt: skip
        values = [r[key] for r in steps[1:] or steps if key in r]
        if values:
            out[f"{label} (mean, s)"] = f"{np.mean(values):.3f}"
    tokens = [r["perf/tokens_per_gpu_per_sec"] for r in steps[1:] or steps if "perf/tokens_per_gpu_per_sec" in r]
    if tokens:
        out["trainer tokens / GPU / s"] = f"{np.mean(tokens):.0f}"
    stale = [r["rollout/staleness_mean"] for r in steps if "rollout/staleness_mean" in r]
    if stale:
        out["staleness mean"] = f"{np.mean(stale):.2f}"
    diffs = [r["train/train_rollout_logprob_abs_diff"] for r in steps if "train/train_rollout_logprob_abs_diff" in r]
    if diffs:
        out["logprob diff mean"] = f"{np.mean(diffs):.2e}"
    _, idle = engine_idle(data)
    if idle is not None:
        out["rollout engine idle"] = f"{idle:.0%}"
    out["faults counted"] = str(data.faults.total) if data.faults.sources else "n/a (no logs, no status.json)"
    return out


def _header(ax: Any, data: RunData, numbers: dict[str, str]) -> None:
    ax.axis("off")
    cfg = data.config
    model = str(cfg.get("hf_checkpoint", "?"))
    if cfg.get("lora_rank"):
        model += f" (LoRA rank {cfg['lora_rank']})"
    batch = (f"{cfg.get('rollout_batch_size', '?')} prompts x {cfg.get('n_samples_per_prompt', '?')} samples, "
             f"responses <= {cfg.get('rollout_max_response_len', '?')} tokens")  # fmt: skip
    layout = (f"{cfg.get('num_rollout_workers', '?')} rollout worker(s) ({cfg.get('rollout_engine', '?')}), "
              f"{cfg.get('num_reward_workers', '?')} reward worker(s), {cfg.get('trainer_world_size', '?')} trainer rank(s) "
              f"({cfg.get('train_backend', '?')}), max staleness {cfg.get('max_staleness', '?')}"
              + (", colocated" if cfg.get("colocate") else ""))  # fmt: skip
    ax.text(0.0, 1.0, f"vime run report: {data.run_dir}", fontsize=17, fontweight="bold", va="top", transform=ax.transAxes)
    lines = [
        f"model {model}   |   data {cfg.get('prompt_data', '?')}, reward {cfg.get('rm_type', '?')}   |   "
        f"{cfg.get('advantage_estimator', '?')}, lr {cfg.get('lr', '?')}",
        f"batch {batch}   |   {layout}",
        f"steps {numbers['steps']} ({numbers['state']})   |   wall time {numbers.get('wall time (job)', 'n/a')} "
        f"({numbers['training time (step 0 to last)']} training)   |   "
        f"final reward {numbers.get('final reward (last 5 mean)', 'n/a')}   |   faults {numbers['faults counted']}",
    ]
    ax.text(0.0, 0.62, "\n".join(lines), fontsize=11.5, va="top", transform=ax.transAxes, linespacing=1.6, family="monospace")


def _numbers(ax: Any, numbers: dict[str, str]) -> None:
    ax.axis("off")
    ax.set_title("numbers", fontsize=12, loc="left", fontweight="bold")
    rows = list(numbers.items())
    text = "\n".join(f"{k:<32s}{v}" for k, v in rows)
    ax.text(0.0, 1.0, text, fontsize=9.5, va="top", family="monospace", transform=ax.transAxes, linespacing=1.45)


def _duration(seconds: float) -> str:
    if not np.isfinite(seconds):
        return "n/a"
    minutes, s = divmod(int(round(seconds)), 60)
    hours, m = divmod(minutes, 60)
    return f"{hours}h{m:02d}m{s:02d}s" if hours else f"{m}m{s:02d}s" if m else f"{s}s"


HTML = """<!doctype html>
<html><head><meta charset="utf-8"><title>vime report: {{ name }}</title>
<style>body{font-family:sans-serif;margin:1em;max-width:1820px}img{width:100%;border:1px solid #ccc}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:2px 8px;text-align:left}
.empty{color:#b00}</style></head><body>
<h1>vime run report: {{ name }}</h1>
<p>{{ run_dir }}</p>
<img alt="report panels: {{ panel_names }}" src="data:image/png;base64,{{ png }}">
<h2>Panels</h2>
<table><tr><th>panel</th><th>data</th><th>reading</th></tr>
{% for p in panels %}<tr><td>{{ p.title }}</td><td{% if not p.has_data %} class="empty"{% endif %}>{{ "yes" if p.has_data else "NO DATA" }}</td><td>{{ p.note }}</td></tr>
{% endfor %}</table>
<h2>Numbers</h2>
<table>{% for k, v in numbers %}<tr><td>{{ k }}</td><td>{{ v }}</td></tr>{% endfor %}</table>
<h2>Faults and restarts</h2>
<table>{% for k, v in faults %}<tr><td>{{ k }}</td><td>{{ v }}</td></tr>{% endfor %}</table>
{% if restarts %}<p>Restarts:</p><ul>{% for when, what in restarts %}<li>{{ when }}: {{ what }}</li>{% endfor %}</ul>{% endif %}
</body></html>
"""


def _html(data: RunData, png: Path, panels: dict[str, PanelResult], numbers: dict[str, str]) -> str:
    import jinja2

    template = jinja2.Environment(autoescape=True).from_string(HTML)
    return template.render(
        name=data.run_dir.name, run_dir=str(data.run_dir), png=base64.b64encode(png.read_bytes()).decode(),
        panel_names=", ".join(panels), panels=list(panels.values()), numbers=list(numbers.items()),
        faults=list(data.faults.counts.items()),
        restarts=[(datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat(timespec="seconds"), what) for t, what in data.faults.restarts],
    )  # fmt: skip


def _heard_last(json_line: str, default: float) -> float:
    """The timestamp of a structlog JSON line, or `default` when it has none."""
    found = TIMESTAMP.search(json_line)
    return _unix_time(found[1]) if found else default


def _unix_time(iso: str) -> float:
    try:
        return datetime.datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return float("nan")


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        loaded = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        loaded = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):  # absent, or caught mid-write
        return None
    return loaded if isinstance(loaded, dict) else None


__all__ = ["PANELS", "Faults", "PanelResult", "Report", "ReportError", "RunData", "engine_idle", "key_numbers", "load_run", "read_faults", "render"]
