"""R3 record/replay hooks on a tiny random transformers Qwen3-MoE (CPU, fp32 unless stated)."""

import numpy as np
import pytest
import torch
from torch import nn

from vime.r3.hf_router import (
    NO_ROUTE,
    RoutingRecorder,
    RoutingReplay,
    find_routers,
    replay_ids_for_batch,
)
from vime.r3.trace import pad_for_training, routing_agreement, validate_trace

transformers = pytest.importorskip("transformers")

NUM_EXPERTS, TOP_K = 8, 2
LENGTHS = [12, 7, 9]  # right-padded batch of different lengths


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from vime.demo.model_factory import make_tiny_qwen3_moe

    torch.set_num_threads(1)
    return make_tiny_qwen3_moe(tmp_path_factory.mktemp("moe"), seed=0, num_experts=NUM_EXPERTS,
                               num_experts_per_tok=TOP_K, dtype="float32")


def load(model_dir, dtype=torch.float32):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


@pytest.fixture(scope="module")
def model(model_dir):
    return load(model_dir)


def batch(lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(1, 60, (len(lengths), width), generator=g)
    for b, n in enumerate(lengths):
        ids[b, n:] = 0  # right padding
    return ids, torch.arange(width).expand(len(lengths), width)


def logits_of(model, ids, pos):
    return model(input_ids=ids, position_ids=pos, use_cache=False).logits


def record(model, ids, pos, lengths=LENGTHS):
    with torch.no_grad(), RoutingRecorder(model) as rec:
        logits_of(model, ids, pos)
    return rec.traces(lengths)


def assert_no_hooks(model):
    for name, router in find_routers(model):
        parent = model.get_submodule(name.rpartition(".")[0])
        assert not router._forward_hooks and not parent._forward_pre_hooks


def test_finds_qwen3_moe_routers(model):
    routers = find_routers(model)
    assert [n for n, _ in routers] == [f"model.layers.{i}.mlp.gate" for i in range(model.config.num_hidden_layers)]
    assert all(type(r).__name__ == "Qwen3MoeTopKRouter" for _, r in routers)
    with pytest.raises(ValueError, match="no MoE routers"):
        RoutingRecorder(nn.Sequential(nn.Linear(4, 4)))


def test_record_gives_valid_per_sample_traces(model):
    traces = record(model, *batch())
    assert [t.shape[0] for t in traces] == [n - 1 for n in LENGTHS]
    for trace, n in zip(traces, LENGTHS):
        validate_trace(trace, num_tokens=n, num_experts=NUM_EXPERTS, num_moe_layers=2, top_k=TOP_K)


@pytest.mark.parametrize("padded", [False, True])
def test_replaying_recorded_ids_reproduces_logits_exactly(model, padded):
    ids, pos = batch()
    traces = record(model, ids, pos)
    if padded:  # the num_experts pad id must mean "route yourself", not reach grouped_mm (NaN there)
        traces = [pad_for_training(t, NUM_EXPERTS) for t in traces]
    with torch.no_grad():
        plain = logits_of(model, ids, pos)
        with RoutingReplay(model, replay_ids_for_batch(traces, LENGTHS)):
            replayed = logits_of(model, ids, pos)
    assert torch.equal(plain, replayed)


def test_replaying_other_ids_changes_routing_and_logits(model):
    ids, pos = batch()
    traces = record(model, ids, pos)
    other = [((t.astype(np.int64) + 3) % NUM_EXPERTS).astype(np.uint8) for t in traces]
    with torch.no_grad():
        plain = logits_of(model, ids, pos)
        with RoutingReplay(model, replay_ids_for_batch(other, LENGTHS)), RoutingRecorder(model) as rec:
            replayed = logits_of(model, ids, pos)
    used = rec.traces(LENGTHS)  # a recorder inside the replay sees what the experts actually got
    assert all(np.array_equal(u, o) for u, o in zip(used, other))
    for b, n in enumerate(LENGTHS):
        assert not torch.allclose(plain[b, 1 : n - 1], replayed[b, 1 : n - 1], atol=1e-4)


def test_router_weights_get_gradients_under_replay(model_dir):
    model = load(model_dir)
    ids, pos = batch()
    traces = record(model, ids, pos)
    other = [((t.astype(np.int64) + 1) % NUM_EXPERTS).astype(np.uint8) for t in traces]
    with RoutingReplay(model, replay_ids_for_batch(other, LENGTHS)):
        logits_of(model, ids, pos).logsumexp(-1).mean().backward()
    for name, router in find_routers(model):
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0, name


def test_bf16_routing_disagrees_without_replay_and_agrees_with_it(model, model_dir):
    # ~0.5% of routes flip in bf16 on this model; 1000 routes make "some flip" certain for these inputs.
    lengths = [64] * 7 + [40]
    ids, pos = batch(lengths, seed=1)
    ref = record(model, ids, pos, lengths)
    model16 = load(model_dir, torch.bfloat16)
    free = record(model16, ids, pos, lengths)
    with torch.no_grad(), RoutingReplay(model16, replay_ids_for_batch(ref, lengths)), RoutingRecorder(model16) as rec:
        logits_of(model16, ids, pos)
    replayed = rec.traces(lengths)
    agree_free = float(np.mean([routing_agreement(a, b) for a, b in zip(ref, free)]))
    agree_replay = float(np.mean([routing_agreement(a, b) for a, b in zip(ref, replayed)]))
    assert 0.9 < agree_free < 1.0
    assert agree_replay == 1.0


def test_hooks_are_removed_on_exit_even_after_an_error(model):
    ids, pos = batch()
    traces = record(model, ids, pos)
    other = [((t.astype(np.int64) + 5) % NUM_EXPERTS).astype(np.uint8) for t in traces]
    with torch.no_grad():
        plain = logits_of(model, ids, pos)
        with pytest.raises(RuntimeError, match="boom"), RoutingReplay(model, replay_ids_for_batch(other, LENGTHS)):
            assert not torch.equal(logits_of(model, ids, pos), plain)
            raise RuntimeError("boom")
        assert_no_hooks(model)
        assert torch.equal(logits_of(model, ids, pos), plain)
        with pytest.raises(ValueError, match="batch size changed"), RoutingRecorder(model):
            logits_of(model, ids, pos)
            logits_of(model, ids[:1], pos[:1])
        assert_no_hooks(model)


def test_recording_a_kv_cached_generation_matches_one_full_forward(model):
    lengths = [10, 10]
    ids, pos = batch(lengths, seed=2)
    full = record(model, ids, pos, lengths)
    with torch.no_grad(), RoutingRecorder(model) as rec:
        out = model(input_ids=ids[:, :6], use_cache=True)
        for t in range(6, 9):  # decode steps; the last token (index 9) is never fed, as in generation
            out = model(input_ids=ids[:, t : t + 1], past_key_values=out.past_key_values, use_cache=True)
    assert rec.recorded_tokens == 9
    assert all(np.array_equal(a, b) for a, b in zip(full, rec.traces(lengths)))


def test_replay_input_errors(model):
    ids, pos = batch()
    traces = record(model, ids, pos)
    replay = RoutingReplay(model)
    with pytest.raises(ValueError, match=r"\[B, T, 2, 2\]"):
        replay.set_expert_ids(torch.zeros(3, 12, 3, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="integers"):
        replay.set_expert_ids(torch.zeros(3, 12, 2, 2))
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="before set_expert_ids"), replay:
            logits_of(model, ids, pos)
        replay.set_expert_ids(replay_ids_for_batch(traces, LENGTHS))
        with pytest.raises(ValueError, match=r"replay ids are for a \[3, 12\] batch"), replay:
            logits_of(model, ids[:2], pos[:2])
    assert_no_hooks(model)
    with pytest.raises(ValueError, match="row 0"):
        replay_ids_for_batch(traces, [5, 7, 9])
    assert (replay_ids_for_batch(traces, LENGTHS)[1, 6:] == NO_ROUTE).all()
