"""`vime run CONFIG`: the one-machine launcher (the embedded default).

Starts the broker, rollout workers, reward workers and trainer ranks as separate child processes, each
with its own log file under RUN_DIR/logs, all reading the same resolved config (RUN_DIR/config.yaml);
its own events go to RUN_DIR/logs/launcher.log. It shows progress from RUN_DIR/metrics.jsonl (one
tqdm line on a terminal, JSON log lines elsewhere); `vime.supervisor` restarts a child that dies. It
stops every child cleanly (SIGTERM, then SIGKILL after a grace period) on Ctrl-C, when the trainer
finishes, or when the supervisor gives up on a child, naming it and showing the end of its log.
"""

from __future__ import annotations

import datetime
import errno
import glob
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import structlog
from tqdm import tqdm
from tqdm.contrib import DummyTqdmFile

from vime.config import VimeConfig
from vime.logging import get_logger
from vime.process import Child
from vime.rollout.vllm_environment import cpu_rollout_environment
from vime.supervisor import JobFailed, Supervisor

log = get_logger(__name__)

GRACE_S = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _base_env() -> dict[str, str]:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def plan_children(cfg: VimeConfig, config_path: Path) -> list[Child]:
    """The processes of a one-machine job, in start order."""
    logs = cfg.run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    common = ["--config", str(config_path)]
    base = _base_env()
    cpu_only = not _has_cuda()
    children = [Child("broker", [py, "-m", "vime.workers.broker", *common], base, logs / "broker.log")]
    for i in range(cfg.num_reward_workers):
        children.append(Child(f"reward-{i}", [py, "-m", "vime.workers.main", "--role", "reward", "--worker-id", f"reward-{i}", *common], base, logs / f"reward-{i}.log"))
    for i in range(cfg.num_rollout_workers):
        env = dict(base)
        if cpu_only:
            for key, value in cpu_rollout_environment(cfg.vllm).items():
                env.setdefault(key, value)
            # Only used when a user picks vLLM's multiprocess executor.
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(i % max(1, os.cpu_count() or 1)))
        children.append(Child(f"rollout-{i}", [py, "-m", "vime.workers.main", "--role", "rollout", "--worker-id", f"rollout-{i}", *common], env, logs / f"rollout-{i}.log"))
    master_port = str(free_port())
    for rank in range(cfg.trainer_world_size):
        env = dict(base)
        env.update(RANK=str(rank), WORLD_SIZE=str(cfg.trainer_world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=master_port)
        if cpu_only:
            env.setdefault("OMP_NUM_THREADS", "1")
        children.append(Child(f"trainer-{rank}", [py, "-m", "vime.workers.main", "--role", "trainer", "--worker-id", f"trainer-{rank}", *common], env, logs / f"trainer-{rank}.log"))
    return children


# Device nodes a process needs to reach a GPU (NVIDIA, AMD ROCm, WSL2's CUDA): with none of them, CUDA
# cannot be available and the launcher need not load torch (~250 MiB, held for the whole job) to ask.
GPU_DEVICE_NODES = ("/dev/nvidia*", "/dev/kfd", "/dev/dxg")


def gpu_device_nodes() -> list[str]:
    return [path for pattern in GPU_DEVICE_NODES for path in glob.glob(pattern)]


def _has_cuda() -> bool:
    if not gpu_device_nodes():
        return False
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


class NewLines:
    """The complete lines appended to a file since the last call (a line still being written waits)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def read(self) -> list[bytes]:
        try:
            with self.path.open("rb") as handle:
                handle.seek(self.offset)
                chunk = handle.read()
        except OSError:  # not written yet
            return []
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self.offset += len(complete)
        return complete.splitlines()


class ConsoleEcho:
    """Shows on the console the log events a child marks `console=True` (a reward server down, back),
    which would otherwise sit in its log file under `vime run`."""

    def __init__(self, children: list[Child]) -> None:
        self.logs = [(child.name, NewLines(child.log_path)) for child in children]

    def refresh(self) -> None:
        for name, log_lines in self.logs:
            for line in log_lines.read():
                if b'"console": true' not in line:
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                details = " ".join(f"{k}={v}" for k, v in record.items() if k not in ("event", "console", "level", "timestamp", "pid", "role", "worker_id"))
                tqdm.write(f"vime: {name}: {record.get('event')} {details}", file=sys.stderr)


class ProgressView:
    """Progress fed by the trainer's metrics.jsonl (step, reward, staleness, logprob diff): a tqdm bar,
    one line, on a terminal; elsewhere (a pipe, a file, SLURM's log) a JSON `progress` log line every
    tenth of the job, since a bar's carriage returns would fill a file with partial lines."""

    def __init__(self, metrics_path: Path, total: int, enabled: bool, terminal: bool | None = None) -> None:
        self.metrics = NewLines(metrics_path)
        self.records: list[dict[str, Any]] = []
        self.steps: set[Any] = set()
        self.total = total
        self.terminal = sys.stderr.isatty() if terminal is None else terminal
        self.log_every = max(1, total // 10)
        self.bar = tqdm(total=total, desc="vime", unit="step", disable=not (enabled and self.terminal), dynamic_ncols=True)
        self.log_lines = enabled and not self.terminal

    @property
    def shows_bar(self) -> bool:
        return not self.bar.disable

    def refresh(self) -> None:
        for line in self.metrics.read():
            record = json.loads(line)
            self.records.append(record)
            if any(key.startswith("eval/") for key in record):
                continue  # an eval run's line, not a step
            if record.get("step") in self.steps:
                continue  # a step replayed by a restarted trainer
            self.steps.add(record.get("step"))
            figures = {  # name: (value, decimals)
                "reward": (record.get("rollout/raw_reward", 0.0), 3),
                "stale": (record.get("rollout/staleness_mean", 0.0), 2),
                "lp_diff": (record.get("train/train_rollout_logprob_abs_diff", 0.0), 4),
                "step_s": (record.get("perf/step_time", 0.0), 2),
            }
            self.bar.update(1)
            self.bar.set_postfix({name: f"{value:.{digits}f}" for name, (value, digits) in figures.items()})
            done = len(self.steps)
            if self.log_lines and (done % self.log_every == 0 or done == self.total):
                numbers = {name: round(value, digits + 2) for name, (value, digits) in figures.items()}
                log.info("progress", steps=done, of=self.total, step=record.get("step"), **numbers)

    def close(self) -> None:
        self.refresh()
        self.bar.close()


class JobLog:
    """RUN_DIR/logs/launcher.log: the launcher's own events as JSON lines (job started, a child died or
    was restarted, the job ended), so the run directory keeps them whatever the console showed; `vime
    report` reads restarts and resumed launches from it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, event: str, level: str = "info", **fields: Any) -> None:
        record = {**fields, "event": event, "level": level, "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")}
        try:
            with self.path.open("a") as handle:
                handle.write(json.dumps(record, default=str) + "\n")
        except OSError as exc:  # a full disk must not stop the job over its event log
            log.warning("launcher_log_failed", path=str(self.path), error=str(exc))


def _log_above_the_bar() -> None:
    """From now on this process's log lines (its own, the supervisor's) are written above a progress bar,
    as tqdm.write does, instead of through it. Loggers that already logged keep writing directly, so this
    runs before the launcher's and the supervisor's first log line."""
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=DummyTqdmFile(sys.stderr)))


class AddressInUse(RuntimeError):
    """The broker's address is taken on this machine, most likely by another job's broker."""


def check_broker_address_free(cfg: VimeConfig) -> None:
    """Raise AddressInUse if the broker could not bind its TCP address here. Without this check a second
    job on the same address would have its broker restarted until it gave up, while that job's workers
    said Hello to the first job's broker (which refuses them: `Hello.job`)."""
    endpoint = cfg.broker_bind or cfg.broker_address
    scheme, _, rest = endpoint.partition("://")
    host, _, port = rest.rpartition(":")
    if scheme != "tcp" or not port.isdigit() or int(port) == 0:
        return  # ipc, inproc or a port zmq picks: nothing to collide with
    host = host.strip("[]")
    host = "0.0.0.0" if host in ("*", "") else host
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as libzmq binds: TIME_WAIT is no obstacle
        try:
            probe.bind((host, int(port)))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise AddressInUse(
                    f"the broker's address {endpoint} is in use on this machine (another vime job?); give this job "
                    f"its own, e.g. --broker-address tcp://127.0.0.1:{free_port()}"
                ) from None
            # Anything else (a name that is not this machine's): the broker reports it when it binds.


# `vime run`'s exit code for a job that ran to the end but whose reward rose less than
# `--min-reward-gain` (1 is a failed process, 124 a timeout, 130 an interrupt).
DID_NOT_LEARN = 3


def run_job(
    cfg: VimeConfig, *, progress: bool = True, timeout_s: float | None = None, min_reward_gain: float | None = None
) -> int:
    """Run the whole job on this machine; returns the exit code for `vime run`.

    The demo model (`make_demo_model`) is built before any process starts; a build that misses its
    accuracy target raises `DemoModelError`. With `min_reward_gain`, a job that finishes but whose mean
    reward rose less than that (first 5 steps -> last 5) returns `DID_NOT_LEARN` and says so.
    """
    from vime.security import check_job

    terminal = sys.stderr.isatty()
    if progress and terminal:
        _log_above_the_bar()
    check_job(cfg)  # SecurityError (missing keys, plaintext off loopback) before any child starts
    check_broker_address_free(cfg)  # AddressInUse likewise
    from vime.tracking import check_installed

    check_installed(cfg)  # TrackerNotInstalled (--use-wandb / --use-tensorboard without the package) likewise
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    if cfg.make_demo_model:
        from vime.demo.model_factory import make_demo_model
        from vime.demo.tasks import DEMO_TASK_RECIPES, demo_task_of

        make_demo_model(cfg.hf_checkpoint, seed=0, **DEMO_TASK_RECIPES[demo_task_of(cfg.prompt_data)])
    if not Path(cfg.hf_checkpoint).exists():
        raise FileNotFoundError(f"--hf-checkpoint {cfg.hf_checkpoint} does not exist (pass --make-demo-model for the demo)")
    config_path = cfg.run_dir / "config.yaml"
    config_path.write_text(cfg.to_yaml())
    metrics_path = cfg.run_dir / "metrics.jsonl"
    if cfg.load is None:  # a resumed job appends to its metrics and process logs
        metrics_path.unlink(missing_ok=True)
        (cfg.run_dir / "trained_groups.jsonl").unlink(missing_ok=True)
        for old_log in (cfg.run_dir / "logs").glob("*.log"):
            old_log.unlink()
    cfg.status_file.unlink(missing_ok=True)
    _set_aside_unfinished_job(cfg)

    children = plan_children(cfg, config_path)
    job_log = JobLog(cfg.run_dir / "logs" / "launcher.log")
    job_log.write("job_started", num_rollout=cfg.num_rollout, load=cfg.load, children=[c.name for c in children], pid=os.getpid())
    view = ProgressView(metrics_path, cfg.num_rollout, enabled=progress, terminal=terminal)
    echo = ConsoleEcho(children)

    def say(text: str) -> None:
        tqdm.write(f"vime: {text}", file=sys.stderr)
        job_log.write("supervisor", level="warning", message=text)

    supervisor = Supervisor(
        children, cfg, say=say, new_rendezvous_port=free_port, has_checkpoint=lambda: _has_checkpoint(cfg),
    )  # fmt: skip
    restarts: dict[str, int] = {}
    stop = {"signal": 0}

    def on_signal(sig: int, _frame: Any) -> None:
        stop["signal"] = sig

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    started = time.monotonic()
    exit_code = 0
    try:
        supervisor.start(time.monotonic())
        trainer0 = next(c for c in children if c.name == "trainer-0")
        while True:
            time.sleep(0.5)
            view.refresh()
            echo.refresh()
            if stop["signal"]:
                log.warning("interrupted", signal=stop["signal"])
                job_log.write("interrupted", level="warning", signal=stop["signal"])
                exit_code = 130
                break
            if trainer0.poll() == 0:
                exit_code = 0
                _wait_for(children, GRACE_S)  # the broker tells the workers to shut down
                break
            try:
                supervisor.check(time.monotonic())
                restarts = _log_restarts(job_log, restarts, supervisor.restarts())
            except JobFailed as failure:
                job_log.write("child_failed", level="error", name=failure.child.name, code=failure.code, reason=failure.reason)
                tqdm.write(
                    f"\nvime: {failure.reason}; stopping the job. End of {failure.child.log_path}:\n{failure.child.tail()}\n",
                    file=sys.stderr,
                )
                log.error("child_failed", name=failure.child.name, code=failure.code, reason=failure.reason, log=str(failure.child.log_path))
                exit_code = 1
                break
            if timeout_s is not None and time.monotonic() - started > timeout_s:
                log.error("job_timeout", seconds=timeout_s)
                job_log.write("job_timeout", level="error", seconds=timeout_s)
                exit_code = 124
                break
    finally:
        stop_children(children)
        view.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if supervisor.restarts():
        log.info("restarts", **supervisor.restarts())
    summary = _finish_report(cfg, view.records)
    if exit_code == 0 and min_reward_gain is not None:
        exit_code = _learning_verdict(summary, min_reward_gain)
    job_log.write("job_ended", exit_code=exit_code, steps=len(view.steps), restarts=supervisor.restarts())
    return exit_code


def _log_restarts(job_log: JobLog, before: dict[str, int], now: dict[str, int]) -> dict[str, int]:
    """One `child_restarted` line per restart the supervisor made since `before`; returns `now`."""
    for name, count in now.items():
        if count > before.get(name, 0):
            job_log.write("child_restarted", level="warning", name=name, restarts=count)
    return now


def _learning_verdict(summary: dict[str, Any] | None, min_reward_gain: float) -> int:
    """0 if the reward rose by at least `min_reward_gain`, else `DID_NOT_LEARN`; says which either way."""
    if summary is None:
        tqdm.write(f"vime: the job did not learn: it trained no step (--min-reward-gain {min_reward_gain})", file=sys.stderr)
        return DID_NOT_LEARN
    rise = (f"reward first-5 {summary['reward_first5']:.3f} -> last-5 {summary['reward_last5']:.3f} "
            f"({summary['reward_gain']:+.3f})")
    if summary["reward_gain"] < min_reward_gain:
        tqdm.write(f"vime: the job did not learn: {rise}, less than --min-reward-gain {min_reward_gain}", file=sys.stderr)
        return DID_NOT_LEARN
    tqdm.write(f"vime: the job learned: {rise}, at least --min-reward-gain {min_reward_gain}")
    return 0


def _set_aside_unfinished_job(cfg: VimeConfig) -> None:
    """A run dir whose broker journal holds an unfinished job: `--load` resumes it (the broker picks the
    journal up); without `--load` this is a new job, so the old journal is kept under another name."""
    from vime.broker.journal import journal_file, move_aside

    path = journal_file(cfg.run_dir)
    if cfg.load is None and cfg.journal and path.exists():
        kept = move_aside(path, "interrupted")
        log.warning("previous_journal_set_aside", journal=str(kept), hint="to resume that job instead, run with --load latest")


def _has_checkpoint(cfg: VimeConfig) -> bool:
    from vime.trainer.checkpoint import CheckpointError, find_checkpoint

    try:
        find_checkpoint("latest", cfg.checkpoint_dir)
    except CheckpointError:
        return False
    return True


def _wait_for(children: list[Child], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(c.poll() is None for c in children):
        time.sleep(0.2)


def stop_children(children: list[Child]) -> None:
    """SIGTERM every live child (newest first), then SIGKILL whatever is left after the grace period."""
    for child in reversed(children):
        child.signal(signal.SIGTERM)
    _wait_for(children, GRACE_S)
    for child in children:
        if child.poll() is None:
            log.warning("child_killed", name=child.name)
        child.kill(wait_s=5)  # the group too: what a child that exited left running (vLLM engines)
        child.close_log()


def _finish_report(cfg: VimeConfig, records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Write the plot and summary.json, print the reward rise; returns the summary (None: no steps)."""
    from vime.metrics import plot_metrics, summarize, training_records

    if not training_records(records):
        return None
    png = plot_metrics(cfg.run_dir / "metrics.jsonl", cfg.run_dir / "reward_curve.png")
    summary = summarize(records)
    (cfg.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    tqdm.write(
        f"vime: {summary['steps']} steps in {summary['wall_time_s']:.0f} s; reward first-5 {summary['reward_first5']:.3f} "
        f"-> last-5 {summary['reward_last5']:.3f} (+{summary['reward_gain']:.3f}); metrics {cfg.run_dir / 'metrics.jsonl'}; plot {png}"
    )
    for run in summary["eval"]:
        passes = "  ".join(f"{k[len('eval/'):]} {v:.3f}" for k, v in run.items() if "/pass@" in k)
        tqdm.write(f"vime: eval at step {run['step']} (weights v{run['weight_version']}): {passes}")
    return summary
