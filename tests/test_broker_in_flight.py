"""The groups between admission and the buffer: leases decide whose result counts, and a worker's leases
come back in the order given, generating ones emptied for the caller, scoring ones to the front of the queue."""

from __future__ import annotations

import numpy as np

from vime.broker.in_flight import GroupsInFlight
from vime.protocol.messages import Group, Sample

A, B = b"worker-a", b"worker-b"


def group(group_id: str, samples: int = 0) -> Group:
    made = Group(group_id=group_id, prompt_index=0, epoch=0, prompt_tokens=np.array([1, 2], np.int32), prompt_text="1+2=",
                 n_samples=max(samples, 1), label="3")  # fmt: skip
    one = np.zeros(1, np.int32)
    made.samples = [Sample(index=i, response_tokens=one, rollout_logprobs=np.zeros(1, np.float32), loss_mask=one.astype(np.uint8),
                           token_versions=one, finish_reason="stop") for i in range(samples)]  # fmt: skip
    return made


def test_only_the_lease_holder_ends_a_generation_lease() -> None:
    flight = GroupsInFlight()
    leased = group("g1")
    flight.generating["g1"] = (leased, A)
    assert flight.generated(B, "g1") is None and "g1" in flight.generating  # a late duplicate from B
    assert flight.generated(A, "unknown") is None
    assert flight.generated(A, "g1") is leased and not flight.generating
    assert flight.generated(A, "g1") is None  # the same result twice counts once


def test_a_scoring_lease_is_looked_up_without_ending_it() -> None:
    flight = GroupsInFlight()
    flight.scoring["g1"] = (scored := group("g1", samples=2), A)
    assert flight.scoring_lease(B, "g1") is None
    assert flight.scoring_lease(A, "g1") is scored and "g1" in flight.scoring


def test_released_leases_come_back_in_order() -> None:
    flight = GroupsInFlight()
    flight.to_score.append(waiting := group("w"))
    for gid in ("s1", "s2"):
        flight.scoring[gid] = (group(gid, samples=2), A)
    for gid in ("g1", "g2"):
        flight.generating[gid] = (group(gid, samples=3), A)
    flight.generating["other"] = (group("other"), B)
    regenerate, released = flight.release(["g2", "s2", "g1", "s1", "not-leased"])
    assert released == 4
    assert [g.group_id for g in regenerate] == ["g2", "g1"] and all(g.samples == [] for g in regenerate)
    # appendleft in the order given: the last released is first in the queue
    assert [g.group_id for g in flight.to_score] == ["s1", "s2", "w"] and flight.to_score[-1] is waiting
    assert list(flight.generating) == ["other"] and not flight.scoring
    flight.retry.extend(regenerate)
    assert flight.ids() == {"g1", "g2", "other", "s1", "s2", "w"}
    assert flight.sizes() == {"retry": 2, "generating": 1, "to_score": 3, "scoring": 0}
