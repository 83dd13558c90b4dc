"""One child process of a launcher: started in its own session with its log file, signalled as a
process group, never outliving the process that started it.

A child's log is opened for append with a marker line per start, so a restarted or resumed process
adds to the story of the one before it instead of erasing it.
"""

from __future__ import annotations

import ctypes
import datetime
import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

PR_SET_PDEATHSIG = 1


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    log_handle: IO[bytes] | None = field(default=None, repr=False)

    def start(self) -> None:
        if self.log_handle is not None:
            self.log_handle.close()
        self.log_handle = self.log_path.open("ab")
        started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self.log_handle.write(f"--- vime: {self.name} started {started}: {' '.join(self.argv)}\n".encode())
        self.log_handle.flush()
        self.process = subprocess.Popen(
            self.argv, env=self.env, stdout=self.log_handle, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=terminate_with_parent,
        )  # fmt: skip

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def poll(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def signal(self, sig: int) -> None:
        """`sig` to the child's whole process group (vLLM starts its own engine processes). Sent even
        when the child itself has exited: its engines may not have, and the group outlives its leader."""
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def kill(self, wait_s: float) -> None:
        """SIGKILL the process group and reap it (waiting at most `wait_s`)."""
        self.signal(signal.SIGKILL)
        if self.process is not None:
            try:
                self.process.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                pass

    def close_log(self) -> None:
        if self.log_handle is not None:
            self.log_handle.close()
            self.log_handle = None

    def tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def die_with_parent(sig: int) -> None:
    """In a child, before exec (Linux): receive `sig` when the process that started it dies, even by
    SIGKILL. A launcher killed hard must not leave a broker bound to its port or an engine holding GPUs."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, sig)
    except OSError:  # not Linux: the launcher's own teardown is all there is
        pass


def terminate_with_parent() -> None:
    """`die_with_parent(SIGTERM)`: the child leaves cleanly (workers say Bye, the broker closes its journal)."""
    die_with_parent(signal.SIGTERM)


__all__ = ["Child", "die_with_parent", "terminate_with_parent"]
