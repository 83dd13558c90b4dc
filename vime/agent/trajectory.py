"""A sample under construction by a custom generate function: slime's `Sample` fields, token in/out.

A trajectory is the prompt followed by turns: model turns (trained: loss mask 1, with the logprob and
weight version of every token) and environment or tool turns (not trained: loss mask 0, logprob 0).
Turns are appended as tokens, never re-tokenized from text, so what the trainer sees is exactly what
the engine was conditioned on. The field names are slime's, so a slime generate function that writes
`sample.tokens`, `sample.response_length`, `sample.loss_mask` and `sample.rollout_log_probs` itself
works; `add_model_turn` / `add_env_turn` keep them consistent for new code.

`finish` checks the lengths and turns the trajectory into the rollout's `GeneratedSample`; what a
function left out (weight versions, logprobs of tokens it copied from engine output) is filled in from
the engine handle's record of every call. A trajectory that breaks the contract (lengths that do not
add up, a trained token whose logprob is unknown) raises `TrajectoryError`, which fails its group.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vime.rollout.base import GeneratedSample


# The weight version of environment tokens that precede every model token, until `finish` knows it.
UNKNOWN_VERSION = -1


class TrajectoryError(ValueError):
    """A generate function returned a trajectory that cannot be trained on; the message says why."""


class Status(str, enum.Enum):
    """slime's sample statuses, plus FAILED (the trajectory's own fault: it is not trained on)."""

    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


# What each status becomes on the wire: (finish_reason, sample status).
_WIRE_STATUS = {
    Status.PENDING: ("stop", "completed"),
    Status.COMPLETED: ("stop", "completed"),
    Status.TRUNCATED: ("length", "truncated"),
    Status.ABORTED: ("abort", "aborted"),
    Status.FAILED: ("abort", "failed"),
}


@dataclass
class ModelTurn:
    """What one engine call produced: the sampled tokens with their processed logprobs and the weight
    version of each, the text they decode to, and the call's R3 trace (`[call prompt + tokens - 1,
    moe_layers, top_k]`) when the engine records routing."""

    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    text: str = ""
    routed_experts: np.ndarray | None = None
    num_experts: int | None = None


@dataclass
class Trajectory:
    """One sample of a group, built turn by turn. See the module docstring."""

    index: int
    prompt: str
    tokens: list[int]
    label: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    response: str = ""
    response_length: int = 0
    loss_mask: list[int] | None = None
    rollout_log_probs: list[float] | None = None
    weight_versions: list[int] | None = None
    status: Status = Status.PENDING
    reward: float | None = None
    failure_reason: str | None = None
    # turns, tool_calls, tool_errors, env_s, masked_tokens: summed into the rollout's metrics.
    stats: dict[str, float] = field(default_factory=dict)
    routed_experts: np.ndarray | None = None
    num_experts: int | None = None
    prompt_length: int = field(init=False)

    Status = Status  # slime writes `sample.Status.COMPLETED`

    def __post_init__(self) -> None:
        self.tokens = [int(t) for t in self.tokens]
        self.prompt_length = len(self.tokens) - self.response_length

    # --- building ------------------------------------------------------------------------------

    def add_model_turn(self, turn: ModelTurn) -> None:
        """Append the model's tokens (trained). A turn cut by the token limit marks the trajectory
        truncated unless the caller decides otherwise later."""
        self._ensure_lists()
        n = len(turn.tokens)
        self.tokens.extend(int(t) for t in turn.tokens)
        self.loss_mask.extend([1] * n)  # type: ignore[union-attr]
        self.rollout_log_probs.extend(float(x) for x in turn.logprobs)  # type: ignore[union-attr]
        self.weight_versions.extend(int(v) for v in turn.versions)  # type: ignore[union-attr]
        self.response += turn.text
        self.response_length += n
        self.count("turns")
        if turn.routed_experts is not None:
            self.routed_experts, self.num_experts = turn.routed_experts, turn.num_experts
        if turn.finish_reason == "length":
            self.status = Status.TRUNCATED
        elif turn.finish_reason == "abort":
            self.status = Status.ABORTED

    def add_env_turn(self, tokens: list[int], text: str = "") -> None:
        """Append environment or tool output (not trained: loss mask 0, logprob 0). Its tokens carry
        the version of the model token before them, so they never make the sample look staler; those
        before the first model token are `UNKNOWN_VERSION` until `finish` gives them the first model
        token's version."""
        self._ensure_lists()
        n = len(tokens)
        version = self.weight_versions[-1] if self.weight_versions else UNKNOWN_VERSION  # type: ignore[index]
        self.tokens.extend(int(t) for t in tokens)
        self.loss_mask.extend([0] * n)  # type: ignore[union-attr]
        self.rollout_log_probs.extend([0.0] * n)  # type: ignore[union-attr]
        self.weight_versions.extend([version] * n)  # type: ignore[union-attr]
        self.response += text
        self.response_length += n
        self.count("masked_tokens", n)

    def count(self, name: str, amount: float = 1.0) -> None:
        """Add to one of the trajectory's counters (`turns`, `tool_calls`, `tool_errors`, `env_s`, ...)."""
        self.stats[name] = self.stats.get(name, 0.0) + float(amount)

    def fail(self, reason: str) -> None:
        """Mark the trajectory failed (its own fault): it is not trained on, and `reason` is logged."""
        self.status = Status.FAILED
        self.failure_reason = reason

    @property
    def context_length(self) -> int:
        return len(self.tokens)

    def _ensure_lists(self) -> None:
        if self.loss_mask is None:
            self.loss_mask = []
        if self.rollout_log_probs is None:
            self.rollout_log_probs = []
        if self.weight_versions is None:
            self.weight_versions = []

    # --- finishing -----------------------------------------------------------------------------

    def response_tokens(self) -> list[int]:
        return self.tokens[self.prompt_length :]

    def finish(self, fill: CallRecord | None = None) -> GeneratedSample:
        """The trajectory as the rollout's `GeneratedSample`; raises TrajectoryError if it breaks the
        contract. `fill` supplies per-token versions and logprobs the function did not record."""
        status = self.status if isinstance(self.status, Status) else Status(str(self.status))
        if len(self.tokens) != self.prompt_length + self.response_length:
            raise TrajectoryError(
                f"sample {self.index}: tokens has {len(self.tokens)} entries but the prompt has {self.prompt_length} "
                f"and response_length is {self.response_length}"
            )
        response = np.asarray(self.response_tokens(), dtype=np.int32)
        n = len(response)
        mask = np.ones(n, dtype=np.uint8) if self.loss_mask is None else _exact(self.loss_mask, n, np.uint8, "loss_mask", self.index)
        if mask.size and mask.max() > 1:
            raise TrajectoryError(f"sample {self.index}: loss_mask must hold only 0 and 1")
        has_logprobs = self.rollout_log_probs is not None and len(self.rollout_log_probs) == n
        has_versions = self.weight_versions is not None and len(self.weight_versions) == n
        # Only a function that left something out needs the engine calls matched against its tokens.
        filled = fill.fill(self.tokens, self.prompt_length) if fill is not None and not (has_logprobs and has_versions) else None
        if has_logprobs:
            logprobs = np.asarray(self.rollout_log_probs, dtype=np.float32)
        elif filled is not None and filled[0] is not None:
            logprobs = filled[0]
        else:
            raise TrajectoryError(
                f"sample {self.index}: rollout_log_probs has {len(self.rollout_log_probs or [])} entries for "
                f"{n} response tokens, and some trained tokens were not sampled by the engine handle"
            )
        if has_versions:
            versions = fill_unknown_versions(np.asarray(self.weight_versions, dtype=np.int32))
        elif filled is not None:
            versions = filled[1]
        else:
            raise TrajectoryError(f"sample {self.index}: weight_versions has {len(self.weight_versions or [])} entries for {n} tokens")
        logprobs = np.where(mask == 1, logprobs, np.float32(0.0)).astype(np.float32)
        if not np.all(np.isfinite(logprobs)):
            raise TrajectoryError(f"sample {self.index}: a trained token has a non-finite logprob")
        finish_reason, _ = _WIRE_STATUS[status]
        return GeneratedSample(
            response_tokens=response, rollout_logprobs=logprobs, loss_mask=mask, token_versions=versions,
            finish_reason=finish_reason,  # type: ignore[arg-type]
            response_text=self.response, routed_experts=self._trace(len(self.tokens)), num_experts=self.num_experts,
        )  # fmt: skip

    def _trace(self, num_tokens: int) -> np.ndarray | None:
        """The last engine call's R3 trace, which covers every position it was conditioned on; None
        when routing was not recorded or when tokens were appended after that call (their routing is
        unknown: R3 replays only what the engine computed)."""
        trace = self.routed_experts
        if trace is None:
            return None
        if len(trace) != num_tokens - 1:
            raise TrajectoryError(
                f"sample {self.index}: the R3 trace covers {len(trace) + 1} tokens, the trajectory has {num_tokens}: "
                "with routing replay a trajectory must end with a model turn"
            )
        return trace


@dataclass
class _Call:
    start: int  # where the call's output begins in the full token sequence
    tokens: list[int]
    logprobs: list[float]
    versions: list[int]


@dataclass
class CallRecord:
    """Every engine call made for one trajectory, so `Trajectory.finish` can label tokens a function
    copied into `sample.tokens` without recording their logprobs or versions."""

    calls: list[_Call] = field(default_factory=list)

    def add(self, prompt_tokens: list[int], turn: ModelTurn) -> None:
        self.calls.append(_Call(len(prompt_tokens), list(turn.tokens), list(turn.logprobs), list(turn.versions)))

    def fill(self, tokens: list[int], prompt_length: int) -> tuple[np.ndarray | None, np.ndarray]:
        """(logprobs, versions) of the response of `tokens`: from the call whose output sits at that
        position with the same ids; other tokens (environment output) get logprob NaN and the version of
        the last sampled token before them. Logprobs are None when none of the calls matched."""
        n = len(tokens) - prompt_length
        logprobs = np.full(n, np.nan, dtype=np.float32)
        versions = np.full(n, UNKNOWN_VERSION, dtype=np.int32)
        matched = False
        for call in self.calls:
            end = call.start + len(call.tokens)
            if call.start < prompt_length or end > len(tokens) or tokens[call.start : end] != call.tokens:
                continue
            matched = True
            logprobs[call.start - prompt_length : end - prompt_length] = call.logprobs
            versions[call.start - prompt_length : end - prompt_length] = call.versions
        first_call = next((c.versions[0] for c in self.calls if c.versions), 0)
        return (logprobs if matched else None), fill_unknown_versions(versions, first_call)


def fill_unknown_versions(versions: np.ndarray, default: int = 0) -> np.ndarray:
    """`versions` with every `UNKNOWN_VERSION` (environment tokens) set to the version of the model
    token before it, or, before the first model token, of the first one after it (`default` when there
    is none): environment tokens never make a sample look staler than its model tokens."""
    unknown = versions == UNKNOWN_VERSION
    if not unknown.any():
        return versions
    known = np.flatnonzero(~unknown)
    if not len(known):
        return np.full_like(versions, default)
    # Index of the last known position at or before each token; before the first, the first known.
    last_known = np.maximum.accumulate(np.where(unknown, -1, np.arange(len(versions))))
    return versions[np.where(last_known < 0, known[0], last_known)]


def _exact(values: list[Any], n: int, dtype: Any, name: str, index: int) -> np.ndarray:
    if len(values) != n:
        raise TrajectoryError(f"sample {index}: {name} has {len(values)} entries for {n} response tokens")
    return np.asarray(values, dtype=dtype)
