"""The reward-server wire formats, both ends: what the client sends and reads, what the server reads and sends.

All bodies are JSON over HTTP POST (`docs/reward-servers.md` is the user-facing description).

format     request body                                         success reply
---------  ---------------------------------------------------  ---------------------------------------------
slime      one sample: {"prompt", "response", "label"}          the reward itself: a number, or a dict whose
                                                                `--reward-key` field (else "score"/"reward")
                                                                is the reward; the other fields are extras
openrlhf   a batch: {"query": [prompt + response, ...],         {"rewards": [...], "scores": [...],
           "prompts": [...], "labels": [...]}                   "extra_logs": {key: [one value per sample]}}
vime v1    a batch: {"version": 1, "samples": [{"id", "prompt",  {"version": 1, "results": [{"id", "reward",
           "response", "label", "metadata"}]}                    "extra"} | {"id", "error"}]}

A sample the server could not score (a scoring timeout, a crashing custom function, a missing label) is
reported, never disguised as a low reward: slime answers HTTP 422 `{"error": reason}`; openrlhf puts
`null` in `rewards` and the reason in `extra_logs["reward_error"]`; vime gives the result an `"error"`.

Client-side decoding raises `ReplyError` when a reply does not have the promised shape (wrong length, a
missing key, an unsupported version); values that are the wrong type for a reward become failed
`RewardResult`s for the samples concerned, so one odd value never fails a whole batch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from vime.rewards.types import SCORE_KEYS, RewardResult, coerce_result

WireFormat = Literal["slime", "openrlhf", "vime"]
FORMATS: tuple[WireFormat, ...] = ("slime", "openrlhf", "vime")
VIME_WIRE_VERSION = 1
SUPPORTED_VIME_VERSIONS: tuple[int, ...] = (VIME_WIRE_VERSION,)
# The top-level key of an openrlhf reply that holds the rewards, unless --reward-key names another.
OPENRLHF_REWARD_KEY = "rewards"
# Where an openrlhf reply explains a null reward.
OPENRLHF_ERROR_KEY = "reward_error"
# The environment variable both ends read a bearer token from (sent as `Authorization: Bearer ...`).
TOKEN_ENV = "VIME_RM_TOKEN"


class ReplyError(ValueError):
    """A reward server's reply does not have the shape its format promises; the message says how."""


class RequestError(ValueError):
    """A request body a server cannot score (inconsistent lengths, unsupported version)."""


@dataclass(frozen=True)
class ScoreItem:
    """One sample to score, as both ends see it. `id` is unique within a request (vime format)."""

    id: str
    prompt: str
    response: str
    label: str | None
    metadata: Mapping[str, Any] = field(default_factory=dict)


def is_batched(fmt: WireFormat) -> bool:
    """slime sends one sample per request; the other formats send batches."""
    return fmt != "slime"


# ------------------------------------------------------------------------------------------- client


def encode_request(fmt: WireFormat, items: Sequence[ScoreItem]) -> dict[str, Any]:
    """The JSON body for `items` (exactly one item for slime)."""
    if fmt == "slime":
        if len(items) != 1:
            raise ValueError(f"the slime format sends one sample per request, got {len(items)}")
        item = items[0]
        return {"prompt": item.prompt, "response": item.response, "label": item.label}
    if fmt == "openrlhf":
        return {
            "query": [item.prompt + item.response for item in items],
            "prompts": [item.prompt for item in items],
            "labels": [item.label for item in items],
        }
    if fmt == "vime":
        return {
            "version": VIME_WIRE_VERSION,
            "samples": [
                {"id": i.id, "prompt": i.prompt, "response": i.response, "label": i.label, "metadata": dict(i.metadata)}
                for i in items
            ],
        }
    raise ValueError(f"unknown reward wire format {fmt!r}; known: {', '.join(FORMATS)}")


def reward_from_value(value: Any, reward_key: str | None) -> RewardResult:
    """One reward value from a reply (a number or a dict) as a `RewardResult`.

    With `reward_key`, a dict's `reward_key` field is the reward and the other fields become extras;
    without it, `coerce_result` looks for "score"/"reward". Unusable values give a failed result.
    """
    if value is None:
        return RewardResult.failure("reward server returned null instead of a reward")
    if isinstance(value, bool):
        return _boolean_reward(value, None)
    if reward_key and isinstance(value, Mapping):
        if reward_key not in value:
            return RewardResult.failure(
                f"reward dict has no --reward-key field {reward_key!r} (fields: {sorted(map(str, value))})"
            )
        extra = {str(k): v for k, v in value.items() if k != reward_key}
        if isinstance(value[reward_key], bool):
            return _boolean_reward(value[reward_key], reward_key, extra)
        inner = coerce_result(value[reward_key])
        if inner.failed:
            return RewardResult.failure(f"{reward_key!r} in reward dict: {inner.reason}", **extra)
        return RewardResult(reward=inner.reward, extra=extra)
    if isinstance(value, Mapping):
        key = next((k for k in SCORE_KEYS if k in value), None)
        if key is not None and isinstance(value[key], bool):
            return _boolean_reward(value[key], key, {str(k): v for k, v in value.items() if k != key})
    result = coerce_result(value)
    if result.failed:
        return RewardResult.failure(f"reward server sent an unusable reward: {result.reason}", **result.extra)
    return result


def _boolean_reward(value: bool, key: str | None, extra: Mapping[str, Any] | None = None) -> RewardResult:
    """JSON true/false is not a number: on the wire it fails the sample (a Python reward function may
    still return a bool, see `coerce_result`), so a server that sends `acc` where the score belongs is
    noticed instead of training on 1.0/0.0."""
    where = f"{key!r} in reward dict" if key else "reward"
    return RewardResult.failure(
        f"reward server sent an unusable reward: {where} is JSON {str(value).lower()}, not a number", **dict(extra or {})
    )


def decode_reply(fmt: WireFormat, body: Any, items: Sequence[ScoreItem], reward_key: str | None) -> list[RewardResult]:
    """Rewards for `items` from a successful (HTTP 2xx) reply body; raises `ReplyError` on a bad shape."""
    if fmt == "slime":
        return [reward_from_value(body, reward_key)]
    if fmt == "openrlhf":
        return _decode_openrlhf(body, len(items), reward_key)
    if fmt == "vime":
        return _decode_vime(body, items, reward_key)
    raise ValueError(f"unknown reward wire format {fmt!r}; known: {', '.join(FORMATS)}")


def _decode_openrlhf(body: Any, n: int, reward_key: str | None) -> list[RewardResult]:
    key = reward_key or OPENRLHF_REWARD_KEY
    if not isinstance(body, Mapping):
        raise ReplyError(f"openrlhf reply must be a JSON object with {key!r}, got {type(body).__name__}")
    if key not in body:
        raise ReplyError(f"openrlhf reply has no {key!r} list (keys: {sorted(map(str, body))})")
    rewards = body[key]
    if not isinstance(rewards, list) or len(rewards) != n:
        got = f"{len(rewards)} entries" if isinstance(rewards, list) else type(rewards).__name__
        raise ReplyError(f"openrlhf reply's {key!r} must be a list of {n} rewards, got {got}")
    logs = body.get("extra_logs") or {}
    per_sample: dict[str, list[Any]] = {}
    if isinstance(logs, Mapping):
        per_sample = {str(k): v for k, v in logs.items() if isinstance(v, list) and len(v) == n}
    if "scores" in body and key != "scores" and isinstance(body["scores"], list) and len(body["scores"]) == n:
        per_sample.setdefault("scores", body["scores"])
    errors = per_sample.pop(OPENRLHF_ERROR_KEY, [None] * n)
    results = []
    for i, value in enumerate(rewards):
        extra = {k: v[i] for k, v in per_sample.items()}
        if value is None:
            reason = errors[i] or "reward server returned null instead of a reward"
            results.append(RewardResult.failure(f"reward server could not score the sample: {reason}", **extra))
            continue
        result = reward_from_value(value, None)
        results.append(result if result.failed else RewardResult(result.reward, {**extra, **result.extra}))
    return results


def _decode_vime(body: Any, items: Sequence[ScoreItem], reward_key: str | None) -> list[RewardResult]:
    if not isinstance(body, Mapping):
        raise ReplyError(f"vime reply must be a JSON object, got {type(body).__name__}")
    version = body.get("version")
    if version not in SUPPORTED_VIME_VERSIONS:
        raise ReplyError(f"vime reply has version {version!r}; this client speaks {list(SUPPORTED_VIME_VERSIONS)}")
    entries = body.get("results")
    if not isinstance(entries, list):
        raise ReplyError(f"vime reply needs a 'results' list (keys: {sorted(map(str, body))})")
    by_id: dict[str, Mapping[str, Any]] = {}
    for entry in entries:
        if not isinstance(entry, Mapping) or "id" not in entry:
            raise ReplyError(f"vime reply result without an id: {str(entry)[:200]}")
        sample_id = str(entry["id"])
        if sample_id in by_id:
            raise ReplyError(f"vime reply has two results for sample id {sample_id!r}")
        by_id[sample_id] = entry
    results = []
    for item in items:
        entry = by_id.get(item.id)
        if entry is None:
            results.append(RewardResult.failure(f"reward server's reply has no result for sample id {item.id!r}"))
            continue
        extra = entry.get("extra") if isinstance(entry.get("extra"), Mapping) else {}
        if entry.get("error") is not None:
            results.append(RewardResult.failure(f"reward server could not score the sample: {entry['error']}", **extra))
            continue
        result = reward_from_value(entry.get("reward"), reward_key)
        results.append(result if result.failed else RewardResult(result.reward, {**extra, **result.extra}))
    return results


# ------------------------------------------------------------------------------------------- server


class SlimeRequest(BaseModel):
    """slime's per-sample body. `prompt` may be chat messages; unknown keys are accepted and ignored."""

    model_config = ConfigDict(extra="ignore")

    prompt: str | list[dict[str, Any]]
    response: str
    label: Any = None


class OpenRLHFRequest(BaseModel):
    """OpenRLHF's batch body: `query` is prompt + response; `prompts` and `labels` are optional."""

    model_config = ConfigDict(extra="ignore")

    query: list[str]
    prompts: list[str] | None = None
    labels: list[Any] | None = None


class VimeSample(BaseModel):
    # Unknown fields are ignored so a newer client's additions within version 1 do not break this server.
    model_config = ConfigDict(extra="ignore")

    id: str
    prompt: str
    response: str
    label: Any = None
    metadata: dict[str, Any] = Field(default_factory=dict)


class VimeRequest(BaseModel):
    """vime's batch body, version 1."""

    model_config = ConfigDict(extra="ignore")

    version: int
    samples: list[VimeSample]


REQUEST_MODELS: dict[WireFormat, type[BaseModel]] = {
    "slime": SlimeRequest,
    "openrlhf": OpenRLHFRequest,
    "vime": VimeRequest,
}


def items_from_request(request: BaseModel) -> list[ScoreItem]:
    """The samples of a validated request body; raises `RequestError` for inconsistent bodies."""
    if isinstance(request, SlimeRequest):
        return [ScoreItem("0", _prompt_text(request.prompt), request.response, _label_text(request.label))]
    if isinstance(request, OpenRLHFRequest):
        n = len(request.query)
        prompts = request.prompts if request.prompts is not None else [""] * n
        labels = request.labels if request.labels is not None else [None] * n
        if len(prompts) != n or len(labels) != n:
            raise RequestError(f"query has {n} entries but prompts has {len(prompts)} and labels {len(labels)}")
        items = []
        for i, (query, prompt, label) in enumerate(zip(request.query, prompts, labels)):
            # OpenRLHF sends prompt + response as one string; split it back when the prompt is its prefix.
            response = query[len(prompt) :] if prompt and query.startswith(prompt) else query
            items.append(ScoreItem(str(i), prompt, response, _label_text(label)))
        return items
    if isinstance(request, VimeRequest):
        if request.version not in SUPPORTED_VIME_VERSIONS:
            raise RequestError(
                f"vime request has version {request.version}; this server speaks {list(SUPPORTED_VIME_VERSIONS)}"
            )
        return [ScoreItem(s.id, s.prompt, s.response, _label_text(s.label), s.metadata) for s in request.samples]
    raise TypeError(f"not a reward request model: {type(request).__name__}")


def encode_reply(fmt: WireFormat, items: Sequence[ScoreItem], results: Sequence[RewardResult]) -> tuple[int, Any]:
    """(HTTP status, JSON body) answering `items` with `results`, in `fmt`."""
    if fmt == "slime":
        result = results[0]
        if result.failed:
            return 422, {"error": result.reason or "the sample could not be scored"}
        return 200, result.reward
    if fmt == "openrlhf":
        rewards = [None if r.failed else r.reward for r in results]
        logs: dict[str, list[Any]] = {}
        keys = sorted({k for r in results for k, v in r.extra.items() if _is_number(v)})
        for key in keys:
            logs[key] = [_number(r.extra.get(key)) for r in results]
        if any(r.failed for r in results):
            logs[OPENRLHF_ERROR_KEY] = [r.reason if r.failed else None for r in results]
        return 200, {"rewards": rewards, "scores": list(rewards), "extra_logs": logs}
    if fmt == "vime":
        out = []
        for item, r in zip(items, results):
            entry: dict[str, Any] = {"id": item.id, "extra": json_safe(r.extra)}
            if r.failed:
                entry["error"] = r.reason or "the sample could not be scored"
            else:
                entry["reward"] = r.reward
            out.append(entry)
        return 200, {"version": VIME_WIRE_VERSION, "results": out}
    raise ValueError(f"unknown reward wire format {fmt!r}; known: {', '.join(FORMATS)}")


def _prompt_text(prompt: str | list[dict[str, Any]]) -> str:
    """Chat messages become their contents joined by newlines (reward functions take plain text)."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(str(m.get("content", "")) for m in prompt)


def _label_text(label: Any) -> str | None:
    """Reward functions take labels as text: numbers as written, structures as JSON."""
    if label is None or isinstance(label, str):
        return label
    if isinstance(label, (int, float)) and not isinstance(label, bool):
        return str(label)
    return json.dumps(label, ensure_ascii=False, default=str)


def _is_number(value: Any) -> bool:
    return isinstance(value, (bool, int, float)) and (not isinstance(value, float) or math.isfinite(value))


def _number(value: Any) -> float | None:
    return float(value) if _is_number(value) else None


def json_safe(value: Any) -> Any:
    """`value` with everything JSON cannot carry (NaN, sets, objects) turned into strings."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return str(value)
