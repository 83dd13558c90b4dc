"""R3 routing-trace payload: compact encoding, validation errors, training padding, agreement."""

import numpy as np
import pytest

from vime.protocol.codec import decode, encode
from vime.protocol.messages import Sample
from vime.r3.trace import encode_trace, pad_for_training, routing_agreement, trace_dtype, validate_trace


def random_trace(rows: int, layers: int, k: int, num_experts: int, seed: int = 0) -> np.ndarray:
    """Ids like a real router's: k distinct experts per (token, layer)."""
    rng = np.random.default_rng(seed)
    keys = rng.random((rows, layers, num_experts))
    return np.argsort(keys, axis=-1)[..., :k]


@pytest.mark.parametrize(("num_experts", "dtype"), [(1, np.uint8), (8, np.uint8), (256, np.uint8), (257, np.uint16),
                                                     (65535, np.uint16)])
def test_dtype_follows_expert_count(num_experts, dtype):
    assert trace_dtype(num_experts) == dtype
    trace = encode_trace(random_trace(5, 3, 1, num_experts), num_experts)
    assert trace.dtype == dtype and trace.flags.c_contiguous


@pytest.mark.parametrize("num_experts", [0, 65536])
def test_dtype_rejects_impossible_counts(num_experts):
    with pytest.raises(ValueError, match="num_experts"):
        trace_dtype(num_experts)


def test_encode_validate_round_trip():
    ids = random_trace(9, 4, 2, 8).astype(np.int64)
    trace = encode_trace(np.asfortranarray(ids), 8)
    assert trace.flags.c_contiguous and np.array_equal(trace, ids)
    validate_trace(trace, num_tokens=10, num_experts=8, num_moe_layers=4, top_k=2)


def test_trace_survives_the_wire():
    trace = encode_trace(random_trace(6, 2, 2, 300), 300)
    sample = Sample(index=0, response_tokens=np.zeros(3, np.int32), rollout_logprobs=np.zeros(3, np.float32),
                    loss_mask=np.ones(3, np.uint8), token_versions=np.zeros(3, np.int32), finish_reason="stop",
                    routed_experts=trace, num_experts=300)
    back = decode(encode(sample))
    assert back.routed_experts.dtype == np.uint16 and np.array_equal(back.routed_experts, trace)
    validate_trace(back.routed_experts, num_tokens=7, num_experts=back.num_experts)


@pytest.mark.parametrize(("ids", "match"), [
    (np.zeros((3, 2)), "3-D"),
    (np.zeros((3, 2, 2), dtype=np.float32) + 0.5, "integer"),
    (np.array([[[0, 8]]]), r"outside \[0, 8\)"),
    (np.array([[[-1, 2]]]), r"outside \[0, 8\)"),
])
def test_encode_errors(ids, match):
    with pytest.raises(ValueError, match=match):
        encode_trace(ids, 8)


def test_validate_errors():
    good = encode_trace(random_trace(4, 3, 2, 8), 8)
    cases = [
        (good[0], {}, "3-D"),
        (good.astype(np.uint16), {}, "dtype uint16 does not match 8 experts"),
        (good, {"num_tokens": 4}, "4 rows for 4 tokens"),
        (good[:, :0], {}, "no MoE layers"),
        (good, {"num_moe_layers": 4}, "3 MoE layers, the model has 4"),
        (good, {"top_k": 4}, "top_k 2, the model routes to 4"),
        (good[:, :, :0], {}, "top_k 0"),
        (np.where(good == good.max(), 8, good).astype(np.uint8), {}, "expert id 8, outside"),
    ]
    for trace, override, match in cases:
        kwargs = {"num_tokens": 5, "num_experts": 8} | override
        with pytest.raises(ValueError, match=match):
            validate_trace(trace, **kwargs)
    with pytest.raises(ValueError, match="3-D numpy array"):
        validate_trace(good.tolist(), num_tokens=5, num_experts=8)  # type: ignore[arg-type]


def test_validate_names_uncaptured_layers():
    trace = encode_trace(random_trace(4, 3, 2, 8), 8)
    trace[:, 1] = 0  # a layer the engine did not capture
    with pytest.raises(ValueError, match=r"MoE layers \[1\]; all-zero .*\[1\]"):
        validate_trace(trace, num_tokens=5, num_experts=8)
    trace = encode_trace(random_trace(4, 3, 2, 8), 8)
    trace[2, 2] = 5  # one bad row, not all zero
    with pytest.raises(ValueError, match=r"repeats an expert .* MoE layers \[2\]$"):
        validate_trace(trace, num_tokens=5, num_experts=8)


def test_empty_trace_of_a_one_token_sequence_is_valid():
    trace = encode_trace(np.zeros((0, 2, 2), np.int64), 8)
    assert trace.shape == (0, 2, 2) and trace.dtype == np.uint8
    validate_trace(trace, num_tokens=1, num_experts=8)  # raises if a one-token sequence were refused


def test_pad_for_training_appends_a_pad_row():
    trace = encode_trace(random_trace(4, 3, 2, 8), 8)
    padded = pad_for_training(trace, pad_id=8)
    assert padded.shape == (5, 3, 2) and padded.dtype == np.uint8
    assert np.array_equal(padded[:4], trace) and (padded[4] == 8).all()
    wide = pad_for_training(encode_trace(random_trace(2, 1, 2, 256), 256), pad_id=256)
    assert wide.dtype == np.uint16 and (wide[-1] == 256).all()
    with pytest.raises(ValueError, match="pad_id"):
        pad_for_training(trace, pad_id=-1)


def test_routing_agreement_compares_expert_sets():
    a = encode_trace(random_trace(10, 2, 2, 8), 8)
    assert routing_agreement(a, a[..., ::-1]) == 1.0  # order within top-k does not matter
    b = a.copy()
    b[0, 0] = [x for x in range(8) if x not in a[0, 0]][:2]
    b[1, 1, 0] = [x for x in range(8) if x not in a[1, 1]][0]  # one of two experts differs: a miss
    assert routing_agreement(a, b) == pytest.approx(18 / 20)
    token_mask = np.ones(10, bool)
    token_mask[0] = False
    assert routing_agreement(a, b, token_mask) == pytest.approx(17 / 18)
    layer_mask = np.zeros((10, 2), bool)
    layer_mask[:, 0] = True
    assert routing_agreement(a, b, layer_mask) == pytest.approx(9 / 10)
    with pytest.raises(ValueError, match="same shape"):
        routing_agreement(a, b[:5])
    with pytest.raises(ValueError, match="mask shape"):
        routing_agreement(a, b, np.ones(3, bool))
    with pytest.raises(ValueError, match="no routes"):
        routing_agreement(a, b, np.zeros(10, bool))
