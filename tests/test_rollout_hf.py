"""The transformers rollout engine: sampling contract, processed logprobs, in-flight versioned updates
over the real weight channel (`WeightPublisher` -> `WeightFetcher`)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers_engines import freeze_in_flight
from vime.demo.model_factory import make_tiny_qwen3
from vime.demo.tokenizer import EOS_ID
from vime.rollout import SamplingConfig, WeightFetchFailed, WeightUpdateError, build_engine
from vime.rollout.hf_engine import HfRolloutEngine, process_logits
from vime.weights import WeightPublisher

torch.set_num_threads(1)

PROMPT = [5, 6, 7, 8, 9]
MAX_LEN = 1024  # the test model's max_position_embeddings
LONG = MAX_LEN - len(PROMPT)  # the longest response: requests that stay in flight for ~1000 steps


def peaked_weights(model_dir: Path, seed: int, scale: float = 2.5) -> list[tuple[str, torch.Tensor]]:
    """A new random state dict for the model in `model_dir` with sharp next-token distributions.

    Random tiny models are nearly uniform (logits ~0.2), which would make "matches the new weights"
    and "differs from the old ones" hard to tell apart; scaling the tied embedding scales the logits.
    """
    from safetensors.torch import load_file

    names = load_file(str(model_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    out = []
    for name, old in names.items():
        if name.endswith("norm.weight"):
            new = 1.0 + 0.1 * torch.randn(old.shape, generator=g)
        else:
            new = 0.05 * torch.randn(old.shape, generator=g)
            if name == "model.embed_tokens.weight":
                new = new * scale
        out.append((name, new.to(old.dtype)))
    return out


def reference_logprobs(model_dir: Path, weights: list[tuple[str, torch.Tensor]] | None,
                       prompt: list[int], response: list[int]) -> np.ndarray:
    """fp32 transformers recompute of log p(response | prompt) with `weights` (None: the checkpoint's)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    if weights is not None:
        missing, unexpected = model.load_state_dict({n: t.float() for n, t in weights}, strict=False)
        assert not unexpected and all("lm_head" in m for m in missing)
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return lp.gather(-1, torch.tensor(response)[:, None]).squeeze(-1).numpy()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(make_tiny_qwen3(tmp_path_factory.mktemp("hf_tiny") / "m", seed=0, max_position_embeddings=MAX_LEN))


@pytest.fixture
def publisher() -> Iterator[WeightPublisher]:
    pub = WeightPublisher(bind="tcp://127.0.0.1:*")
    yield pub
    pub.close()


@pytest.fixture
def engine(loop: asyncio.AbstractEventLoop, model_dir: Path, publisher: WeightPublisher) -> Iterator[HfRolloutEngine]:
    eng = build_engine("hf", str(model_dir), engine_args={"dtype": "float32"}, weight_endpoint=publisher.endpoint)
    assert isinstance(eng, HfRolloutEngine)
    loop.run_until_complete(eng.start())
    yield eng
    loop.run_until_complete(eng.shutdown())


def test_generate_shapes_dtypes_and_finish_reasons(loop, engine) -> None:
    samples = loop.run_until_complete(engine.generate(PROMPT, n=4, sampling=SamplingConfig(max_tokens=12, seed=1)))
    assert len(samples) == 4
    for s in samples:
        n = s.response_length
        assert 1 <= n <= 12
        assert s.response_tokens.dtype == np.int32 and s.rollout_logprobs.dtype == np.float32
        assert s.loss_mask.dtype == np.uint8 and s.token_versions.dtype == np.int32
        assert s.loss_mask.tolist() == [1] * n and s.token_versions.tolist() == [0] * n
        assert np.all(s.rollout_logprobs <= 0) and np.all(np.isfinite(s.rollout_logprobs))
        if s.finish_reason == "stop":
            assert s.response_tokens[-1] == EOS_ID and EOS_ID not in s.response_tokens[:-1]
        else:
            assert s.finish_reason == "length" and n == 12
        assert isinstance(s.response_text, str)

    # Every token a stop token: each sample stops after one token, and keeps it.
    stop_all = SamplingConfig(max_tokens=5, stop_token_ids=tuple(range(64)))
    for s in loop.run_until_complete(engine.generate(PROMPT, n=3, sampling=stop_all)):
        assert s.finish_reason == "stop" and s.response_length == 1

    long = SamplingConfig(max_tokens=20, ignore_eos=True)
    for s in loop.run_until_complete(engine.generate(PROMPT, n=2, sampling=long)):
        assert s.finish_reason == "length" and s.response_length == 20


def test_seeded_sampling_is_reproducible(loop, engine) -> None:
    cfg = SamplingConfig(max_tokens=10, seed=123, ignore_eos=True)
    a = loop.run_until_complete(engine.generate(PROMPT, n=2, sampling=cfg))
    b = loop.run_until_complete(engine.generate(PROMPT, n=2, sampling=cfg))
    assert [s.response_tokens.tolist() for s in a] == [s.response_tokens.tolist() for s in b]


def test_processed_logprobs_follow_temperature_and_top_p(loop, engine, model_dir, publisher) -> None:
    # Sharp weights so top-p actually removes tokens.
    publisher.publish(1, peaked_weights(model_dir, seed=3))
    loop.run_until_complete(engine.update_weights(1))
    cfg = SamplingConfig(temperature=0.7, top_p=0.8, max_tokens=6, ignore_eos=True, seed=5)
    (sample,) = loop.run_until_complete(engine.generate(PROMPT, n=1, sampling=cfg))
    model = engine._model
    ids = torch.tensor([PROMPT + sample.response_tokens.tolist()])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(PROMPT) - 1 : -1].float()
    expected = process_logits(logits, 0.7, 0, 0.8)
    got = expected.gather(-1, torch.tensor(sample.response_tokens, dtype=torch.long)[:, None]).squeeze(-1)
    np.testing.assert_allclose(sample.rollout_logprobs, got.numpy(), atol=1e-4)
    # Processed, not raw: the raw (T=1, full vocabulary) logprobs of the same tokens are different.
    raw = torch.log_softmax(logits, -1).gather(-1, torch.tensor(sample.response_tokens, dtype=torch.long)[:, None])
    assert not np.allclose(sample.rollout_logprobs, raw.squeeze(-1).numpy(), atol=1e-3)


def test_logprobs_after_update_match_new_weights(loop, engine, model_dir, publisher) -> None:
    response = [10, 11, 12, 13, 14, 15, 16, 17]
    before = loop.run_until_complete(engine.score(PROMPT, response))
    np.testing.assert_allclose(before, reference_logprobs(model_dir, None, PROMPT, response), atol=1e-4)

    new = peaked_weights(model_dir, seed=1)
    publisher.publish(1, new)
    result = loop.run_until_complete(engine.update_weights(1))
    assert result.version == 1 and not result.skipped and result.nbytes > 0
    assert engine.weight_version == 1

    after = loop.run_until_complete(engine.score(PROMPT, response))
    np.testing.assert_allclose(after, reference_logprobs(model_dir, new, PROMPT, response), atol=1e-4)
    assert np.mean(np.abs(after - before)) > 0.5

    # Rollout logprobs (T=1, no top-p: processed == raw) of freshly sampled tokens match too.
    samples = loop.run_until_complete(engine.generate(PROMPT, n=2, sampling=SamplingConfig(max_tokens=10, seed=2)))
    for s in samples:
        assert s.token_versions.tolist() == [1] * s.response_length
        ref = reference_logprobs(model_dir, new, PROMPT, s.response_tokens.tolist())
        np.testing.assert_allclose(s.rollout_logprobs, ref, atol=1e-4)


def test_update_in_flight_keeps_requests_and_stamps_new_version(loop, engine, model_dir, publisher) -> None:
    """The request is in flight at the update by construction: started, then frozen by a pause."""

    async def scenario():
        start = engine.progress
        (task,) = await freeze_in_flight(engine, PROMPT, requests=1, n=2, max_tokens=LONG)
        try:
            frozen = engine.progress
            publisher.publish(1, peaked_weights(model_dir, seed=1))
            result = await engine.update_weights(1)
            # The update loaded the weights and left the freeze alone: not one step ran meanwhile.
            assert engine.generation_paused and engine.progress == frozen and not task.done()
        finally:
            await engine.resume_generation()
        return await task, result, frozen.tokens - start.tokens

    samples, result, tokens_before = loop.run_until_complete(scenario())
    print(f"\ntokens per row sampled before the freeze: {tokens_before / 2:g} of {LONG}")
    assert result.version == 1 and not engine.generation_paused
    # Both rows decode in lockstep, so each had the same number of tokens when the engine froze.
    assert tokens_before % 2 == 0 and 1 <= tokens_before // 2 < LONG
    old = tokens_before // 2
    for s in samples:
        assert s.finish_reason == "length" and s.response_length == LONG
        # Exactly the tokens sampled before the freeze are old; every later one is new.
        assert s.token_versions.tolist() == [0] * old + [1] * (LONG - old)


def test_pause_holds_new_requests_until_resume(loop, engine) -> None:
    async def scenario():
        await engine.pause_generation()
        await engine.pause_generation()  # idempotent
        try:
            frozen = engine.progress
            task = asyncio.create_task(engine.generate(PROMPT, n=2, sampling=SamplingConfig(max_tokens=4, ignore_eos=True)))
            await asyncio.sleep(0.3)  # only gives a broken gate the time to let the request through
            assert not task.done() and engine.progress == frozen
        finally:
            await engine.resume_generation()
        await engine.resume_generation()  # idempotent
        return await task, engine.progress.tokens - frozen.tokens

    samples, tokens = loop.run_until_complete(scenario())
    assert [s.response_length for s in samples] == [4, 4] and tokens == 8


def test_missed_versions_jump_to_latest(loop, engine, model_dir, publisher) -> None:
    for v in (1, 2, 3):
        publisher.publish(v, peaked_weights(model_dir, seed=v))
    result = loop.run_until_complete(engine.update_weights(1))
    assert result.version == 3 and engine.weight_version == 3
    again = loop.run_until_complete(engine.update_weights(2))
    assert again.skipped and engine.weight_version == 3


def test_bad_weights_are_rejected_before_touching_the_model(loop, engine, model_dir, publisher) -> None:
    response = [10, 11, 12]
    before = loop.run_until_complete(engine.score(PROMPT, response))
    publisher.publish(1, [("model.not_a_layer.weight", torch.zeros(3))])
    with pytest.raises(WeightUpdateError, match="not a parameter"):
        loop.run_until_complete(engine.update_weights(1))
    assert engine.weight_version == 0
    np.testing.assert_array_equal(loop.run_until_complete(engine.score(PROMPT, response)), before)


def test_unreachable_publisher_fails_cleanly(loop, model_dir) -> None:
    eng = HfRolloutEngine(str(model_dir), fetch_timeout_s=0.5)
    loop.run_until_complete(eng.start())
    try:
        with pytest.raises(WeightFetchFailed, match="keeps its weights"):
            loop.run_until_complete(eng.update_weights(1, "tcp://127.0.0.1:9"))
        assert eng.weight_version == 0
        (s,) = loop.run_until_complete(eng.generate(PROMPT, n=1, sampling=SamplingConfig(max_tokens=3)))
        assert s.response_length >= 1
    finally:
        loop.run_until_complete(eng.shutdown())


def test_cancelled_generate_leaves_engine_usable(loop, engine) -> None:
    """Cancelled while frozen in flight (so it cannot have finished first): its decode thread stops."""

    async def scenario():
        (task,) = await freeze_in_flight(engine, PROMPT, requests=1, n=1, max_tokens=LONG)
        try:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            await engine.resume_generation()
        before = engine.progress
        (sample,) = await engine.generate(PROMPT, n=1, sampling=SamplingConfig(max_tokens=3, ignore_eos=True))
        return sample, engine.progress.tokens - before.tokens

    s, tokens = loop.run_until_complete(scenario())
    assert s.response_length == 3
    assert tokens == 3, "the cancelled request kept decoding after the resume"


def test_interface_errors(loop, engine) -> None:
    with pytest.raises(ValueError):
        SamplingConfig(top_p=0.0)
    with pytest.raises(ValueError):
        SamplingConfig(max_tokens=0)
    assert SamplingConfig(stop_token_ids=[1, 2]).stop_token_ids == (1, 2)
    with pytest.raises(ValueError, match="unknown engine kind"):
        build_engine("tgi", "x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown hf engine args"):
        build_engine("hf", "x", engine_args={"tensor_parallel_size": 2})
    with pytest.raises(ValueError):
        loop.run_until_complete(engine.generate([], n=1, sampling=SamplingConfig()))
    with pytest.raises(RuntimeError, match="not started"):
        loop.run_until_complete(HfRolloutEngine("x").generate(PROMPT, n=1, sampling=SamplingConfig()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs in the GPU check)")
def test_the_engine_runs_on_the_device_it_is_given(loop, model_dir: Path) -> None:
    """`device`: the model (and its sampling) on the GPU; the logprobs match the model's own on the CPU."""
    eng = build_engine("hf", str(model_dir), engine_args={"dtype": "float32", "device": "cuda"})
    loop.run_until_complete(eng.start())
    try:
        (s,) = loop.run_until_complete(eng.generate(PROMPT, n=1, sampling=SamplingConfig(max_tokens=6, seed=3)))
        assert next(eng._model.parameters()).device.type == "cuda"
    finally:
        loop.run_until_complete(eng.shutdown())
    expected = reference_logprobs(model_dir, None, PROMPT, s.response_tokens.tolist())
    np.testing.assert_allclose(s.rollout_logprobs, expected, atol=2e-3)


# --- R3: routing capture -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vime.demo.model_factory import make_tiny_qwen3_moe

    return Path(make_tiny_qwen3_moe(tmp_path_factory.mktemp("hf_moe") / "m", seed=0, num_experts=64,
                                    num_experts_per_tok=4, moe_intermediate_size=16))  # fmt: skip


def test_capture_routing_returns_a_valid_trace_per_sample_matching_a_full_forward(loop, moe_dir) -> None:
    from transformers import AutoModelForCausalLM

    from vime.r3.hf_router import RoutingRecorder
    from vime.r3.trace import routing_agreement, validate_trace

    eng = build_engine("hf", str(moe_dir), engine_args={"dtype": "float32"}, capture_routing=True)
    loop.run_until_complete(eng.start())
    try:
        samples = loop.run_until_complete(eng.generate(PROMPT, n=3, sampling=SamplingConfig(max_tokens=10, seed=2)))
    finally:
        loop.run_until_complete(eng.shutdown())
    model = AutoModelForCausalLM.from_pretrained(str(moe_dir), dtype=torch.float32).eval()
    for s in samples:
        tokens = PROMPT + s.response_tokens.tolist()
        assert s.num_experts == 64 and s.routed_experts is not None
        assert s.routed_experts.shape == (len(tokens) - 1, 2, 4) and s.routed_experts.dtype == np.uint8
        validate_trace(s.routed_experts, len(tokens), 64, num_moe_layers=2, top_k=4)
        # A teacher-forced forward of the whole sequence routes the same (KV-cached decode, same dtype).
        with torch.no_grad(), RoutingRecorder(model) as rec:
            model(input_ids=torch.tensor([tokens]))
        (full,) = rec.traces([len(tokens)])
        assert routing_agreement(s.routed_experts, full) >= 0.99


def test_capture_routing_off_gives_no_trace_and_dense_model_is_refused(loop, engine, model_dir) -> None:
    (s,) = loop.run_until_complete(engine.generate(PROMPT, n=1, sampling=SamplingConfig(max_tokens=3, seed=0)))
    assert s.routed_experts is None and s.num_experts is None
    dense = build_engine("hf", str(model_dir), capture_routing=True)
    with pytest.raises(ValueError, match="no MoE routers"):
        loop.run_until_complete(dense.start())
    loop.run_until_complete(dense.shutdown())


def test_moe_update_fuses_per_expert_checkpoint_names(loop, moe_dir, publisher) -> None:
    """The trainer publishes checkpoint names (`experts.<e>.gate_proj.weight`, as vLLM loads them);
    transformers 5 holds fused `experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I]."""
    from safetensors.torch import load_file

    weights = [(n, t.float() * 2) for n, t in load_file(str(moe_dir / "model.safetensors")).items()]
    assert any(".experts.3.up_proj.weight" in n for n, _ in weights)
    eng = build_engine("hf", str(moe_dir), engine_args={"dtype": "float32"}, weight_endpoint=publisher.endpoint)
    loop.run_until_complete(eng.start())
    try:
        publisher.publish(1, weights)
        assert loop.run_until_complete(eng.update_weights(1)).version == 1
        named = dict(weights)
        experts = eng._model.model.layers[1].mlp.experts
        p = "model.layers.1.mlp.experts.3."
        expected = torch.cat([named[p + "gate_proj.weight"], named[p + "up_proj.weight"]], dim=0)
        torch.testing.assert_close(experts.gate_up_proj[3], expected)
        torch.testing.assert_close(experts.down_proj[3], named[p + "down_proj.weight"])
        del named[p + "down_proj.weight"]
        publisher.publish(2, list(named.items()))
        with pytest.raises(WeightUpdateError, match="down_proj covers experts"):
            loop.run_until_complete(eng.update_weights(2))
    finally:
        loop.run_until_complete(eng.shutdown())
