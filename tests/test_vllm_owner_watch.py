"""An engine's processes die with the process that owns them, even when the owner is SIGKILLed (a
killed rollout worker left vLLM's engine core and worker running, holding memory and cores)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import run_env
from test_launcher import _alive

REPO = Path(__file__).resolve().parent.parent

# The owner arms the watch, then starts one child by fork (as vLLM does on CPU) and one by spawn (as on
# CUDA). The spawned child loads vime's `vllm.general_plugins` entry point the way vLLM loads its plugins.
OWNER = textwrap.dedent("""
    import multiprocessing, os, sys, time
    from vime.rollout.vllm_owner_watch import arm

    def forked_child():
        time.sleep(120)

    def spawned_child():
        from importlib.metadata import entry_points
        plugin = next(e for e in entry_points(group="vllm.general_plugins") if e.name == "vime_owner_watch")
        plugin.load()()
        time.sleep(120)

    if __name__ == "__main__":
        arm()
        children = [multiprocessing.get_context("fork").Process(target=forked_child),
                    multiprocessing.get_context("spawn").Process(target=spawned_child)]
        for child in children:
            child.start()
        time.sleep(3)  # the spawned child has imported and loaded the plugin
        open(sys.argv[1], "w").write(" ".join(str(c.pid) for c in children))
        time.sleep(120)
""")


def test_engine_processes_die_when_their_owner_is_sigkilled(tmp_path: Path) -> None:
    script, pids_file = tmp_path / "owner.py", tmp_path / "children.pids"
    script.write_text(OWNER)
    owner = subprocess.Popen([sys.executable, str(script), str(pids_file)], cwd=REPO, env=run_env(), start_new_session=True)
    children: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while not (pids_file.exists() and pids_file.read_text()):
            assert owner.poll() is None, "the owner died before starting its children"
            assert time.monotonic() < deadline, "the owner did not start its children"
            time.sleep(0.1)
        children = [int(p) for p in pids_file.read_text().split()]
        assert all(_alive(pid) for pid in children)
        owner.send_signal(signal.SIGKILL)  # the owner only, not its process group: as a crash would
        owner.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [pid for pid in children if _alive(pid)] == [], "an engine process outlived its owner (fork, spawn)"
    finally:
        owner.kill()
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.vllm
def test_vllm_finds_the_owner_watch_among_its_general_plugins() -> None:
    pytest.importorskip("vllm")
    from vllm.plugins import load_plugins_by_group

    plugins = load_plugins_by_group("vllm.general_plugins")
    from vime.rollout.vllm_owner_watch import watch_owner

    assert plugins.get("vime_owner_watch") is watch_owner
