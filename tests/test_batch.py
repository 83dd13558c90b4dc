"""RolloutBatch: packing, logprob alignment, sharding, micro-batching and tensor-only broadcast."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vime.trainer.batch import RolloutBatch, SampleRecord, broadcast_batch


def make_sample(
    prompt_len: int, resp_len: int, group: int = 0, seed: int = 0, reward: float = 0.0, routes: bool = False
) -> SampleRecord:
    rng = np.random.default_rng(seed)
    trace = rng.integers(0, 8, (prompt_len + resp_len - 1, 3, 2)).astype(np.uint8) if routes else None
    return SampleRecord(
        routed_experts=trace,
        group_index=group,
        prompt_tokens=rng.integers(1, 50, prompt_len),
        response_tokens=rng.integers(1, 50, resp_len),
        rollout_logprobs=-rng.random(resp_len).astype(np.float32),
        loss_mask=(rng.random(resp_len) > 0.2).astype(np.uint8),
        reward=reward,
        token_versions=np.full(resp_len, seed, dtype=np.int32),
    )


def make_batch(lengths: list[tuple[int, int]], routes: bool = False) -> tuple[RolloutBatch, list[SampleRecord]]:
    samples = [
        make_sample(p, r, group=i // 2, seed=i, reward=float(i), routes=routes) for i, (p, r) in enumerate(lengths)
    ]
    return RolloutBatch.from_samples(samples), samples


def test_micro_batch_alignment_reads_response_logprobs_from_previous_position():
    batch, samples = make_batch([(3, 4), (5, 2), (1, 6)])
    for mb in batch.micro_batches(size=2):
        flat_ids = mb.input_ids.flatten()
        # logits at position t predict token t+1: the token right after each logit position is the target
        assert torch.equal(flat_ids[mb.logit_index + 1], mb.targets)
        for row, i in enumerate(mb.sample_index.tolist()):
            s, sel = samples[i], mb.token_sample == row
            assert mb.targets[sel].tolist() == s.response_tokens.tolist()
            assert mb.rollout_logprobs[sel].tolist() == pytest.approx(s.rollout_logprobs.tolist())
            assert mb.loss_mask[sel].tolist() == s.loss_mask.astype(float).tolist()
            # first response token is predicted by the last prompt position
            assert (mb.logit_index[sel][0] % mb.input_ids.shape[1]).item() == s.prompt_tokens.size - 1
            assert mb.position_ids[row, : s.prompt_tokens.size + s.response_tokens.size].tolist() == list(
                range(s.prompt_tokens.size + s.response_tokens.size)
            )


def test_from_samples_packs_and_select_keeps_identity():
    batch, samples = make_batch([(3, 4), (5, 2), (2, 3)])
    assert batch.sequence_lengths.tolist() == [7, 7, 5]
    assert batch.response_lengths.tolist() == [4, 2, 3]
    assert batch.group_ids.tolist() == [0, 0, 1]
    sub = batch.select([2, 0])
    assert sub.sample_ids.tolist() == [2, 0]
    assert sub.tokens.tolist() == np.concatenate(
        [samples[2].prompt_tokens, samples[2].response_tokens, samples[0].prompt_tokens, samples[0].response_tokens]
    ).tolist()
    assert sub.token_versions.tolist() == [2, 2, 2, 0, 0, 0, 0]
    parts = batch.split_responses(batch.rollout_logprobs)
    assert [p.tolist() for p in parts] == [pytest.approx(s.rollout_logprobs.tolist()) for s in samples]
    assert [c.sample_ids.tolist() for c in batch.chunks(2)] == [[0, 1], [2]]
    assert batch.select([]).num_samples == 0


def test_sample_record_validation():
    with pytest.raises(ValueError, match="empty prompt"):
        SampleRecord(0, np.array([]), np.array([1]), np.array([0.0]), np.array([1]), 0.0)
    with pytest.raises(ValueError, match="entries"):
        SampleRecord(0, np.array([1]), np.array([1, 2]), np.array([0.0]), np.array([1, 1]), 0.0)
    with pytest.raises(ValueError, match="0 and 1"):
        SampleRecord(0, np.array([1]), np.array([1]), np.array([0.0]), np.array([2]), 0.0)
    with pytest.raises(ValueError, match="non-finite"):
        SampleRecord(0, np.array([1]), np.array([1]), np.array([np.nan]), np.array([1]), 0.0)
    ok = SampleRecord(0, np.array([1]), np.array([1, 2]), np.array([-np.inf, -1.0]), np.array([0, 1]), 1.0)
    assert ok.rollout_logprobs.tolist() == [0.0, -1.0]  # masked non-finite values are neutralised
    assert ok.token_versions.tolist() == [-1, -1]


def test_shard_balances_tokens_and_covers_every_sample():
    lengths = [(10, 90), (5, 5), (20, 20), (1, 9), (30, 30), (2, 2), (50, 10)]
    batch, _ = make_batch(lengths)
    shards = batch.shard_indices(3)
    assert sorted(i for s in shards for i in s) == list(range(len(lengths)))
    assert all(shards)
    loads = [sum(p + r for p, r in (lengths[i] for i in s)) for s in shards]
    assert max(loads) - min(loads) <= max(p + r for p, r in lengths)
    assert batch.shard(1, 3).sample_ids.tolist() == shards[1]


def test_shard_with_fewer_samples_than_ranks_gives_empty_shard():
    batch, _ = make_batch([(3, 3)])
    assert batch.shard(0, 2).num_samples == 1
    empty = batch.shard(1, 2)
    assert empty.num_samples == 0 and empty.micro_batches(size=1) == []


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 8), st.integers(0, 8)), min_size=1, max_size=12),
    world=st.integers(1, 4),
    size=st.one_of(st.none(), st.integers(1, 4)),
    max_tokens=st.one_of(st.none(), st.integers(1, 40)),
)
def test_shards_and_micro_batches_partition_samples(lengths, world, size, max_tokens):
    batch, _ = make_batch(lengths)
    shards = batch.shard_indices(world)
    assert sorted(i for s in shards for i in s) == list(range(len(lengths)))
    if len(lengths) >= world:
        assert all(shards)
    mbs = batch.micro_batches(max_tokens=max_tokens, size=size)
    assert sorted(i for mb in mbs for i in mb.sample_index.tolist()) == list(range(len(lengths)))
    for mb in mbs:
        assert size is None or mb.num_samples <= size
        assert max_tokens is None or mb.num_samples == 1 or mb.input_ids.numel() <= max_tokens
        assert mb.targets.numel() == int(batch.response_lengths[mb.sample_index].sum())


def test_routing_traces_survive_select_shard_and_micro_batches():
    from vime.r3.hf_router import NO_ROUTE

    batch, samples = make_batch([(3, 4), (5, 0), (1, 6), (2, 2)], routes=True)
    assert batch.routed_experts.dtype == torch.int16 and batch.routed_experts.shape == (6 + 4 + 6 + 3, 3, 2)
    sub = batch.select([3, 1, 2]).shard(0, 1).chunks(2)[0].select([1, 0])
    assert sub.sample_ids.tolist() == [1, 3]
    for j, i in enumerate(sub.sample_ids.tolist()):
        assert np.array_equal(sub.sample_trace(j).numpy(), samples[i].routed_experts)
    for mb in batch.micro_batches(size=2):
        assert mb.replay_ids.shape == (*mb.input_ids.shape, 3, 2) and mb.replay_ids.dtype == torch.int32
        for row, i in enumerate(mb.sample_index.tolist()):
            n = samples[i].routed_experts.shape[0]
            assert np.array_equal(mb.replay_ids[row, :n].numpy(), samples[i].routed_experts)
            assert (mb.replay_ids[row, n:] == NO_ROUTE).all()  # last token and padding
    plain = make_batch([(3, 4)])[0]
    assert plain.routed_experts is None and plain.micro_batches()[0].replay_ids is None


def test_routing_traces_all_or_none():
    with pytest.raises(ValueError, match="1 of 2 samples have no routed_experts"):
        RolloutBatch.from_samples([make_sample(2, 3, routes=True), make_sample(2, 3)])
    with pytest.raises(ValueError, match="prompt \\+ response - 1"):
        SampleRecord(group_index=0, prompt_tokens=[1, 2], response_tokens=[3], rollout_logprobs=[0.0],
                     loss_mask=[1], reward=0.0, routed_experts=np.zeros((3, 1, 1), np.uint8))  # fmt: skip


def test_broadcast_is_identity_without_process_group():
    batch, _ = make_batch([(2, 2)])
    assert batch.broadcast(src=0) is batch
    with pytest.raises(ValueError):
        broadcast_batch(None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_broadcast_round_trip_two_process_gloo(tmp_path):
    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(__file__)), env.get("PYTHONPATH", "")])
        procs.append(subprocess.Popen([sys.executable, __file__, str(tmp_path)], env=env))
    for p in procs:
        assert p.wait(timeout=120) == 0
    expected, _ = make_batch(BROADCAST_LENGTHS, routes=True)
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["routed_experts"] == expected.routed_experts.tolist() and got["routes_dtype"] == "torch.int16"
        assert got["plain_routes"] is None
        for name in ("tokens", "seq_offsets", "resp_offsets", "loss_mask", "token_versions", "group_ids", "sample_ids"):
            assert got[name] == getattr(expected, name).tolist(), name
        assert got["rollout_logprobs"] == pytest.approx(expected.rollout_logprobs.tolist())
        assert got["rewards"] == pytest.approx(expected.rewards.tolist())


BROADCAST_LENGTHS = [(3, 4), (5, 0), (2, 7)]


def _broadcast_worker(out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    batch = make_batch(BROADCAST_LENGTHS, routes=True)[0] if dist.get_rank() == 0 else None
    got = RolloutBatch.broadcast(batch, src=0)
    plain = RolloutBatch.broadcast(make_batch(BROADCAST_LENGTHS)[0] if dist.get_rank() == 0 else None, src=0)
    fields = ("tokens", "seq_offsets", "resp_offsets", "rollout_logprobs", "loss_mask", "token_versions",
              "group_ids", "sample_ids", "rewards", "routed_experts")  # fmt: skip
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        out = {name: getattr(got, name).tolist() for name in fields}
        json.dump({**out, "routes_dtype": str(got.routed_experts.dtype), "plain_routes": plain.routed_experts}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    _broadcast_worker(sys.argv[1])
