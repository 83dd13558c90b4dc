"""Messages between the broker and the workers (rollout, reward, trainer) and status clients.

One message type per purpose; all travel over the broker's ROUTER socket as `codec` frames. Token
arrays are int32, logprobs float32, loss masks uint8, per-token weight versions int32, routing traces
uint8/uint16: large ones become zero-copy frames; the broker reads generated groups through
`vime.protocol.group_views`, which leaves every array in wire form, so it forwards sample payloads
without decoding or copying them.

Conversation shapes (worker -> broker, broker -> worker):
- any worker: Hello -> Welcome; Heartbeat -> HeartbeatAck; Bye.
- rollout: Credit(n) grants n slots; broker sends DispatchGroups when admission allows;
  worker returns GroupsGenerated -> Ack. WeightVersionAnnounce tells it a newer version exists.
- reward: Credit(n); broker sends ScoreGroups (each group's texts, label and metadata only: `ScoringGroup`);
  worker returns GroupsScored -> Ack.
- trainer: BatchRequest -> TrainBatch (held until enough admissible groups exist);
  StepDone, WeightsPublished and CheckpointSaved -> Ack. A BatchRequest for a step that already has a
  batch gets the same groups again. EvalResult (broker -> trainer) when an eval run is scored.
- status: StatusRequest -> StatusReply.
- any malformed or unexpected message -> ErrorReply; Shutdown ends a worker. ErrorReply code
  `unknown_peer` means the broker does not know the sender (it restarted): say Hello again.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from vime.protocol.codec import ERROR_INVALID, Message, ProtocolError, WireArray, require
from vime.r3.trace import validate_trace

# The dtypes sample arrays must have, built once: comparing dtype objects is cheap, naming them is not.
_INT32, _FLOAT32, _UINT8 = np.dtype("int32"), np.dtype("float32"), np.dtype("uint8")
_DTYPE_OF = {"int32": _INT32, "float32": _FLOAT32, "uint8": _UINT8}

Role = Literal["rollout", "reward", "trainer", "status"]
SampleStatus = Literal["completed", "truncated", "aborted", "failed"]


class Sample(Message, tag="sample"):
    """One generated response of a prompt group, as produced by a rollout engine."""

    index: int
    response_tokens: np.ndarray
    rollout_logprobs: np.ndarray
    loss_mask: np.ndarray
    token_versions: np.ndarray
    finish_reason: str
    response_text: str = ""
    status: SampleStatus = "completed"
    reward: float | None = None
    reward_extra: dict[str, Any] = {}
    failure_reason: str | None = None
    # R3 routing trace [tokens - 1, moe_layers, top_k], uint8/uint16; None for dense models.
    routed_experts: np.ndarray | None = None
    num_experts: int | None = None
    # Counters of a multi-turn rollout (turns, tool_calls, tool_errors, env_s, masked_tokens, ...).
    rollout_stats: dict[str, float] = {}

    def validate(self) -> None:
        n = _length_of(self.response_tokens, _INT32, "response_tokens")
        _length_of(self.rollout_logprobs, _FLOAT32, "rollout_logprobs", expected=n)
        _length_of(self.loss_mask, _UINT8, "loss_mask", expected=n)
        _length_of(self.token_versions, _INT32, "token_versions", expected=n)
        if self.reward is not None:
            require(np.isfinite(self.reward), f"sample {self.index}: reward {self.reward} is not finite")

    @property
    def min_version(self) -> int:
        return int(self.token_versions.min()) if len(self.token_versions) else -1


class Group(Message, tag="group"):
    """A prompt and its n samples: the unit of dispatch, scoring, buffering and staleness."""

    group_id: str
    prompt_index: int
    epoch: int
    prompt_tokens: np.ndarray
    prompt_text: str
    n_samples: int
    label: str | None = None
    metadata: dict[str, Any] = {}
    # The rollout worker must hold at least this weight version before it starts generating.
    min_weight_version: int = 0
    samples: list[Sample] = []
    # "eval": generated with the job's eval sampling for an eval run at weight version
    # `min_weight_version`, scored, and never trained on (the broker keeps its own record of the
    # kind, so a worker cannot turn eval work into training data).
    kind: Literal["train", "eval"] = "train"

    def validate(self) -> None:
        _length_of(self.prompt_tokens, _INT32, f"group {self.group_id} prompt_tokens")
        require(self.n_samples >= 1, f"group {self.group_id}: n_samples must be >= 1")
        require(len(self.samples) <= self.n_samples, f"group {self.group_id}: more samples than n_samples")
        for sample in self.samples:
            sample.validate()
            if sample.routed_experts is not None:
                check_trace(self.group_id, sample, len(self.prompt_tokens))

    @property
    def oldest_version(self) -> int:
        """The oldest weight version that produced any token of this group (-1 if no tokens)."""
        # One reduction over the joined arrays: the broker asks this of every group on its way through,
        # and a numpy reduction per sample cost 3.5x as much for the demo's groups of 8 short samples.
        versions = [s.token_versions for s in self.samples if len(s.token_versions)]
        return int(np.concatenate(versions).min()) if versions else -1


def check_trace(group_id: str, sample: Any, prompt_len: int) -> None:
    """R3: `sample`'s trace must cover prompt + response - 1 tokens, compact dtype, ids < num_experts.
    A function, not a method: the broker's group views (vime.protocol.group_views) run `Group.validate` too."""
    what = f"group {group_id} sample {sample.index}"
    require(sample.num_experts is not None, f"{what}: routed_experts without num_experts")
    try:
        validate_trace(sample.routed_experts, prompt_len + len(sample.response_tokens), int(sample.num_experts))
    except ValueError as exc:
        require(False, f"{what}: {exc}")


def _length_of(arr: np.ndarray | WireArray, dtype: np.dtype, what: str, expected: int | None = None) -> int:
    # Checked before any message text is built: this runs for every array of every sample the broker
    # decodes, and formatting the details (or asking numpy for a dtype's name) costs more than the checks.
    if type(arr) is WireArray:  # an array the broker forwards undecoded (vime.protocol.group_views)
        return _wire_length_of(arr, dtype, what, expected)
    if arr.ndim != 1:
        raise ProtocolError(ERROR_INVALID, f"{what} must be 1-D, got shape {arr.shape}")
    if arr.dtype != dtype:
        raise ProtocolError(ERROR_INVALID, f"{what} must be {dtype}, got {arr.dtype.name}")
    if expected is not None and len(arr) != expected:
        raise ProtocolError(ERROR_INVALID, f"{what} has {len(arr)} entries, expected {expected}")
    return len(arr)


def _wire_length_of(arr: WireArray, dtype: np.dtype, what: str, expected: int | None) -> int:
    """`_length_of` for an array in wire form whose bytes are in the header (frames are followed first)."""
    if len(arr.shape) != 1:
        raise ProtocolError(ERROR_INVALID, f"{what} must be 1-D, got shape {tuple(arr.shape)}")
    if _DTYPE_OF.get(arr.dtype) is not dtype:  # the same dtype objects as the callers pass
        raise ProtocolError(ERROR_INVALID, f"{what} must be {dtype}, got {arr.dtype}")
    n = arr.shape[0]
    if len(arr.data) != n * dtype.itemsize:  # type: ignore[arg-type]
        raise ProtocolError(ERROR_INVALID, f"{what}: {n} entries of {arr.dtype} in {len(arr.data)} bytes")  # type: ignore[arg-type]
    if expected is not None and n != expected:
        raise ProtocolError(ERROR_INVALID, f"{what} has {n} entries, expected {expected}")
    return n


# --- session ---------------------------------------------------------------------------------------


class Hello(Message, tag="hello"):
    role: Role
    worker_id: str
    host: str = ""
    pid: int = 0
    weight_version: int = -1
    info: dict[str, Any] = {}
    # Where this worker serves Prometheus /metrics (`vime status` lists it); None: it serves none.
    # Optional, so a broker and workers of different versions still understand each other's Hello.
    metrics_url: str | None = None
    # The job this worker belongs to (`VimeConfig.job_name`); a broker of another job refuses it.
    # Empty: not said (an older worker, a test client), accepted.
    job: str = ""

    def validate(self) -> None:
        # Shown by `vime status` and kept per worker: a bounded address, not a payload.
        require(self.metrics_url is None or len(self.metrics_url) <= 512, "metrics_url is longer than 512 characters")
        require(len(self.job) <= 4096, "job is longer than 4096 characters")


class JobInfo(Message, tag="job_info"):
    """What a worker needs to know about the job, sent in Welcome."""

    n_samples_per_prompt: int
    sampling: dict[str, Any]
    weight_version: int
    weight_endpoint: str | None
    max_staleness: int
    rm_type: str = "arithmetic"
    # Sampling of eval groups (temperature, top_p, max_tokens); empty when the job runs no eval.
    eval_sampling: dict[str, Any] = {}


class Welcome(Message, tag="welcome"):
    worker_id: str
    job: JobInfo


class Heartbeat(Message, tag="heartbeat"):
    weight_version: int = -1
    in_flight: int = 0
    stats: dict[str, float] = {}


class HeartbeatAck(Message, tag="heartbeat_ack"):
    weight_version: int
    weight_endpoint: str | None


class Bye(Message, tag="bye"):
    reason: str = ""


class Shutdown(Message, tag="shutdown"):
    reason: str


class Ack(Message, tag="ack"):
    ids: list[str] = []
    detail: str = ""


class ErrorReply(Message, tag="error"):
    code: str
    detail: str


# --- rollout and reward work -----------------------------------------------------------------------


class Credit(Message, tag="credit"):
    """The worker can take `n` more groups now."""

    n: int

    def validate(self) -> None:
        require(0 < self.n <= 4096, f"credit must be in 1..4096, got {self.n}")


class DispatchGroups(Message, tag="dispatch_groups"):
    groups: list[Group]


class GroupsGenerated(Message, tag="groups_generated"):
    groups: list[Group]

    def validate(self) -> None:
        for group in self.groups:
            group.validate()
            require(len(group.samples) == group.n_samples, f"group {group.group_id}: incomplete samples")


class WeightVersionAnnounce(Message, tag="weight_version"):
    version: int
    endpoint: str


class ScoringSample(Message, tag="scoring_sample"):
    """What a reward worker needs of a sample: its text, and whether it arrives judged (failed during
    its rollout, or rewarded by its environment)."""

    index: int
    response_text: str
    status: SampleStatus = "completed"
    reward: float | None = None
    reward_extra: dict[str, Any] = {}
    failure_reason: str | None = None


class ScoringGroup(Message, tag="scoring_group"):
    """A generated group as a reward worker sees it: texts, label and metadata. No token arrays,
    logprobs or routing traces: the broker keeps those, and they are most of a group's bytes."""

    group_id: str
    prompt_text: str
    label: str | None = None
    metadata: dict[str, Any] = {}
    samples: list[ScoringSample] = []

    @classmethod
    def of(cls, group: Group) -> ScoringGroup:
        return cls(
            group_id=group.group_id, prompt_text=group.prompt_text, label=group.label, metadata=group.metadata,
            samples=[
                ScoringSample(index=s.index, response_text=s.response_text, status=s.status, reward=s.reward,
                              reward_extra=s.reward_extra, failure_reason=s.failure_reason)
                for s in group.samples
            ],
        )  # fmt: skip


class ScoreGroups(Message, tag="score_groups"):
    groups: list[ScoringGroup]


class GroupScores(Message, tag="group_scores"):
    group_id: str
    rewards: list[float]
    failed: list[bool]
    reasons: list[str | None]
    extras: list[dict[str, Any]] = []

    def validate(self) -> None:
        require(len(self.failed) == len(self.rewards), f"group {self.group_id}: failed/rewards lengths differ")
        require(len(self.reasons) == len(self.rewards), f"group {self.group_id}: reasons/rewards lengths differ")
        for reward in self.rewards:
            require(np.isfinite(reward), f"group {self.group_id}: reward {reward} is not finite")


class GroupsScored(Message, tag="groups_scored"):
    scores: list[GroupScores]

    def validate(self) -> None:
        for score in self.scores:
            score.validate()


# --- trainer -----------------------------------------------------------------------------------------


class BatchRequest(Message, tag="batch_request"):
    """Trainer rank 0 asks for the groups of training step `step`, trained by weights `policy_version`."""

    step: int
    n_groups: int
    policy_version: int

    def validate(self) -> None:
        require(self.n_groups >= 1, "n_groups must be >= 1")
        require(self.step >= 0, "step must be >= 0")


class TrainBatch(Message, tag="train_batch"):
    step: int
    groups: list[Group]
    stats: dict[str, float] = {}
    # A step the job trained before, sent again to a trainer resumed from an earlier checkpoint.
    replayed: bool = False


class StepDone(Message, tag="step_done"):
    step: int
    group_ids: list[str]
    metrics: dict[str, float] = {}


class EvalResult(Message, tag="eval_result"):
    """An eval run's metrics (`eval/<name>/pass@k`, ...), taken on the weights after training step
    `step` (-1: before training) = weight version `weight_version`."""

    step: int
    weight_version: int
    metrics: dict[str, float]

    def validate(self) -> None:
        require(self.step >= -1, f"eval step must be >= -1, got {self.step}")
        for key, value in self.metrics.items():
            require(bool(np.isfinite(value)), f"eval metric {key} = {value} is not finite")


class CheckpointSaved(Message, tag="checkpoint_saved"):
    """Trainer rank 0 saved a resumable checkpoint after `steps_done` steps (`--load` resumes from it):
    the broker may release the batches of earlier steps. Answered with Ack."""

    steps_done: int
    path: str = ""

    def validate(self) -> None:
        require(self.steps_done >= 1, f"steps_done must be >= 1, got {self.steps_done}")


class WeightsPublished(Message, tag="weights_published"):
    version: int
    endpoint: str
    step: int
    nbytes: int = 0
    seconds: float = 0.0
    # Where the current version is served, said again after the trainer rejoined a restarted broker
    # (which does not trust the endpoint in its journal): no new weights, no eval run.
    reannounce: bool = False


# --- status ------------------------------------------------------------------------------------------


class StatusRequest(Message, tag="status_request"):
    pass


class StatusReply(Message, tag="status_reply"):
    status: dict[str, Any]
