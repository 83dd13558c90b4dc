"""Bytes per group on each hop of the pipeline, as `vime.protocol.codec.encode` frames them.

Hops: rollout -> broker (`GroupsGenerated`), broker -> reward (`ScoreGroups`: each group's texts, label
and metadata; before issue 18 the whole group: token arrays, logprobs, versions, R3 traces), reward ->
broker (`GroupsScored`), broker -> trainer (`TrainBatch`). One group of 8 samples, two shapes:

- demo: the CPU demo's (an 8-token prompt, 4-token responses);
- 30b-a3b: Qwen3-30B-A3B-like with R3 (512 prompt + 3584 response tokens, trace [4095, 48, 8] uint8).

    python bench/hop_bytes.py --json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from vime.protocol.codec import Message, encode  # noqa: E402
from vime.protocol.messages import (  # noqa: E402
    Group, GroupScores, GroupsGenerated, GroupsScored, Sample, ScoreGroups, ScoringGroup, TrainBatch,
)

SAMPLES = 8
SHAPES: dict[str, dict[str, Any]] = {
    "demo": {"prompt": 8, "response": 4, "trace": None, "text": "579"},
    "30b-a3b": {"prompt": 512, "response": 3584, "trace": (48, 8), "text": "x" * 12_000},
}


class WholeGroupsForScoring(Message, tag="bench_whole_groups_for_scoring"):
    """What `ScoreGroups` carried before issue 18: the whole group."""

    groups: list[Group]


def make_group(shape: dict[str, Any], seed: int = 0) -> Group:
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(SAMPLES):
        n = shape["response"]
        trace = None
        if shape["trace"] is not None:
            layers, top_k = shape["trace"]
            trace = rng.integers(0, 128, size=(shape["prompt"] + n - 1, layers, top_k), dtype=np.uint8)
        samples.append(Sample(
            index=i, response_tokens=rng.integers(0, 151_936, n, dtype=np.int32),
            rollout_logprobs=rng.normal(-1, 0.5, n).astype(np.float32), loss_mask=np.ones(n, dtype=np.uint8),
            token_versions=np.full(n, 7, dtype=np.int32), finish_reason="stop", response_text=shape["text"],
            routed_experts=trace, num_experts=128 if trace is not None else None, reward=1.0,
        ))  # fmt: skip
    return Group(
        group_id="e0-p1", prompt_index=1, epoch=0, prompt_tokens=rng.integers(0, 151_936, shape["prompt"], dtype=np.int32),
        prompt_text="q" * (shape["prompt"] * 4), n_samples=SAMPLES, label="42", metadata={"source": "bench"},
        samples=samples,
    )  # fmt: skip


def nbytes(msg: Message) -> int:
    return sum(memoryview(f).nbytes for f in encode(msg))


def measure(name: str) -> dict[str, Any]:
    group = make_group(SHAPES[name])
    scores = GroupScores(group_id=group.group_id, rewards=[1.0] * SAMPLES, failed=[False] * SAMPLES, reasons=[None] * SAMPLES)
    before = nbytes(WholeGroupsForScoring(groups=[group]))
    after = nbytes(ScoreGroups(groups=[ScoringGroup.of(group)]))
    return {
        "shape": name,
        "rollout_to_broker": nbytes(GroupsGenerated(groups=[group])),
        "broker_to_reward_before": before,
        "broker_to_reward": after,
        "broker_to_reward_saved": round(1 - after / before, 4),
        "reward_to_broker": nbytes(GroupsScored(scores=[scores])),
        "broker_to_trainer": nbytes(TrainBatch(step=0, groups=[group])),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="end with one JSON object")
    args = parser.parse_args()
    rows = [measure(name) for name in SHAPES]
    print(f"{'shape':8} {'rollout->broker':>16} {'broker->reward (before)':>24} {'broker->reward':>15} {'reward->broker':>15} {'broker->trainer':>16}")
    for r in rows:
        print(f"{r['shape']:8} {r['rollout_to_broker']:>16,} {r['broker_to_reward_before']:>24,} {r['broker_to_reward']:>15,} "
              f"{r['reward_to_broker']:>15,} {r['broker_to_trainer']:>16,}")  # fmt: skip
    if args.json:
        print(json.dumps({"bytes_per_group": rows, "samples_per_group": SAMPLES}))


if __name__ == "__main__":
    main()
