"""Shared-prompt micro-batches (vime/trainer/shared_prompts.py): the layout (every sample once, within
the budgets, one prompt copy per row, a tree mask), and training that equals the padded layout to
float32 tolerance on the CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_packed_sequences import assert_same_training, uneven_batch
from test_torch_backend import VOCAB, config, make_checkpoint

from vime.trainer.batch import RolloutBatch, SampleRecord
from vime.trainer.shared_prompts import SharedPromptError, prompt_groups
from vime.trainer.torch_backend import TorchTrainer

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {kind: make_checkpoint(str(root / kind), kind == "moe") for kind in ("dense", "moe")}


def grouped_batch(seed: int, groups: int = 4, per_group: int = 4) -> RolloutBatch:
    """GRPO-shaped: `per_group` samples of each prompt with responses of varied lengths (some empty)."""
    rng = np.random.default_rng(seed)
    records = []
    for g in range(groups):
        prompt = rng.integers(1, VOCAB, int(rng.integers(2, 9)))
        for i in range(per_group):
            n = int(rng.integers(0, 7))
            records.append(SampleRecord(
                group_index=g, prompt_tokens=prompt, response_tokens=rng.integers(1, VOCAB, n),
                rollout_logprobs=np.full(n, -3.0), loss_mask=(rng.random(n) < 0.8).astype(np.uint8), reward=float(i % 2),
            ))  # fmt: skip
    return RolloutBatch.from_samples(records)


def real_tokens(mb) -> int:
    """Non-padding positions: every real token sees its row's first prompt token, padding only itself."""
    return int(mb.attention_mask[:, 0, :, 0].sum())


def test_prompt_groups_need_the_same_group_and_the_same_prompt():
    batch = grouped_batch(seed=0, groups=3, per_group=2)
    assert prompt_groups(batch) == [[0, 1], [2, 3], [4, 5]]
    # a group whose samples carry different prompts (a multi-turn group) is split by prompt
    uneven = uneven_batch(seed=1, samples=6)  # groups of 3, every sample its own prompt
    assert sorted(len(g) for g in prompt_groups(uneven)) == [1] * 6


@pytest.mark.parametrize("max_tokens,size", [(None, None), (20, None), (None, 3), (40, 6), (4, 2)])
def test_shared_prompt_micro_batches_hold_every_sample_once_within_the_budgets(max_tokens, size):
    batch = grouped_batch(seed=1)
    mbs = batch.micro_batches(max_tokens=max_tokens, size=size, shared_prompts=True)
    assert torch.cat([mb.sample_index for mb in mbs]).sort().values.tolist() == list(range(batch.num_samples))
    assert torch.cat([mb.token_index for mb in mbs]).sort().values.tolist() == list(range(batch.rollout_logprobs.numel()))
    for mb in mbs:
        rows, width = mb.input_ids.shape
        assert mb.attention_mask.shape == (rows, 1, width, width)
        if size is not None:
            assert mb.num_samples <= size
        if max_tokens is not None and rows > 1:
            assert rows * width <= max_tokens
        # each row holds one copy of its prompt: no more tokens than the samples' own sequences
        lengths = batch.sequence_lengths[mb.sample_index]
        assert real_tokens(mb) <= int(lengths.sum())
    if max_tokens is None and size is None:
        (mb,) = mbs
        prompts = sum(int(batch.prompt_lengths[g[0]]) for g in prompt_groups(batch))
        assert mb.input_ids.shape[0] == 4  # a row per prompt
        assert real_tokens(mb) == prompts + batch.rollout_logprobs.numel()


def test_each_response_sees_the_prompt_and_itself_and_reads_its_own_logits():
    batch = grouped_batch(seed=2, groups=1, per_group=3)
    (mb,) = batch.micro_batches(shared_prompts=True)
    p = int(batch.prompt_lengths[0])
    mask = mb.attention_mask[0, 0]
    ids = mb.input_ids[0]
    at = p
    for i in mb.sample_index.tolist():
        n = int(batch.response_lengths[i])
        for t in range(n):
            q = at + t
            visible = mask[q].nonzero().flatten().tolist()
            assert visible == list(range(p)) + list(range(at, q + 1))
            assert int(mb.position_ids[0, q]) == p + t
        at += n
    # the logits that predict each target come from the position just before it in the sample
    for j in range(mb.targets.numel()):
        pos = int(mb.logit_index[j])
        sample = int(mb.sample_index[mb.token_sample[j]])
        s, q = int(batch.seq_offsets[sample]), int(mb.position_ids[0, pos])
        assert int(batch.tokens[s + q]) == int(ids[pos])  # the predicting token is the sample's token q
        assert int(batch.tokens[s + q + 1]) == int(mb.targets[j])  # and it predicts the sample's next token


def test_shared_prompt_logprobs_equal_the_padded_ones(checkpoints):
    batch = grouped_batch(seed=3)
    trainers = {s: TorchTrainer(config(checkpoints["dense"], share_prompts=s)) for s in (True, False)}
    for got, want in zip(trainers[True].compute_logprobs(batch), trainers[False].compute_logprobs(batch)):
        np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_shared_prompt_training_matches_padded(checkpoints, kind):
    """Two optimizer steps with PPO clipping, TIS, a KL penalty, an entropy bonus and a temperature:
    the same metrics, weights and logprobs afterwards, shared prompts or padded."""
    overrides = dict(num_steps_per_rollout=2, micro_batch_size=6, use_tis=True, use_kl_loss=True, kl_loss_coef=0.1,
                     entropy_coef=0.01, rollout_temperature=0.8)  # fmt: skip
    trainers = {s: TorchTrainer(config(checkpoints[kind], share_prompts=s == "on", **overrides)) for s in ("on", "off")}
    metrics = {s: t.train_step(grouped_batch(seed=5)) for s, t in trainers.items()}
    assert metrics["on"]["train/kl_loss"] != 0.0
    assert_same_training(trainers, metrics, grouped_batch(seed=6))


def test_shared_prompt_ppo_critic_matches_padded(checkpoints):
    overrides = dict(advantage_estimator="ppo", max_tokens_per_micro_batch=30, gamma=0.9, lambd=0.95)
    trainers = {s: TorchTrainer(config(checkpoints["dense"], share_prompts=s == "on", **overrides)) for s in ("on", "off")}
    metrics = {s: [t.train_step(grouped_batch(seed=k)) for k in (7, 8)][-1] for s, t in trainers.items()}
    assert metrics["on"]["critic/values_mean"] != 0.0
    assert_same_training(trainers, metrics, grouped_batch(seed=9))
    critic = {s: dict(t.critic.module.named_parameters()) for s, t in trainers.items()}
    for name, w in critic["on"].items():
        torch.testing.assert_close(w, critic["off"][name], rtol=1e-4, atol=1e-6)


def test_shared_prompts_refuse_what_they_cannot_lay_out(checkpoints):
    batch = grouped_batch(seed=4, groups=1, per_group=2)
    traced = RolloutBatch.from_samples([
        SampleRecord(group_index=0, prompt_tokens=[1, 2], response_tokens=[3], rollout_logprobs=[-1.0], loss_mask=[1],
                     reward=1.0, routed_experts=np.zeros((2, 1, 1), np.int16)),
    ])  # fmt: skip
    with pytest.raises(SharedPromptError, match="R3"):
        traced.micro_batches(shared_prompts=True)
    with pytest.raises(ValueError, match="packed or shared-prompt"):
        batch.micro_batches(packed=True, shared_prompts=True)
    with pytest.raises(ValueError, match="two micro-batch layouts"):
        config(checkpoints["dense"], share_prompts=True, pack_sequences="on")
    with pytest.raises(ValueError, match="R3"):
        config(checkpoints["dense"], share_prompts=True, use_rollout_routing_replay=True)
