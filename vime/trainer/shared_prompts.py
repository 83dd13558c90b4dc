"""Micro-batches in which the samples of a group share one copy of their prompt.

GRPO-style batches hold `n_samples_per_prompt` samples of every prompt. Padded or packed, each sample
carries its own copy of the prompt, so the forward and backward compute every prompt position that many
times. Here a row holds one prompt followed by the responses of the samples that share it,

    [prompt | response 1 | response 2 | ... ]

with position ids that restart after the prompt for every response (prompt 0..P-1, each response
P..P+R-1) and a boolean attention mask [rows, 1, T, T] in which a token sees the prompt positions up
to itself and the earlier tokens of its own response, never another response. Every response token's
logits are those of its sample alone, so the losses and the gradients equal those of the padded
layout (the prompt's one copy collects the gradient that the copies would have summed).

The mask is a dense tensor that transformers' SDPA attention takes as it is: T^2 booleans per row,
which suits the short responses this layout pays off for (many samples of short answers to long
prompts, as in the CPU demo); long responses make the mask and the masked attention cost more than
the prompt copies saved. Samples share a prompt when they have the same group id and the same prompt
tokens. Routing-replay traces (R3) are refused: a trace row per token of each sample has no place in a
shared prompt.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vime.trainer.batch import PAD_TOKEN_ID, MicroBatch, RolloutBatch


class SharedPromptError(ValueError):
    """The batch cannot be laid out with shared prompts (it carries routing traces)."""


def prompt_groups(batch: RolloutBatch) -> list[list[int]]:
    """Sample indices of `batch` by shared prompt: the same group id and the same prompt tokens, in
    order of first appearance."""
    groups: dict[tuple[int, bytes], list[int]] = {}
    for i in range(batch.num_samples):
        start, p = int(batch.seq_offsets[i]), int(batch.prompt_lengths[i])
        key = (int(batch.group_ids[i]), batch.tokens[start : start + p].numpy().tobytes())
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def _segments(batch: RolloutBatch, max_tokens: int | None, size: int | None) -> list[list[int]]:
    """Each prompt group cut into segments (one prompt + some responses) that fit `max_tokens` tokens and
    `size` samples; a sample too long for `max_tokens` alone gets a segment of its own."""
    out = []
    responses = batch.response_lengths.tolist()
    for group in prompt_groups(batch):
        p = int(batch.prompt_lengths[group[0]])
        cur: list[int] = []
        length = p
        for i in sorted(group, key=lambda i: (-responses[i], i)):
            too_long = max_tokens is not None and length + responses[i] > max_tokens
            if cur and (too_long or (size is not None and len(cur) >= size)):
                out.append(cur)
                cur, length = [], p
            cur.append(i)
            length += responses[i]
        out.append(cur)
    return out


def shared_prompt_micro_batches(batch: RolloutBatch, max_tokens: int | None = None, size: int | None = None) -> list[MicroBatch]:
    """`batch` as micro-batches of shared-prompt rows (module docstring). `max_tokens` bounds rows x the
    longest row, `size` the samples per micro-batch; with neither, one micro-batch holds everything.
    Raises SharedPromptError for a batch with routing traces."""
    if batch.routed_experts is not None:
        raise SharedPromptError("shared-prompt micro-batches cannot carry R3 routing traces (one trace row per "
                                "token of each sample); turn off share_prompts or routing replay")  # fmt: skip
    if batch.num_samples == 0:
        return []
    segments = _segments(batch, max_tokens, size)
    widths = [int(batch.prompt_lengths[s[0]]) + sum(int(batch.response_lengths[i]) for i in s) for s in segments]
    order = sorted(range(len(segments)), key=lambda k: (-widths[k], k))
    micro: list[list[int]] = []
    samples = 0
    for k in order:
        cur = micro[-1] if micro else None
        fits = cur is not None and (size is None or samples + len(segments[k]) <= size)
        # sorted descending, so the micro-batch's first segment is its widest row
        if fits and max_tokens is not None and (len(cur) + 1) * widths[cur[0]] > max_tokens:  # type: ignore[arg-type]
            fits = False
        if fits:
            cur.append(k)  # type: ignore[union-attr]
            samples += len(segments[k])
        else:
            micro.append([k])
            samples = len(segments[k])
    return [_micro_batch(batch, [segments[k] for k in ks]) for ks in micro]


def _micro_batch(batch: RolloutBatch, rows: list[list[int]]) -> MicroBatch:
    prompts = [int(batch.prompt_lengths[r[0]]) for r in rows]
    widths = [p + sum(int(batch.response_lengths[i]) for i in r) for p, r in zip(prompts, rows)]
    width = max(widths)
    input_ids = torch.full((len(rows), width), PAD_TOKEN_ID, dtype=torch.int64)
    position_ids = torch.zeros(len(rows), width, dtype=torch.int64)
    # segment id per position: 0 prompt, j + 1 the row's j-th response, -1 padding
    segment = torch.full((len(rows), width), -1, dtype=torch.int64)
    logit_index, targets, token_sample, token_index, sample_index = [], [], [], [], []
    for b, (r, p) in enumerate(zip(rows, prompts)):
        start = int(batch.seq_offsets[r[0]])
        input_ids[b, :p] = batch.tokens[start : start + p]
        position_ids[b, :p] = torch.arange(p)
        segment[b, :p] = 0
        at = p
        for j, i in enumerate(r):
            r0, r1 = int(batch.resp_offsets[i]), int(batch.resp_offsets[i + 1])
            n, s = r1 - r0, int(batch.seq_offsets[i])
            response = batch.tokens[s + p : s + p + n].to(torch.int64)
            input_ids[b, at : at + n] = response
            position_ids[b, at : at + n] = torch.arange(p, p + n)
            segment[b, at : at + n] = j + 1
            # response token 0 is predicted by the prompt's last position, token t by response token t - 1
            flat = b * width
            logit_index.append(torch.cat([torch.tensor([flat + p - 1]), torch.arange(flat + at, flat + at + max(0, n - 1))])[:n])
            targets.append(response)
            token_sample.append(torch.full((n,), len(sample_index), dtype=torch.int64))
            token_index.append(torch.arange(r0, r1))
            sample_index.append(i)
            at += n
    index = torch.cat(token_index)
    return MicroBatch(
        input_ids=input_ids, position_ids=position_ids, attention_mask=_tree_mask(segment, position_ids),
        logit_index=torch.cat(logit_index), targets=torch.cat(targets), token_sample=torch.cat(token_sample),
        token_index=index, sample_index=torch.tensor(sample_index, dtype=torch.int64),
        loss_mask=batch.loss_mask[index], rollout_logprobs=batch.rollout_logprobs[index],
        advantages=batch.advantages[index],
    )  # fmt: skip


def _tree_mask(segment: Tensor, position_ids: Tensor) -> Tensor:
    """[rows, 1, T, T] bool, True where query q may attend key k: k is a prompt position or in q's own
    response, and k is not after q. Padding queries see only themselves (their outputs are never read,
    but a row with no visible key would be NaN)."""
    q, k = segment[:, :, None], segment[:, None, :]
    causal = position_ids[:, None, :] <= position_ids[:, :, None]
    visible = ((k == 0) | (k == q)) & (k >= 0) & (q >= 0) & causal
    eye = torch.eye(segment.shape[1], dtype=torch.bool)[None]
    return (visible | (eye & (q < 0))).unsqueeze(1)
