"""The broker's settings: the flags it acts on, read once from the job's config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vime.config import VimeConfig


@dataclass
class BrokerSettings:
    rollout_batch_size: int
    n_samples_per_prompt: int
    max_staleness: int
    update_weights_interval: int
    num_rollout: int
    worker_timeout_s: float
    sampling: dict[str, Any]
    rm_type: str = "arithmetic"
    # Dynamic sampling: prompts dispatched per step when the filter drops groups (None: no over-sampling).
    over_sampling_batch_size: int | None = None
    # Eval: every `eval_interval` steps (None: never), on `eval_sampling`, `n_samples_per_eval_prompt` each.
    eval_interval: int | None = None
    eval_before_train: bool = True
    n_samples_per_eval_prompt: int = 1
    eval_sampling: dict[str, Any] = field(default_factory=dict)
    eval_pass_threshold: float = 1.0
    # Keep trained batches replayable until a trainer checkpoint covers them (the job saves checkpoints).
    retain_until_checkpoint: bool = False

    @classmethod
    def from_config(cls, cfg: VimeConfig) -> BrokerSettings:
        return cls(
            rollout_batch_size=cfg.rollout_batch_size,
            n_samples_per_prompt=cfg.n_samples_per_prompt,
            max_staleness=cfg.max_staleness,
            update_weights_interval=cfg.update_weights_interval,
            num_rollout=cfg.num_rollout,
            worker_timeout_s=cfg.worker_timeout_s,
            sampling={
                "temperature": cfg.rollout_temperature,
                "top_p": cfg.rollout_top_p,
                "max_tokens": cfg.rollout_max_response_len,
            },
            rm_type=cfg.rm_type,
            over_sampling_batch_size=cfg.over_sampling_batch_size,
            eval_interval=cfg.eval_interval if cfg.eval_prompt_data else None,
            eval_before_train=not cfg.skip_eval_before_train,
            n_samples_per_eval_prompt=cfg.n_samples_per_eval_prompt,
            eval_sampling=cfg.eval_sampling if cfg.eval_interval else {},
            eval_pass_threshold=cfg.eval_pass_threshold,
            retain_until_checkpoint=cfg.save_interval is not None,
        )

    @property
    def groups_per_version(self) -> int:
        return self.rollout_batch_size * self.update_weights_interval

    @property
    def lookahead_steps(self) -> int:
        """Training steps admission runs ahead of the published weights."""
        return (self.max_staleness + 1) * self.update_weights_interval

    @property
    def over_sampling_extra(self) -> int:
        """Extra prompts per step that over-sampling may dispatch (0 without it)."""
        return max(0, (self.over_sampling_batch_size or self.rollout_batch_size) - self.rollout_batch_size)
