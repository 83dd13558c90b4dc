"""Chaos test: the demo job under random SIGKILLs, then proof that nothing was lost or trained twice.

Starts the job's processes itself, from `vime.launcher.plan_children` (not through `vime run`, whose
launcher stops the whole job as soon as a child dies), on a config written into the run directory: the
demo config for exactly one epoch (`demo_num_prompts = num_rollout * rollout_batch_size`), 2 rollout and
2 reward workers, and short heartbeats and worker timeouts so leases of dead workers come back fast.

A seeded fault schedule then, while the job trains:
- SIGKILLs random rollout and reward workers (`--worker-kills`, at random training steps), each
  restarted after a short random delay, with its old worker id (the broker releases the dead one's
  leases when it says Hello again) or a new one (its leases come back when the old lease expires);
- SIGKILLs the broker once (`--broker-kills`, default 1) and restarts it with the same command line:
  it must resume from its journal (RUN_DIR/broker.journal), and every worker and the trainer reconnect;
- optionally (`--trainer-kills 1`) SIGKILLs trainer rank 0 and restarts it with `--load latest`; under
  `--supervised`, with `--trainer-ranks N`, any rank (`--trainer-kill-rank`), and all ranks restart.

At the end it checks, from RUN_DIR/status.json (the broker's final status), RUN_DIR/trained_groups.jsonl
(the trainer's record of the groups of each step; the last record of a step counts) and
RUN_DIR/metrics.jsonl:
- the job finished: trainer rank 0 exited 0, a metrics line for every step, the broker says finished;
- `groups_lost == 0` and `counters.groups_trained_twice == 0` in the broker's status;
- every prompt of the epoch was trained exactly once: the union of the steps' group ids is exactly
  {e0-p0 .. e0-p(N-1)} and no group id appears twice;
- no process died that the harness did not kill (workers must reconnect on their own);
- every fault was survived: the restarted process rejoined the job and training went on after it;
- the reward rose: mean `rollout/raw_reward` of the last W steps exceeds the first W steps' by more than
  max(--min-reward-gain, 3 standard errors of that difference, from the per-step values).

It prints a summary and writes RUN_DIR/chaos_summary.json (faults injected and survived by kind, each
fault, the checks, broker counters, wall time). Exit code 0 only if every check passed. Every child is
torn down at the end, on an exception, on Ctrl-C / SIGTERM, and by a watchdog (`--timeout`).

    .venv/bin/python bench/chaos.py --preset ci                  # the CI form: hf engine, tiny model, ~1 min
    .venv/bin/python bench/chaos.py --preset full                # vLLM, the demo model, arithmetic reward
    .venv/bin/python bench/chaos.py --preset ci --trainer-kills 1 --worker-kills 8 --seed 7
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from vime.process import Child, die_with_parent  # noqa: E402  (after the path set-up above)

WORKER_KINDS = ("rollout", "reward")
POLL_S = 0.05  # how often the harness looks at the job: well under a step of the fastest form

# Presets: the CI form (fast: transformers engine, a random tiny model, a reward it learns in a few
# steps) and the full form (the real demo: vLLM, the warm-started demo model, the arithmetic reward).
PRESETS: dict[str, dict[str, Any]] = {
    "ci": dict(
        engine="hf", model="tiny", task="digits", num_rollout=40, rollout_batch_size=8, n_samples_per_prompt=8,
        rollout_concurrency=4, reward_concurrency=4, lr=1e-2, worker_kills=4, broker_kills=1, trainer_kills=0,
        job_kills=1, reward_window=10, min_reward_gain=0.05, timeout=240.0, rejoin_window_s=15.0,
    ),
    "full": dict(
        engine="vllm", model="demo", task="arithmetic", num_rollout=120, rollout_batch_size=32, n_samples_per_prompt=8,
        rollout_concurrency=32, reward_concurrency=16, lr=None, worker_kills=6, broker_kills=1, trainer_kills=0,
        job_kills=1, reward_window=10, min_reward_gain=0.03, timeout=1200.0, rejoin_window_s=150.0,
    ),
}


# --- the CI form's reward ----------------------------------------------------------------------------


def digit_reward(prompt: str, response: str, label: str, metadata: dict) -> float:
    """The CI form's reward (`--task digits`): the fraction of the response's characters that are digits.

    A random-init tiny model starts near 10/64 (ten digits in a 64-token vocabulary) and GRPO pushes it
    up within a few steps, so "the reward still rises" is checkable in a one-minute job; the exact-match
    arithmetic reward stays at 0 for a random model. Loaded by the reward workers through
    `--custom-rm-path bench/chaos.py:digit_reward`.
    """
    from vime.demo.arithmetic import clean_response

    text = clean_response(response)
    return sum(c.isdigit() for c in text) / len(text) if text else 0.0


# --- processes ---------------------------------------------------------------------------------------


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL it if the harness dies (even by SIGKILL), so nothing leaks."""
    die_with_parent(signal.SIGKILL)


@dataclass
class Proc(Child):
    """One slot of the job (broker, rollout-0, ..., trainer-0) and its current incarnation: the
    launcher's Child, restartable, logging every incarnation to one file."""

    kind: str = ""  # broker | rollout | reward | trainer
    incarnation: int = 0
    started_at: float = 0.0
    killed: bool = False  # by the harness, on purpose: its exit is not a failure
    restart_at: float | None = None  # when to start the next incarnation
    restart_argv: list[str] | None = None
    joined_offset: int = 0  # size of the broker's log when this incarnation started
    joined: bool = False  # this incarnation said Hello to the broker

    @property
    def worker_id(self) -> str | None:
        return self.argv[self.argv.index("--worker-id") + 1] if "--worker-id" in self.argv else None

    def start(self, argv: list[str] | None = None) -> None:
        if argv is not None:
            self.argv = argv
        self.close_log()
        self.log_handle = self.log_path.open("ab")  # one log per slot; incarnations appended, marked
        self.log_handle.write(f"--- chaos: {self.name} incarnation {self.incarnation}: {' '.join(self.argv)}\n".encode())
        self.log_handle.flush()
        self.process = subprocess.Popen(
            self.argv, env=self.env, cwd=REPO, stdout=self.log_handle, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=_die_with_parent,
        )  # fmt: skip
        self.started_at = time.monotonic()
        self.killed = False
        self.restart_at = None
        self.restart_argv = None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self, wait_s: float = 10.0) -> None:
        """SIGKILL the process group and reap it; its exit is then not a failure."""
        self.killed = True
        super().kill(wait_s)


def teardown(procs: list[Proc], grace_s: float = 3.0) -> list[str]:
    """SIGTERM every live process group (newest first), SIGKILL what is left after `grace_s`; returns
    the names of those that had to be killed."""
    for p in reversed(procs):
        p.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p.alive for p in procs):
        time.sleep(0.1)
    forced = [p.name for p in procs if p.alive]
    for p in procs:
        Child.kill(p, wait_s=5)  # the group, also where its leader has exited (vLLM's engine processes)
        p.close_log()
    return forced


# --- reading the run directory -------------------------------------------------------------------------


def read_json(path: Path) -> dict[str, Any] | None:
    for _ in range(5):
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, json.JSONDecodeError):
            time.sleep(0.05)  # caught mid-write
    return None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written right now
    return out


def training_steps(metrics: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """step -> its last metrics line (a resumed trainer may write a step again; eval lines skipped)."""
    steps: dict[int, dict[str, Any]] = {}
    for record in metrics:
        if "rollout/raw_reward" in record and not any(k.startswith("eval/") for k in record):
            steps[int(record["step"])] = record
    return steps


def log_events(path: Path, event: str) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return events_in(path.read_text(errors="replace"), event)


def events_in(text: str, event: str) -> list[dict[str, Any]]:
    """The JSON log records of `event` in a log's text (other lines are skipped)."""
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("event") == event:
                out.append(record)
    return out


# --- faults -----------------------------------------------------------------------------------------


@dataclass
class Fault:
    kind: str  # rollout | reward | broker | trainer
    at_step: int  # fire once this many steps are trained
    delay_steps: float  # ... plus this (random) fraction of a step's time: a random moment within a step
    restart_after_s: float
    new_worker_id: bool = False
    # filled in when it happens
    target: str | None = None
    pid: int | None = None
    fired_at_s: float | None = None
    steps_at_fire: int | None = None
    restarted_at_s: float | None = None
    restarted_as: str | None = None
    log_offset: int = 0  # size of the broker's log when the victim was restarted
    rejoined_after_s: float | None = None
    restart_wall: float | None = None  # time.time() of the restart
    reconnected: list[str] | None = None  # broker faults: workers that said Hello to the new broker
    rejoined: bool | None = None
    progressed: bool | None = None
    survived: bool | None = None
    note: str = ""
    due_at: float | None = field(default=None, repr=False)  # monotonic time it fires (step reached + delay)

    @property
    def injected(self) -> bool:
        return self.fired_at_s is not None


class StepClock:
    """How long a training step takes lately, from the moments the harness saw the step count grow: the
    median over the last few steps, so a stall (a restart) does not stretch the estimate."""

    def __init__(self, window: int = 8, initial_s: float = 1.0) -> None:
        self.window, self.initial_s = window, initial_s
        self.last: tuple[int, float] | None = None
        self.per_step_s: list[float] = []

    def observe(self, steps: int, now: float) -> None:
        if self.last is not None and steps > self.last[0]:
            self.per_step_s = [*self.per_step_s, (now - self.last[1]) / (steps - self.last[0])][-self.window :]
        if self.last is None or steps != self.last[0]:
            self.last = (steps, now)

    def step_s(self) -> float:
        return statistics.median(self.per_step_s) if self.per_step_s else self.initial_s


def plan_faults(args: argparse.Namespace, rng: random.Random) -> list[Fault]:
    """The seeded schedule: worker kills at random steps in [1, worker_kill_span * num_rollout] (late
    enough that the job is warm, early enough that restarted workers rejoin before the end), the broker kill(s)
    near `--broker-kill-at` of the run, the trainer kill(s) near `--trainer-kill-at`. Every position is
    counted in training steps, never in seconds, so the same seed injects the same faults into a job
    however fast this machine trains it."""
    last = max(1, args.num_rollout - 2)
    span = max(1, min(last, round(args.num_rollout * args.worker_kill_span)))
    faults = []
    for _ in range(args.worker_kills):
        faults.append(Fault(
            kind=rng.choice(WORKER_KINDS), at_step=rng.randint(1, span), delay_steps=rng.uniform(0.0, args.max_fault_delay_steps),
            restart_after_s=rng.uniform(args.min_restart_delay, args.max_restart_delay), new_worker_id=rng.random() < 0.5,
        ))  # fmt: skip
    for i in range(args.broker_kills):
        step = min(last, max(1, round(args.num_rollout * args.broker_kill_at) + i * 2))
        faults.append(Fault("broker", step, rng.uniform(0.0, args.max_fault_delay_steps), args.broker_restart_delay))
    for i in range(args.trainer_kills):
        step = min(last, max(1, round(args.num_rollout * args.trainer_kill_at) + i * 2))
        faults.append(Fault("trainer", step, rng.uniform(0.0, args.max_fault_delay_steps), args.min_restart_delay))
    for i in range(args.job_kills):
        # Off the checkpoint steps: the resumed trainer must replay steps the job has trained since.
        step = min(last, max(1, round(args.num_rollout * args.job_kill_at) + i * 2))
        if args.save_interval and step % args.save_interval == 0:
            step = min(last, step + 1)
        faults.append(Fault("job", step, rng.uniform(0.0, args.max_fault_delay_steps), args.broker_restart_delay))
    faults.sort(key=lambda f: (f.at_step, f.delay_steps))
    return faults


# --- the job ----------------------------------------------------------------------------------------


def build_config(args: argparse.Namespace, run_dir: Path, model: Path):  # type: ignore[no-untyped-def]
    from vime.config import load_config
    from vime.launcher import free_port

    n_prompts = args.num_rollout * args.rollout_batch_size
    overrides: dict[str, Any] = dict(
        run_dir=run_dir, hf_checkpoint=model, make_demo_model=False, num_rollout=args.num_rollout,
        rollout_batch_size=args.rollout_batch_size, n_samples_per_prompt=args.n_samples_per_prompt,
        demo_num_prompts=n_prompts,  # exactly one epoch: every prompt once
        num_rollout_workers=args.rollout_workers, num_reward_workers=args.reward_workers,
        rollout_engine=args.engine, rollout_concurrency=args.rollout_concurrency,
        reward_concurrency=args.reward_concurrency, worker_timeout_s=args.worker_timeout_s,
        heartbeat_interval_s=args.heartbeat_interval_s, broker_address=f"tcp://127.0.0.1:{free_port()}",
        seed=args.seed, trainer_world_size=args.trainer_ranks,
        # Every restarted trainer would compile its layers again; the harness measures recovery, not speed.
        torch_compile=False,
    )  # fmt: skip
    if args.max_staleness is not None:
        overrides["max_staleness"] = args.max_staleness
    if args.lr is not None:
        overrides["lr"] = args.lr
    if args.task == "digits":
        overrides.update(rm_type="custom", custom_rm_path=f"{Path(__file__).resolve()}:digit_reward")
    if args.trainer_kills or args.job_kills:
        overrides["save_interval"] = args.save_interval
    if args.supervised:
        overrides["max_restarts"] = 10  # the harness may kill one worker several times within the restart window
    return load_config(REPO / "configs" / "demo.yaml", overrides)


def resolve_model(args: argparse.Namespace, run_dir: Path) -> Path:
    if args.hf_checkpoint is not None:
        return Path(args.hf_checkpoint).resolve()
    if args.model == "tiny":
        from vime.demo.model_factory import make_tiny_qwen3

        return Path(make_tiny_qwen3(run_dir.parent / f"{run_dir.name}-tiny-model", seed=0)).resolve()
    from vime.demo.model_factory import make_demo_model

    path = (REPO / "runs" / "demo-model").resolve()
    make_demo_model(path, seed=0)  # reused when already built
    return path


class Chaos:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.run_dir = Path(args.run_dir).resolve()
        self.rng = random.Random(args.seed)
        self.procs: list[Proc] = []
        self.faults: list[Fault] = []
        self.unexpected_exits: list[dict[str, Any]] = []
        self.events: list[str] = []
        self.t0 = time.monotonic()
        self.trainer_exit: int | None = None
        self.end_s: float | None = None
        self.timed_out = False
        # No new fault until this many steps are trained: set past a broker or trainer kill, so the
        # restarted process has served training again before anything else is killed.
        self.quiet_until_step = 0
        self.step_clock = StepClock()
        # The slowest start-to-Hello of any incarnation per worker kind, measured in this run: how long
        # a restarted worker of that kind needs on this machine, under this load.
        self.join_latency_s: dict[str, float] = {}

    # -- helpers --
    def now(self) -> float:
        return round(time.monotonic() - self.t0, 2)

    def say(self, text: str) -> None:
        line = f"[chaos {self.now():7.1f}s] {text}"
        self.events.append(line)
        if not self.args.quiet:
            print(line, flush=True)

    def proc(self, name: str) -> Proc:
        return next(p for p in self.procs if p.name == name)

    def steps_done(self) -> int:
        steps = training_steps(read_jsonl(self.run_dir / "metrics.jsonl"))
        done = max(steps) + 1 if steps else 0
        self.step_clock.observe(done, time.monotonic())
        return done

    def broker_log_size(self) -> int:
        try:
            return (self.run_dir / "logs" / "broker.log").stat().st_size
        except OSError:
            return 0

    def has_joined(self, p: Proc) -> bool:
        if not p.joined:
            p.joined = any(e.get("worker") == p.worker_id for e in self.broker_events_after(p.joined_offset, "worker_joined"))
            if p.joined:
                latency = time.monotonic() - p.started_at
                self.join_latency_s[p.kind] = max(self.join_latency_s.get(p.kind, 0.0), latency)
        return p.joined

    def rejoin_window_s(self, kind: str) -> float:
        """How close to the job's end a restarted worker may come back and still not be expected to
        rejoin: the configured window, or twice the slowest join of that kind seen in this run."""
        return max(self.args.rejoin_window_s, 2.0 * self.join_latency_s.get(kind, 0.0))

    def broker_events_after(self, offset: int, event: str) -> list[dict[str, Any]]:
        path = self.run_dir / "logs" / "broker.log"
        try:
            with path.open("rb") as handle:
                handle.seek(offset)
                text = handle.read().decode(errors="replace")
        except OSError:
            return []
        return events_in(text, event)

    # -- setup --
    def prepare(self) -> None:
        from vime.launcher import plan_children

        if self.run_dir.exists():  # a previous run's outputs would be read as this one's (or resumed)
            for pattern in ("metrics.jsonl", "status.json", "trained_groups.jsonl", "broker.journal*", "chaos_summary.json", "logs/*.log"):
                for f in self.run_dir.glob(pattern):
                    f.unlink()
            shutil.rmtree(self.run_dir / "checkpoints", ignore_errors=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        model = resolve_model(self.args, self.run_dir)
        self.cfg = build_config(self.args, self.run_dir, model)
        config_path = self.run_dir / "config.yaml"
        config_path.write_text(self.cfg.to_yaml())
        for child in plan_children(self.cfg, config_path):
            kind = child.name.split("-")[0]
            self.procs.append(Proc(child.name, list(child.argv), dict(child.env), child.log_path, kind=kind))
        self.faults = plan_faults(self.args, self.rng)
        self.say(
            f"run {self.run_dir}: {self.cfg.num_rollout} steps x {self.cfg.rollout_batch_size} groups "
            f"({self.cfg.demo_num_prompts} prompts, one epoch), engine {self.cfg.rollout_engine}, model {model}; "
            f"{len(self.faults)} faults planned: "
            + ", ".join(f"{f.kind}@step{f.at_step}" for f in self.faults)
        )

    # -- the loop --
    def run(self) -> None:
        self._start_job()
        deadline = self.t0 + self.args.timeout
        pending = list(self.faults)
        while True:
            time.sleep(POLL_S)
            now = time.monotonic()
            if now > deadline:
                self.timed_out = True
                self.say(f"watchdog: the job did not finish within {self.args.timeout:.0f} s")
                return
            steps = self.steps_done()
            if self._job_over(now, steps):
                return
            self._fire_due(pending, now, steps)

    def _start_job(self) -> None:
        for p in self.procs:
            p.start()

    def _job_over(self, now: float, steps: int) -> bool:
        """Restarts what is due and watches the processes; True once trainer rank 0 has exited."""
        self._restart_due(now)
        for p in self.procs:
            if p.kind in WORKER_KINDS and p.alive:
                self.has_joined(p)  # measures join latency as it happens
        trainer = self.proc("trainer-0")
        code = trainer.poll()
        if code is not None and not trainer.killed:
            self.trainer_exit = code
            self.end_s = self.now()
            self.say(f"trainer-0 exited with code {code} after {steps} steps")
            if code == 0:
                self._wait_for_broker_exit()
            return True
        self._check_unexpected_exits(now, steps)
        return False

    def _fire_due(self, pending: list[Fault], now: float, steps: int) -> None:
        if steps >= self.args.num_rollout:
            return  # every step is trained: a kill now is no mid-job fault (the job may have finished)
        if pending and steps >= max(pending[0].at_step, self.quiet_until_step) and not self._restart_pending():
            fault = pending[0]
            if fault.due_at is None:  # its step is reached: a random moment within the step starts
                fault.due_at = now + fault.delay_steps * self.step_clock.step_s()
            if now >= fault.due_at:
                if self._fire(fault, now, steps):
                    pending.pop(0)
                else:
                    fault.due_at = now + 0.5  # no victim right now (all restarting): try again shortly

    def _wait_for_broker_exit(self) -> None:
        """After the last step the broker shuts the workers down and, a few seconds later, exits. Once
        its status says finished there is nothing left to wait for: the teardown's SIGTERM makes it
        write its final status.json at once."""
        broker = self.proc("broker")
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and broker.alive:
            if (read_json(self.run_dir / "status.json") or {}).get("finished") is True:
                break
            time.sleep(0.2)
        for p in self.procs:
            p.restart_at = None  # the job is over: nothing left to rejoin

    def _restart_pending(self) -> bool:
        """A killed broker or trainer the harness has not restarted yet."""
        return any(p.restart_at is not None for p in self.procs if p.kind in ("broker", "trainer"))

    def _quiet_after(self, steps: int) -> None:
        """No other fault until `--settle-steps` more steps are trained: progress past the kill's step
        needs the restarted broker or trainer back in the job (a resumed trainer replays the steps since
        its checkpoint first)."""
        self.quiet_until_step = steps + self.args.settle_steps

    def _fire(self, fault: Fault, now: float, steps: int) -> bool:
        if fault.kind in WORKER_KINDS:
            # Only workers that have joined the job (hold or can hold leases): killing one still
            # starting up tests nothing, and its fault could not show a rejoin.
            victims = [p for p in self.procs if p.kind == fault.kind and p.alive and p.restart_at is None and self.has_joined(p)]
            if not victims:
                return False
            victim = self.rng.choice(victims)
        elif fault.kind == "job":
            return self._fire_job(fault, now, steps)
        else:
            victim = self.proc("broker" if fault.kind == "broker" else "trainer-0")
            if not victim.alive:
                return False
        fault.target = victim.name
        fault.pid = victim.process.pid if victim.process else None
        fault.fired_at_s = self.now()
        fault.steps_at_fire = steps
        victim.kill()
        victim.incarnation += 1
        argv = list(victim.argv)
        if fault.kind in WORKER_KINDS and fault.new_worker_id:
            i = argv.index("--worker-id")
            argv[i + 1] = f"{victim.name}-r{victim.incarnation}"
        if fault.kind == "trainer" and "--load" not in argv:
            argv += ["--load", "latest"]
        victim.restart_at = now + fault.restart_after_s
        victim.restart_argv = argv
        worker_id = argv[argv.index("--worker-id") + 1] if "--worker-id" in argv else None
        fault.restarted_as = worker_id or victim.name
        if fault.kind in ("broker", "trainer"):
            self._quiet_after(steps)
        self.say(
            f"SIGKILL {victim.name} (pid {fault.pid}) at step {steps}; restart in {fault.restart_after_s:.1f} s"
            + (f" as {worker_id}" if fault.kind in WORKER_KINDS else "")
            + (" with --load latest" if fault.kind == "trainer" else "")
        )
        fault.note = "restart pending"
        return True

    def _fire_job(self, fault: Fault, now: float, steps: int) -> bool:
        """The broker and trainer rank 0 at once (a lost machine, a killed job): both restart, the broker
        from its journal, the trainer with --load latest from a checkpoint behind the job's step."""
        broker, trainer = self.proc("broker"), self.proc("trainer-0")
        if not (broker.alive and trainer.alive):
            return False
        fault.target, fault.restarted_as = "trainer-0", "trainer-0"  # its rejoin proves both are back
        fault.pid = trainer.process.pid if trainer.process else None
        fault.fired_at_s, fault.steps_at_fire = self.now(), steps
        broker.kill()
        trainer.kill()
        for victim in (broker, trainer):
            victim.incarnation += 1
            victim.restart_at = now + fault.restart_after_s
            victim.restart_argv = list(victim.argv)
        if "--load" not in trainer.argv:
            trainer.restart_argv = [*trainer.argv, "--load", "latest"]
        self._quiet_after(steps)
        self.say(f"SIGKILL broker and trainer-0 at step {steps}; both restart in {fault.restart_after_s:.1f} s (trainer with --load latest)")
        fault.note = "restart pending"
        return True

    def _restart_due(self, now: float) -> None:
        for p in self.procs:
            if p.restart_at is not None and now >= p.restart_at:
                argv = p.restart_argv or p.argv
                offset = self.broker_log_size()  # a restarted broker appends to the same log
                p.start(argv)
                p.joined_offset, p.joined = offset, False
                for fault in self.faults:
                    if fault.target == p.name and fault.injected and fault.restarted_at_s is None:
                        fault.restarted_at_s = self.now()
                        fault.log_offset = offset
                        fault.restart_wall = time.time()
                        fault.note = ""
                self.say(f"restarted {p.name} (pid {p.process.pid if p.process else '?'})")

    def _check_unexpected_exits(self, now: float, steps: int) -> None:
        for p in self.procs:
            if p.name == "trainer-0" or p.killed or p.restart_at is not None or p.process is None:
                continue
            code = p.poll()
            if code is None:
                continue
            if code == 0:
                # Workers exit 0 only when the broker says the job is over (Shutdown) and the broker
                # only when it finished: the end of the job, not a crash. (If it came early, the trainer
                # never finishes and the job_finished check fails.)
                p.killed = True
                self.say(f"{p.name} exited with code 0 (job over) at step {steps}")
                continue
            record = {"name": p.name, "code": code, "at_s": self.now(), "log_tail": p.tail(15)}
            self.unexpected_exits.append(record)
            self.say(f"UNEXPECTED: {p.name} exited with code {code} (not killed by the harness); restarting it\n{record['log_tail']}")
            p.killed = True
            p.incarnation += 1
            p.restart_at = now + 1.0
            p.restart_argv = list(p.argv)

    # -- results --
    def assess_faults(self, steps_final: int) -> None:
        """A fault is survived when the job finished, training went on after it, and the restarted
        process rejoined: a worker or the trainer said Hello to the broker again, a restarted broker
        started serving (and the workers said Hello to it). A worker restarted less than
        `--rejoin-window-s` before the job ended may not have had the time to rejoin: not held against it."""
        finished = self.trainer_exit == 0
        end = self.end_s if self.end_s is not None else self.now()
        for fault in self.faults:
            if not fault.injected:
                fault.note = fault.note or "not injected (the job ended first)"
                continue
            assert fault.steps_at_fire is not None and fault.restarted_as is not None
            fault.progressed = steps_final > fault.steps_at_fire
            if fault.restarted_at_s is None:
                fault.note = "the job finished before its restart was due"
                fault.rejoined = None
            else:
                if fault.kind == "broker":
                    seen = self.broker_events_after(fault.log_offset, "broker_started")
                    joined = self.broker_events_after(fault.log_offset, "worker_joined")
                    fault.reconnected = sorted({e.get("worker", "?") for e in joined})
                else:
                    seen = [e for e in self.broker_events_after(fault.log_offset, "worker_joined") if e.get("worker") == fault.restarted_as]
                if seen:
                    fault.rejoined = True
                    fault.rejoined_after_s = _seconds_between(seen[0].get("timestamp"), fault)
                elif fault.kind in WORKER_KINDS and end - fault.restarted_at_s < self.rejoin_window_s(fault.kind):
                    fault.rejoined = None
                    fault.note = (
                        f"restarted {end - fault.restarted_at_s:.1f} s before the job ended: too late to rejoin "
                        f"(a {fault.kind} worker took up to {self.join_latency_s.get(fault.kind, 0.0):.1f} s to join here)"
                    )
                else:
                    fault.rejoined = False
            fault.survived = bool(finished and fault.progressed and fault.rejoined is not False)

    def summary(self, wall_s: float) -> dict[str, Any]:
        status = read_json(self.run_dir / "status.json") or {}
        metrics = read_jsonl(self.run_dir / "metrics.jsonl")
        steps = training_steps(metrics)
        self.assess_faults(max(steps) + 1 if steps else 0)
        checks = run_checks(self.args, self.run_dir, status, steps, self.trainer_exit, self.timed_out, self.unexpected_exits, self.faults)
        injected: dict[str, int] = {}
        survived: dict[str, int] = {}
        for fault in self.faults:
            if fault.injected:
                injected[fault.kind] = injected.get(fault.kind, 0) + 1
                survived[fault.kind] = survived.get(fault.kind, 0) + int(bool(fault.survived))
        counters = status.get("counters", {})
        return {
            "passed": all(c["passed"] for c in checks),
            "run_dir": str(self.run_dir),
            "seed": self.args.seed,
            "preset": self.args.preset,
            "engine": self.args.engine,
            "task": self.args.task,
            "num_rollout": self.args.num_rollout,
            "rollout_batch_size": self.args.rollout_batch_size,
            "prompts": self.args.num_rollout * self.args.rollout_batch_size,
            "wall_time_s": round(wall_s, 1),
            "steps_trained": len(steps),
            "faults_injected": injected,
            "faults_survived": survived,
            "faults_planned": len(self.faults),
            "unexpected_exits": [{k: v for k, v in e.items() if k != "log_tail"} for e in self.unexpected_exits],
            "checks": checks,
            "broker": {
                "finished": status.get("finished"),
                "groups_lost": status.get("groups_lost"),
                **{k: counters.get(k) for k in (
                    "groups_admitted", "groups_trained", "groups_trained_twice", "groups_requeued",
                    "late_results_dropped", "broker_restarts", "groups_dropped_stale", "groups_failed", "bad_messages",
                )},
            },  # fmt: skip
            "faults": [asdict(f) for f in self.faults],
            "events": self.events,
        }


class SupervisedChaos(Chaos):
    """The same faults under `vime run` (`--supervised`): the harness only kills, one process as a crash
    does (not its process group); the launcher's supervisor must notice, clean up and restart. Victims
    and their new incarnations are read from RUN_DIR/processes.json, which the launcher keeps."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.awaiting_restart: dict[str, int] = {}  # name -> the pid killed, until a new one shows
        self.kill_offsets: dict[str, int] = {}  # name -> the broker log's size when it was last killed
        self.kills: dict[str, int] = {}
        # Worker incarnations whose Hello is awaited: name -> (broker log offset, start time), to measure
        # how long a worker needs to join on this machine (see `rejoin_window_s`).
        self.awaiting_join: dict[str, tuple[int, float]] = {}

    def prepare(self) -> None:
        (self.run_dir / "launcher.log").unlink(missing_ok=True)
        super().prepare()
        env = dict(self.procs[0].env)
        argv = [sys.executable, "-m", "vime.cli", "run", str(self.run_dir / "config.yaml"), "--no-progress",
                "--timeout", str(self.args.timeout)]  # fmt: skip
        self.launcher = Proc("launcher", argv, env, self.run_dir / "launcher.log", kind="launcher")
        self.procs = [self.launcher]

    def processes(self) -> dict[str, dict[str, Any]]:
        return read_json(self.run_dir / "processes.json") or {}

    def _restart_pending(self) -> bool:
        """A killed broker or trainer rank the supervisor has not restarted yet."""
        return any(name.split("-")[0] in ("broker", "trainer") for name in self.awaiting_restart)

    def _start_job(self) -> None:
        self.launcher.start()
        self.awaiting_join = {name: (0, time.monotonic()) for name in self._worker_names()}

    def _job_over(self, now: float, steps: int) -> bool:
        self._note_restarts()
        self._note_joins(now)
        code = self.launcher.poll()
        if code is None:
            return False
        self.trainer_exit = code  # vime run exits 0 only when the trainer finished
        self.end_s = self.now()
        self.say(f"vime run exited with code {code} after {steps} steps\n{self.launcher.tail(8)}")
        return True

    def _worker_names(self) -> list[str]:
        cfg = self.cfg
        return [f"rollout-{i}" for i in range(cfg.num_rollout_workers)] + [f"reward-{i}" for i in range(cfg.num_reward_workers)]

    def _note_joins(self, now: float) -> None:
        for name, (offset, started) in list(self.awaiting_join.items()):
            if any(e.get("worker") == name for e in self.broker_events_after(offset, "worker_joined")):
                kind = name.split("-")[0]
                self.join_latency_s[kind] = max(self.join_latency_s.get(kind, 0.0), now - started)
                del self.awaiting_join[name]

    def _joined(self, name: str) -> bool:
        joined = self.broker_events_after(self.kill_offsets.get(name, 0), "worker_joined")
        return any(e.get("worker") == name for e in joined)

    def _fire(self, fault: Fault, now: float, steps: int) -> bool:
        table = self.processes()
        if fault.kind in WORKER_KINDS:
            candidates = [n for n in table if n.split("-")[0] == fault.kind and n not in self.awaiting_restart and self._joined(n)]
            if not candidates:
                return False
            names = [self.rng.choice(candidates)]
        else:
            rank = f"trainer-{self.args.trainer_kill_rank}"
            names = {"broker": ["broker"], "trainer": [rank], "job": ["broker", "trainer-0"]}[fault.kind]
            if any(n not in table or n in self.awaiting_restart for n in names):
                return False
        offset = self.broker_log_size()
        for name in names:
            pid = int(table[name]["pid"])
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                return False
            self.awaiting_restart[name] = pid
            self.kill_offsets[name] = offset
            self.kills[name] = self.kills.get(name, 0) + 1
        fault.target = fault.restarted_as = names[-1]
        if fault.kind == "trainer":
            fault.restarted_as = "trainer-0"  # the ranks restart together; rank 0's Hello to the broker proves it
        fault.pid = int(table[names[-1]]["pid"])
        fault.fired_at_s, fault.steps_at_fire = self.now(), steps
        fault.log_offset = offset  # the victim's next incarnation logs after this
        fault.note = "restart pending"
        if fault.kind not in WORKER_KINDS:
            self._quiet_after(steps)
        self.say(f"SIGKILL {' and '.join(names)} (pid {fault.pid}) at step {steps}; the supervisor restarts it")
        return True

    def _note_restarts(self) -> None:
        table = self.processes()
        for name, pid in list(self.awaiting_restart.items()):
            entry = table.get(name)
            if entry is None or entry.get("pid") == pid:
                continue
            del self.awaiting_restart[name]
            if name.split("-")[0] in WORKER_KINDS:
                self.awaiting_join[name] = (self.kill_offsets.get(name, 0), time.monotonic())
            for fault in self.faults:
                if fault.target == name and fault.injected and fault.restarted_at_s is None:
                    fault.restarted_at_s, fault.restart_wall, fault.note = self.now(), time.time(), ""
            self.say(f"the supervisor restarted {name} (pid {entry.get('pid')})")

    def summary(self, wall_s: float) -> dict[str, Any]:
        table = self.processes()
        # A restart the harness did not cause is a process that died on its own.
        for name, entry in table.items():
            slot_kills = self.kills.get(name, 0)
            if name.startswith("trainer-"):  # the ranks restart together, whichever was killed
                slot_kills = sum(n for victim, n in self.kills.items() if victim.startswith("trainer-"))
            extra = int(entry.get("restarts", 0)) - slot_kills
            if extra > 0:
                self.unexpected_exits.append({"name": name, "code": "?", "at_s": "?", "restarts_not_caused": extra})
        out = super().summary(wall_s)
        out["supervised"] = True
        out["restart_latency_s"] = {name: entry.get("downtime_s", []) for name, entry in table.items() if entry.get("downtime_s")}
        return out


def _seconds_between(timestamp: str | None, fault: Fault) -> float | None:
    """Seconds from the fault's restart to a broker log event's ISO timestamp (None if unknown)."""
    if not timestamp or fault.restart_wall is None:
        return None
    from datetime import datetime

    try:
        when = datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
    return round(when - fault.restart_wall, 2)


def _check(name: str, passed: bool, detail: str) -> dict[str, Any]:
    return {"name": name, "passed": bool(passed), "detail": detail}


def reward_rise(steps: dict[int, dict[str, Any]], window: int, min_gain: float) -> dict[str, Any]:
    """Mean reward of the last `window` steps vs the first `window`: the gain must exceed
    max(min_gain, 3 * SE), SE = sqrt(var_first / W + var_last / W) from the per-step means (each step's
    reward is already a mean over its rollout_batch_size * n_samples samples, so per-step values carry
    the within-step correlation of a group's samples). Without learning the gain is 0 +- SE: 3 SE keeps a
    flat curve from passing by chance (< 0.2 % one-sided, for roughly normal step means)."""
    ordered = [steps[s]["rollout/raw_reward"] for s in sorted(steps)]
    window = max(1, min(window, len(ordered) // 2))
    first, last = ordered[:window], ordered[-window:]
    if not first:
        return _check("reward_rises", False, "no training steps")

    def mean(x: list[float]) -> float:
        return sum(x) / len(x)

    def var(x: list[float]) -> float:
        m = mean(x)
        return sum((v - m) ** 2 for v in x) / max(1, len(x) - 1)

    gain = mean(last) - mean(first)
    se = math.sqrt(var(first) / len(first) + var(last) / len(last))
    margin = max(min_gain, 3 * se)
    out = _check(
        "reward_rises", gain > margin,
        f"mean reward of the first {window} steps {mean(first):.3f} -> last {window} steps {mean(last):.3f}: "
        f"gain {gain:+.3f} vs required > {margin:.3f} (max of {min_gain} and 3 SE = {3 * se:.3f})",
    )  # fmt: skip
    out.update(first=round(mean(first), 4), last=round(mean(last), 4), gain=round(gain, 4), margin=round(margin, 4))
    return out


def run_checks(
    args: argparse.Namespace, run_dir: Path, status: dict[str, Any], steps: dict[int, dict[str, Any]],
    trainer_exit: int | None, timed_out: bool, unexpected: list[dict[str, Any]], faults: list[Fault],
) -> list[dict[str, Any]]:  # fmt: skip
    n_steps, batch = args.num_rollout, args.rollout_batch_size
    checks = []
    missing_steps = sorted(set(range(n_steps)) - set(steps))
    finished = trainer_exit == 0 and not timed_out and not missing_steps and status.get("finished") is True
    checks.append(_check(
        "job_finished", finished,
        f"trainer-0 exit code {trainer_exit}, {'watchdog timeout, ' if timed_out else ''}{len(steps)}/{n_steps} steps "
        f"in metrics.jsonl{f' (missing {missing_steps[:10]})' if missing_steps else ''}, broker finished={status.get('finished')}",
    ))  # fmt: skip

    counters = status.get("counters", {})
    if "groups_lost" in status:
        checks.append(_check("groups_lost_zero", status["groups_lost"] == 0, f"groups_lost = {status['groups_lost']}"))
    else:
        checks.append(_check("groups_lost_zero", False, "status.json has no top-level 'groups_lost' (the broker does not report it)"))
    if "groups_trained_twice" in counters:
        twice = counters["groups_trained_twice"]
        checks.append(_check("groups_trained_twice_zero", twice == 0, f"counters.groups_trained_twice = {twice}"))
    else:
        checks.append(_check("groups_trained_twice_zero", False, "status.json counters have no 'groups_trained_twice' (the broker does not report it)"))
    if "groups_trained" in counters:
        checks.append(_check(
            "broker_counts_every_group", counters["groups_trained"] == n_steps * batch,
            f"counters.groups_trained = {counters['groups_trained']}, expected {n_steps * batch}",
        ))  # fmt: skip

    prompts_once = every_prompt_once(run_dir / "trained_groups.jsonl", n_steps, batch)
    stale = counters.get("groups_dropped_stale", 0)
    if not prompts_once["passed"] and stale:
        prompts_once["detail"] += (
            f" [the broker dropped {stale} scored groups at its staleness gate (counters.groups_dropped_stale); "
            "their prompts were not generated again, and prompts of the next epoch took their slots]"
        )  # fmt: skip
    checks.append(prompts_once)
    checks.append(_check(
        "no_unexpected_exits", not unexpected,
        "none" if not unexpected else "; ".join(f"{e['name']} exited {e['code']} at {e['at_s']} s" for e in unexpected),
    ))  # fmt: skip
    injected = [f for f in faults if f.injected]
    not_survived = [f for f in injected if not f.survived]
    checks.append(_check(
        "faults_survived", not not_survived and bool(injected) or (not injected and not faults),
        f"{len(injected) - len(not_survived)}/{len(injected)} injected faults survived"
        + (f"; not: {', '.join(f'{f.kind} {f.target}@step{f.steps_at_fire} (rejoined={f.rejoined}, progressed={f.progressed})' for f in not_survived)}" if not_survived else "")
        + (f"; {len(faults) - len(injected)} planned faults not injected (the job ended first)" if len(injected) < len(faults) else ""),
    ))  # fmt: skip
    for kind, wanted in (("broker", args.broker_kills), ("trainer", args.trainer_kills), ("job", args.job_kills)):
        if wanted:
            done = sum(1 for f in injected if f.kind == kind)
            checks.append(_check(f"{kind}_kill_injected", done == wanted, f"{done}/{wanted} {kind} kills injected"))
    checks.append(reward_rise(steps, args.reward_window, args.min_reward_gain))
    return checks


def every_prompt_once(path: Path, n_steps: int, batch: int) -> dict[str, Any]:
    """Union of the last record of each step in trained_groups.jsonl == every prompt of epoch 0, once."""
    if not path.exists():
        return _check("every_prompt_trained_once", False, f"{path.name} does not exist (the trainer does not write it)")
    last: dict[int, list[str]] = {}
    for record in read_jsonl(path):
        last[int(record["step"])] = list(record["group_ids"])  # a replayed step: the last record counts
    seen: dict[str, int] = {}
    repeated = []
    for step in sorted(last):
        for gid in last[step]:
            if gid in seen:
                repeated.append(f"{gid} (steps {seen[gid]} and {step})")
            seen[gid] = step
    expected = {f"e0-p{i}" for i in range(n_steps * batch)}
    missing = sorted(expected - set(seen), key=lambda g: int(g.split("-p")[1]))
    extra = sorted(set(seen) - expected)
    missing_steps = sorted(set(range(n_steps)) - set(last))
    ok = not repeated and not missing and not extra and not missing_steps
    detail = (
        f"{len(last)}/{n_steps} steps recorded, {len(seen)} distinct groups of {len(expected)} prompts"
        + (f"; trained twice: {repeated[:5]}" if repeated else "")
        + (f"; never trained: {missing[:10]}{'...' if len(missing) > 10 else ''} ({len(missing)})" if missing else "")
        + (f"; not of this epoch: {extra[:10]}" if extra else "")
        + (f"; steps without a record: {missing_steps[:10]}" if missing_steps else "")
    )
    return _check("every_prompt_trained_once", ok, detail)


def print_summary(summary: dict[str, Any]) -> None:
    print("\n=== chaos summary ===")
    print(f"run {summary['run_dir']}  seed {summary['seed']}  engine {summary['engine']}  task {summary['task']}  "
          f"{summary['steps_trained']}/{summary['num_rollout']} steps  wall {summary['wall_time_s']} s")  # fmt: skip
    kinds = sorted(set(summary["faults_injected"]) | {"rollout", "reward", "broker", "trainer"})
    print("faults  " + "  ".join(f"{k}: {summary['faults_survived'].get(k, 0)}/{summary['faults_injected'].get(k, 0)} survived" for k in kinds))
    print("broker  " + "  ".join(f"{k}={v}" for k, v in summary["broker"].items()))
    for c in summary["checks"]:
        print(f"  [{'PASS' if c['passed'] else 'FAIL'}] {c['name']}: {c['detail']}")
    print(f"RESULT: {'PASS' if summary['passed'] else 'FAIL'}  ({summary['run_dir']}/chaos_summary.json)")


# --- entry point --------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench/chaos.py", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog="\n\n".join(__doc__.split("\n\n")[1:]),
    )  # fmt: skip
    p.add_argument("--preset", choices=sorted(PRESETS), default="ci", help="defaults for the flags below (default: ci)")
    p.add_argument("--run-dir", default=None, help="default: runs/chaos-PRESET")
    p.add_argument("--seed", type=int, default=0, help="seeds the fault schedule (and the job)")
    p.add_argument("--engine", choices=["hf", "vllm"], help="rollout engine (ci: hf, full: vllm)")
    p.add_argument("--model", choices=["tiny", "demo"], help="tiny: random tiny Qwen3 (seconds); demo: the warm-started demo model")
    p.add_argument("--hf-checkpoint", default=None, help="use this model directory instead of --model")
    p.add_argument("--task", choices=["digits", "arithmetic"], help="reward: digits (fraction of digit characters, learnable by a random model) or arithmetic (the demo's exact match)")
    p.add_argument("--num-rollout", type=int, help="training steps (the epoch is num_rollout * rollout_batch_size prompts)")
    p.add_argument("--rollout-batch-size", type=int)
    p.add_argument("--n-samples-per-prompt", type=int)
    p.add_argument("--rollout-concurrency", type=int)
    p.add_argument("--reward-concurrency", type=int)
    p.add_argument("--lr", type=float, help="learning rate (full: the demo config's)")
    p.add_argument("--max-staleness", type=int, help="default: the demo config's (1)")
    p.add_argument("--rollout-workers", type=int, default=2)
    p.add_argument("--reward-workers", type=int, default=2)
    p.add_argument("--worker-timeout-s", type=float, default=3.0, help="lease expiry of a silent worker")
    p.add_argument("--heartbeat-interval-s", type=float, default=0.5)
    p.add_argument("--worker-kills", type=int, help="SIGKILLs of random rollout/reward workers")
    p.add_argument("--worker-kill-span", type=float, default=0.75, help="worker kills happen in the first this fraction of the steps")
    p.add_argument("--broker-kills", type=int, help="SIGKILLs of the broker (each restarted with the same command line)")
    p.add_argument("--broker-kill-at", type=float, default=0.4, help="fraction of the steps after which the broker is killed")
    p.add_argument("--broker-restart-delay", type=float, default=2.0)
    p.add_argument("--trainer-kills", type=int, help="SIGKILLs of trainer rank 0 (restarted with --load latest); off by default")
    p.add_argument("--trainer-kill-at", type=float, default=0.7)
    p.add_argument("--trainer-ranks", type=int, default=1, help="trainer ranks (--trainer-world-size); more than 1 needs --supervised")
    p.add_argument("--trainer-kill-rank", type=int, default=0, help="which trainer rank a trainer kill hits (--supervised; all ranks restart together)")
    p.add_argument("--job-kills", type=int, help="SIGKILLs of the broker and trainer rank 0 together, off a checkpoint step (both restarted)")
    p.add_argument("--job-kill-at", type=float, default=0.55, help="fraction of the steps after which broker and trainer are killed together")
    p.add_argument("--save-interval", type=int, default=4, help="checkpoint interval when the trainer is killed")
    p.add_argument("--rejoin-window-s", type=float, help="a worker restarted this close to the end need not rejoin (ci 15, full 150)")
    p.add_argument("--min-restart-delay", type=float, default=0.5)
    p.add_argument("--max-restart-delay", type=float, default=3.0)
    p.add_argument("--max-fault-delay-steps", type=float, default=1.0,
                   help="a fault fires a random delay after its step is reached, up to this many steps' time (the recent step time)")
    p.add_argument("--settle-steps", type=int, default=2, help="no other fault until this many steps after a broker/trainer kill")
    p.add_argument("--reward-window", type=int, help="steps averaged at each end for the reward-rise check")
    p.add_argument("--min-reward-gain", type=float)
    p.add_argument("--timeout", type=float, help="watchdog: seconds until everything is torn down (ci 240, full 1200)")
    p.add_argument("--supervised", action="store_true", help="run the job under `vime run` and let its supervisor restart what is killed")
    p.add_argument("--quiet", action="store_true", help="print only the summary")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.run_dir is None:
        args.run_dir = str(REPO / "runs" / f"chaos-{args.preset}")
    if args.trainer_ranks < 1 or not 0 <= args.trainer_kill_rank < args.trainer_ranks:
        raise SystemExit(f"chaos: --trainer-kill-rank {args.trainer_kill_rank} is not one of --trainer-ranks {args.trainer_ranks}")
    if (args.trainer_ranks > 1 or args.trainer_kill_rank) and not args.supervised:
        # By hand the harness restarts rank 0 alone; the other ranks' process group is gone with it.
        raise SystemExit("chaos: --trainer-ranks above 1 and --trainer-kill-rank need --supervised (the ranks restart together)")
    return args


class _Stop(Exception):
    pass


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    chaos = SupervisedChaos(args) if args.supervised else Chaos(args)
    started = time.monotonic()

    def on_signal(sig: int, _frame: Any) -> None:
        raise _Stop(f"signal {sig}")

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    # A last-resort watchdog: if the main loop itself hangs, kill every process group and leave.
    def watchdog() -> None:
        time.sleep(args.timeout + 120)
        for p in chaos.procs:
            p.signal(signal.SIGKILL)
        print("chaos: watchdog fired; every process killed", file=sys.stderr, flush=True)
        os._exit(124)

    threading.Thread(target=watchdog, daemon=True).start()
    interrupted = None
    try:
        chaos.prepare()
        chaos.run()
    except (_Stop, KeyboardInterrupt) as exc:
        interrupted = str(exc) or "interrupted"
        chaos.say(f"stopped: {interrupted}")
    finally:
        for sig in previous:  # a second Ctrl-C must not cut the teardown short
            signal.signal(sig, signal.SIG_IGN)
        forced = teardown(chaos.procs, grace_s=25.0 if args.supervised else 3.0)  # vime run stops its children itself
        if forced:
            chaos.say(f"teardown had to SIGKILL: {', '.join(forced)}")
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    summary = chaos.summary(time.monotonic() - started)
    if interrupted:
        summary["passed"] = False
        summary["interrupted"] = interrupted
    (chaos.run_dir / "chaos_summary.json").write_text(json.dumps(summary, indent=1))
    if args.json:
        print(json.dumps({k: v for k, v in summary.items() if k != "events"}, indent=1))
    else:
        print_summary(summary)
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
