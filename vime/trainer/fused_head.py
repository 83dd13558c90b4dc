"""Token logprobs and entropy straight from hidden states and the LM head, a chunk of tokens at a time.

The plain path (`lm_head(hidden)`, then `losses.logprobs_from_logits` and `losses.entropy_from_logits`)
holds several `[tokens, vocab]` float32 tensors at once: at Qwen3's 151,936-token vocabulary that is
0.6 MB per token each, gigabytes per micro-batch, and most of a step's GPU time goes to writing and
reading them. `head_logprobs_and_entropy` computes the logits of `chunk_tokens` tokens, reduces them to
three numbers per token (the target's logit, the log-sum-exp and the entropy) and drops them; the
backward recomputes each chunk's logits from the saved hidden states. The result equals the plain path
to float32 rounding: each chunk's matrix product runs in the dtype the plain path's would (the autocast
dtype when autocast is on, else the inputs'), and its softmax in float32.

Failure modes: `targets` outside `[0, vocab)` raise (as `gather` would); non-finite logits give
non-finite logprobs, as on the plain path.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Logits of one chunk in float32 take about this much memory (the backward holds two such tensors).
CHUNK_BYTES = 1024 * 1024 * 1024


def default_chunk_tokens(vocab_size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Tokens per chunk so that one chunk's float32 logits take about `chunk_bytes`."""
    return max(1, chunk_bytes // (4 * max(1, vocab_size)))


def _compute_dtype(hidden: Tensor) -> torch.dtype:
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return hidden.dtype


def _chunk_logits(hidden: Tensor, weight: Tensor, temperature: float) -> Tensor:
    """float32 logits / temperature of one chunk, rounded like the plain path's `lm_head` output."""
    logits = (hidden @ weight.t()).float()
    return logits / temperature if temperature != 1.0 else logits


class _ChunkedHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float, chunk: int,
                compute_dtype: torch.dtype, with_entropy: bool) -> tuple[Tensor, Tensor]:  # fmt: skip
        n = hidden.shape[0]
        logprobs = torch.empty(n, dtype=torch.float32, device=hidden.device)
        # without entropy: an empty stand-in, so the function's outputs stay tensors
        entropy = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        w = weight.to(compute_dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, n, chunk):
                end = min(n, start + chunk)
                z = _chunk_logits(hidden[start:end].to(compute_dtype), w, temperature)
                chunk_lse = torch.logsumexp(z, dim=-1)
                lse[start:end] = chunk_lse
                logprobs[start:end] = z.gather(-1, targets[start:end, None]).squeeze(-1) - chunk_lse
                if with_entropy:
                    p = torch.sub(z, chunk_lse[:, None]).exp_()
                    entropy[start:end] = chunk_lse - p.mul_(z).sum(dim=-1)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.chunk, ctx.compute_dtype = temperature, chunk, compute_dtype
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs: Tensor | None, grad_entropy: Tensor | None):  # type: ignore[override]
        hidden, weight, targets, lse = ctx.saved_tensors
        if grad_entropy is not None and grad_entropy.numel() == 0:
            grad_entropy = None  # the empty stand-in of a call without entropy
        if grad_logprobs is None and grad_entropy is None:
            return None, None, None, None, None, None, None
        temperature, chunk, cd = ctx.temperature, ctx.chunk, ctx.compute_dtype
        w = weight.to(cd)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], chunk):
                end = min(hidden.shape[0], start + chunk)
                h = hidden[start:end].to(cd)
                z = _chunk_logits(h, w, temperature)
                p = torch.sub(z, lse[start:end, None]).exp_()
                # d logprob / dz = onehot(target) - p;  d entropy / dz = -p * (z - E_p[z]); so the
                # gradient is p * (-g_lp - g_ent * (z - E_p[z])) + g_lp at the target, built in z's memory
                if grad_entropy is not None:
                    g_ent = grad_entropy[start:end, None]
                    mean_z = (p * z).sum(dim=-1, keepdim=True)
                    g = z.sub_(mean_z).mul_(-g_ent)
                    if grad_logprobs is not None:
                        g.sub_(grad_logprobs[start:end, None])
                    g.mul_(p)
                else:
                    g = p.mul_(-grad_logprobs[start:end, None])
                if grad_logprobs is not None:
                    g.scatter_add_(-1, targets[start:end, None], grad_logprobs[start:end, None])
                if temperature != 1.0:
                    g /= temperature
                g = g.to(cd)
                if grad_hidden is not None:
                    grad_hidden[start:end] = (g @ w).to(hidden.dtype)
                if grad_weight is not None:
                    grad_weight += (g.t() @ h).float()
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def head_logprobs_and_entropy(
    hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0, chunk_tokens: int | None = None,
    with_entropy: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """log p(target) and the entropy of softmax(hidden @ weight.T / temperature), per token, float32.

    `hidden` is [N, H] (the decoder's last hidden states at the positions that predict `targets`),
    `weight` the LM head's [V, H] (no bias: Qwen3, Llama and GLM heads have none), `targets` [N] int64.
    Both outputs carry gradients to `hidden` and `weight`; an output the loss does not use costs
    nothing in the backward. Without `with_entropy` the entropy is not computed (None): the logprobs
    alone, as for old and reference logprobs. `chunk_tokens` defaults to `default_chunk_tokens(V)`.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden [N, H] and weight [V, H] expected, got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be [N] = [{hidden.shape[0]}], got {tuple(targets.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    chunk = chunk_tokens or default_chunk_tokens(weight.shape[0])
    logprobs, entropy = _ChunkedHead.apply(
        hidden, weight, targets.long(), float(temperature), int(chunk), _compute_dtype(hidden), with_entropy
    )
    return logprobs, entropy if with_entropy else None
