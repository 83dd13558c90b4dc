"""Trainer ranks that do not fit the node's GPUs fail at once, naming the fit, before any process group
or CUDA call (a rank on a GPU that does not exist would die in CUDA with "invalid device ordinal")."""

from __future__ import annotations

import pytest
import torch

from vime.workers.trainer import TrainerLayoutError, init_distributed


def test_second_rank_on_a_one_gpu_node_names_the_gpus_it_found(monkeypatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    set_device_calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: set_device_calls.append(d))
    with pytest.raises(TrainerLayoutError, match=r"local rank 1, but this node has 1 GPU\(s\).*--trainer-world-size"):
        init_distributed()
    assert set_device_calls == []
