"""Per-token weight versions kept by vime, for vLLM builds that do not stamp them.

vLLM 0.32+ labels each output token with the weight version that produced it
(`CompletionOutput.weight_versions`); older builds (0.26, the CUDA build matching torch 2.11) do not.
`VersionLedger` records, at every weight update, how many tokens each request in flight had already
produced: those came from the old weights, the rest from the new ones. The sample then carries exact
per-token versions either way, and the staleness gate does not care which vLLM produced them.

How the count is made exact (the engine's update does these in order, while vLLM is paused):
1. new submissions are held and the ones already under way finish registering (`submitting`);
2. vLLM is paused: the engine core then has no step running and has sent every output it made;
3. `OutputBarrier` waits until the front end has processed all of those outputs;
4. `output_positions` reads each live request's output length from vLLM's output processor, and
   `mark` records it for every request the ledger tracks. A tracked request with no live state has
   finished: all its tokens are old.
Steps 3-4 read vLLM front-end internals (`engine_core.outputs_queue`, `output_processor
.request_states`, their `external_req_id`, `request_index` and detokenizer); `output_positions`
raises `FrontEndStateUnavailable` when they are missing, and the engine checks that at start.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


class FrontEndStateUnavailable(RuntimeError):
    """This vLLM's front end lacks the per-request state vime reads to place version boundaries."""


def output_positions(llm: Any) -> dict[tuple[str, int], int]:
    """(request id as submitted, sequence index) -> output tokens the front end has processed so far,
    for every request vLLM's front end still holds."""
    processor = getattr(llm, "output_processor", None)
    states = getattr(processor, "request_states", None)
    if not isinstance(states, dict):
        raise FrontEndStateUnavailable(
            f"vLLM's {type(llm).__name__} has no output_processor.request_states; vime cannot count the "
            "tokens each request had produced when weights changed"
        )
    positions: dict[tuple[str, int], int] = {}
    for state in states.values():
        try:
            key = (str(state.external_req_id), int(state.request_index))
            positions[key] = int(state.detokenizer.num_output_tokens())
        except AttributeError as exc:
            raise FrontEndStateUnavailable(f"vLLM's request state lacks a field vime reads: {exc}") from None
    return positions


@dataclass
class _TrackedRequest:
    base_version: int
    num_sequences: int
    # (version, output index per sequence from which it applies; None: that sequence had finished)
    marks: list[tuple[int, list[int | None]]] = field(default_factory=list)


class VersionLedger:
    """The version boundaries of the requests in flight, keyed by the request id vime submitted."""

    def __init__(self) -> None:
        self._requests: dict[str, _TrackedRequest] = {}
        self.submitting = 0  # requests past the submission gate whose registration with vLLM is under way

    def track(self, request_id: str, num_sequences: int, version: int) -> None:
        """Start tracking a request vLLM has registered (all of its sequences) under `version`."""
        self._requests[request_id] = _TrackedRequest(base_version=int(version), num_sequences=int(num_sequences))

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def mark(self, version: int, positions: dict[tuple[str, int], int]) -> int:
        """Tokens produced from here on by every tracked request come from `version`; returns how many
        sequences were in flight (had live state) at the mark."""
        live = 0
        for request_id, tracked in self._requests.items():
            starts: list[int | None] = [positions.get((request_id, i)) for i in range(tracked.num_sequences)]
            live += sum(s is not None for s in starts)
            tracked.marks.append((int(version), starts))
        return live

    def versions(self, request_id: str, index: int, num_tokens: int) -> np.ndarray:
        """One int32 version per output token of sequence `index` of a tracked request."""
        tracked = self._requests[request_id]
        out = np.full(num_tokens, tracked.base_version, dtype=np.int32)
        for version, starts in tracked.marks:
            start = starts[index]
            if start is not None:
                out[min(start, num_tokens) :] = version
        return out

    def __len__(self) -> int:
        return len(self._requests)
