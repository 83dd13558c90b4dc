"""Training batches: scored samples in, packed tensors out, split across ranks and micro-batches.

A `RolloutBatch` stores every sample packed end to end (prompt then response) in one flat token tensor
with offsets, and every per-response-token quantity (rollout logprobs, loss mask, versions, advantages)
in flat tensors in the same sample order. That layout is compact, broadcasts as a handful of tensors
(no pickle), and slices cheaply into data-parallel shards and micro-batches.

R3 routing traces (optional, all samples or none): sample i's trace `[P+R-1, moe_layers, top_k]` (the
rollout's expert ids per token and MoE layer; the last token has no row, see `vime.r3.trace`) is packed
flat in `RolloutBatch.routed_experts` [sum(P+R-1), moe_layers, top_k] (int16, or int32 for ids >= 32768),
sample i's rows starting at `route_offsets[i] = seq_offsets[i] - i`. Micro-batches carry them as
`replay_ids` [B, T, moe_layers, top_k] aligned with `input_ids`, `NO_ROUTE` where there is no row (the
last token, padding): ready for `vime.r3.hf_router.RoutingReplay.set_expert_ids`.

Alignment convention: a causal LM's logits at position t predict token t+1. For a sample with prompt
length P and response length R, response token j (0-based) is token P+j of the sequence, so its
logprob is read from the logits at position P+j-1. `MicroBatch.logit_index` holds exactly those
positions (flattened over the micro-batch's [B, T] inputs), and every per-token tensor of a micro-batch
is aligned with it.

Micro-batches come in two layouts. Padded: one row per sample, right padded to the longest. Packed
(`micro_batches(packed=True)`): one row holding the samples end to end, positions restarting at each
sample, with `cu_seqlens` marking the boundaries for variable-length attention
(`vime.trainer.varlen_attention`): no padding token is ever computed. Shared prompts
(`micro_batches(shared_prompts=True)`, `vime.trainer.shared_prompts`): one row per prompt holding the
responses of the samples that share it, with a tree attention mask: each prompt is computed once.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field, fields
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from vime.r3.hf_router import replay_ids_for_batch

PAD_TOKEN_ID = 0  # never attended to by real tokens (right padding + causal mask), any id works


@dataclass
class SampleRecord:
    """One scored sample as the trainer receives it from the broker.

    Arrays are 1-D. `rollout_logprobs`, `loss_mask` and `token_versions` have one entry per response
    token. Raises ValueError on inconsistent shapes, an empty prompt, a loss mask that is not 0/1, or a
    non-finite rollout logprob on a token that is trained on (non-finite logprobs on masked tokens are
    zeroed: they never enter the loss). `token_versions=None` means unknown (-1).
    """

    group_index: int
    prompt_tokens: np.ndarray
    response_tokens: np.ndarray
    rollout_logprobs: np.ndarray
    loss_mask: np.ndarray
    reward: float
    token_versions: np.ndarray | None = None
    # R3: the rollout's routing trace for prompt + response, [P + R - 1, moe_layers, top_k] integer ids
    routed_experts: np.ndarray | None = None

    def __post_init__(self) -> None:
        # A trainer builds 256+ of these a step on its critical path: arrays that already have the
        # wanted form are kept as they are, and the masked-logprob pass runs only when one is not finite.
        self.prompt_tokens = _flat(self.prompt_tokens, np.int32)
        self.response_tokens = _flat(self.response_tokens, np.int32)
        self.rollout_logprobs = np.array(self.rollout_logprobs, dtype=np.float32).reshape(-1)
        self.loss_mask = _flat(self.loss_mask, np.uint8)
        n = self.response_tokens.size
        if self.token_versions is None:
            self.token_versions = np.full(n, -1, dtype=np.int32)
        self.token_versions = _flat(self.token_versions, np.int32)
        if self.prompt_tokens.size == 0:
            raise ValueError("sample has an empty prompt; the first response token needs a prompt position")
        for name in ("rollout_logprobs", "loss_mask", "token_versions"):
            if getattr(self, name).size != n:
                raise ValueError(f"{name} has {getattr(self, name).size} entries for {n} response tokens")
        if n and self.loss_mask.max() > 1:
            raise ValueError("loss_mask must contain only 0 and 1")
        finite = np.isfinite(self.rollout_logprobs)
        if not finite.all():
            bad = ~finite
            if (bad & (self.loss_mask == 1)).any():
                raise ValueError("non-finite rollout logprob on a token with loss_mask=1")
            self.rollout_logprobs[bad] = 0.0
        if not math.isfinite(self.reward):
            raise ValueError(f"non-finite reward {self.reward}")
        if self.routed_experts is not None:
            trace = np.asarray(self.routed_experts)
            rows = self.prompt_tokens.size + n - 1
            if trace.ndim != 3 or trace.shape[0] != rows:
                raise ValueError(f"routed_experts has shape {trace.shape}, expected [prompt + response - 1 = {rows}, "
                                 "moe_layers, top_k]")
            if trace.size and not np.issubdtype(trace.dtype, np.integer):
                raise ValueError(f"routed_experts must hold integer expert ids, got dtype {trace.dtype}")
            if trace.size and int(trace.min()) < 0:
                raise ValueError(f"routed_experts has a negative expert id {int(trace.min())}")
            self.routed_experts = np.ascontiguousarray(trace)


def _flat(values: object, dtype: type) -> np.ndarray:
    """`values` as a contiguous 1-D array of `dtype`, the same object when it already is one."""
    if type(values) is np.ndarray and values.dtype == dtype and values.ndim == 1 and values.flags.c_contiguous:
        return values
    return np.ascontiguousarray(values, dtype=dtype).reshape(-1)


@dataclass
class MicroBatch:
    """Model inputs for a few samples plus their response tokens, flat and aligned.

    `input_ids`/`position_ids` are [B, T]: B samples right padded, or (packed) B = 1 with the samples end to
    end and `cu_seqlens` [samples + 1] their cumulative lengths. The per-token tensors are [N] with N = number of
    response tokens in the micro-batch: `logit_index` (position in the flattened [B*T] logits that predicts
    the token), `targets`, `token_sample` (the token's sample, 0..num_samples-1), `token_index` (position in the parent batch's flat
    response arrays, to look up old/ref logprobs computed earlier), and the aligned training data.
    """

    input_ids: Tensor
    position_ids: Tensor
    logit_index: Tensor
    targets: Tensor
    token_sample: Tensor
    token_index: Tensor
    sample_index: Tensor  # [B] index of each row in the parent batch
    loss_mask: Tensor
    rollout_logprobs: Tensor
    advantages: Tensor
    replay_ids: Tensor | None = None  # int32 [B, T, moe_layers, top_k], NO_ROUTE where no trace row
    cu_seqlens: Tensor | None = None  # packed only: int32 [samples + 1] sample boundaries in the row
    max_seqlen: int = 0  # packed only: the longest sample
    attention_mask: Tensor | None = None  # shared prompts only: bool [B, 1, T, T], True where q sees k

    @property
    def num_samples(self) -> int:
        return int(self.sample_index.numel())

    def to(self, device: torch.device | str) -> "MicroBatch":
        return MicroBatch(**{f.name: _to(getattr(self, f.name), device) for f in fields(self)})


# Order of tensors on the wire for `broadcast`; header carries their lengths.
_WIRE_FIELDS = (
    "tokens",
    "seq_offsets",
    "prompt_lengths",
    "resp_offsets",
    "rollout_logprobs",
    "loss_mask",
    "token_versions",
    "advantages",
    "rewards",
    "group_ids",
    "sample_ids",
)


@dataclass
class RolloutBatch:
    """Packed samples on CPU. See module docstring for the layout.

    `sample_ids` are the samples' indices in the batch built by `from_samples`; they survive `select`,
    `shard` and `chunks`, so results computed on a shard can be put back in the original order.
    """

    tokens: Tensor  # int32 [sum(P+R)]
    seq_offsets: Tensor  # int64 [S+1]
    prompt_lengths: Tensor  # int64 [S]
    resp_offsets: Tensor  # int64 [S+1]
    rollout_logprobs: Tensor  # float32 [sum(R)]
    loss_mask: Tensor  # float32 [sum(R)]
    token_versions: Tensor  # int32 [sum(R)]
    advantages: Tensor  # float32 [sum(R)], zeros until the trainer fills it
    rewards: Tensor  # float32 [S]
    group_ids: Tensor  # int64 [S]
    sample_ids: Tensor = field(default=None)  # type: ignore[assignment]  # int64 [S]
    routed_experts: Tensor | None = None  # int16/int32 [sum(P+R-1), moe_layers, top_k], or None

    def __post_init__(self) -> None:
        if self.sample_ids is None:
            self.sample_ids = torch.arange(self.num_samples, dtype=torch.int64)
        if self.routed_experts is not None:
            t = self.routed_experts
            rows = self.num_tokens - self.num_samples
            if t.ndim != 3 or t.shape[0] != rows or t.dtype not in (torch.int16, torch.int32):
                raise ValueError(f"routed_experts must be int16/int32 [{rows}, moe_layers, top_k] "
                                 f"(one row per token but each sample's last), got {t.dtype} {tuple(t.shape)}")

    # ------------------------------------------------------------------------------ construction

    @classmethod
    def from_samples(cls, samples: Sequence[SampleRecord]) -> "RolloutBatch":
        """Pack samples in the given order. Raises ValueError on an empty list."""
        if not samples:
            raise ValueError("cannot build a RolloutBatch from zero samples")
        seqs = [np.concatenate([s.prompt_tokens, s.response_tokens]) for s in samples]
        resp_lens = [s.response_tokens.size for s in samples]
        return cls(
            routed_experts=_pack_traces(samples),
            tokens=torch.from_numpy(np.concatenate(seqs)),
            seq_offsets=_offsets([x.size for x in seqs]),
            prompt_lengths=torch.tensor([s.prompt_tokens.size for s in samples], dtype=torch.int64),
            resp_offsets=_offsets(resp_lens),
            rollout_logprobs=torch.from_numpy(np.concatenate([s.rollout_logprobs for s in samples])),
            loss_mask=torch.from_numpy(np.concatenate([s.loss_mask for s in samples]).astype(np.float32)),
            token_versions=torch.from_numpy(np.concatenate([s.token_versions for s in samples])),
            advantages=torch.zeros(sum(resp_lens), dtype=torch.float32),
            rewards=torch.tensor([float(s.reward) for s in samples], dtype=torch.float32),
            group_ids=torch.tensor([int(s.group_index) for s in samples], dtype=torch.int64),
        )

    # ---------------------------------------------------------------------------------- shape info

    @property
    def num_samples(self) -> int:
        return int(self.prompt_lengths.numel())

    @property
    def sequence_lengths(self) -> Tensor:
        return self.seq_offsets[1:] - self.seq_offsets[:-1]

    @property
    def response_lengths(self) -> Tensor:
        return self.resp_offsets[1:] - self.resp_offsets[:-1]

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    @property
    def route_offsets(self) -> Tensor:
        """[S+1] row offsets of each sample's trace in `routed_experts` (a sample has seq_len - 1 rows)."""
        return self.seq_offsets - torch.arange(self.num_samples + 1, dtype=torch.int64)

    @property
    def has_routes(self) -> bool:
        return self.routed_experts is not None

    def sample_trace(self, i: int) -> Tensor:
        """Sample i's routing trace [seq_len - 1, moe_layers, top_k]; ValueError if the batch has none."""
        if self.routed_experts is None:
            raise ValueError("this batch carries no routing traces")
        a = int(self.seq_offsets[i]) - i
        return self.routed_experts[a : a + int(self.sequence_lengths[i]) - 1]

    def response_token_sample_ids(self) -> Tensor:
        """[sum(R)] which sample each flat response token belongs to."""
        return torch.repeat_interleave(torch.arange(self.num_samples), self.response_lengths)

    def split_responses(self, flat: Tensor) -> list[np.ndarray]:
        """Cut a flat per-response-token tensor into one numpy array per sample."""
        bounds = self.resp_offsets.tolist()
        return [flat[a:b].detach().cpu().numpy() for a, b in zip(bounds[:-1], bounds[1:])]

    # -------------------------------------------------------------------------------- subsetting

    def select(self, indices: Sequence[int] | Tensor) -> "RolloutBatch":
        """New batch with the given samples, in the given order (may be empty)."""
        idx = torch.as_tensor(indices, dtype=torch.int64).reshape(-1)
        seq_lens, resp_lens = self.sequence_lengths[idx], self.response_lengths[idx]
        tok = _ranges(self.seq_offsets[idx], seq_lens)
        resp = _ranges(self.resp_offsets[idx], resp_lens)
        return RolloutBatch(
            tokens=self.tokens[tok],
            seq_offsets=_offsets(seq_lens.tolist()),
            prompt_lengths=self.prompt_lengths[idx],
            resp_offsets=_offsets(resp_lens.tolist()),
            rollout_logprobs=self.rollout_logprobs[resp],
            loss_mask=self.loss_mask[resp],
            token_versions=self.token_versions[resp],
            advantages=self.advantages[resp],
            rewards=self.rewards[idx],
            group_ids=self.group_ids[idx],
            sample_ids=self.sample_ids[idx],
            routed_experts=(
                None if self.routed_experts is None
                else self.routed_experts[_ranges(self.route_offsets[idx], seq_lens - 1)]
            ),
        )

    def chunks(self, size: int) -> list["RolloutBatch"]:
        """Consecutive pieces of at most `size` samples (one per optimizer step, slime order)."""
        if size <= 0:
            raise ValueError(f"chunk size must be positive, got {size}")
        return [self.select(range(i, min(i + size, self.num_samples))) for i in range(0, self.num_samples, size)]

    def shard_indices(self, world_size: int) -> list[list[int]]:
        """Assign samples to `world_size` ranks balancing token counts (longest first, to the lightest).

        Every rank gets a sample when there are at least `world_size` samples: the first `world_size`
        assignments each go to a distinct still-empty rank. Indices within a shard stay sorted.
        """
        if world_size <= 0:
            raise ValueError(f"world_size must be positive, got {world_size}")
        lengths = self.sequence_lengths.tolist()
        order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
        heap = [(0, r) for r in range(world_size)]
        shards: list[list[int]] = [[] for _ in range(world_size)]
        for i in order:
            load, r = heapq.heappop(heap)
            shards[r].append(i)
            heapq.heappush(heap, (load + lengths[i], r))
        return [sorted(s) for s in shards]

    def shard(self, rank: int, world_size: int) -> "RolloutBatch":
        """This rank's data-parallel share (deterministic, identical on all ranks). May be empty when
        there are fewer samples than ranks; callers must still take part in collectives then."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of {world_size}")
        return self.select(self.shard_indices(world_size)[rank])

    # ------------------------------------------------------------------------------ micro-batches

    def micro_batches(
        self, max_tokens: int | None = None, size: int | None = None, packed: bool = False,
        shared_prompts: bool = False,
    ) -> list[MicroBatch]:  # fmt: skip
        """Group samples into micro-batches, longest samples first.

        Padded: `max_tokens` bounds rows * longest row (the padded tensor the model sees). Packed: it
        bounds the row's total length, and samples go first-fit into the micro-batches already open, so
        short samples fill the gaps long ones leave. Shared prompts: rows of one prompt and its samples'
        responses (`vime.trainer.shared_prompts`), bounded like padded rows. Every way a sample longer
        than `max_tokens` gets a micro-batch of its own, `size` bounds samples per micro-batch, and with
        neither bound one micro-batch holds everything.
        """
        if packed and shared_prompts:
            raise ValueError("micro-batches are either packed or shared-prompt, not both")
        if shared_prompts:
            from vime.trainer.shared_prompts import shared_prompt_micro_batches

            return shared_prompt_micro_batches(self, max_tokens=max_tokens, size=size)
        if self.num_samples == 0:
            return []
        lengths = self.sequence_lengths.tolist()
        order = sorted(range(self.num_samples), key=lambda i: (-lengths[i], i))
        groups: list[list[int]] = []
        if packed:
            totals: list[int] = []
            for i in order:
                for g, group in enumerate(groups):
                    if (size is None or len(group) < size) and (max_tokens is None or totals[g] + lengths[i] <= max_tokens):
                        group.append(i)
                        totals[g] += lengths[i]
                        break
                else:
                    groups.append([i])
                    totals.append(lengths[i])
            return [self._make_packed_micro_batch(g) for g in groups]
        for i in order:
            cur = groups[-1] if groups else None
            fits = cur is not None and (size is None or len(cur) < size)
            # sorted descending, so the group's first sample is its longest row
            if fits and max_tokens is not None and (len(cur) + 1) * lengths[cur[0]] > max_tokens:
                fits = False
            if fits:
                cur.append(i)
            else:
                groups.append([i])
        return [self._make_micro_batch(g) for g in groups]

    def _response_positions(self, rows: list[int], row_starts: list[int]) -> dict[str, Tensor]:
        """The per-response-token tensors of a micro-batch whose sample b starts at flat position row_starts[b]."""
        logit_index, targets, token_sample, token_index = [], [], [], []
        for b, (i, start) in enumerate(zip(rows, row_starts)):
            p = int(self.prompt_lengths[i])
            r0, r1 = int(self.resp_offsets[i]), int(self.resp_offsets[i + 1])
            logit_index.append(torch.arange(start + p - 1, start + p - 1 + (r1 - r0)))  # logits at t predict t+1
            seq_start = int(self.seq_offsets[i])
            targets.append(self.tokens[seq_start + p : seq_start + p + (r1 - r0)].to(torch.int64))
            token_sample.append(torch.full((r1 - r0,), b, dtype=torch.int64))
            token_index.append(torch.arange(r0, r1))
        index = torch.cat(token_index)
        return dict(
            logit_index=torch.cat(logit_index), targets=torch.cat(targets), token_sample=torch.cat(token_sample),
            token_index=index, sample_index=torch.tensor(rows, dtype=torch.int64), loss_mask=self.loss_mask[index],
            rollout_logprobs=self.rollout_logprobs[index], advantages=self.advantages[index],
        )

    def _make_micro_batch(self, rows: list[int]) -> MicroBatch:
        lengths = self.sequence_lengths[rows]
        width = int(lengths.max())
        input_ids = torch.full((len(rows), width), PAD_TOKEN_ID, dtype=torch.int64)
        for b, i in enumerate(rows):
            start, seq_len = int(self.seq_offsets[i]), int(lengths[b])
            input_ids[b, :seq_len] = self.tokens[start : start + seq_len]
        replay_ids = None
        if self.routed_experts is not None:
            traces = [self.sample_trace(i).numpy() for i in rows]
            replay_ids = replay_ids_for_batch(traces, lengths.tolist(), width)
        return MicroBatch(
            input_ids=input_ids,
            position_ids=torch.arange(width).expand(len(rows), width).contiguous(),
            replay_ids=replay_ids,
            **self._response_positions(rows, [b * width for b in range(len(rows))]),
        )

    def _make_packed_micro_batch(self, rows: list[int]) -> MicroBatch:
        idx = torch.tensor(rows, dtype=torch.int64)
        lengths = self.sequence_lengths[idx]
        cu_seqlens = _offsets(lengths.tolist())
        starts = cu_seqlens[:-1]
        positions = torch.arange(int(cu_seqlens[-1])) - torch.repeat_interleave(starts, lengths)
        replay_ids = None
        if self.routed_experts is not None:
            traces = [self.sample_trace(i).numpy() for i in rows]
            padded = replay_ids_for_batch(traces, lengths.tolist())
            replay_ids = torch.cat([padded[b, :n] for b, n in enumerate(lengths.tolist())])[None]
        return MicroBatch(
            input_ids=self.tokens[_ranges(self.seq_offsets[idx], lengths)].to(torch.int64)[None],
            position_ids=positions[None],
            replay_ids=replay_ids,
            cu_seqlens=cu_seqlens.to(torch.int32),
            max_seqlen=int(lengths.max()),
            **self._response_positions(rows, starts.tolist()),
        )

    # ----------------------------------------------------------------------------------- transport

    def broadcast(self, src: int = 0, group: dist.ProcessGroup | None = None) -> "RolloutBatch":
        """Send this batch from global rank `src` to every rank of `group`; see `broadcast_batch`.

        Ranks that have no batch call `RolloutBatch.broadcast(None, src=0)` or `broadcast_batch(None)`.
        """
        return broadcast_batch(self, src=src, group=group)


_WIRE_DTYPES = {
    "tokens": torch.int32, "seq_offsets": torch.int64, "prompt_lengths": torch.int64,
    "resp_offsets": torch.int64, "rollout_logprobs": torch.float32, "loss_mask": torch.float32,
    "token_versions": torch.int32, "advantages": torch.float32, "rewards": torch.float32,
    "group_ids": torch.int64, "sample_ids": torch.int64,
}  # fmt: skip


def broadcast_batch(
    batch: RolloutBatch | None, src: int = 0, group: dist.ProcessGroup | None = None
) -> RolloutBatch:
    """Every rank of `group` gets the batch held by global rank `src` (others pass None or anything).

    Tensors only (a size header, then one broadcast per field), so no pickle. Returns `batch` itself when
    torch.distributed is not initialised or the group has one rank. With NCCL the tensors travel through
    the current CUDA device and come back to CPU. Raises ValueError if `src` has no batch; all ranks
    must call this together or the others hang in the header broadcast.
    """
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        if batch is None:
            raise ValueError("broadcast_batch needs a batch when not running distributed")
        return batch
    nccl = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    is_src = dist.get_rank() == src
    if is_src and batch is None:
        raise ValueError(f"rank {src} is the broadcast source but has no batch")
    # [samples, tokens, response tokens, trace layers (0: no traces), trace top_k, trace id bits]
    header = torch.zeros(6, dtype=torch.int64)
    if is_src:
        route = batch.routed_experts
        bits = 0 if route is None else (16 if route.dtype == torch.int16 else 32)
        layers, top_k = (0, 0) if route is None else tuple(route.shape[1:])
        sizes_out = [batch.num_samples, batch.num_tokens, batch.rollout_logprobs.numel(), layers, top_k, bits]
        header = torch.tensor(sizes_out, dtype=torch.int64)
    header = header.to(device)
    dist.broadcast(header, src=src, group=group)
    num_samples, num_tokens, num_resp, layers, top_k, bits = header.tolist()
    sizes = {
        "tokens": num_tokens, "seq_offsets": num_samples + 1, "resp_offsets": num_samples + 1,
        "prompt_lengths": num_samples, "rewards": num_samples, "group_ids": num_samples, "sample_ids": num_samples,
    }  # fmt: skip
    out = {}
    for name in _WIRE_FIELDS:
        if is_src:
            t = getattr(batch, name).to(_WIRE_DTYPES[name]).contiguous().to(device)
        else:
            t = torch.empty(sizes.get(name, num_resp), dtype=_WIRE_DTYPES[name], device=device)
        dist.broadcast(t, src=src, group=group)
        out[name] = t.cpu()
    if layers > 0:
        # int32 on the wire: gloo has no int16 collectives
        shape = (num_tokens - num_samples, layers, top_k)
        if is_src:
            t = batch.routed_experts.to(torch.int32).contiguous().to(device)  # type: ignore[union-attr]
        else:
            t = torch.empty(shape, dtype=torch.int32, device=device)
        dist.broadcast(t, src=src, group=group)
        out["routed_experts"] = t.cpu().to(torch.int16 if bits == 16 else torch.int32)
    return RolloutBatch(**out)


def _to(value: object, device: torch.device | str) -> object:
    return value.to(device) if isinstance(value, Tensor) else value


def _pack_traces(samples: Sequence[SampleRecord]) -> Tensor | None:
    """All samples' routing traces packed flat (int16, int32 when an id needs it), or None when none has one.

    Raises ValueError when only some samples have a trace or the traces disagree on [moe_layers, top_k].
    """
    missing = [i for i, s in enumerate(samples) if s.routed_experts is None]
    if len(missing) == len(samples):
        return None
    if missing:
        raise ValueError(
            f"{len(missing)} of {len(samples)} samples have no routed_experts (first: sample {missing[0]}): "
            "a batch carries routing traces for all samples or for none"
        )
    traces = [s.routed_experts for s in samples]
    shapes = sorted({tuple(t.shape[1:]) for t in traces})  # type: ignore[union-attr]
    if len(shapes) != 1:
        raise ValueError(f"routed_experts disagree on [moe_layers, top_k] across samples: {shapes}")
    hi = max((int(t.max()) for t in traces if t.size), default=0)  # type: ignore[union-attr]
    dtype = np.int16 if hi <= np.iinfo(np.int16).max else np.int32
    return torch.from_numpy(np.concatenate([t.astype(dtype, copy=False) for t in traces]))  # type: ignore[union-attr]


def _offsets(lengths: Sequence[int]) -> Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    if len(lengths):
        out[1:] = torch.cumsum(torch.as_tensor(list(lengths), dtype=torch.int64), 0)
    return out


def _ranges(starts: Tensor, lengths: Tensor) -> Tensor:
    """Concatenation of arange(s, s+l) for each (s, l), vectorised."""
    if lengths.numel() == 0:
        return torch.zeros(0, dtype=torch.int64)
    total = int(lengths.sum())
    seg_start = torch.repeat_interleave(starts - (torch.cumsum(lengths, 0) - lengths), lengths)
    return torch.arange(total, dtype=torch.int64) + seg_start
