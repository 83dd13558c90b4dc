"""Restart the processes of a one-machine job when they die (`vime run`, unless `--no-supervise`).

What restarts together (a slot): each worker and the broker on their own; the trainer ranks as one,
because a dead rank breaks its peers' collectives. A dead process's whole process group is killed
first (its vLLM engines with it). Then, after a backoff:
- a rollout or reward worker starts again with the same command line and worker id (the broker
  releases the dead one's leases when it says Hello);
- the broker starts again with the same command line and resumes from its journal (without
  `--journal` there is nothing to resume from, so the job stops);
- the trainer ranks start again on a new rendezvous port, with `--load latest` once a checkpoint
  exists (before the first one they start from the model, and the broker replays the steps trained).

A rollout or reward worker that exits with code 0 has left the job (its broker said training finished,
or someone sent it SIGTERM). If the broker's status.json still says the job is not finished
`LEFT_GRACE_S` later, it is restarted like a dead one: otherwise a job whose last reward worker left
would wait forever.

A restart fails when the restarted process dies again within `--restart-window-s`. After more than
`--max-restarts` failed restarts in a row the supervisor gives up: `JobFailed` names the process and
the reason, and the launcher stops the job. A process that stays up for the window has recovered.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable

from vime.config import VimeConfig
from vime.logging import get_logger
from vime.process import Child

log = get_logger(__name__)

MAX_BACKOFF_S = 30.0
# Workers leave a moment before the trainer ends the job (the broker tells them first); a worker gone
# this long while the job is not finished left too early.
LEFT_GRACE_S = 10.0


class JobFailed(Exception):
    """The supervisor stopped restarting: `child` died, `reason` says why the job cannot go on."""

    def __init__(self, child: Child, code: int, reason: str) -> None:
        super().__init__(reason)
        self.child = child
        self.code = code
        self.reason = reason


@dataclass(frozen=True)
class RestartPolicy:
    enabled: bool
    max_restarts: int
    backoff_s: float
    window_s: float

    @classmethod
    def from_config(cls, cfg: VimeConfig) -> RestartPolicy:
        return cls(cfg.supervise, cfg.max_restarts, cfg.restart_backoff_s, cfg.restart_window_s)

    def delay_s(self, failures: int) -> float:
        """Wait before the restart that follows the `failures`-th death in a row."""
        return min(MAX_BACKOFF_S, self.backoff_s * 2 ** max(0, failures - 1))


@dataclass
class Slot:
    """What restarts as one, and its history."""

    name: str
    children: list[Child]
    failures: int = 0  # deaths in a row, each within the restart window of its start
    restarts: int = 0
    started_at: float = 0.0
    restart_at: float | None = None
    downtime: list[float] = field(default_factory=list)  # death noticed -> restarted, seconds
    died_at: float | None = None
    left_at: float | None = None  # when a worker of this slot was first seen to have exited with code 0

    @property
    def kind(self) -> str:
        return self.name.split("-")[0]


class Supervisor:
    """Watches the children of `vime run` (call `check` often); restarts the dead as the module says."""

    def __init__(
        self, children: list[Child], cfg: VimeConfig, *, say: Callable[[str], None],
        new_rendezvous_port: Callable[[], int], has_checkpoint: Callable[[], bool],
    ) -> None:  # fmt: skip
        self.cfg = cfg
        self.policy = RestartPolicy.from_config(cfg)
        self.say = say
        self.new_rendezvous_port = new_rendezvous_port
        self.has_checkpoint = has_checkpoint
        trainers = [c for c in children if c.name.startswith("trainer-")]
        self.slots = [Slot(c.name, [c]) for c in children if not c.name.startswith("trainer-")]
        if trainers:
            self.slots.append(Slot("trainer", trainers))
        self.processes_path = cfg.run_dir / "processes.json"

    def start(self, now: float) -> None:
        for slot in self.slots:
            self._start(slot, now)

    def check(self, now: float) -> None:
        """Restart what is due; raises `JobFailed` when a death cannot (or may no longer) be recovered."""
        for slot in self.slots:
            if slot.restart_at is not None:
                if now >= slot.restart_at:
                    self._restart(slot, now)
                continue
            dead = [(c, code) for c in slot.children if (code := c.poll()) not in (None, 0)]
            if dead:
                self._on_death(slot, *dead[0], now)
            elif slot.kind in ("rollout", "reward"):
                self._check_left(slot, now)

    def restarts(self) -> dict[str, int]:
        return {slot.name: slot.restarts for slot in self.slots if slot.restarts}

    def _check_left(self, slot: Slot, now: float) -> None:
        """A worker that exited with code 0 while the job is not finished is restarted after the grace."""
        left = next((c for c in slot.children if c.poll() == 0), None)
        if left is None:
            slot.left_at = None
        elif slot.left_at is None:
            slot.left_at = now
        elif now - slot.left_at >= LEFT_GRACE_S and not self._job_finished():
            slot.left_at = None
            self._on_death(slot, left, 0, now)

    def _job_finished(self) -> bool:
        """The broker's word in status.json; a file that cannot be read counts as finished, so a worker
        is never restarted on a guess."""
        try:
            return bool(json.loads(self.cfg.status_file.read_text()).get("finished", True))
        except (OSError, ValueError):
            return True

    def _on_death(self, slot: Slot, child: Child, code: int, now: float) -> None:
        for c in slot.children:  # its engines, and for the trainer the other ranks
            c.kill(wait_s=5)
        how = "left the job (exit code 0) before it finished" if code == 0 else f"exited with code {code}"
        if not self.policy.enabled:
            raise JobFailed(child, code, f"{child.name} {how} (--no-supervise: no restart)")
        if slot.kind == "broker" and not self.cfg.journal:
            raise JobFailed(child, code, f"{child.name} exited with code {code}; with --no-journal a restarted broker has nothing to resume from")
        lived = now - slot.started_at
        slot.failures = slot.failures + 1 if lived < self.policy.window_s else 1
        if slot.failures > self.policy.max_restarts:
            raise JobFailed(child, code, (
                f"{child.name} exited with code {code}; it kept failing: {slot.failures - 1} restart(s) in a row "
                f"died within --restart-window-s {self.policy.window_s:g} (--max-restarts {self.policy.max_restarts})"
            ))  # fmt: skip
        delay = self.policy.delay_s(slot.failures)
        slot.restart_at = now + delay
        slot.died_at = now
        self.say(f"{child.name} {how} after {lived:.0f} s; restarting {self._what(slot)} in {delay:.1f} s "
                 f"(failed restarts in a row: {slot.failures - 1} of at most {self.policy.max_restarts})")  # fmt: skip
        log.warning("child_died", name=child.name, code=code, lived_s=round(lived, 1), restart_in_s=delay, failures=slot.failures)

    def _what(self, slot: Slot) -> str:
        if slot.kind == "trainer":
            ranks = f"the {len(slot.children)} trainer ranks" if len(slot.children) > 1 else "the trainer"
            return f"{ranks} {'with --load latest' if self.has_checkpoint() else 'from the model (no checkpoint yet)'}"
        if slot.kind == "broker":
            return "the broker from its journal"
        return slot.name

    def _restart(self, slot: Slot, now: float) -> None:
        if slot.kind == "trainer":
            port = str(self.new_rendezvous_port())
            resume = self.has_checkpoint()
            for child in slot.children:
                child.env = {**child.env, "MASTER_PORT": port}
                if resume and child.argv[-2:] != ["--load", "latest"]:
                    child.argv = [*child.argv, "--load", "latest"]
        slot.restarts += 1
        slot.restart_at = None
        if slot.died_at is not None:
            slot.downtime.append(now - slot.died_at)
        self._start(slot, now)
        log.info("child_restarted", name=slot.name, restarts=slot.restarts, pids=[c.pid for c in slot.children])

    def _start(self, slot: Slot, now: float) -> None:
        for child in slot.children:
            child.start()
            log.info("child_started", name=child.name, pid=child.pid, log=str(child.log_path))
        slot.started_at = now
        self._write_processes()

    def _write_processes(self) -> None:
        """RUN_DIR/processes.json: each child's current pid and restart count (for people and tools that
        need to find a process of the job)."""
        record = {
            c.name: {"pid": c.pid, "restarts": slot.restarts, "downtime_s": [round(d, 2) for d in slot.downtime], "log": str(c.log_path)}
            for slot in self.slots for c in slot.children
        }  # fmt: skip
        tmp = self.processes_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(record, indent=1))
        tmp.replace(self.processes_path)


__all__ = ["JobFailed", "RestartPolicy", "Supervisor", "Slot"]
