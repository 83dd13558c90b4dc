"""Evaluation: pass@k from raw rewards, and the broker's bookkeeping of eval runs.

An eval run is every prompt of every `--eval-prompt-data` set, sampled `--n-samples-per-eval-prompt`
times with the eval sampling parameters, on the weights published after training step `step` (step -1:
the initial weights, unless `--skip-eval-before-train`). Runs happen every `--eval-interval` steps.
The broker starts a run when the trainer announces those weights, hands its groups to rollout workers
ahead of training work, has reward workers score them, and sends the finished run's metrics to the
trainer, which logs them into metrics.jsonl at that step. Eval groups never enter the trainable buffer.

A sample is correct when its raw reward is >= `--eval-pass-threshold` (default 1.0: slime counts
reward == 1 as a pass; dapo's -1/1 and the 0/1 rule rewards both fit). Per prompt with n scored samples
of which c are correct, pass@k is the unbiased estimator 1 - C(n-c, k) / C(n, k) (Chen et al., 2021),
averaged over prompts. Samples whose reward failed are left out of n (and counted); a prompt with fewer
than k scored samples is left out of pass@k's average.

Metrics of a run, per set NAME: `eval/NAME/pass@k` for k = 1, 2, 4, ... and k = n, `reward_mean`,
`response_len`, `truncated_ratio`, `num_prompts`, `samples_failed`, and the oldest and newest weight
version that produced any of its tokens (`weight_version_min`/`_max`: normally both the run's
version; see `vime/workers/rollout.py` for how workers hold it); plus `eval/time_s`, the run's wall time.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vime.data.prompts import Prompt
from vime.protocol.messages import EvalResult, Group


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt: n samples, c of them correct; 1 - C(n-c, k) / C(n, k).

    Exact (integer binomials). Raises ValueError unless 0 <= c <= n and 1 <= k <= n.
    """
    if not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:
        return 1.0  # every k-subset holds a correct sample
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def ks_for(n: int) -> list[int]:
    """The k of pass@k reported for n samples per prompt: 1, 2, 4, ... below n, and n."""
    ks = [1 << i for i in range(max(n, 1).bit_length()) if (1 << i) < n]
    return sorted({*ks, max(n, 1)})


def mean_pass_at_k(per_prompt: Iterable[tuple[int, int]], k: int) -> float | None:
    """Mean pass@k over prompts given as (n, c); prompts with n < k are left out; None if none is left."""
    values = [pass_at_k(n, c, k) for n, c in per_prompt if n >= k]
    return float(np.mean(values)) if values else None


@dataclass(frozen=True)
class EvalSet:
    """One `--eval-prompt-data NAME PATH` dataset, tokenized."""

    name: str
    prompts: list[Prompt]


@dataclass
class PromptOutcome:
    """One eval prompt's scored group: raw rewards of the scored samples and what else we report."""

    rewards: list[float]
    failed: int
    response_lengths: list[int]
    truncated: int
    version_min: int
    version_max: int


def outcome_of(group: Group) -> PromptOutcome:
    """Read an eval group after scoring (failed samples carry status 'failed')."""
    scored = [s for s in group.samples if s.status != "failed" and s.reward is not None]
    # np.asarray: the broker holds a group's arrays in wire form (vime.protocol.group_views)
    versions = [np.asarray(s.token_versions) for s in group.samples if len(s.token_versions)]
    return PromptOutcome(
        rewards=[float(s.reward) for s in scored],  # type: ignore[arg-type]
        failed=len(group.samples) - len(scored),
        response_lengths=[len(s.response_tokens) for s in scored],
        truncated=sum(s.status == "truncated" for s in scored),
        version_min=min(int(v.min()) for v in versions) if versions else -1,
        version_max=max(int(v.max()) for v in versions) if versions else -1,
    )


def summarize_set(name: str, outcomes: Sequence[PromptOutcome], n_samples: int, threshold: float) -> dict[str, float]:
    """The `eval/NAME/...` metrics of one set's outcomes (see the module docstring)."""
    prefix = f"eval/{name}"
    per_prompt = [(len(o.rewards), sum(r >= threshold for r in o.rewards)) for o in outcomes]
    rewards = [r for o in outcomes for r in o.rewards]
    lengths = [n for o in outcomes for n in o.response_lengths]
    metrics: dict[str, float] = {}
    for k in ks_for(n_samples):
        value = mean_pass_at_k(per_prompt, k)
        if value is not None:
            metrics[f"{prefix}/pass@{k}"] = value
    if rewards:
        metrics[f"{prefix}/reward_mean"] = float(np.mean(rewards))
        metrics[f"{prefix}/response_len"] = float(np.mean(lengths))
        metrics[f"{prefix}/truncated_ratio"] = sum(o.truncated for o in outcomes) / len(rewards)
    metrics[f"{prefix}/num_prompts"] = float(sum(1 for n, _ in per_prompt if n > 0))
    metrics[f"{prefix}/samples_failed"] = float(sum(o.failed for o in outcomes))
    versions = [o for o in outcomes if o.version_min >= 0]
    if versions:
        metrics[f"{prefix}/weight_version_min"] = float(min(o.version_min for o in versions))
        metrics[f"{prefix}/weight_version_max"] = float(max(o.version_max for o in versions))
    return metrics


def is_eval_step(step: int, interval: int | None, before_train: bool) -> bool:
    """Whether the weights after training step `step` (-1: initial weights) are evaluated."""
    if interval is None:
        return False
    if step == -1:
        return before_train
    return step >= 0 and (step + 1) % interval == 0


@dataclass
class EvalRun:
    step: int
    version: int
    started: float
    pending: set[str]
    outcomes: dict[str, list[PromptOutcome]] = field(default_factory=dict)
    finished: float | None = None


class EvalTracker:
    """Eval runs for the broker: which are due, their groups, their scores, their metrics. Pure logic.

    `start` is idempotent per step (a re-announced version does not start a second run). Results
    come out of `pop_finished` once every group of a run is scored, in the order runs finish.
    """

    def __init__(
        self, sets: Sequence[EvalSet], *, n_samples: int, interval: int | None, before_train: bool,
        threshold: float, num_rollout: int,
    ) -> None:  # fmt: skip
        if not sets:
            raise ValueError("an eval tracker needs at least one eval set")
        self.sets = list(sets)
        self.n_samples = n_samples
        self.interval = interval
        self.before_train = before_train
        self.threshold = threshold
        self.num_rollout = num_rollout
        self.runs: dict[int, EvalRun] = {}
        self.started_steps: set[int] = set()
        self.runs_done = 0
        self.last_metrics: dict[str, float] = {}
        self._group_run: dict[str, tuple[int, str]] = {}

    def is_due(self, step: int) -> bool:
        return step not in self.started_steps and is_eval_step(step, self.interval, self.before_train)

    @property
    def final_step_due(self) -> bool:
        """The run after the last training step is scheduled and has not started yet."""
        last = self.num_rollout - 1
        return is_eval_step(last, self.interval, self.before_train) and last not in self.started_steps

    @property
    def busy(self) -> bool:
        """A run is in flight, or the final one is still to come: the job is not finished."""
        return bool(self.runs) or self.final_step_due

    def start(self, step: int, version: int, now: float) -> list[Group]:
        """The groups of the run for `step` on weight `version` ([] if not due or already started)."""
        if not self.is_due(step):
            return []
        self.started_steps.add(step)
        groups = []
        for eval_set in self.sets:
            for prompt in eval_set.prompts:
                group = Group(
                    group_id=f"eval-s{step}-{eval_set.name}-p{prompt.index}", prompt_index=prompt.index, epoch=0,
                    prompt_tokens=prompt.tokens, prompt_text=prompt.text, label=prompt.label,
                    metadata=prompt.metadata, n_samples=self.n_samples, min_weight_version=version, kind="eval",
                )  # fmt: skip
                self._group_run[group.group_id] = (step, eval_set.name)
                groups.append(group)
        run = EvalRun(step, version, now, {g.group_id for g in groups})
        if not groups:
            run.finished = now  # nothing to wait for (empty sets are refused at load time)
        self.runs[step] = run
        return groups

    def owns(self, group_id: str) -> bool:
        return group_id in self._group_run

    def record(self, group: Group, now: float) -> bool:
        """Take a scored eval group; False if it belongs to no running run (a late duplicate)."""
        where = self._group_run.pop(group.group_id, None)
        if where is None:
            return False
        step, name = where
        run = self.runs[step]
        run.pending.discard(group.group_id)
        run.outcomes.setdefault(name, []).append(outcome_of(group))
        if not run.pending:
            run.finished = now
        return True

    def pop_finished(self) -> list[EvalResult]:
        """Metrics of every run whose groups are all scored; each run is returned once."""
        done = [run for run in self.runs.values() if run.finished is not None]
        results = []
        for run in sorted(done, key=lambda r: r.step):
            del self.runs[run.step]
            metrics: dict[str, float] = {}
            for eval_set in self.sets:
                metrics.update(summarize_set(eval_set.name, run.outcomes.get(eval_set.name, []), self.n_samples, self.threshold))
            metrics["eval/time_s"] = float(run.finished - run.started)  # type: ignore[operator]
            self.runs_done += 1
            self.last_metrics = metrics
            results.append(EvalResult(step=run.step, weight_version=run.version, metrics=metrics))
        return results

    def status(self) -> dict[str, Any]:
        return {
            "sets": {s.name: len(s.prompts) for s in self.sets},
            "runs_started": len(self.started_steps),
            "runs_done": self.runs_done,
            "running": [
                {"step": r.step, "weight_version": r.version, "groups_pending": len(r.pending)} for r in self.runs.values()
            ],
            "last": self.last_metrics,
        }
