"""Packed micro-batches (samples end to end, variable-length attention) against padded ones.

On the CPU the packed attention is SDPA per sample (`varlen_attention._sdpa_per_sample`); the flash
varlen kernel it uses on CUDA is checked against padded SDPA by `--check-pack` in `scripts/gpu_train_speed.sh`.
"""

import math

import numpy as np
import pytest
import torch
from test_r3_trainer import rollout
from test_torch_backend import VOCAB, config, make_batch, make_checkpoint

from vime.trainer import varlen_attention
from vime.trainer.batch import RolloutBatch, SampleRecord
from vime.trainer.torch_backend import TorchTrainer
from vime.trainer.varlen_attention import PackedAttentionError, packed_attention_forward

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {kind: make_checkpoint(str(root / kind), kind == "moe") for kind in ("dense", "moe")}


def uneven_batch(seed: int, samples: int = 12) -> RolloutBatch:
    rng = np.random.default_rng(seed)
    records = []
    for i in range(samples):
        prompt, resp = int(rng.integers(1, 9)), int(rng.integers(0, 14))
        records.append(SampleRecord(
            group_index=i // 3, prompt_tokens=rng.integers(1, VOCAB, prompt), response_tokens=rng.integers(1, VOCAB, resp),
            rollout_logprobs=np.full(resp, -3.0), loss_mask=np.ones(resp, np.uint8), reward=float(i % 2),
        ))  # fmt: skip
    return RolloutBatch.from_samples(records)


@pytest.mark.parametrize("max_tokens,size", [(None, None), (24, None), (None, 4), (30, 5), (5, 3)])
def test_packed_micro_batches_hold_every_sample_once_within_the_budgets(max_tokens, size):
    batch = uneven_batch(seed=1)
    lengths = batch.sequence_lengths
    mbs = batch.micro_batches(max_tokens=max_tokens, size=size, packed=True)
    seen = torch.cat([mb.sample_index for mb in mbs]).sort().values
    assert seen.tolist() == list(range(batch.num_samples))
    assert torch.cat([mb.token_index for mb in mbs]).sort().values.tolist() == list(range(batch.rollout_logprobs.numel()))
    for mb in mbs:
        total = int(lengths[mb.sample_index].sum())
        assert mb.input_ids.shape == mb.position_ids.shape == (1, total)  # not one padding token
        assert mb.cu_seqlens.tolist() == [0, *torch.cumsum(lengths[mb.sample_index], 0).tolist()]
        assert mb.max_seqlen == int(lengths[mb.sample_index].max())
        if max_tokens is not None and mb.num_samples > 1:
            assert total <= max_tokens
        if size is not None:
            assert mb.num_samples <= size
    if max_tokens is None and size is None:
        assert len(mbs) == 1


def test_packed_rows_hold_the_padded_rows_tokens_positions_and_targets():
    batch = uneven_batch(seed=2)
    (padded,) = batch.micro_batches()
    (packed,) = batch.micro_batches(packed=True)
    width = padded.input_ids.shape[1]
    bounds = packed.cu_seqlens.tolist()
    for b_packed, i in enumerate(packed.sample_index.tolist()):
        b_padded = padded.sample_index.tolist().index(i)
        a, z = bounds[b_packed], bounds[b_packed + 1]
        assert packed.input_ids[0, a:z].tolist() == padded.input_ids[b_padded, : z - a].tolist()
        assert packed.position_ids[0, a:z].tolist() == list(range(z - a))
    # the same response tokens, read from the same logit rows of each sample
    order_packed, order_padded = packed.token_index.argsort(), padded.token_index.argsort()
    assert torch.equal(packed.targets[order_packed], padded.targets[order_padded])
    assert torch.equal(packed.input_ids.flatten()[packed.logit_index + 1][order_packed], packed.targets[order_packed])
    row_offset = packed.cu_seqlens.long()[packed.token_sample]
    padded_pos = padded.logit_index % width
    assert torch.equal((packed.logit_index - row_offset)[order_packed], padded_pos[order_padded])


def test_packed_replay_ids_are_the_padded_rows_end_to_end(tmp_path):
    from vime.demo.model_factory import make_tiny_qwen3_moe

    model = make_tiny_qwen3_moe(tmp_path, seed=0, num_experts=8, num_layers=2, num_experts_per_tok=2,
                                moe_intermediate_size=8, dtype="float32")  # fmt: skip
    batch = RolloutBatch.from_samples(rollout(str(model), seed=1))
    (padded,) = batch.micro_batches()
    (packed,) = batch.micro_batches(packed=True)
    lengths = batch.sequence_lengths
    want = torch.cat([padded.replay_ids[padded.sample_index.tolist().index(i), : int(lengths[i])]
                      for i in packed.sample_index.tolist()])  # fmt: skip
    assert packed.replay_ids.shape == (1, *want.shape)
    assert torch.equal(packed.replay_ids[0], want)


def block_causal_attention(q, k, v, cu_seqlens, scale):
    """The reference: one softmax over the whole row with a block-diagonal causal mask."""
    t = q.shape[2]
    sample = torch.repeat_interleave(torch.arange(len(cu_seqlens) - 1), torch.diff(cu_seqlens))
    allowed = (sample[:, None] == sample[None, :]) & torch.ones(t, t, dtype=torch.bool).tril()
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = (q @ k.transpose(-1, -2)) * scale
    out = scores.masked_fill(~allowed, -math.inf).softmax(-1) @ v
    return out.transpose(1, 2)  # [1, T, H, D]


def test_varlen_attention_is_block_causal_with_grouped_heads():
    torch.manual_seed(0)
    cu = torch.tensor([0, 3, 4, 11, 16], dtype=torch.int32)
    q, k, v = torch.randn(1, 4, 16, 8), torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 8)
    module = torch.nn.Module()
    out, weights = packed_attention_forward(module, q, k, v, None, scaling=0.3, cu_seq_lens_q=cu, max_length_q=7)
    assert weights is None
    torch.testing.assert_close(out, block_causal_attention(q, k, v, cu.long(), 0.3), rtol=1e-5, atol=1e-6)


def test_varlen_attention_refuses_what_it_cannot_do_exactly():
    q = k = v = torch.zeros(1, 2, 4, 8)
    cu = torch.tensor([0, 2, 4], dtype=torch.int32)
    module = torch.nn.Module()
    with pytest.raises(PackedAttentionError, match="sliding-window"):
        packed_attention_forward(module, q, k, v, None, sliding_window=2, cu_seq_lens_q=cu)
    with pytest.raises(PackedAttentionError, match="dropout"):
        packed_attention_forward(module, q, k, v, None, dropout=0.1, cu_seq_lens_q=cu)
    with pytest.raises(PackedAttentionError, match="one row"):
        packed_attention_forward(module, torch.zeros(2, 2, 4, 8), k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1),
                                 None, cu_seq_lens_q=cu)  # fmt: skip


def assert_same_training(trainers: dict[str, TorchTrainer], metrics: dict[str, dict[str, float]], batch: RolloutBatch):
    for name in metrics["off"]:
        assert metrics["on"][name] == pytest.approx(metrics["off"][name], rel=1e-4, abs=1e-6), name
    padded = dict(trainers["off"].hf_model.named_parameters())
    for name, w in trainers["on"].hf_model.named_parameters():
        torch.testing.assert_close(w, padded[name], rtol=1e-4, atol=1e-6)
    for got, want in zip(trainers["on"].compute_logprobs(batch), trainers["off"].compute_logprobs(batch)):
        np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_packed_training_matches_padded(checkpoints, kind):
    """Two optimizer steps with PPO clipping, TIS, a KL penalty, an entropy bonus and a temperature:
    the same metrics, weights and logprobs afterwards, packed or padded."""
    overrides = dict(num_steps_per_rollout=2, micro_batch_size=3, use_tis=True, use_kl_loss=True, kl_loss_coef=0.1,
                     entropy_coef=0.01, rollout_temperature=0.8)  # fmt: skip
    trainers = {p: TorchTrainer(config(checkpoints[kind], pack_sequences=p, **overrides)) for p in ("on", "off")}
    assert trainers["on"].pack_sequences and not trainers["off"].pack_sequences
    metrics = {p: t.train_step(make_batch(seed=5)) for p, t in trainers.items()}
    assert metrics["on"]["train/kl_loss"] != 0.0
    assert_same_training(trainers, metrics, uneven_batch(seed=3))


def test_packed_ppo_critic_matches_padded(checkpoints):
    overrides = dict(advantage_estimator="ppo", max_tokens_per_micro_batch=24, gamma=0.9, lambd=0.95)
    trainers = {p: TorchTrainer(config(checkpoints["dense"], pack_sequences=p, **overrides)) for p in ("on", "off")}
    metrics = {p: [t.train_step(uneven_batch(seed=s)) for s in (4, 5)][-1] for p, t in trainers.items()}
    assert metrics["on"]["critic/values_mean"] != 0.0  # the second step's values come from a trained critic
    assert_same_training(trainers, metrics, uneven_batch(seed=6))
    critic = {p: dict(t.critic.module.named_parameters()) for p, t in trainers.items()}
    for name, w in critic["on"].items():
        torch.testing.assert_close(w, critic["off"][name], rtol=1e-4, atol=1e-6)


def test_packed_routing_replay_matches_padded(tmp_path):
    """R3: replayed routes and the routing-agreement metrics are the same in a packed row."""
    from vime.demo.model_factory import make_tiny_qwen3_moe

    def make_model(seed: int) -> str:
        return str(make_tiny_qwen3_moe(tmp_path / str(seed), seed=seed, num_experts=16, num_layers=2,
                                       num_experts_per_tok=2, moe_intermediate_size=8, dtype="float32"))  # fmt: skip

    # traces from another model's routing: replay visibly changes which experts the trainer uses
    batch = RolloutBatch.from_samples(rollout(make_model(1), seed=2))
    model = make_model(0)
    overrides = dict(use_rollout_routing_replay=True, micro_batch_size=4, num_steps_per_rollout=2)
    trainers = {p: TorchTrainer(config(model, pack_sequences=p, **overrides)) for p in ("on", "off")}
    metrics = {p: t.train_step(batch) for p, t in trainers.items()}
    assert metrics["on"]["train/routing_agreement"] == 1.0
    assert 0.0 < metrics["on"]["train/routing_agreement_unreplayed"] < 1.0
    assert_same_training(trainers, metrics, batch)


def test_pack_sequences_auto_is_off_on_the_cpu(checkpoints):
    for setting in ("auto", "off"):
        trainer = TorchTrainer(config(checkpoints["dense"], pack_sequences=setting))
        assert not trainer.pack_sequences
        assert trainer.hf_model.config._attn_implementation == "sdpa"
    assert varlen_attention.register() == varlen_attention.ATTENTION_NAME  # idempotent
