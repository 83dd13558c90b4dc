"""Rank 0 and the other trainer ranks issue the same collectives in the same order (two gloo processes):
every publish of rank 0, the first one and none for a replayed step included, is a publish of every rank,
since a sharded model's export gathers (a collective that would otherwise hang the job)."""

from __future__ import annotations

import multiprocessing
import socket
from types import SimpleNamespace
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist

from vime.trainer.batch import RolloutBatch, SampleRecord, broadcast_batch
from vime.workers.trainer import COMMAND_STOP, COMMAND_TRAIN, _command, follower_loop, lead_publish


class GatheringTrainer:
    """Stands in for a sharded trainer: its export and its step are collectives, and it counts them."""

    lora = None

    def __init__(self) -> None:
        self.exports = 0
        self.steps = 0

    def export_weights(self, dtype: torch.dtype, on_device: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        gathered = torch.ones(1)
        dist.all_reduce(gathered)  # FSDP2's full_tensor() is an all-gather on every rank
        self.exports += 1
        if dist.get_rank() == 0:
            yield "w", gathered

    def train_step(self, batch: RolloutBatch) -> dict[str, float]:
        grad = torch.ones(1)
        dist.all_reduce(grad)  # DDP's gradient all-reduce
        self.steps += 1
        return {}


def _batch() -> RolloutBatch:
    record = SampleRecord(group_index=0, prompt_tokens=np.array([1, 2]), response_tokens=np.array([3]),
                          rollout_logprobs=np.array([-1.0]), loss_mask=np.array([1]), reward=1.0)  # fmt: skip
    return RolloutBatch.from_samples([record])


def _rank(rank: int, port: int, results: Any) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    trainer = GatheringTrainer()
    try:
        if rank == 0:
            lead_publish(trainer, None, 0, torch.bfloat16)  # type: ignore[arg-type]  # the first version
            for step, publishes in ((0, False), (1, True)):  # step 0 replayed after a resume: no publish
                _command(COMMAND_TRAIN, step)
                trainer.train_step(broadcast_batch(_batch(), src=0))
                if publishes:
                    lead_publish(trainer, None, step + 1, torch.bfloat16)  # type: ignore[arg-type]
            _command(COMMAND_STOP, 2)
        else:
            follower_loop(trainer, SimpleNamespace(checkpoint_dir=None, update_weights_interval=1), torch.bfloat16)  # type: ignore[arg-type]
        results.put((rank, trainer.exports, trainer.steps))
    finally:
        dist.destroy_process_group()


def test_every_rank_exports_exactly_when_rank_zero_publishes() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    ranks = [ctx.Process(target=_rank, args=(rank, port, results)) for rank in (0, 1)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=120)
    alive = [process.pid for process in ranks if process.is_alive()]
    for process in ranks:
        if process.is_alive():
            process.kill()
    assert not alive, "a rank hung in a collective the other never issued"
    assert sorted(results.get(timeout=5) for _ in ranks) == [(0, 2, 2), (1, 2, 2)]
    assert all(process.exitcode == 0 for process in ranks)
