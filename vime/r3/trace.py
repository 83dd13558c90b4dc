"""The R3 routing trace: which experts each token was routed to, per MoE layer, during rollout.

A trace is a numpy array `[tokens - 1, moe_layers, top_k]` of expert ids, in the order the router ranked
them. The last token has no row: the inference engine never feeds the last sampled token back through the
model (same convention as vLLM's `CompletionOutput.routed_experts`). The ids are stored as uint8 when the
model has at most 256 experts, else uint16, so that a 4k-token trace of a 48-layer top-8 model is 1.5 MB
instead of 12 MB as int64: the trace dominates a sample's payload.

The expert count travels next to the trace (`Sample.num_experts`): it fixes the dtype and the valid id
range, and `num_experts` itself is the padding id (see `pad_for_training`).
"""

from __future__ import annotations

import numpy as np

_UINT16_MAX_EXPERTS = 65535


def trace_dtype(num_experts: int) -> np.dtype:
    """The compact dtype for a model with `num_experts` experts: uint8 up to 256 experts, else uint16.

    The vLLM convention is "uint8 when <= 256 experts". With exactly 256 experts the padding id (256) does
    not fit in uint8; `pad_for_training` widens in that case. Raises ValueError for a count < 1 or > 65535.
    """
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if num_experts <= 256:
        return np.dtype(np.uint8)
    if num_experts <= _UINT16_MAX_EXPERTS:
        return np.dtype(np.uint16)
    raise ValueError(f"num_experts {num_experts} does not fit a uint16 trace (max {_UINT16_MAX_EXPERTS})")


def encode_trace(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """Expert ids `[rows, moe_layers, top_k]` (any integer array, torch tensors via `.numpy()`) as a
    C-contiguous array of the compact dtype.

    Raises ValueError when `ids` is not 3-D, not integer, or holds an id outside [0, num_experts): a
    silent wrap-around to uint8 would replay the wrong expert.
    """
    arr = np.asarray(ids)
    if arr.ndim != 3:
        raise ValueError(f"routing trace must be 3-D [tokens - 1, moe_layers, top_k], got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"routing trace must hold integer expert ids, got dtype {arr.dtype}")
    dtype = trace_dtype(num_experts)
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"routing trace has expert ids in [{lo}, {hi}], outside [0, {num_experts})")
    return np.ascontiguousarray(arr, dtype=dtype)


def validate_trace(
    trace: np.ndarray,
    num_tokens: int,
    num_experts: int,
    num_moe_layers: int | None = None,
    top_k: int | None = None,
) -> None:
    """Check a received trace against its sample and the model; raise ValueError naming the problem.

    `num_tokens` is the whole sequence (prompt + response): the trace must have `num_tokens - 1` rows.
    Checks, in order: 3-D shape; dtype is the compact dtype for `num_experts`; row count; layer count
    (and at least one MoE layer); top-k; ids in [0, num_experts); no repeated expert within a row. A
    real top-k route picks k distinct experts, so a repeat means a dense layer or a layer the engine did
    not capture (an all-zero layer is the typical case, which slime rejects too). With top_k == 1 an
    uncaptured layer is indistinguishable from "every token chose expert 0" and is not detected.
    """
    if not isinstance(trace, np.ndarray) or trace.ndim != 3:
        shape = getattr(trace, "shape", None)
        raise ValueError(f"routing trace must be a 3-D numpy array [tokens - 1, moe_layers, top_k], got {shape}")
    expected_dtype = trace_dtype(num_experts)
    if trace.dtype != expected_dtype:
        raise ValueError(
            f"routing trace dtype {trace.dtype} does not match {num_experts} experts (expected {expected_dtype})"
        )
    rows, layers, k = trace.shape
    if rows != num_tokens - 1:
        raise ValueError(
            f"routing trace has {rows} rows for {num_tokens} tokens (expected tokens - 1 = {num_tokens - 1})"
        )
    if layers == 0:
        raise ValueError("routing trace has no MoE layers")
    if num_moe_layers is not None and layers != num_moe_layers:
        raise ValueError(f"routing trace has {layers} MoE layers, the model has {num_moe_layers}")
    if top_k is not None and k != top_k:
        raise ValueError(f"routing trace has top_k {k}, the model routes to {top_k} experts")
    if k == 0:
        raise ValueError("routing trace has top_k 0")
    if trace.size == 0:
        return
    hi = int(trace.max())  # unsigned: no negative ids possible
    if hi >= num_experts:
        raise ValueError(f"routing trace has expert id {hi}, outside [0, {num_experts})")
    if k > 1:
        # k(k-1)/2 pairwise compares instead of a sort: validation runs on the broker's receive path,
        # where a 4k-token, 48-layer, top-8 trace is 1.5 M ids.
        repeated = np.zeros(trace.shape[:2], dtype=bool)  # [rows, layers]
        for i in range(k):
            for j in range(i + 1, k):
                repeated |= trace[..., i] == trace[..., j]
        if repeated.any():
            bad_layers = np.flatnonzero(repeated.any(axis=0)).tolist()
            all_zero = [int(i) for i in bad_layers if not trace[:, i, :].any()]
            hint = f"; all-zero (uncaptured or dense) layers: {all_zero}" if all_zero else ""
            raise ValueError(
                f"routing trace repeats an expert within a token's top-{k} in MoE layers {bad_layers}{hint}"
            )


def pad_for_training(trace: np.ndarray, pad_id: int) -> np.ndarray:
    """Append one row of `pad_id` so the trace has a row per token (the last token has none).

    The row only affects the last token's own hidden state, which no loss reads (causal attention: earlier
    positions never see it). The reference suggests `pad_id=num_experts` because the experts module skips
    it. Verified against transformers 5.19 (`Qwen3MoeExperts` + `integrations/moe.py`), that holds only for
    the eager experts forward (one_hot over num_experts + 1 classes, then `if expert_idx ==
    self.num_experts: continue`). Without expert parallelism, `grouped_mm` (the default a checkpoint loads
    with) returns NaN for such a token and `batched_mm` raises IndexError: both mask the sentinel only
    when `_is_expert_parallel`. So never feed a padded trace straight to the experts: `vime.r3.hf_router`
    treats ids >= the expert count as "no recorded route" and lets the model route that token itself,
    which is safe with every experts implementation. The dtype widens to uint16 when pad_id does not fit
    (256 experts, pad 256).
    """
    if trace.ndim != 3:
        raise ValueError(f"routing trace must be 3-D, got shape {trace.shape}")
    if pad_id < 0:
        raise ValueError(f"pad_id must be >= 0, got {pad_id}")
    dtype = trace.dtype if pad_id <= np.iinfo(trace.dtype).max else np.dtype(np.uint16)
    if pad_id > np.iinfo(dtype).max:
        raise ValueError(f"pad_id {pad_id} does not fit {dtype}")
    out = np.empty((trace.shape[0] + 1, *trace.shape[1:]), dtype=dtype)
    out[:-1] = trace
    out[-1] = pad_id
    return out


def routing_agreement(trace_a: np.ndarray, trace_b: np.ndarray, mask: np.ndarray | None = None) -> float:
    """Fraction of (token, layer) routes whose expert SET is the same in both traces.

    Order within the top-k is ignored (two engines can rank near-tied experts differently and still use
    the same experts with the same weights). `mask` selects the routes to count: bool `[rows]` (per token)
    or `[rows, layers]`. Raises ValueError on shape mismatch or when the mask selects nothing (an agreement
    over zero routes is meaningless, not 1.0).
    """
    a, b = np.asarray(trace_a), np.asarray(trace_b)
    if a.shape != b.shape or a.ndim != 3:
        raise ValueError(f"traces must be 3-D and of the same shape, got {a.shape} and {b.shape}")
    same = (np.sort(a, axis=-1) == np.sort(b, axis=-1)).all(axis=-1)  # [rows, layers]
    if mask is not None:
        m = np.asarray(mask, dtype=bool)
        if m.shape == same.shape[:1]:
            m = np.broadcast_to(m[:, None], same.shape)
        elif m.shape != same.shape:
            raise ValueError(f"mask shape {m.shape} matches neither [rows] nor [rows, layers] of {same.shape}")
        same = same[m]
    if same.size == 0:
        raise ValueError("no routes to compare (empty traces or an all-false mask)")
    return float(same.mean())
