"""Attention over packed sequences for transformers models, registered as `attn_implementation="vime_varlen"`.

A packed micro-batch is one row holding several samples end to end (`RolloutBatch.micro_batches(...,
packed=True)`); each sample must attend only to itself. The trainer passes the samples' boundaries as
`cu_seq_lens_q` (int32 [samples + 1], cumulative lengths) and `max_length_q` (the longest sample) through
the decoder's keyword arguments, the names transformers' own flash-attention path reads.

On CUDA in bf16/fp16 (autocast included) the attention is PyTorch's variable-length flash kernel
(`torch.nn.attention.varlen.varlen_attn`): no padding, no mask, no work across samples. Elsewhere
(CPU, fp32) each sample goes through SDPA on its own slice: exact, but a Python loop, so packing is
off by default there. Without boundaries (an ordinary padded batch) the call is transformers' SDPA with
a causal mask, which is exact for right-padded rows since no real token sees a later pad.

transformers skips building a mask for attention implementations that have no mask function, which is
why this one registers none: the padded path needs no mask (see above) and the packed path no [T, T] one.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ATTENTION_NAME = "vime_varlen"


class PackedAttentionError(ValueError):
    """The model or batch asks for something packed attention does not do (sliding window, dropout)."""


def register() -> str:
    """Make `attn_implementation=ATTENTION_NAME` available to transformers (idempotent); returns the name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, packed_attention_forward)
    _flash_varlen()  # resolved here, outside any compiled region
    return ATTENTION_NAME


def attention_kwargs(cu_seqlens: Tensor | None, max_seqlen: int, attention_mask: Tensor | None = None) -> dict[str, Any]:
    """The decoder keyword arguments of a micro-batch's layout: a packed row's sample boundaries, a
    shared-prompt row's 4D mask (`vime.trainer.shared_prompts`), or {} for a padded batch (causal)."""
    if cu_seqlens is not None:
        return dict(cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, max_length_q=max_seqlen, max_length_k=max_seqlen)
    if attention_mask is not None:
        return dict(attention_mask=attention_mask)
    return {}


def packed_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    cu_seq_lens_q: Tensor | None = None,
    max_length_q: int | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention-function contract: query [B, H, T, D], key/value [B, Hkv, T, D] in,
    ([B, T, H, D], None) out. Raises PackedAttentionError for a sliding window or dropout on a packed row."""
    if cu_seq_lens_q is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if sliding_window is not None:
        raise PackedAttentionError(f"packed sequences do not support sliding-window attention (window {sliding_window})")
    if dropout:
        raise PackedAttentionError(f"packed sequences do not support attention dropout ({dropout})")
    if query.shape[0] != 1:
        raise PackedAttentionError(f"a packed micro-batch is one row, got {query.shape[0]}")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    dtype = torch.get_autocast_dtype("cuda") if query.is_cuda and torch.is_autocast_enabled("cuda") else query.dtype
    if query.is_cuda and dtype in (torch.float16, torch.bfloat16) and _flash_varlen() is not None:
        max_len = int(max_length_q) if max_length_q is not None else query.shape[2]
        out = _flash_packed(query[0].to(dtype), key[0].to(dtype), value[0].to(dtype), cu_seq_lens_q, max_len, scale)
    else:
        out = _sdpa_per_sample(query, key, value, cu_seq_lens_q, scale)
    return out.unsqueeze(0), None


_FLASH_VARLEN: list[tuple[Any, frozenset[str]] | None] = []  # filled once, outside compiled code


def _flash_varlen() -> tuple[Any, frozenset[str]] | None:
    """PyTorch's varlen flash function and its keyword names (they changed between releases), or None."""
    if not _FLASH_VARLEN:
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError:
            _FLASH_VARLEN.append(None)
        else:
            _FLASH_VARLEN.append((varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)))
    return _FLASH_VARLEN[0]


def _flash_packed(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, scale: float) -> Tensor:
    """[H, T, D] query and [Hkv, T, D] key/value in, [T, H, D] out."""
    fn, params = _flash_varlen()  # type: ignore[misc]  # a torch.library custom op: compiled layers trace it
    q, k, v = (t.transpose(0, 1).contiguous() for t in (q, k, v))  # [T, heads, D]
    kwargs: dict[str, Any] = {}
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    elif groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if "scale" in params:
        kwargs["scale"] = scale
    elif not math.isclose(scale, q.shape[-1] ** -0.5, rel_tol=1e-6):
        q = q * (scale * math.sqrt(q.shape[-1]))  # this release's kernel always scales by 1/sqrt(D)
    if "is_causal" in params:
        kwargs["is_causal"] = True
    else:
        kwargs["window_size"] = (-1, 0)  # no limit to the left, none to the right: causal
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    return fn(q, k, v, cu, cu, max_seqlen, max_seqlen, **kwargs)


def _sdpa_per_sample(query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, scale: float) -> Tensor:
    """[1, H, T, D] in, [T, H, D] out: causal SDPA on each sample's slice."""
    gqa = query.shape[1] != key.shape[1]
    bounds = cu_seqlens.tolist()
    parts = [
        F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], is_causal=True,
                                       scale=scale, enable_gqa=gqa)  # fmt: skip
        for a, b in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(parts, dim=2)[0].transpose(0, 1)
