"""Multi-turn samples in the trainer: environment tokens (loss mask 0) get no gradient, whatever their
rollout logprobs and weight versions say, under PPO clipping, TIS, the KL penalty and an entropy bonus."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from vime.trainer.batch import RolloutBatch, SampleRecord
from vime.trainer.torch_backend import TorchTrainer, TorchTrainerConfig

MODEL_TURN_1, ENV_TURN, MODEL_TURN_2 = [11, 12, 13], [30, 31, 32, 33], [14, 1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vime.demo.model_factory import make_tiny_qwen3

    return make_tiny_qwen3(tmp_path_factory.mktemp("agent-train") / "tiny", seed=0, dtype="float32")


def multi_turn_samples(env_logprob: float, env_version: int, env_trained: bool) -> list[SampleRecord]:
    """Two groups of two trajectories: model turn, environment turn, model turn."""
    rng = np.random.default_rng(0)
    response = np.array(MODEL_TURN_1 + ENV_TURN + MODEL_TURN_2, dtype=np.int32)
    env = np.r_[np.zeros(len(MODEL_TURN_1)), np.ones(len(ENV_TURN)), np.zeros(len(MODEL_TURN_2))].astype(bool)
    samples = []
    for group in range(2):
        for i in range(2):
            logprobs = np.log(np.full(len(response), 1 / 64)) + rng.normal(0, 0.3, len(response))
            logprobs[env] = env_logprob
            versions = np.where(env, env_version, 3).astype(np.int32)
            samples.append(SampleRecord(
                group_index=group, prompt_tokens=np.array([5 + group, 6, 7], dtype=np.int32), response_tokens=response,
                rollout_logprobs=logprobs.astype(np.float32), loss_mask=(~env | env_trained).astype(np.uint8),
                reward=float(i), token_versions=versions,
            ))  # fmt: skip
    return samples


def weights_after_one_step(checkpoint: Path, samples: list[SampleRecord]) -> dict[str, torch.Tensor]:
    cfg = TorchTrainerConfig(
        hf_checkpoint=str(checkpoint), lr=1e-2, adam_eps=1.0, weight_decay=0.0, seed=0, device="cpu", micro_batch_size=2,
        use_tis=True, use_kl_loss=True, kl_loss_coef=0.1, entropy_coef=0.01, eps_clip=0.2,
    )  # fmt: skip
    trainer = TorchTrainer(cfg)
    trainer.train_step(RolloutBatch.from_samples(samples))
    return {name: p.detach().clone() for name, p in trainer.hf_model.named_parameters()}


def test_environment_tokens_get_no_gradient(checkpoint: Path) -> None:
    plain = weights_after_one_step(checkpoint, multi_turn_samples(env_logprob=0.0, env_version=3, env_trained=False))
    # Wild logprobs and very stale versions on the masked tokens change nothing: they are not trained,
    # weighted (TIS) or penalised (KL, entropy).
    wild = weights_after_one_step(checkpoint, multi_turn_samples(env_logprob=-40.0, env_version=-7, env_trained=False))
    for name, w in plain.items():
        torch.testing.assert_close(wild[name], w, rtol=0, atol=0, msg=name)
    # The same tokens trained move the weights: the check above can fail.
    trained = weights_after_one_step(checkpoint, multi_turn_samples(env_logprob=-4.0, env_version=3, env_trained=True))
    assert any(not torch.equal(trained[name], w) for name, w in plain.items())
