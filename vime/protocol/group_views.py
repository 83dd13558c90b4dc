"""The broker's view of generated groups: `Group` and `Sample` with their arrays left in wire form.

The broker reads a generated group's ids, texts, statuses and token versions, never its tokens,
logprobs, masks or routing traces; it only passes them on (to the trainer in `TrainBatch`, to its
journal). `GroupsGeneratedView` decodes the same bytes as `GroupsGenerated`, but each array is a
`WireArray` that msgspec decodes and re-encodes in C, so a group crosses the broker without a numpy
object or a Python hook per array. An array that travelled as a frame of its own (large prompts,
long responses, R3 traces) becomes a numpy view of that frame during validation, since its frame index
means nothing in another message; it is then forwarded as a frame again, still without a copy.

Validation is the canonical types' (same dtypes, same lengths, same R3 checks, the same `ProtocolError`
codes), so a malformed group is refused at the broker's door and never reaches a training batch. The
view classes are derived from `Sample` and `Group` field by field, so a field added there travels
through the broker without a change here.
"""

from __future__ import annotations

import functools
from typing import Any

import msgspec
import numpy as np

from vime.protocol.codec import ERROR_INVALID, ProtocolError, WireArray, message_tag, require, wire_array_value
from vime.protocol.messages import Group, GroupsGenerated, Sample, check_trace

_ITEMSIZE = {"int32": 4, "float32": 4, "uint8": 1}


def _checked(value: Any, dtype_name: str, what: str, expected: int | None = None) -> tuple[Any, int]:
    """(`value` with a frame index followed, its length); ProtocolError unless it is a 1-D array of
    `dtype_name` with `expected` entries."""
    if type(value) is WireArray and type(value.data) is int:
        value = wire_array_value(value)  # a frame of this message: a numpy view of it from now on
    if type(value) is WireArray:
        if len(value.shape) != 1:
            raise ProtocolError(ERROR_INVALID, f"{what} must be 1-D, got shape {tuple(value.shape)}")
        if value.dtype != dtype_name:
            raise ProtocolError(ERROR_INVALID, f"{what} must be {dtype_name}, got {value.dtype}")
        n = value.shape[0]
        if len(value.data) != n * _ITEMSIZE[dtype_name]:  # type: ignore[arg-type]
            raise ProtocolError(ERROR_INVALID, f"{what}: {n} entries of {dtype_name} in {len(value.data)} bytes")  # type: ignore[arg-type]
    else:
        if value.ndim != 1:
            raise ProtocolError(ERROR_INVALID, f"{what} must be 1-D, got shape {value.shape}")
        if value.dtype.name != dtype_name:
            raise ProtocolError(ERROR_INVALID, f"{what} must be {dtype_name}, got {value.dtype.name}")
        n = len(value)
    if expected is not None and n != expected:
        raise ProtocolError(ERROR_INVALID, f"{what} has {n} entries, expected {expected}")
    return value, n


def _sample_validate(self: Any) -> None:
    self.response_tokens, n = _checked(self.response_tokens, "int32", "response_tokens")
    self.rollout_logprobs, _ = _checked(self.rollout_logprobs, "float32", "rollout_logprobs", n)
    self.loss_mask, _ = _checked(self.loss_mask, "uint8", "loss_mask", n)
    self.token_versions, _ = _checked(self.token_versions, "int32", "token_versions", n)
    if self.reward is not None:
        require(np.isfinite(self.reward), f"sample {self.index}: reward {self.reward} is not finite")
    if type(self.routed_experts) is WireArray:
        self.routed_experts = wire_array_value(self.routed_experts)


def _group_validate(self: Any) -> None:
    self.prompt_tokens, prompt_len = _checked(self.prompt_tokens, "int32", f"group {self.group_id} prompt_tokens")
    require(self.n_samples >= 1, f"group {self.group_id}: n_samples must be >= 1")
    require(len(self.samples) <= self.n_samples, f"group {self.group_id}: more samples than n_samples")
    for sample in self.samples:
        sample.validate()
        if sample.routed_experts is not None:
            check_trace(self.group_id, sample, prompt_len)


def _oldest_version(self: Any) -> int:
    """The oldest weight version that produced any token of this group (-1 if no tokens)."""
    # validated int32 (`_sample_validate`): one numpy reduction over the joined bytes
    joined = b"".join(v.data if type(v) is WireArray else v.tobytes() for v in (s.token_versions for s in self.samples))
    return int(np.frombuffer(joined, dtype=np.int32).min()) if joined else -1


def _groups_generated_validate(self: Any) -> None:
    for group in self.groups:
        group.validate()
        require(len(group.samples) == group.n_samples, f"group {group.group_id}: incomplete samples")


def _view_of(cls: type[msgspec.Struct], name: str, replace: dict[Any, Any], namespace: dict[str, Any]) -> Any:
    """A struct with `cls`'s fields, tag and defaults, each field type looked up in `replace` first."""
    fields = []
    for f in msgspec.structs.fields(cls):
        default = (msgspec.field(default_factory=f.default_factory) if f.default_factory is not msgspec.NODEFAULT
                   else f.default)  # fmt: skip
        field_type = replace.get(f.type, f.type)
        fields.append((f.name, field_type) if default is msgspec.NODEFAULT else (f.name, field_type, default))
    return msgspec.defstruct(
        name, fields, namespace={"__module__": __name__, **namespace}, tag=message_tag(cls), tag_field="type",  # type: ignore[arg-type]
        kw_only=True, omit_defaults=True, dict=True,
    )  # fmt: skip


SampleView = _view_of(
    Sample, "SampleView", {np.ndarray: WireArray, np.ndarray | None: WireArray | None}, {"validate": _sample_validate},
)
GroupView = _view_of(
    Group, "GroupView", {np.ndarray: WireArray, list[Sample]: list[SampleView]},
    {"validate": _group_validate, "oldest_version": functools.cached_property(_oldest_version)},
)
GroupsGeneratedView = _view_of(
    GroupsGenerated, "GroupsGeneratedView", {list[Group]: list[GroupView]}, {"validate": _groups_generated_validate}
)
