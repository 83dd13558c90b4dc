"""Fixtures and helpers shared by several test modules."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parent.parent


# The suite runs on pytest-xdist workers one test file at a time (`make test`: -n 2 --dist loadfile), so
# a long file bounds the wall time wherever it lands. These files take longest (vime run jobs, vLLM
# engines, model builds; measured on the 2-core machine), longest first; they are handed out first and
# the many short files fill in behind them. test_chaos_supervised is early, and test_socket_fuzz and
# test_weight_faults are not last, because much of their time is waiting (for restarted processes, for
# timeouts), which the other worker's tests then fill. test_lora follows test_torch_backend so that it
# usually lands on the same worker, whose first torch.compile has then been paid. Order only: no test
# depends on it.
LONG_FILES_FIRST = (
    "test_demo_model.py", "test_chaos_supervised.py", "test_slurm_cluster.py", "test_e2e.py",
    "test_e2e_multiturn.py", "test_e2e_r3.py", "test_rollout_vllm.py", "test_chaos.py", "test_elastic_workers.py",
    "test_curve.py", "test_report.py", "test_torch_backend.py", "test_lora.py", "test_tracking.py", "test_eval.py",
    "test_rollout_vllm_lora.py", "test_reward_server.py", "test_vllm_inline_core.py", "test_broker_scale.py",
    "test_socket_fuzz.py", "test_weight_faults.py", "test_broker_memory.py",
)


def pytest_configure(config: pytest.Config) -> None:
    # pytest-xdist would otherwise hand out files by their number of tests, most first, which puts the
    # long files above (few tests each) last.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONG_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's tests keep their order


def run_env(**extra: str) -> dict[str, str]:
    """The environment for a child process that imports vime: this checkout first on PYTHONPATH, then
    whatever the caller had there (a GPU machine's packages installed with --target, say)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, **extra)


def shared_demo_model_dir(tmp_path_factory: pytest.TempPathFactory, seed: int) -> Path:
    """Where the demo model of `seed` (the shipped recipe) is built for this test session.

    One folder for every pytest-xdist worker of the session (the parent of each worker's base temp),
    so a model is built once per session: `make_demo_model` locks the folder while it builds and
    reuses a complete build of the same recipe.
    """
    return tmp_path_factory.getbasetemp().parent / "demo-models" / f"seed{seed}"


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The CPU demo's own model (seed 0, as `make demo` builds it), built once per session."""
    from vime.demo.model_factory import make_demo_model

    return make_demo_model(shared_demo_model_dir(tmp_path_factory, 0), seed=0)


def load_bench(name: str) -> ModuleType:
    """`bench/NAME.py` as a module (bench/ is scripts, not a package), registered in sys.modules first
    because dataclasses look their module up while a class is created."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """One event loop for a module's tests, for engines that live as long as the module."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def start_tool_server(log_path: Path, *args: str, timeout_s: float = 60.0) -> tuple[subprocess.Popen[bytes], str]:
    """A `vime-tool-server` process on a free port, logging to `log_path`, and its URL, read from its
    `tool_server_listening` line (an info line: the level is set here, whatever the environment of the
    test process says). Raises RuntimeError with the log's end if it exits or stays silent."""
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "vime.agent.tool_server", "--port", "0", *args],
            cwd=REPO, env=run_env(VIME_LOG_LEVEL="INFO"), stdout=log_file, stderr=subprocess.STDOUT,
        )  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        for line in log_path.read_text().splitlines():
            if '"tool_server_listening"' in line:
                return process, json.loads(line)["url"]
        time.sleep(0.05)
    process.kill()
    process.wait(timeout=10)
    raise RuntimeError(f"the tool server did not start (exit code {process.returncode}):\n{log_path.read_text()[-3000:]}")
