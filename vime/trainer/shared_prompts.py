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

import numpy as np
import torch
from torch import Tensor

from vime.trainer.batch import PAD_TOKEN_ID, MicroBatch, RolloutBatch


class SharedPromptError(ValueError):
    """The batch cannot be laid out with shared prompts (it carries routing traces)."""


def prompt_groups(batch: RolloutBatch) -> list[list[int]]:
    """Sample indices of `batch` by shared prompt: the same group id and the same prompt tokens, in
    order of first appearance."""
    groups: dict[tuple[int, bytes], list[int]] = {}
    tokens = batch.tokens.numpy()
    for i, (start, p, group_id) in enumerate(zip(batch.seq_offsets.tolist(), batch.prompt_lengths.tolist(), batch.group_ids.tolist())):
        groups.setdefault((group_id, tokens[start : start + p].tobytes()), []).append(i)
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
    # Index arithmetic in numpy over all samples and tokens at once: a loop of small tensor ops per
    # sample cost more than the model's forward on the CPU demo's batches.
    samples = np.fromiter((i for r in rows for i in r), dtype=np.int64)
    sizes = np.array([len(r) for r in rows], dtype=np.int64)
    row_of = np.repeat(np.arange(len(rows)), sizes)
    row_first = np.cumsum(sizes) - sizes  # each row's first entry in `samples`
    first_sample = samples[row_first]
    seq_offsets, resp_offsets = batch.seq_offsets.numpy(), batch.resp_offsets.numpy()
    prompt = batch.prompt_lengths.numpy()[first_sample].astype(np.int64)
    n = (resp_offsets[samples + 1] - resp_offsets[samples]).astype(np.int64)
    # where each response starts in its row: after the prompt and the row's earlier responses
    before = np.cumsum(n) - n
    at = prompt[row_of] + before - before[row_first][row_of]
    width = int((prompt + np.bincount(row_of, weights=n, minlength=len(rows)).astype(np.int64)).max())

    tok_sample = np.repeat(np.arange(samples.size), n)
    t = np.arange(tok_sample.size) - np.repeat(before, n)  # position within its response
    tok_row = row_of[tok_sample]
    tok_pos = at[tok_sample] + t
    tokens = batch.tokens.numpy()
    response = tokens[seq_offsets[samples][tok_sample] + prompt[tok_row] + t].astype(np.int64)

    prompt_row = np.repeat(np.arange(len(rows)), prompt)
    prompt_pos = np.arange(prompt_row.size) - np.repeat(np.cumsum(prompt) - prompt, prompt)
    input_ids = np.full((len(rows), width), PAD_TOKEN_ID, dtype=np.int64)
    position_ids = np.zeros((len(rows), width), dtype=np.int64)
    # segment id per position: 0 prompt, j + 1 the row's j-th response, -1 padding
    segment = np.full((len(rows), width), -1, dtype=np.int64)
    input_ids[prompt_row, prompt_pos] = tokens[seq_offsets[first_sample][prompt_row] + prompt_pos]
    position_ids[prompt_row, prompt_pos] = prompt_pos
    segment[prompt_row, prompt_pos] = 0
    input_ids[tok_row, tok_pos] = response
    position_ids[tok_row, tok_pos] = prompt[tok_row] + t
    segment[tok_row, tok_pos] = (np.arange(samples.size) - row_first[row_of])[tok_sample] + 1
    # response token 0 is predicted by the prompt's last position, token t by response token t - 1
    logit_index = tok_row * width + np.where(t == 0, prompt[tok_row] - 1, tok_pos - 1)
    index = torch.from_numpy(resp_offsets[samples][tok_sample] + t).to(torch.int64)
    position_ids_t = torch.from_numpy(position_ids)
    return MicroBatch(
        input_ids=torch.from_numpy(input_ids), position_ids=position_ids_t,
        attention_mask=_tree_mask(torch.from_numpy(segment), position_ids_t),
        logit_index=torch.from_numpy(logit_index), targets=torch.from_numpy(response),
        token_sample=torch.from_numpy(tok_sample), token_index=index, sample_index=torch.from_numpy(samples),
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
