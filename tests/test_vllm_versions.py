"""vime's own per-token version tracking for vLLM builds without stamps, the output barrier it relies
on, the choice between vLLM's stamps and the ledger, and the environment vime sets for vLLM. No engine
is started here (tests/test_rollout_vllm.py runs the ledger on a real engine, checked against vLLM's
stamps)."""

from __future__ import annotations

import asyncio
import dataclasses
import types

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here")

from vime.rollout import vllm_environment  # noqa: E402
from vime.rollout.vllm_engine import VllmRolloutEngine  # noqa: E402
from vime.rollout.vllm_stats import FrontEndBarrierUnavailable, OutputBarrier, StatHooks  # noqa: E402
from vime.rollout.vllm_versions import FrontEndStateUnavailable, VersionLedger, output_positions  # noqa: E402


def request_state(external: str, index: int, tokens: int) -> types.SimpleNamespace:
    detok = types.SimpleNamespace(num_output_tokens=lambda: tokens)
    return types.SimpleNamespace(external_req_id=external, request_index=index, detokenizer=detok)


def fake_llm(states: dict | None = None, *, stamps: bool = False, queue: bool = True) -> types.SimpleNamespace:
    llm = types.SimpleNamespace(
        output_processor=types.SimpleNamespace(request_states=states if states is not None else {}),
        engine_core=types.SimpleNamespace(outputs_queue=asyncio.Queue() if queue else None),
    )
    if stamps:
        llm.update_weight_version = lambda v: None
    return llm


def test_ledger_splits_each_sequence_where_the_update_found_it() -> None:
    ledger = VersionLedger()
    ledger.track("a", num_sequences=3, version=4)
    ledger.track("b", num_sequences=1, version=4)
    # Sequence a/1 had finished (no live state); a/2 was still queued (0 tokens); b/0 had 7 tokens.
    live = ledger.mark(5, {("a", 0): 3, ("a", 2): 0, ("b", 0): 7})
    assert live == 3
    ledger.track("c", num_sequences=1, version=5)  # admitted after the first update
    ledger.mark(6, {("a", 0): 10, ("b", 0): 7, ("c", 0): 2})
    assert ledger.versions("a", 0, 12).tolist() == [4] * 3 + [5] * 7 + [6] * 2
    assert ledger.versions("a", 1, 5).tolist() == [4] * 5
    assert ledger.versions("a", 2, 4).tolist() == [5] * 4  # a/2 finished before the second update
    assert ledger.versions("b", 0, 7).tolist() == [4] * 7  # no token after either mark
    assert ledger.versions("c", 0, 3).tolist() == [5, 5, 6]
    assert ledger.versions("c", 0, 3).dtype == np.int32
    ledger.forget("a")
    assert len(ledger) == 2
    with pytest.raises(KeyError):
        ledger.versions("a", 0, 1)


def test_output_positions_read_vllm_request_states_and_name_what_is_missing() -> None:
    llm = fake_llm({"x-1": request_state("x", 0, 5), "0_y-2": request_state("y", 0, 1), "1_y-2": request_state("y", 1, 2)})
    assert output_positions(llm) == {("x", 0): 5, ("y", 0): 1, ("y", 1): 2}
    with pytest.raises(FrontEndStateUnavailable, match="request_states"):
        output_positions(types.SimpleNamespace())
    broken = fake_llm({"x": types.SimpleNamespace(external_req_id="x", request_index=0)})
    with pytest.raises(FrontEndStateUnavailable, match="detokenizer"):
        output_positions(broken)


def test_output_barrier_returns_after_everything_queued_before_it() -> None:
    """A stand-in output handler drains the queue in order, calling the stat hooks per batch as
    vLLM's does; the barrier must not return before the batches queued ahead of it are processed."""
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats

    async def scenario() -> list[str]:
        hooks = StatHooks()
        llm = fake_llm()
        queue = llm.engine_core.outputs_queue
        seen: list[str] = []
        stats = [SchedulerStats(num_running_reqs=i) for i in (1, 2, 3)]

        async def output_handler() -> None:
            while True:
                batch = await queue.get()
                await asyncio.sleep(0.01)  # processing takes a while and yields
                real = [i for i, st in enumerate(stats, start=1) if st is batch.scheduler_stats]
                seen.append(f"batch{real[0]}" if real else "marker")
                hooks._record(batch.scheduler_stats, None, batch.engine_index)

        handler = asyncio.create_task(output_handler())
        for st in stats:
            queue.put_nowait(EngineCoreOutputs(scheduler_stats=st))
        barrier = OutputBarrier(llm, hooks)
        await barrier.wait(timeout_s=5)
        seen.append("barrier returned")
        handler.cancel()
        assert hooks.last_scheduler_stats is stats[-1]  # the marker is not taken for a real batch
        return seen

    assert asyncio.run(scenario()) == ["batch1", "batch2", "batch3", "marker", "barrier returned"]


def test_output_barrier_times_out_when_the_handler_is_gone_and_refuses_unknown_front_ends() -> None:
    async def scenario() -> None:
        barrier = OutputBarrier(fake_llm(), StatHooks())
        with pytest.raises(TimeoutError):
            await barrier.wait(timeout_s=0.05)

    asyncio.run(scenario())
    with pytest.raises(FrontEndBarrierUnavailable, match="outputs_queue"):
        OutputBarrier(fake_llm(queue=False), StatHooks())


@pytest.mark.parametrize(
    ("wanted", "stamps", "expected"),
    [("auto", True, "vllm"), ("auto", False, "vime"), ("vime", True, "vime"), ("vllm", True, "vllm")],
)
def test_version_source_follows_what_vllm_offers(monkeypatch, wanted, stamps, expected) -> None:
    import vllm.outputs

    # A CompletionOutput with or without the weight_versions field (0.32+ has it, 0.26 does not),
    # whichever this vLLM has.
    fields = [(f.name, f.type, f) for f in dataclasses.fields(vllm.outputs.CompletionOutput) if f.name != "weight_versions"]
    if stamps:
        fields.append(("weight_versions", list | None, dataclasses.field(default=None)))
    monkeypatch.setattr(vllm.outputs, "CompletionOutput", dataclasses.make_dataclass("CompletionOutput", fields))
    engine = VllmRolloutEngine("unused", version_source=wanted)
    engine._llm = fake_llm(stamps=stamps)
    engine._choose_version_source()
    assert engine.version_source == expected
    assert engine._native_versions == stamps
    assert (engine._ledger is not None) == (expected == "vime")


def test_version_source_errors_name_the_missing_piece(monkeypatch) -> None:
    engine = VllmRolloutEngine("unused", version_source="vllm")
    engine._llm = fake_llm(stamps=False)
    with pytest.raises(RuntimeError, match="does not stamp"):
        engine._choose_version_source()
    engine = VllmRolloutEngine("unused", version_source="vime")
    engine._llm = types.SimpleNamespace(engine_core=types.SimpleNamespace(outputs_queue=asyncio.Queue()))
    with pytest.raises(RuntimeError, match="request_states"):
        engine._choose_version_source()
    with pytest.raises(ValueError, match="version_source"):
        VllmRolloutEngine("unused", version_source="engine")  # type: ignore[arg-type]


def test_environment_for_cuda_and_r3_keeps_what_the_user_set(monkeypatch) -> None:
    for key in ("VLLM_WORKER_MULTIPROC_METHOD", "VLLM_USE_FLASHINFER_SAMPLER", "VLLM_USE_V2_MODEL_RUNNER", "VLLM_USE_AOT_COMPILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(vllm_environment.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(vllm_environment, "v1_runner_captures_routed_experts", lambda: True)
    # the CPU: vLLM's older compile cache, which loads (its AOT artifacts do not)
    assert vllm_environment.vllm_environment(on_cuda=False, capture_routing=False) == {"VLLM_USE_AOT_COMPILE": "0"}
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    applied = vllm_environment.apply_vllm_environment(on_cuda=True, capture_routing=True)
    assert applied == {"VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_USE_V2_MODEL_RUNNER": "0"}
    import os

    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"  # the user's choice stands
    monkeypatch.setattr(vllm_environment, "v1_runner_captures_routed_experts", lambda: False)
    assert vllm_environment.vllm_environment(on_cuda=True, capture_routing=True)["VLLM_USE_V2_MODEL_RUNNER"] == "1"
