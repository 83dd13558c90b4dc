"""Experiment tracking: trainer rank 0 sends every metric line to Weights & Biases and/or TensorBoard.

The lines are the ones of RUN_DIR/metrics.jsonl (train, rollout, perf and eval keys, slime's names);
`--use-wandb` and `--use-tensorboard` (slime's flags) turn the trackers on. Neither package is a core
dependency: they come with `pip install 'vime[tracking]'`, are imported only when a flag asks, and a
flag whose package is missing fails at start with `TrackerNotInstalled`.

The x axis is the training step. Eval lines arrive at the step whose weights were evaluated, often
after later steps' lines: TensorBoard takes any step order, and W&B (whose own `step=` must only grow)
gets the step as the metric `train/step`, which every other metric is plotted against.

A tracker that fails at start is an error (an online W&B run that cannot reach its server, say); one
that fails mid-run is logged once and training goes on without its lines.

Resumption follows metrics.jsonl: when the trainer appends to an existing metrics.jsonl (a resumed or
restarted trainer), W&B logs into the same run (its id is kept in RUN_DIR/wandb_run_id) and
TensorBoard appends to the same directory, hiding the earlier events of the steps trained again.
"""

from __future__ import annotations

import importlib
import numbers
import secrets
import string
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

from vime.config import VimeConfig
from vime.logging import get_logger

log = get_logger("vime.tracking")

STEP_METRIC = "train/step"
RUN_ID_FILE = "wandb_run_id"
# Keys of a metric line that are not metrics: the step is the x axis, the time each tracker keeps itself.
_NOT_METRICS = frozenset({"step", "time"})
# Lowest step a line can have: eval of the initial weights is logged at step -1.
_FIRST_POSSIBLE_STEP = -1


class TrackingError(RuntimeError):
    """A tracker the configuration asks for cannot start; the message says which and why."""


class TrackerNotInstalled(TrackingError):
    """A tracking flag is set but its package is not installed (`pip install 'vime[tracking]'`)."""

    def __init__(self, flag: str, module: str) -> None:
        super().__init__(f"{flag} needs the {module} package, which is not installed: pip install 'vime[tracking]'")
        self.flag = flag
        self.module = module


class MetricSink(Protocol):
    """Somewhere metric lines go. `log` may raise; `Trackers` contains such failures."""

    def log(self, step: int, metrics: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The numeric values of a metric line (strings, lists and the `step`/`time` keys left out)."""
    return {k: float(v) for k, v in metrics.items() if k not in _NOT_METRICS and isinstance(v, numbers.Real)}


def new_run_id() -> str:
    """A fresh W&B run id, shaped like W&B's own (8 lowercase letters and digits)."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def _require(flag: str, module: str, package: str | None = None) -> ModuleType:
    """Import `module` for `flag`; TrackerNotInstalled names `package` (default: the module) if it fails."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise TrackerNotInstalled(flag, package or module) from exc


def check_installed(cfg: VimeConfig) -> None:
    """Raise TrackerNotInstalled if a tracking flag of `cfg` asks for a package that is not installed."""
    if cfg.use_wandb:
        _require("--use-wandb", "wandb")
    if cfg.use_tensorboard:
        _require("--use-tensorboard", "tensorboard")
        _require("--use-tensorboard", "torch.utils.tensorboard", "tensorboard")


class WandbSink:
    """One W&B run; every metric is plotted against `train/step`."""

    def __init__(self, run: Any) -> None:
        self.run = run

    @classmethod
    def open(cls, cfg: VimeConfig, continuing: bool) -> WandbSink:
        """Start (or, `continuing`, resume) the job's W&B run with the config as its run config.

        The run id is `--wandb-run-id`, else the one kept in RUN_DIR/wandb_run_id when continuing, else a
        new one, written there. Raises TrackerNotInstalled, or TrackingError if W&B cannot start the run
        (e.g. online without credentials or network)."""
        wandb = _require("--use-wandb", "wandb")
        id_file = cfg.run_dir / RUN_ID_FILE
        run_id = cfg.wandb_run_id
        if run_id is None and continuing and id_file.is_file():
            run_id = id_file.read_text().strip() or None
        if run_id is None:
            run_id = new_run_id()
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        id_file.write_text(run_id + "\n")
        wandb_dir = cfg.wandb_dir or cfg.run_dir
        wandb_dir.mkdir(parents=True, exist_ok=True)
        try:
            run = wandb.init(
                project=cfg.wandb_project, entity=cfg.wandb_team, group=cfg.wandb_group, name=cfg.run_dir.name,
                id=run_id, resume="allow", dir=str(wandb_dir), mode=cfg.wandb_mode,
                config=cfg.model_dump(mode="json"),
                # The trainer's stderr is its structured log (RUN_DIR/logs); W&B must not wrap it.
                settings=wandb.Settings(console="off"),
            )  # fmt: skip
            run.define_metric(STEP_METRIC)
            run.define_metric("*", step_metric=STEP_METRIC)
        except Exception as exc:  # wandb raises several types (UsageError, CommError, ...)
            mode = cfg.wandb_mode or "from WANDB_MODE"
            raise TrackingError(f"W&B could not start run {run_id} (mode {mode}): {exc}") from exc
        log.info("wandb_run_started", run_id=run_id, project=run.project, mode=cfg.wandb_mode, dir=str(wandb_dir))
        return cls(run)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        self.run.log({STEP_METRIC: step, **scalars(metrics)})

    def close(self) -> None:
        self.run.finish()


class TensorBoardSink:
    """One TensorBoard log directory; every metric is a scalar at its step, the config a text summary."""

    def __init__(self, writer: Any) -> None:
        self.writer = writer

    @staticmethod
    def log_dir(cfg: VimeConfig) -> Path:
        base = Path(cfg.tb_project_name) if cfg.tb_project_name else cfg.run_dir / "tensorboard"
        return base / cfg.tb_experiment_name if cfg.tb_experiment_name else base

    @classmethod
    def open(cls, cfg: VimeConfig, continuing: bool, first_step: int) -> TensorBoardSink:
        """Open the log directory. Events of an earlier trainer there at steps >= the first step this one
        logs (`first_step` when `continuing`, else every step: a new job) are hidden by TensorBoard's
        purge, so a resumed job shows each step once. Raises TrackerNotInstalled."""
        _require("--use-tensorboard", "tensorboard")
        summary_writer = _require("--use-tensorboard", "torch.utils.tensorboard", "tensorboard").SummaryWriter
        path = cls.log_dir(cfg)
        path.mkdir(parents=True, exist_ok=True)
        purge_step = first_step if continuing else _FIRST_POSSIBLE_STEP
        writer = summary_writer(log_dir=str(path), purge_step=purge_step)
        # Indented lines are a code block in TensorBoard's markdown text view.
        config_text = "\n".join("    " + line for line in cfg.to_yaml().splitlines())
        writer.add_text("config", config_text, global_step=max(first_step, 0))
        writer.flush()
        log.info("tensorboard_started", log_dir=str(path), purge_step=purge_step)
        return cls(writer)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        walltime = metrics.get("time")
        walltime = float(walltime) if isinstance(walltime, numbers.Real) else None
        for key, value in scalars(metrics).items():
            self.writer.add_scalar(key, value, global_step=step, walltime=walltime)
        self.writer.flush()  # a line per step, seconds apart: TensorBoard shows it at once

    def close(self) -> None:
        self.writer.close()


class Trackers:
    """The configured sinks behind one `log`/`close`. A sink that raises is logged once (`tracker_failed`)
    and kept: later lines still go to every sink, and training is never stopped by a tracker."""

    def __init__(self, sinks: Mapping[str, MetricSink] | None = None) -> None:
        self.sinks: dict[str, MetricSink] = dict(sinks or {})
        self.failed: set[str] = set()

    def __bool__(self) -> bool:
        return bool(self.sinks)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        for name, sink in self.sinks.items():
            try:
                sink.log(step, metrics)
            except Exception as exc:  # a tracker's failure must not end the training run
                self._failed(name, "log", exc, step)

    def close(self) -> None:
        for name, sink in self.sinks.items():
            try:
                sink.close()
            except Exception as exc:
                self._failed(name, "close", exc, None)
        self.sinks.clear()

    def _failed(self, name: str, what: str, exc: Exception, step: int | None) -> None:
        if name in self.failed:
            return
        self.failed.add(name)
        log.warning("tracker_failed", tracker=name, during=what, step=step, error=f"{type(exc).__name__}: {exc}",
                    hint="training goes on; further failures of this tracker are not logged")  # fmt: skip


def open_trackers(cfg: VimeConfig, continuing: bool = False, first_step: int = 0) -> Trackers:
    """The trackers `cfg` asks for (none: an empty Trackers whose `log` does nothing).

    `continuing`: this trainer appends to an earlier trainer's metrics of the same job, from step
    `first_step` on. Raises TrackerNotInstalled or TrackingError before any tracker starts logging;
    a tracker already opened is closed again in that case."""
    check_installed(cfg)
    trackers = Trackers()
    try:
        if cfg.use_wandb:
            trackers.sinks["wandb"] = WandbSink.open(cfg, continuing)
        if cfg.use_tensorboard:
            trackers.sinks["tensorboard"] = TensorBoardSink.open(cfg, continuing, first_step)
    except BaseException:
        trackers.close()
        raise
    return trackers


__all__ = [
    "MetricSink", "STEP_METRIC", "TensorBoardSink", "TrackerNotInstalled", "Trackers", "TrackingError", "WandbSink",
    "check_installed", "open_trackers", "scalars",
]  # fmt: skip
