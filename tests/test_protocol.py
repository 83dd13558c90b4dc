"""Wire protocol: round trips, zero-copy frames, and rejection of malformed input (with fuzzing)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vime.protocol.codec import (
    ERROR_BAD_VERSION,
    ERROR_INVALID,
    ERROR_MALFORMED,
    ERROR_OVERSIZED,
    ERROR_UNKNOWN_TYPE,
    INLINE_ARRAY_BYTES,
    PROTOCOL_VERSION,
    ProtocolError,
    decode,
    encode,
)
from vime.protocol.messages import Bye, Credit, Group, GroupScores, GroupsGenerated, GroupsScored, Hello, Sample


def make_sample(index: int, length: int, version: int = 0) -> Sample:
    rng = np.random.default_rng(index)
    return Sample(
        index=index,
        response_tokens=rng.integers(0, 50, length, dtype=np.int32),
        rollout_logprobs=-rng.random(length, dtype=np.float32),
        loss_mask=np.ones(length, dtype=np.uint8),
        token_versions=np.full(length, version, dtype=np.int32),
        finish_reason="stop",
        response_text="123",
    )


def make_group(n: int = 4, length: int = 100) -> Group:
    return Group(
        group_id="e0-p7",
        prompt_index=7,
        epoch=0,
        prompt_tokens=np.arange(12, dtype=np.int32),
        prompt_text="123+456=",
        label="579",
        metadata={"source": "test"},
        n_samples=n,
        samples=[make_sample(i, length) for i in range(n)],
    )


def test_group_round_trip_keeps_every_field_and_uses_frames_for_large_arrays() -> None:
    group = make_group(n=3, length=200)
    frames = encode(GroupsGenerated(groups=[group]))
    # Per sample: tokens, logprobs, versions are 800 bytes (own frames); the uint8 loss mask is 200
    # bytes, under INLINE_ARRAY_BYTES, so it rides in the header.
    assert len(frames) == 1 + 3 * 3
    decoded = decode(frames)
    assert isinstance(decoded, GroupsGenerated)
    got = decoded.groups[0]
    assert got.group_id == group.group_id and got.label == "579" and got.metadata == {"source": "test"}
    for a, b in zip(got.samples, group.samples):
        np.testing.assert_array_equal(a.response_tokens, b.response_tokens)
        np.testing.assert_array_equal(a.rollout_logprobs, b.rollout_logprobs)
        assert a.response_tokens.dtype == np.int32 and a.rollout_logprobs.dtype == np.float32


def test_small_arrays_are_inlined_in_the_header() -> None:
    group = make_group(n=2, length=3)
    frames = encode(GroupsGenerated(groups=[group]))
    assert len(frames) == 1
    assert 3 * 4 < INLINE_ARRAY_BYTES
    decoded = decode(frames)
    np.testing.assert_array_equal(decoded.groups[0].samples[1].response_tokens, group.samples[1].response_tokens)


def test_decoded_arrays_are_views_of_the_received_frames() -> None:
    frames = [bytes(f) if not isinstance(f, bytes) else f for f in encode(GroupsGenerated(groups=[make_group(1, 500)]))]
    decoded = decode(frames)
    tokens = decoded.groups[0].samples[0].response_tokens
    assert not tokens.flags.owndata
    assert not tokens.flags.writeable  # bytes frames are immutable: no accidental writes into buffers


def test_unknown_type_bad_version_and_garbage_are_rejected_with_codes() -> None:
    with pytest.raises(ProtocolError) as err:
        decode([msgspec.msgpack.encode((PROTOCOL_VERSION, {"type": "no_such_message"}))])
    assert err.value.code == ERROR_UNKNOWN_TYPE and "no_such_message" in err.value.detail
    with pytest.raises(ProtocolError) as err:
        decode([msgspec.msgpack.encode((PROTOCOL_VERSION + 1, {"type": "credit", "n": 1}))])
    assert err.value.code == ERROR_BAD_VERSION
    with pytest.raises(ProtocolError) as err:
        decode([b"\xc1\xff\x00garbage"])
    assert err.value.code == ERROR_MALFORMED
    with pytest.raises(ProtocolError) as err:
        decode([])
    assert err.value.code == ERROR_MALFORMED


def test_wrong_field_types_and_semantic_violations_are_invalid() -> None:
    with pytest.raises(ProtocolError) as err:
        decode([msgspec.msgpack.encode((PROTOCOL_VERSION, {"type": "credit", "n": "many"}))])
    assert err.value.code == ERROR_INVALID and "n" in err.value.detail
    with pytest.raises(ProtocolError) as err:
        decode(encode(Credit(n=0)))
    assert err.value.code == ERROR_INVALID
    group = make_group(2, 100)
    group.samples[0].rollout_logprobs = group.samples[0].rollout_logprobs[:-1]
    with pytest.raises(ProtocolError, match="rollout_logprobs has 99 entries, expected 100"):
        decode(encode(GroupsGenerated(groups=[group])))
    scores = GroupScores(group_id="g", rewards=[float("nan")], failed=[False], reasons=[None])
    with pytest.raises(ProtocolError, match="not finite"):
        decode(encode(GroupsScored(scores=[scores])))


def test_array_byte_length_must_match_its_shape() -> None:
    frames = encode(GroupsGenerated(groups=[make_group(1, 100)]))
    frames[1] = bytes(frames[1])[:-4]
    with pytest.raises(ProtocolError) as err:
        decode(frames)
    assert err.value.code == ERROR_INVALID and "needs 400 bytes, got 396" in err.value.detail


def test_disallowed_dtype_cannot_be_sent_or_received() -> None:
    group = make_group(1, 4)
    group.prompt_tokens = np.array(["a"], dtype=object)
    with pytest.raises(TypeError, match="cannot be sent"):
        encode(group)
    header = msgspec.msgpack.encode(
        (PROTOCOL_VERSION, {"type": "group", "group_id": "g", "prompt_index": 0, "epoch": 0,
                            "prompt_tokens": ["O", [1], b"x" * 8], "prompt_text": "", "n_samples": 1})
    )
    with pytest.raises(ProtocolError, match="not allowed"):
        decode([header])


def test_limits_on_frames_and_sizes() -> None:
    frames = encode(GroupsGenerated(groups=[make_group(2, 1000)]))
    with pytest.raises(ProtocolError) as err:
        decode(frames, max_total_bytes=1000)
    assert err.value.code == ERROR_OVERSIZED
    with pytest.raises(ProtocolError) as err:
        decode(frames, max_frames=2)
    assert err.value.code == ERROR_OVERSIZED
    with pytest.raises(ProtocolError) as err:
        decode(frames, max_header_bytes=10)
    assert err.value.code == ERROR_OVERSIZED


def test_receiver_can_restrict_accepted_types() -> None:
    with pytest.raises(ProtocolError) as err:
        decode(encode(Credit(n=2)), expect=(Hello,))
    assert err.value.code == ERROR_UNKNOWN_TYPE and "'credit'" in err.value.detail and "hello" in err.value.detail
    with pytest.raises(ProtocolError) as err:  # against a union of accepted types as well as a single one
        decode(encode(Credit(n=2)), expect=(Hello, Bye))
    assert err.value.code == ERROR_UNKNOWN_TYPE
    # an accepted type with a bad field is invalid, not unknown
    frames = encode(Credit(n=2))
    frames[0] = msgspec.msgpack.encode((PROTOCOL_VERSION, {"type": "credit", "n": "two"}))
    with pytest.raises(ProtocolError) as err:
        decode(frames, expect=(Hello, Credit))
    assert err.value.code == ERROR_INVALID
    assert decode(encode(Credit(n=2)), expect=(Hello, Credit)) == Credit(n=2)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=300), min_size=0, max_size=5))
def test_fuzz_random_frames_only_raise_protocol_errors(frames: list[bytes]) -> None:
    try:
        msg = decode(frames)
    except ProtocolError as exc:
        assert exc.code in {ERROR_MALFORMED, ERROR_OVERSIZED, ERROR_UNKNOWN_TYPE, ERROR_BAD_VERSION, ERROR_INVALID}
        return
    assert msg is not None  # random bytes that happen to decode must still be a validated message


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_fuzz_mutated_valid_messages_only_raise_protocol_errors(data: st.DataObject) -> None:
    frames = [bytes(f) for f in encode(GroupsGenerated(groups=[make_group(2, 80)]))]
    which = data.draw(st.integers(0, len(frames) - 1))
    raw = bytearray(frames[which])
    if raw:
        cut = data.draw(st.integers(0, len(raw)))
        flips = data.draw(st.lists(st.tuples(st.integers(0, max(0, len(raw) - 1)), st.integers(0, 255)), max_size=8))
        for pos, value in flips:
            raw[pos] = value
        raw = raw[:cut] if data.draw(st.booleans()) else raw
    frames[which] = bytes(raw)
    try:
        msg = decode(frames)
    except ProtocolError:
        return
    assert isinstance(msg, GroupsGenerated)  # a mutation that still decodes must still be valid


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.integers(0, 2**31 - 1), min_size=0, max_size=300),
    st.text(max_size=40),
    st.one_of(st.none(), st.text(max_size=10)),
)
def test_round_trip_property(tokens: list[int], text: str, label: str | None) -> None:
    group = Group(
        group_id="g",
        prompt_index=1,
        epoch=2,
        prompt_tokens=np.asarray(tokens or [1], dtype=np.int32),
        prompt_text=text,
        label=label,
        n_samples=1,
    )
    decoded = decode(encode(group))
    assert decoded.prompt_text == text and decoded.label == label
    np.testing.assert_array_equal(decoded.prompt_tokens, group.prompt_tokens)


# --- R3 routing traces ---------------------------------------------------------------------------------


def _group_with_traces(num_experts: int = 64, layers: int = 2, top_k: int = 4, length: int = 100) -> Group:
    group = make_group(n=2, length=length)
    rng = np.random.default_rng(0)
    rows = len(group.prompt_tokens) + length - 1
    for sample in group.samples:
        ids = np.stack([rng.permutation(num_experts)[:top_k] for _ in range(rows * layers)]).reshape(rows, layers, top_k)
        sample.routed_experts = ids.astype(np.uint8 if num_experts <= 256 else np.uint16)
        sample.num_experts = num_experts
    return group


@pytest.mark.parametrize("num_experts", [64, 300])
def test_routing_trace_round_trips_bit_identically_as_a_zero_copy_frame(num_experts: int) -> None:
    group = _group_with_traces(num_experts=num_experts)
    frames = [bytes(f) if not isinstance(f, bytes) else f for f in encode(GroupsGenerated(groups=[group]))]
    decoded = decode(frames).groups[0]
    for sent, got in zip(group.samples, decoded.samples, strict=True):
        assert got.num_experts == num_experts
        assert got.routed_experts.dtype == sent.routed_experts.dtype
        assert got.routed_experts.shape == sent.routed_experts.shape
        assert got.routed_experts.tobytes() == sent.routed_experts.tobytes()
        assert not got.routed_experts.flags.owndata  # a view of its frame


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda s: setattr(s, "routed_experts", s.routed_experts[:-1]), "110 rows for 112 tokens"),
        (lambda s: setattr(s, "routed_experts", s.routed_experts[:, 0]), "3-D"),
        (lambda s: setattr(s, "routed_experts", s.routed_experts.astype(np.uint16)), "dtype uint16 does not match 64"),
        (lambda s: s.routed_experts.__setitem__((3, 1, 0), 64), "expert id 64, outside"),
        (lambda s: setattr(s, "num_experts", None), "routed_experts without num_experts"),
    ],
    ids=["rows", "ndim", "dtype", "id_range", "no_num_experts"],
)
def test_a_bad_routing_trace_is_an_invalid_message_naming_the_problem(corrupt, message: str) -> None:  # type: ignore[no-untyped-def]
    group = _group_with_traces()
    corrupt(group.samples[1])
    with pytest.raises(ProtocolError) as err:
        decode(encode(GroupsGenerated(groups=[group])))
    assert err.value.code == ERROR_INVALID
    assert message in err.value.detail and "sample 1" in err.value.detail


def test_a_groups_oldest_version_is_its_oldest_token_across_samples() -> None:
    group = make_group(n=3, length=6)
    group.samples[0].token_versions = np.array([4, 4, 5, 5, 6, 6], dtype=np.int32)  # an update mid-sequence
    group.samples[1].token_versions = np.array([3, 3, 3, 4, 4, 4], dtype=np.int32)
    group.samples[2].token_versions = np.full(6, 5, dtype=np.int32)
    assert group.oldest_version == 3 and isinstance(group.oldest_version, int)
    group.samples[1] = make_sample(1, 0)  # an empty response has no version to give
    assert group.oldest_version == 4
    assert make_group(n=2, length=0).oldest_version == -1
    assert Group(group_id="g", prompt_index=0, epoch=0, prompt_tokens=np.arange(3, dtype=np.int32), prompt_text="", n_samples=2).oldest_version == -1
