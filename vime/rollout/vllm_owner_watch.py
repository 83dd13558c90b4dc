"""vLLM's engine processes die with the vime process that started them, however it dies.

A SIGKILLed rollout worker cannot stop its engine, and vLLM's engine core follows nobody (its
workers follow the engine core), so without this an engine outlives its worker holding memory and
cores. `arm()`, called in the rollout worker before it starts an engine, names the worker the
engine's owner (`VIME_ENGINE_OWNER_PID`). Every process of the engine then watches the owner
through a pidfd and SIGKILLs itself once the owner is gone:
- processes vLLM forks run the watcher from an at-fork hook that `arm()` installs;
- processes vLLM spawns load vLLM's general plugins, among them `watch_owner` (vime's entry point
  `vllm.general_plugins: vime_owner_watch`), which starts the watcher there.
Without pidfds (Linux < 5.3) the watcher polls the owner's pid every second instead.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time

OWNER_ENV = "VIME_ENGINE_OWNER_PID"
POLL_S = 1.0

_armed = False
_watching_in: int | None = None  # the pid of the process whose watcher runs


def arm() -> None:
    """In the process that starts an engine: make it the owner of every engine process started from here."""
    global _armed
    os.environ[OWNER_ENV] = str(os.getpid())
    if not _armed:
        os.register_at_fork(after_in_child=watch_owner)
        _armed = True


def watch_owner() -> None:
    """vLLM plugin entry point (also the at-fork hook): in a process other than the owner, die when it does."""
    global _watching_in
    owner = _owner_pid()
    if owner is None or owner == os.getpid() or _watching_in == os.getpid():
        return
    _watching_in = os.getpid()
    try:
        handle: int | None = os.pidfd_open(owner)
    except ProcessLookupError:
        _die()
        return
    except (AttributeError, OSError):  # no pidfd on this kernel or Python: poll instead
        handle = None
    threading.Thread(target=_wait_for_exit, args=(owner, handle), name="vime-owner-watch", daemon=True).start()


def _owner_pid() -> int | None:
    value = os.environ.get(OWNER_ENV, "")
    return int(value) if value.isdigit() else None


def _wait_for_exit(owner: int, pidfd: int | None) -> None:
    if pidfd is not None:
        select.select([pidfd], [], [])  # a pidfd turns readable when its process exits
    else:
        while _alive(owner):
            time.sleep(POLL_S)
    _die()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a pid reused by another user's process: ours is gone
        return False
    return True


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


__all__ = ["OWNER_ENV", "arm", "watch_owner"]
