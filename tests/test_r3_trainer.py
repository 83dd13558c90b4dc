"""R3 on the trainer side: rollout routing traces through RolloutBatch into TorchTrainer's forwards.

The "rollout engine" is a bf16 copy of a tiny random Qwen3-MoE: its routing (recorded with
`RoutingRecorder`) and logprobs differ a little from the fp32 trainer's, as a real engine's would.
"""

import math

import numpy as np
import pytest
import torch

from vime.r3.hf_router import RoutingRecorder, RoutingReplay, replay_ids_for_batch
from vime.trainer.batch import RolloutBatch, SampleRecord
from vime.trainer.torch_backend import TorchTrainer, TorchTrainerConfig

transformers = pytest.importorskip("transformers")

NUM_EXPERTS, TOP_K, LAYERS = 64, 4, 2  # many experts: near-ties make bf16 and fp32 route apart


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from vime.demo.model_factory import make_tiny_qwen3_moe

    torch.set_num_threads(1)
    path = make_tiny_qwen3_moe(tmp_path_factory.mktemp("moe"), seed=0, num_experts=NUM_EXPERTS, num_layers=LAYERS,
                               num_experts_per_tok=TOP_K, moe_intermediate_size=16, dtype="float32")  # fmt: skip
    return str(path)


def rollout(model_dir, seed=0, groups=2, n=3):
    """SampleRecords whose traces and logprobs come from a bf16 forward (the stand-in engine)."""
    engine = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    rng = np.random.default_rng(seed)
    samples = []
    for g in range(groups):
        prompt = rng.integers(1, 60, 6 + g)
        for i in range(n):
            resp = rng.integers(1, 60, int(rng.integers(4, 12)))
            ids = torch.from_numpy(np.r_[prompt, resp]).long()[None]
            with torch.no_grad(), RoutingRecorder(engine) as rec:
                logits = engine(input_ids=ids, use_cache=False).logits[0].float()
            p = prompt.size
            lp = torch.log_softmax(logits[p - 1 : -1], -1).gather(-1, ids[0, p:, None]).squeeze(-1)
            samples.append(SampleRecord(
                group_index=g, prompt_tokens=prompt, response_tokens=resp, rollout_logprobs=lp.numpy(),
                loss_mask=np.ones(resp.size, np.uint8), reward=float(rng.integers(0, 2)) + 0.1 * i,
                routed_experts=rec.traces([ids.shape[1]])[0],
            ))  # fmt: skip
    return samples


@pytest.fixture(scope="module")
def samples(model_dir):
    return rollout(model_dir)


def config(model_dir, **overrides) -> TorchTrainerConfig:
    base = dict(hf_checkpoint=model_dir, lr=1e-2, adam_eps=1.0, weight_decay=0.0, seed=0, device="cpu")
    return TorchTrainerConfig(**{**base, **overrides})


def abs_diff(got: list[np.ndarray], batch: RolloutBatch) -> float:
    return float(np.mean([np.abs(g - r).mean() for g, r in zip(got, batch.split_responses(batch.rollout_logprobs))]))


def test_replay_uses_rollout_routes_and_changes_the_mismatch(model_dir, samples):
    batch = RolloutBatch.from_samples(samples)
    replayed = TorchTrainer(config(model_dir, use_rollout_routing_replay=True, micro_batch_size=2))
    got = replayed.compute_logprobs(batch)
    plain = TorchTrainer(config(model_dir)).compute_logprobs(batch)

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    routes_differ = False
    for i, s in enumerate(samples):
        ids = torch.from_numpy(np.r_[s.prompt_tokens, s.response_tokens]).long()[None]
        replay = replay_ids_for_batch([s.routed_experts], [ids.shape[1]])
        with torch.no_grad(), RoutingReplay(model, replay):
            logits = model(input_ids=ids, use_cache=False).logits[0]
        p = s.prompt_tokens.size
        ref = torch.log_softmax(logits[p - 1 : -1], -1).gather(-1, ids[0, p:, None]).squeeze(-1)
        np.testing.assert_allclose(got[i], ref.numpy(), atol=1e-5)
        with torch.no_grad(), RoutingRecorder(model) as rec:
            model(input_ids=ids, use_cache=False)
        routes_differ |= not np.array_equal(rec.traces([ids.shape[1]])[0], s.routed_experts)
    assert routes_differ  # the bf16 engine routes some token differently from the fp32 trainer
    on, off = abs_diff(got, batch), abs_diff(plain, batch)
    print(f"trainer/rollout logprob abs diff: replay on {on:.6f}, off {off:.6f}")
    assert on != pytest.approx(off, rel=1e-3)
    assert on < off  # replaying the engine's experts brings the trainer closer to the engine


@pytest.mark.parametrize("steps", [1, 2])
def test_train_step_with_replay_reports_routing_agreement(model_dir, samples, steps):
    batch = RolloutBatch.from_samples(samples)
    metrics = {}
    for replay in (True, False):
        cfg = config(model_dir, use_rollout_routing_replay=replay, micro_batch_size=2, num_steps_per_rollout=steps,
                     use_kl_loss=True, kl_loss_coef=0.1, use_tis=True)  # fmt: skip
        metrics[replay] = TorchTrainer(cfg).train_step(batch)
        assert all(math.isfinite(v) for v in metrics[replay].values()), metrics[replay]
        assert 0.5 < metrics[replay]["train/routing_agreement_unreplayed"] < 1.0
    # the routes actually used: the rollout's under replay, the trainer's own without
    assert metrics[True]["train/routing_agreement"] == 1.0
    assert metrics[False]["train/routing_agreement"] == metrics[False]["train/routing_agreement_unreplayed"]
    # the unreplayed figure is of the same pre-update policy: the same with replay on and off
    assert metrics[True]["train/routing_agreement_unreplayed"] == metrics[False]["train/routing_agreement_unreplayed"]
    on, off = (metrics[r]["train/train_rollout_logprob_abs_diff"] for r in (True, False))
    print(f"train_step abs diff ({steps} step(s)): replay on {on:.6f}, off {off:.6f}")
    assert on < off


def test_batch_without_traces_has_no_agreement_metric(model_dir, samples):
    plain = [SampleRecord(**{**s.__dict__, "routed_experts": None}) for s in samples]
    metrics = TorchTrainer(config(model_dir, use_rollout_routing_replay=True)).train_step(
        RolloutBatch.from_samples(plain)
    )
    assert "train/routing_agreement" not in metrics and "train/routing_agreement_unreplayed" not in metrics
    assert all(math.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("steps", [1, 2])
def test_replayed_agreement_is_measured_not_assumed(model_dir, samples, steps, monkeypatch):
    """A replay whose hooks do nothing leaves the trainer on its own routes: the metric must show it."""
    import vime.trainer.torch_backend as tb

    class BrokenReplay(RoutingReplay):
        def _router_hook(self, i):
            return lambda module, args, output: None

    monkeypatch.setattr(tb, "RoutingReplay", BrokenReplay)
    cfg = config(model_dir, use_rollout_routing_replay=True, micro_batch_size=2, num_steps_per_rollout=steps)
    metrics = TorchTrainer(cfg).train_step(RolloutBatch.from_samples(samples))
    assert metrics["train/routing_agreement"] == metrics["train/routing_agreement_unreplayed"] < 1.0


def test_traces_that_do_not_fit_the_model_raise(model_dir, samples):
    trainer = TorchTrainer(config(model_dir, use_rollout_routing_replay=True))
    one_layer = [SampleRecord(**{**s.__dict__, "routed_experts": s.routed_experts[:, :1]}) for s in samples]
    with pytest.raises(ValueError, match="model has 2 MoE layers with top_k 4"):
        trainer.train_step(RolloutBatch.from_samples(one_layer))
    wide = [SampleRecord(**{**s.__dict__, "routed_experts": np.concatenate([s.routed_experts] * 2, -1)})
            for s in samples]  # fmt: skip
    with pytest.raises(ValueError, match="top_k"):
        trainer.compute_logprobs(RolloutBatch.from_samples(wide))
    big = [SampleRecord(**{**s.__dict__, "routed_experts": s.routed_experts.astype(np.int32) + NUM_EXPERTS})
           for s in samples]  # fmt: skip
    with pytest.raises(ValueError, match="expert id"):
        trainer.train_step(RolloutBatch.from_samples(big))
    with pytest.raises(ValueError, match="prompt \\+ response - 1"):
        SampleRecord(**{**samples[0].__dict__, "routed_experts": samples[0].routed_experts[1:]})


def test_replay_with_activation_checkpointing_matches_replay_without(model_dir, samples):
    """The recompute in backward re-runs the routers: it must replay the same experts as the forward."""
    batch = RolloutBatch.from_samples(samples)
    results = {}
    for checkpointing in (False, True):
        cfg = config(model_dir, use_rollout_routing_replay=True, micro_batch_size=2, gradient_checkpointing=checkpointing)
        trainer = TorchTrainer(cfg)
        results[checkpointing] = (trainer.train_step(batch), trainer.compute_logprobs(batch))
    (m_plain, lp_plain), (m_ckpt, lp_ckpt) = results[False], results[True]
    assert m_ckpt["train/routing_agreement"] == 1.0
    assert abs(m_ckpt["train/grad_norm"] - m_plain["train/grad_norm"]) < 1e-4 * max(1.0, m_plain["train/grad_norm"])
    for a, b in zip(lp_plain, lp_ckpt):
        np.testing.assert_allclose(a, b, atol=1e-5)
