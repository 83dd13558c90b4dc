"""The broker's view of generated groups (`vime.protocol.group_views`): arrays stay in wire form through
the broker, what it forwards decodes to the rollout worker's groups, and it refuses what the canonical
types refuse."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from tests.test_protocol import make_group, make_sample
from tests.test_r3_trace import random_trace
from vime.protocol.codec import ERROR_INVALID, ProtocolError, WireArray, decode, encode
from vime.protocol.group_views import GroupsGeneratedView, GroupView
from vime.protocol.messages import Group, GroupsGenerated, TrainBatch
from vime.r3.trace import encode_trace


def _forwarded(groups: list[Group]) -> tuple[GroupsGeneratedView, TrainBatch]:
    """What the broker holds after receiving `groups`, and what the trainer decodes from its TrainBatch."""
    frames = [bytes(f) for f in encode(GroupsGenerated(groups=groups))]
    view = decode(frames, (GroupsGeneratedView,))
    assert isinstance(view, GroupsGeneratedView)
    batch = decode([bytes(f) for f in encode(TrainBatch(step=3, groups=view.groups))], (TrainBatch,))
    assert isinstance(batch, TrainBatch)
    return view, batch


def _assert_same_group(got: Group, want: Group) -> None:
    for name in ("group_id", "prompt_index", "epoch", "prompt_text", "n_samples", "label", "metadata", "kind"):
        assert getattr(got, name) == getattr(want, name), name
    np.testing.assert_array_equal(got.prompt_tokens, want.prompt_tokens)
    assert len(got.samples) == len(want.samples)
    for g, w in zip(got.samples, want.samples):
        for name in ("index", "finish_reason", "response_text", "status", "reward", "reward_extra", "num_experts", "rollout_stats"):
            assert getattr(g, name) == getattr(w, name), name
        for name in ("response_tokens", "rollout_logprobs", "loss_mask", "token_versions"):
            got_arr, want_arr = getattr(g, name), getattr(w, name)
            assert got_arr.dtype == want_arr.dtype, name
            np.testing.assert_array_equal(got_arr, want_arr, err_msg=name)
        if w.routed_experts is None:
            assert g.routed_experts is None
        else:
            np.testing.assert_array_equal(g.routed_experts, w.routed_experts)


def test_short_groups_cross_the_broker_in_wire_form_byte_for_byte() -> None:
    group = make_group(n=8, length=5)  # the demo's shape: every array under INLINE_ARRAY_BYTES
    group.samples[2].rollout_stats = {"turns": 2.0}
    group.samples[3].reward_extra = {"judge": "ok"}
    view, batch = _forwarded([group])
    sample = view.groups[0].samples[0]
    assert type(sample.response_tokens) is WireArray and type(sample.rollout_logprobs) is WireArray
    # the broker's TrainBatch is exactly the one it would have built from decoded groups
    canonical = decode(encode(GroupsGenerated(groups=[group])), (GroupsGenerated,))
    assert encode(TrainBatch(step=3, groups=view.groups))[0] == encode(TrainBatch(step=3, groups=canonical.groups))[0]
    _assert_same_group(batch.groups[0], group)


def test_frames_stay_frames_without_a_copy() -> None:
    group = make_group(n=3, length=200)  # tokens, logprobs and versions travel as frames of their own
    trace = random_trace(len(group.prompt_tokens) + 200 - 1, layers=4, k=2, num_experts=64)
    group.samples[1].routed_experts = encode_trace(trace, 64)
    group.samples[1].num_experts = 64
    frames = encode(GroupsGenerated(groups=[group]))
    received = [bytes(f) for f in frames]
    view = decode(received, (GroupsGeneratedView,))
    tokens = view.groups[0].samples[0].response_tokens
    assert isinstance(tokens, np.ndarray) and np.shares_memory(tokens, np.frombuffer(received[1], dtype=np.uint8))
    assert type(view.groups[0].samples[0].loss_mask) is WireArray  # 200 bytes: inline, left undecoded
    out = encode(TrainBatch(step=0, groups=view.groups))
    assert len(out) == len(frames)
    batch = decode([bytes(f) for f in out], (TrainBatch,))
    _assert_same_group(batch.groups[0], group)


def test_the_view_knows_what_the_broker_reads() -> None:
    group = make_group(n=3, length=5)
    group.samples[1].token_versions[:] = [4, 2, 5, 5, 5]
    view, _ = _forwarded([group])
    forwarded = view.groups[0]
    assert isinstance(forwarded, GroupView)
    assert forwarded.oldest_version == group.oldest_version == 0
    group.samples[0].token_versions[:] = 3
    group.samples[2].token_versions[:] = 3
    assert _forwarded([group])[0].groups[0].oldest_version == group.oldest_version == 2
    assert len(forwarded.samples[1].response_tokens) == 5
    np.testing.assert_array_equal(np.asarray(forwarded.samples[1].token_versions), [4, 2, 5, 5, 5])


def _bad_groups() -> dict[str, Group]:
    cases = {}
    g = make_group(n=2, length=5)
    g.samples[0].response_tokens = g.samples[0].response_tokens.astype(np.int64)
    cases["tokens not int32"] = g
    g = make_group(n=2, length=5)
    g.samples[1].rollout_logprobs = g.samples[1].rollout_logprobs[:3]
    cases["logprobs shorter than tokens"] = g
    g = make_group(n=2, length=200)
    g.samples[1].token_versions = g.samples[1].token_versions[:150]
    cases["framed versions shorter than tokens"] = g
    g = make_group(n=2, length=6)
    g.samples[0].loss_mask = np.ones((2, 3), dtype=np.uint8)
    cases["2-D loss mask"] = g
    g = make_group(n=2, length=5)
    g.samples[0].reward = float("nan")
    cases["reward not finite"] = g
    g = make_group(n=2, length=5)
    g.samples = g.samples[:1]
    cases["incomplete group"] = g
    g = make_group(n=1, length=5)
    g.samples[0].routed_experts = np.full((len(g.prompt_tokens) + 5 - 1, 2, 2), 70, dtype=np.uint8)
    g.samples[0].num_experts = 64
    cases["expert id out of range"] = g
    return cases


@pytest.mark.parametrize("case", sorted(_bad_groups()))
def test_the_view_refuses_what_the_canonical_types_refuse(case: str) -> None:
    frames = [bytes(f) for f in encode(GroupsGenerated(groups=[_bad_groups()[case]]))]
    with pytest.raises(ProtocolError) as canonical:
        decode(frames, (GroupsGenerated,))
    with pytest.raises(ProtocolError) as view:
        decode(frames, (GroupsGeneratedView,))
    assert view.value.code == canonical.value.code == ERROR_INVALID


@pytest.mark.parametrize("tamper", ["dtype", "bytes", "frame"])
def test_a_tampered_array_is_refused(tamper: str) -> None:
    """Arrays whose header lies about themselves (a dtype off the allow-list, bytes that do not fill the
    shape, a frame that is not there), as a hostile or broken sender could write them."""
    group = make_group(n=1, length=100)
    sample = make_sample(0, 100)
    array = {"dtype": ["object", [5], b"x" * 5], "bytes": ["int32", [5], b"\0" * 19], "frame": ["int32", [100], 9]}[tamper]
    body = {
        "type": "groups_generated",
        "groups": [{
            "type": "group", "group_id": group.group_id, "prompt_index": 7, "epoch": 0, "prompt_text": "1+1=",
            "n_samples": 1, "prompt_tokens": ["int32", [1], b"\0" * 4],
            "samples": [{
                "type": "sample", "index": 0, "finish_reason": "stop", "response_tokens": array,
                "rollout_logprobs": ["float32", [5], sample.rollout_logprobs[:5].tobytes()],
                "loss_mask": ["uint8", [5], b"\1" * 5], "token_versions": ["int32", [5], b"\0" * 20],
            }],
        }],
    }  # fmt: skip
    frames = [msgspec.msgpack.encode([1, body]), b"\0" * 400]
    for accepted in ((GroupsGenerated,), (GroupsGeneratedView,)):
        with pytest.raises(ProtocolError) as err:
            decode(frames, accepted)
        assert err.value.code == ERROR_INVALID
