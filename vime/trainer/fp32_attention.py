"""SDPA with its inputs in float32, for bf16 training on the CPU: `attn_implementation="vime_sdpa_fp32"`.

Under bf16 autocast on the CPU the matrix products gain (AMX runs them ~2.4x faster than fp32 at the
CPU demo's sizes) but PyTorch's CPU flash-attention backward in bf16 is ~8x slower than in fp32, which
more than ate the gain (docs/benchmarks.md). This is transformers' SDPA attention with query, key and
value cast to float32 and autocast off inside it; the output comes back in the query's dtype. The mask
and everything else are passed through unchanged, so it computes what "sdpa" computes, in fp32.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

ATTENTION_NAME = "vime_sdpa_fp32"


def register() -> str:
    """Make `attn_implementation=ATTENTION_NAME` available to transformers (idempotent); returns the name.
    It builds masks as SDPA does."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(ATTENTION_NAME, fp32_sdpa_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return ATTENTION_NAME


def fp32_sdpa_attention_forward(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, **kwargs: Any
) -> tuple[Tensor, Tensor | None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    dtype = query.dtype
    with torch.autocast(query.device.type, enabled=False):
        out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask, **kwargs)
    return out.to(dtype), weights
