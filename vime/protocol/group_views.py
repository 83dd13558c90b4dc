"""The broker's view of generated groups: `Group` and `Sample` with their arrays left in wire form.

The broker reads a generated group's ids, texts, statuses and token versions, never its tokens,
logprobs, masks or routing traces; it only passes them on (to the trainer in `TrainBatch`, to its
journal). `GroupsGeneratedView` decodes the same bytes as `GroupsGenerated`, but each array is a
`WireArray` that msgspec decodes and re-encodes in C, so a group crosses the broker without a numpy
object or a Python hook per array. An array that travelled as a frame of its own (large prompts,
long responses, R3 traces) becomes a numpy view of that frame during validation, since its frame index
means nothing in another message; it is then forwarded as a frame again, still without a copy.

Validation is the canonical types' own `validate` (which checks a `WireArray`'s header against its
bytes), run once frames are followed, so a malformed group is refused at the broker's door and never
reaches a training batch. The view classes are derived from `Sample` and `Group` field by field, so a
field added there travels through the broker without a change here.
"""

from __future__ import annotations

import functools
from typing import Any

import msgspec
import numpy as np

from vime.protocol.codec import WireArray, message_tag, wire_array_value
from vime.protocol.messages import Group, GroupsGenerated, Sample

_SAMPLE_ARRAYS = ("response_tokens", "rollout_logprobs", "loss_mask", "token_versions")


def _follow_frames(struct: Any, names: tuple[str, ...]) -> None:
    """Each named array that refers to a frame of the message being decoded becomes a numpy view of it:
    the index means nothing in another message, the view is sent on as a frame again."""
    for name in names:
        value = getattr(struct, name)
        if type(value) is WireArray and type(value.data) is int:
            setattr(struct, name, wire_array_value(value))


def _sample_validate(self: Any) -> None:
    _follow_frames(self, _SAMPLE_ARRAYS)
    if type(self.routed_experts) is WireArray:
        self.routed_experts = wire_array_value(self.routed_experts)  # the R3 checks read its ids
    Sample.validate(self)


def _group_validate(self: Any) -> None:
    _follow_frames(self, ("prompt_tokens",))
    Group.validate(self)


def _oldest_version(self: Any) -> int:
    """The oldest weight version that produced any token of this group (-1 if no tokens)."""
    # validated int32 (`Sample.validate`): one numpy reduction over the joined bytes
    joined = b"".join(v.data if type(v) is WireArray else v.tobytes() for v in (s.token_versions for s in self.samples))
    return int(np.frombuffer(joined, dtype=np.int32).min()) if joined else -1


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
    GroupsGenerated, "GroupsGeneratedView", {list[Group]: list[GroupView]}, {"validate": GroupsGenerated.validate}
)
