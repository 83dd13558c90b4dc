"""LoRA on the torch trainer (vime/trainer/lora.py): what trains, the frozen-base reference, masked tokens,
exact resume, the adapter export as peft and vLLM read it, merged HF weights, and the refused settings.

All on the tiny float32 Qwen3 the trainer tests use, on the CPU in fp32, so comparisons are exact where
the same operations run in the same order."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_env
from test_agent_training import multi_turn_samples

from vime.config import ConfigError, load_config
from vime.trainer.batch import RolloutBatch, SampleRecord
from vime.trainer.checkpoint import find_checkpoint, load_checkpoint, save_checkpoint
from vime.trainer.torch_backend import TorchTrainer, TorchTrainerConfig

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vime.demo.model_factory import make_tiny_qwen3

    return make_tiny_qwen3(tmp_path_factory.mktemp("lora") / "tiny", seed=0, dtype="float32")


def lora_config(checkpoint: Path, **overrides: object) -> TorchTrainerConfig:
    # lr 1e-2 and adam_eps 1 (as the other trainer tests): visible, smooth moves in one step
    base = dict(hf_checkpoint=str(checkpoint), lr=1e-2, adam_eps=1.0, weight_decay=0.0, seed=0, device="cpu",
                micro_batch_size=2, lora_rank=4, lora_alpha=8.0, use_kl_loss=True, kl_loss_coef=0.1)  # fmt: skip
    return TorchTrainerConfig(**{**base, **overrides})  # type: ignore[arg-type]


def batch(seed: int = 0) -> RolloutBatch:
    """Two groups of three samples over the tiny model's 64-token vocabulary, some tokens masked."""
    rng = np.random.default_rng(seed)
    samples = []
    for group in range(2):
        prompt = rng.integers(4, 60, 3 + group)
        for i in range(3):
            n = int(rng.integers(2, 6))
            samples.append(SampleRecord(
                group_index=group, prompt_tokens=prompt, response_tokens=rng.integers(4, 60, n),
                rollout_logprobs=np.log(np.full(n, 1 / 64)) + rng.normal(0, 0.1, n),
                loss_mask=np.r_[np.ones(n - 1), rng.integers(0, 2)].astype(np.uint8), reward=float(i == group),
            ))  # fmt: skip
    return RolloutBatch.from_samples(samples)


def adapter(trainer: TorchTrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.module.named_parameters() if ".lora_" in n}


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


IDS = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29]])


def test_only_the_adapter_trains_and_the_reference_is_the_base(checkpoint: Path) -> None:
    trainer = TorchTrainer(lora_config(checkpoint))
    trainable = {n for n, p in trainer.module.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A.default." in n or ".lora_B.default." in n for n in trainable)
    # all-linear: the 7 projections of each of the 2 decoder layers, never the LM head or the embeddings
    assert len(trainable) == 2 * 7 * 2
    in_optimizer = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert in_optimizer == {id(p) for p in trainer.module.parameters() if p.requires_grad}
    assert trainer.ref_module is not None and not isinstance(trainer.ref_module, torch.nn.Module)  # no second model

    frozen = {n: p.detach().clone() for n, p in trainer.module.named_parameters() if not p.requires_grad}
    before = adapter(trainer)
    for seed in range(2):
        metrics = trainer.train_step(batch(seed))
    assert np.isfinite(list(metrics.values())).all()
    # AdamW state exists for the adapter only
    assert {id(p) for p in trainer.optimizer.state} == in_optimizer
    for name, value in trainer.module.named_parameters():
        if name in frozen:
            assert torch.equal(value, frozen[name]), name
    after = adapter(trainer)
    assert any(not torch.equal(after[n], before[n]) for n in after if ".lora_B." in n)
    assert all(p.requires_grad for n, p in trainer.module.named_parameters() if n in trainable)  # restored after ref

    # The reference (adapter off) gives the base model's logprobs exactly; the trained policy does not.
    full = TorchTrainer(lora_config(checkpoint, lora_rank=None, use_kl_loss=False))
    probe = batch(7)
    base_lp = torch.cat([torch.from_numpy(x) for x in full.compute_logprobs(probe)])
    ref_lp, _ = trainer._shard_logprobs(probe, trainer.ref_module)
    order = torch.cat([torch.arange(int(o), int(o) + int(n)) for o, n in zip(probe.resp_offsets, probe.response_lengths)])
    torch.testing.assert_close(ref_lp[order], base_lp, rtol=0, atol=0)
    policy_lp = torch.cat([torch.from_numpy(x) for x in trainer.compute_logprobs(probe)])
    assert not torch.allclose(policy_lp, base_lp, atol=1e-4)


def test_masked_tokens_get_no_gradient(checkpoint: Path) -> None:
    def adapter_after_step(samples: list[SampleRecord]) -> dict[str, torch.Tensor]:
        trainer = TorchTrainer(lora_config(checkpoint, use_tis=True, entropy_coef=0.01))
        trainer.train_step(RolloutBatch.from_samples(samples))
        return adapter(trainer)

    plain = adapter_after_step(multi_turn_samples(env_logprob=0.0, env_version=3, env_trained=False))
    wild = adapter_after_step(multi_turn_samples(env_logprob=-40.0, env_version=-7, env_trained=False))
    for name, value in plain.items():
        torch.testing.assert_close(wild[name], value, rtol=0, atol=0, msg=name)
    trained = adapter_after_step(multi_turn_samples(env_logprob=-4.0, env_version=3, env_trained=True))
    assert any(not torch.equal(trained[n], v) for n, v in plain.items())


def test_gradient_checkpointing_trains_like_without(checkpoint: Path) -> None:
    got = {}
    for ckpt in (False, True):
        trainer = TorchTrainer(lora_config(checkpoint, gradient_checkpointing=ckpt))
        trainer.train_step(batch(1))
        got[ckpt] = adapter(trainer)
    for name, value in got[False].items():
        torch.testing.assert_close(got[True][name], value, rtol=1e-5, atol=1e-7, msg=name)


def test_resume_is_exact(checkpoint: Path, tmp_path: Path) -> None:
    """Bit for bit: the resumed trainer loads the same fp32 adapter and AdamW moments, the base from the
    same HF checkpoint, and its RNG (LoRA dropout draws from it), then runs the same CPU kernels."""
    cfg = lora_config(checkpoint, lora_dropout=0.1, lr_warmup_steps=3)
    straight = TorchTrainer(cfg)
    for seed in range(2):
        straight.train_step(batch(seed))
    torch.manual_seed(123)  # the RNG at the cut: the resumed trainer must get it back from the checkpoint
    expected = [straight.train_step(batch(seed)) for seed in (2, 3)]

    first = TorchTrainer(cfg)
    for seed in range(2):
        first.train_step(batch(seed))
    torch.manual_seed(123)
    path = save_checkpoint(first, tmp_path / "ckpt", steps_done=2, weight_version=2)
    del first
    torch.manual_seed(999)

    # the checkpoint is an adapter directory, with no copy of the base weights
    assert (path / "adapter_config.json").is_file() and (path / "adapter_model.safetensors").is_file()
    assert not list(path.glob("model*.safetensors"))
    state = torch.load(path / "trainer" / "state.pt", weights_only=True)
    assert all(".lora_" in name for name in state["model"])

    resumed = TorchTrainer(cfg)
    load_checkpoint(resumed, find_checkpoint("latest", tmp_path / "ckpt"))
    got = [resumed.train_step(batch(seed)) for seed in (2, 3)]
    assert got == expected
    want = adapter(straight)
    for name, value in adapter(resumed).items():
        assert torch.equal(value, want[name]), name
    for p_straight, p_resumed in zip(straight.optimizer.state.values(), resumed.optimizer.state.values()):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(p_straight[key], p_resumed[key])

    with pytest.raises(ValueError, match="holds a LoRA adapter"):
        load_checkpoint(TorchTrainer(lora_config(checkpoint, lora_rank=None)), path)
    with pytest.raises(ValueError, match=r"differs from this run's in r \(saved 4, now 8\)"):
        load_checkpoint(TorchTrainer(lora_config(checkpoint, lora_rank=8)), path)


def test_adapter_export_loads_in_peft_with_the_same_logits(checkpoint: Path, tmp_path: Path) -> None:
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    trainer = TorchTrainer(lora_config(checkpoint))
    for seed in range(2):
        trainer.train_step(batch(seed))
    trained = logits(trainer.hf_model, IDS)

    export = trainer.export_adapter()
    assert export is not None
    reference = get_peft_model_state_dict(trainer.lora.peft_model)  # type: ignore[union-attr]
    assert set(export.tensors) == set(reference)
    for name, value in reference.items():
        assert torch.equal(export.tensors[name], value), name
    export.write(tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["bias"]) == ("LORA", 4, 8.0, "none")

    base = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    untrained = logits(base, IDS)
    loaded = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    torch.testing.assert_close(logits(loaded, IDS), trained, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(untrained, trained, atol=1e-4)  # the adapter carries the training

    # bf16 for the wire: half the bytes, same names
    small = trainer.export_adapter(dtype=torch.bfloat16)
    assert small is not None and set(small.tensors) == set(export.tensors) and small.nbytes * 2 == export.nbytes


def test_merged_weights_export_and_hf_checkpoint(checkpoint: Path, tmp_path: Path) -> None:
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    trainer = TorchTrainer(lora_config(checkpoint))
    trainer.train_step(batch(0))
    trained = logits(trainer.hf_model, IDS)
    with safe_open(str(checkpoint / "model.safetensors"), "pt") as f:
        expected = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
    assert {k: list(v.shape) for k, v in trainer.export_weights(dtype=torch.float32)} == expected

    trainer.save_hf_checkpoint(tmp_path / "merged", dtype=torch.float32)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    # W + B @ A * s in one matrix rounds differently from W x + s B (A x): float32 tolerance
    torch.testing.assert_close(logits(merged, IDS), trained, rtol=1e-4, atol=1e-5)
    assert trainer.lora is not None and trainer.hf_model is trainer.lora.hf_model  # the model kept its adapter


def test_lora_settings_that_cannot_run_are_refused(checkpoint: Path) -> None:
    cases = {
        "the Megatron backend": dict(train_backend="megatron"),
        "PPO's critic is a second full model": dict(advantage_estimator="ppo"),
        "LoRA on the LM head or the embeddings": dict(target_modules="q_proj,lm_head"),
        "target_modules is empty": dict(target_modules=" , "),
        "all-linear stands alone": dict(target_modules="all-linear,q_proj"),
    }
    for message, overrides in cases.items():
        with pytest.raises(ConfigError, match=message):
            load_config(None, {"lora_rank": 8, **overrides})
    with pytest.raises(ConfigError, match="lora_dropout"):
        load_config(None, {"lora_rank": 8, "lora_dropout": 1.0})
    # without an adapter the LoRA settings do not matter, and rank 0 is off
    assert load_config(None, {"lora_rank": 0, "advantage_estimator": "ppo"}).lora_rank == 0
    job = load_config(None, {"lora_rank": 16, "lora_alpha": 32, "target_modules": "q_proj,v_proj"})
    cfg = TorchTrainerConfig.from_vime_config(job)
    assert (cfg.lora_rank, cfg.lora_alpha, cfg.target_modules) == (16, 32.0, "q_proj,v_proj")

    with pytest.raises(ValueError, match="PPO's critic"):
        lora_config(checkpoint, advantage_estimator="ppo")
    with pytest.raises(ValueError, match="nonexistent_proj"):  # peft names a target that matches nothing
        TorchTrainer(lora_config(checkpoint, target_modules="nonexistent_proj"))
    with pytest.raises(ValueError, match="no lora_rank"):
        TorchTrainer(lora_config(checkpoint, lora_rank=None)).export_adapter()


def test_torch_compile_trains_like_eager(checkpoint: Path) -> None:
    """Compiled decoder layers hold the LoRA layers (injected first); the reference forward with the
    adapter off runs through them too. Compiling costs ~20 s on 2 cores."""
    got = {}
    for compiled in (False, True):
        trainer = TorchTrainer(lora_config(checkpoint, torch_compile=compiled))
        metrics = trainer.train_step(batch(1))
        got[compiled] = (metrics, adapter(trainer))
    for name, value in got[False][0].items():
        assert got[True][0][name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
    for name, value in got[False][1].items():
        torch.testing.assert_close(got[True][1][name], value, rtol=1e-4, atol=1e-6, msg=name)


def test_two_rank_ddp_and_fsdp_match_single_rank(checkpoint: Path, tmp_path: Path) -> None:
    """Two gloo ranks, each half the batch: DDP reduces the adapter's gradients only, FSDP2 shards base
    and adapter alike (mixed requires_grad in one unit) and gathers them for the exports."""
    from safetensors.torch import load_file
    from test_torch_backend import _free_port

    port = _free_port()
    procs = []
    for rank in range(2):
        env = run_env(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, __file__, str(checkpoint), str(tmp_path)], env=env))
    single = TorchTrainer(lora_config(checkpoint))
    single.train_step(batch(0))
    want = single.export_adapter()
    assert want is not None
    want_merged = dict(single.export_weights(dtype=torch.float32))
    for p in procs:
        assert p.wait(timeout=300) == 0
    for mode in ("ddp", "fsdp"):
        got = load_file(tmp_path / f"{mode}_adapter.safetensors")
        assert set(got) == set(want.tensors)
        for name, value in want.tensors.items():
            torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-6, msg=f"{mode} {name}")
    merged = load_file(tmp_path / "fsdp_merged.safetensors")
    assert set(merged) == set(want_merged)
    for name, value in want_merged.items():
        torch.testing.assert_close(merged[name], value, rtol=1e-4, atol=1e-6, msg=name)
    assert json.loads((tmp_path / "fsdp_state_keys.json").read_text()) == sorted(
        n for n, p in single.module.named_parameters() if p.requires_grad
    )


def test_r3_replay_reaches_the_adapter_off_reference(tmp_path: Path) -> None:
    """On a MoE policy with rollout routing traces, the KL reference (adapter off) is replayed like the
    policy: it equals the base model's replayed logprobs, and replay changes them (the test can fail)."""
    from test_r3_trainer import LAYERS, NUM_EXPERTS, TOP_K, rollout

    from vime.demo.model_factory import make_tiny_qwen3_moe

    moe = make_tiny_qwen3_moe(tmp_path / "moe", seed=0, num_experts=NUM_EXPERTS, num_layers=LAYERS,
                              num_experts_per_tok=TOP_K, moe_intermediate_size=16, dtype="float32")  # fmt: skip
    traced = RolloutBatch.from_samples(rollout(str(moe)))
    trainer = TorchTrainer(lora_config(moe, use_rollout_routing_replay=True))
    assert all(".self_attn." in n for n, p in trainer.module.named_parameters() if p.requires_grad)  # routers untouched
    metrics = trainer.train_step(traced)
    assert metrics["train/routing_agreement"] == 1.0
    base = TorchTrainer(lora_config(moe, lora_rank=None, use_kl_loss=False))
    for replay in (True, False):
        ref, _ = trainer._shard_logprobs(traced, trainer.ref_module, replay=replay)
        want, _ = base._shard_logprobs(traced, base.module, replay=replay)
        torch.testing.assert_close(ref, want, rtol=0, atol=0)
    assert not torch.equal(trainer._shard_logprobs(traced, trainer.ref_module, replay=True)[0], want)
    with pytest.raises(ValueError, match="MoE routers or fused expert weights"):
        TorchTrainer(lora_config(moe, target_modules="q_proj,gate"))


def _dist_worker(checkpoint: str, out_dir: str) -> None:
    """One rank of the two-rank test: a DDP step and an FSDP2 step, exports and training state."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    shared = RolloutBatch.broadcast(batch(0) if rank == 0 else None, src=0)
    for mode in ("ddp", "fsdp"):
        trainer = TorchTrainer(lora_config(Path(checkpoint), use_fsdp=mode == "fsdp", micro_batch_size=1))
        trainer.train_step(shared)
        export = trainer.export_adapter()  # collective under FSDP2
        merged = dict(trainer.export_weights(dtype=torch.float32))
        state = trainer.training_state()
        if rank == 0:
            assert export is not None and state is not None
            save_file(export.tensors, str(Path(out_dir) / f"{mode}_adapter.safetensors"))
            if mode == "fsdp":
                save_file(merged, str(Path(out_dir) / "fsdp_merged.safetensors"))
                (Path(out_dir) / "fsdp_state_keys.json").write_text(json.dumps(sorted(state["model"])))
    dist.destroy_process_group()


if __name__ == "__main__":
    _dist_worker(sys.argv[1], sys.argv[2])
    os._exit(0)  # as test_torch_backend's worker: skip teardown, where gloo/FSDP2 threads may abort


def test_only_the_adapter_is_published_and_the_hf_engine_merges_it(checkpoint: Path) -> None:
    """A LoRA run publishes adapter versions (peft names + adapter_config.json); the hf rollout engine
    merges each one into the base it started from, so it generates with the trainer's merged weights."""
    import asyncio

    from vime.rollout import WeightUpdateError, build_engine
    from vime.weights import WeightPublisher
    from vime.workers.trainer import publish_weights

    trainer = TorchTrainer(lora_config(checkpoint))
    full_bytes = sum(t.numel() * 4 for _, t in trainer.export_weights(dtype=torch.float32))
    loop = asyncio.new_event_loop()
    with WeightPublisher(bind="tcp://127.0.0.1:*") as publisher:
        engine = build_engine("hf", str(checkpoint), engine_args={"dtype": "float32"}, weight_endpoint=publisher.endpoint)
        loop.run_until_complete(engine.start())
        try:
            for version in (1, 2):
                trainer.train_step(batch(version))
                times = publish_weights(trainer, publisher, version, torch.float32)
                export = trainer.export_adapter(dtype=torch.float32)
                assert export is not None and times.nbytes == export.nbytes < full_bytes / 4
                result = loop.run_until_complete(engine.update_weights(version))
                assert result.version == version and result.nbytes == times.nbytes
                state = engine._model.state_dict()  # type: ignore[attr-defined]
                for name, merged in trainer.export_weights(dtype=torch.float32):
                    torch.testing.assert_close(state[name], merged, rtol=0, atol=1e-6, msg=name)
            torch.testing.assert_close(logits(engine._model, IDS), logits(trainer.hf_model, IDS), rtol=1e-4, atol=1e-5)  # type: ignore[attr-defined]
            # An adapter the merge cannot reproduce is refused before any weight changes.
            before = {k: v.clone() for k, v in engine._model.state_dict().items()}  # type: ignore[attr-defined]
            export = trainer.export_adapter(dtype=torch.float32)
            assert export is not None
            publisher.publish(3, list(export.tensors.items()), adapter_config={**export.config, "use_dora": True})
            with pytest.raises(WeightUpdateError, match="DoRA"):
                loop.run_until_complete(engine.update_weights(3))
            after = engine._model.state_dict()  # type: ignore[attr-defined]
            assert all(torch.equal(before[k], after[k]) for k in before) and engine.weight_version == 2
        finally:
            loop.run_until_complete(engine.shutdown())
            loop.close()


def test_native_lora_rollout_is_refused_where_it_cannot_work() -> None:
    """vLLM's native adapters: not past vLLM's largest rank, and not colocated (a deep sleep drops the base
    weights under the adapter); auto picks merge there instead."""
    from vime.config import VimeConfig

    base = dict(hf_checkpoint="m", prompt_data="demo:arithmetic", lora_rank=16)
    assert VimeConfig(**base, lora_rollout="native").lora_rollout == "native"
    assert VimeConfig(**base, colocate=True).lora_rollout == "auto"
    with pytest.raises(ValueError, match="colocated"):
        VimeConfig(**base, lora_rollout="native", colocate=True)
    with pytest.raises(ValueError, match="largest max_lora_rank"):
        VimeConfig(**{**base, "lora_rank": 1024}, lora_rollout="native")
