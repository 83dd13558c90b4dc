"""R3 (Rollout Routing Replay): record MoE routing at rollout, replay it in training.

`trace` defines the per-sample routing trace payload; `hf_router` records and replays routing in
transformers MoE models (importing it needs torch).
"""

from vime.r3.trace import (
    encode_trace,
    pad_for_training,
    routing_agreement,
    trace_dtype,
    validate_trace,
)

__all__ = ["encode_trace", "pad_for_training", "routing_agreement", "trace_dtype", "validate_trace"]
