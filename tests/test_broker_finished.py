"""The ledger of finished groups on its own: one byte per prompt, folding whole epochs, its snapshot."""

from __future__ import annotations

import numpy as np
import pytest

from vime.broker.finished import FinishedGroups, FinishedTwice


def test_outcomes_are_kept_per_prompt_until_the_epoch_is_whole() -> None:
    ledger = FinishedGroups(prompts_per_epoch=4)
    ledger.add(0, 2, "trained")
    ledger.add(0, 0, "filtered")
    ledger.add(1, 3, "stale")
    assert [ledger.outcome(0, i) for i in range(4)] == ["filtered", None, "trained", None]
    assert ledger.outcome(1, 3) == "stale" and not ledger.has(1, 0) and not ledger.has(7, 1)
    assert ledger.counts == {"trained": 1, "filtered": 1, "stale": 1} and ledger.total == 3
    ledger.add(0, 1, "failed")
    ledger.add(0, 3, "trained")
    assert ledger.outcome(0, 1) == "finished", "a whole epoch keeps only that it finished"
    assert ledger.nbytes == 4, "epoch 1 is still finishing"
    assert ledger.counts["trained"] == 2 and ledger.total == 5


@pytest.mark.parametrize("epoch_whole", [False, True])
def test_a_group_cannot_finish_twice(epoch_whole: bool) -> None:
    ledger = FinishedGroups(prompts_per_epoch=2)
    ledger.add(0, 0, "trained")
    if epoch_whole:
        ledger.add(0, 1, "trained")
    with pytest.raises(FinishedTwice, match="e0-p0"):
        ledger.add(0, 0, "stale")
    assert ledger.counts["stale"] == 0


def test_indexes_beyond_the_dataset_size_grow_the_epoch() -> None:
    ledger = FinishedGroups(prompts_per_epoch=2)
    ledger.add(0, 5, "trained")  # sparse dataset indexes
    assert ledger.outcome(0, 5) == "trained" and ledger.outcome(0, 4) is None


def test_the_snapshot_round_trips_and_bad_codes_are_refused() -> None:
    ledger = FinishedGroups(prompts_per_epoch=3)
    for epoch, index, outcome in [(0, 0, "trained"), (0, 1, "stale"), (0, 2, "trained"), (1, 1, "failed")]:
        ledger.add(epoch, index, outcome)  # type: ignore[arg-type]
    restored = FinishedGroups.from_snapshot(3, *ledger.snapshot())
    assert restored.counts == ledger.counts and restored.outcome(0, 2) == "finished"
    assert [restored.outcome(1, i) for i in range(3)] == [None, "failed", None]
    restored.add(1, 0, "trained")
    restored.add(1, 2, "trained")
    assert restored.nbytes == 0 and restored.outcome(1, 0) == "finished"
    with pytest.raises(ValueError, match="epoch 0"):
        FinishedGroups.from_snapshot(3, {0: np.array([9, 0, 0], dtype=np.uint8)}, 0, [], {})
    with pytest.raises(ValueError, match="unknown"):
        FinishedGroups.from_snapshot(3, {}, 0, [], {"lost": 1})


def test_whole_epochs_fold_into_a_count_even_out_of_order() -> None:
    ledger = FinishedGroups(prompts_per_epoch=1)
    ledger.add(1, 0, "trained")  # epoch 1 whole before epoch 0
    assert ledger.snapshot()[1:3] == (0, [1])
    ledger.add(0, 0, "stale")
    assert ledger.snapshot()[1:3] == (2, []), "nothing per epoch is kept once the epochs below are whole"
    for epoch in range(2, 1_000):
        ledger.add(epoch, 0, "trained")
    assert ledger.snapshot()[1:3] == (1_000, []) and ledger.outcome(500, 0) == "finished" and not ledger.has(1_000, 0)
