"""Record and replay MoE routing in transformers models (R3 = Rollout Routing Replay).

`RoutingRecorder` captures, for every forward inside its `with` block, each MoE router's top-k expert
ids; `traces(lengths)` turns them into per-sample traces `[tokens - 1, moe_layers, top_k]` (see
`vime.r3.trace`). `RoutingReplay` makes every router use given expert ids instead of its own top-k: it
keeps the router's logits, takes the softmax in float32, gathers the probabilities at the given ids and
renormalises them when the router does (`norm_topk_prob`). The routing weights are therefore a
differentiable function of the router weight, so the router keeps learning while the experts used are
the rollout's.

Both work with forward hooks on the routers (plus a pre-hook on each router's parent to learn the
[B, T] batch shape, since the router itself sees flattened tokens). Nothing is monkey-patched; leaving
the `with` block removes every hook, also on exceptions.

Which modules are routers: `find_routers` picks modules with an int `top_k`, an int `num_experts` and a
2-D `weight` of shape [num_experts, hidden] whose forward returns `(logits, top_weights, top_indices)`.
That is transformers 5.x's `Qwen3MoeTopKRouter` (verified against 5.19: `F.linear` -> softmax in float ->
topk -> optional renormalise -> cast to the logits' dtype), reached as `model.layers[i].mlp.gate`. Other
routers with the same contract (softmax scoring) fit too; routers that score otherwise (sigmoid plus a
selection bias, grouped top-k) are found by these attributes but would replay with the wrong weights,
so pass `routers=` explicitly for anything that is not verified.

Padding and missing rows: a replay id < 0 or >= num_experts means "no recorded route" and the router
routes that token itself. That covers right padding, the last token (which has no trace row) and the
`num_experts` padding id of `pad_for_training`, without relying on an experts implementation that skips
out-of-range ids: in transformers 5.19 only the eager one does; `grouped_mm` (what checkpoints load with
by default) yields NaN for them and `batched_mm` an IndexError, outside expert parallelism. Such tokens only influence later positions (causal
attention), which are padding or the last token, so no loss reads them.

Gradient checkpointing re-runs the routers in backward: keep the `RoutingReplay` context open until
`backward()` returns, or the recomputation routes on its own and checkpointing fails on mismatched
saved tensors (the torch trainer does this). A recorder left open through backward would record the
recomputation twice; close it before backward or record under `torch.no_grad()`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Self

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from vime.r3.trace import encode_trace

NO_ROUTE = -1  # replay id meaning "let the router choose" (padding, last token)


def is_topk_router(module: nn.Module) -> bool:
    """True for modules that look like a softmax top-k router (see the module docstring)."""
    top_k, num_experts = getattr(module, "top_k", None), getattr(module, "num_experts", None)
    weight = getattr(module, "weight", None)
    return (
        isinstance(top_k, int)
        and isinstance(num_experts, int)
        and isinstance(weight, Tensor)
        and weight.ndim == 2
        and weight.shape[0] == num_experts
    )


def find_routers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's MoE routers in module order (= decoder layer order), as (qualified name, module).

    The trace's layer axis follows this order: dense layers have no router and no trace column.
    """
    return [(name, m) for name, m in model.named_modules() if is_topk_router(m)]


class _RouterHooks:
    """Shared plumbing: find the routers, install hooks on enter, remove them all on exit."""

    def __init__(self, model: nn.Module, routers: Sequence[tuple[str, nn.Module]] | None = None) -> None:
        self._model = model
        self._routers = list(routers) if routers is not None else find_routers(model)
        if not self._routers:
            raise ValueError(f"no MoE routers found in {type(model).__name__} (dense model?)")
        experts = {int(m.num_experts) for _, m in self._routers}
        top_ks = {int(m.top_k) for _, m in self._routers}
        if len(experts) != 1 or len(top_ks) != 1:
            # One trace array needs one expert count and one top-k across layers.
            raise ValueError(f"routers disagree on num_experts {experts} or top_k {top_ks}")
        self.num_experts: int = experts.pop()
        self.top_k: int = top_ks.pop()
        self._handles: list[RemovableHandle] = []
        # Last [B, T] seen by each router's parent block, so flat router rows can be unflattened.
        self._shapes: dict[int, tuple[int, int]] = {}

    @property
    def num_layers(self) -> int:
        """Number of MoE layers, the trace's middle axis."""
        return len(self._routers)

    @property
    def router_names(self) -> list[str]:
        return [name for name, _ in self._routers]

    def __enter__(self) -> Self:
        if self._handles:
            raise RuntimeError(f"{type(self).__name__} is already active")
        try:
            for i, (name, router) in enumerate(self._routers):
                parent = self._parent(name)
                if parent is not None:
                    self._handles.append(parent.register_forward_pre_hook(self._shape_hook(i), with_kwargs=True))
                self._handles.append(router.register_forward_hook(self._router_hook(i)))
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self._remove()

    def _remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._shapes.clear()

    def _parent(self, name: str) -> nn.Module | None:
        if not name:  # the model itself is the router: no parent to read the batch shape from
            return None
        return self._model.get_submodule(name.rpartition(".")[0])  # "" -> the model

    def _shape_hook(self, i: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            hidden = args[0] if args else kwargs.get("hidden_states")
            if isinstance(hidden, Tensor) and hidden.ndim == 3:
                self._shapes[i] = (int(hidden.shape[0]), int(hidden.shape[1]))
            else:
                self._shapes.pop(i, None)

        return hook

    def _router_hook(self, i: int):
        raise NotImplementedError

    def _unpack(self, i: int, output: Any) -> tuple[Tensor, Tensor, Tensor]:
        if not (isinstance(output, tuple) and len(output) == 3):
            raise TypeError(f"router {self._routers[i][0]} returned {type(output).__name__}, "
                            "expected (logits, top_weights, top_indices)")
        logits, weights, indices = output
        if logits.shape[-1] != self.num_experts or indices.shape[-1] != self.top_k:
            raise TypeError(f"router {self._routers[i][0]} returned logits {tuple(logits.shape)} and indices "
                            f"{tuple(indices.shape)}, expected [..., {self.num_experts}] and [..., {self.top_k}]")
        return logits, weights, indices


class RoutingRecorder(_RouterHooks):
    """Records every router's top-k ids for the forwards run inside `with recorder:`.

    Successive forwards of the same batch size are concatenated along time, so a KV-cached generation
    (prompt forward, then one token per step) records whole sequences. Call `reset()` between batches.
    Raises ValueError when a router's parent does not see a 3-D [B, T, H] input (the batch shape is then
    unknown) or when the batch size changes between forwards without a reset.
    """

    def __init__(self, model: nn.Module, routers: Sequence[tuple[str, nn.Module]] | None = None) -> None:
        super().__init__(model, routers)
        self._chunks: list[list[Tensor]] = [[] for _ in self._routers]

    def reset(self) -> None:
        """Forget everything recorded so far."""
        self._chunks = [[] for _ in self._routers]

    def _router_hook(self, i: int):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            _, _, indices = self._unpack(i, output)
            shape = self._shapes.get(i)
            if shape is None or shape[0] * shape[1] != indices.shape[0]:
                raise ValueError(f"router {self._routers[i][0]}: cannot tell the [B, T] shape of "
                                 f"{indices.shape[0]} routed tokens (parent input shape {shape})")
            chunks = self._chunks[i]
            if chunks and chunks[0].shape[0] != shape[0]:
                raise ValueError(f"batch size changed from {chunks[0].shape[0]} to {shape[0]} while recording; "
                                 "call reset() between batches")
            # Small ints keep a long generation's recording cheap; int32 only for > 32767 experts.
            dtype = torch.int16 if self.num_experts <= 32767 else torch.int32
            chunks.append(indices.detach().reshape(shape[0], shape[1], self.top_k).to(dtype))

        return hook

    @property
    def recorded_tokens(self) -> int:
        """Tokens per row recorded so far (equal across layers after a full forward)."""
        return sum(c.shape[1] for c in self._chunks[0])

    def expert_ids(self) -> Tensor:
        """Everything recorded as one CPU tensor [B, T, moe_layers, top_k]. Raises ValueError if empty."""
        if not self._chunks[0]:
            raise ValueError("nothing recorded")
        per_layer = [torch.cat(chunks, dim=1) for chunks in self._chunks]
        if len({t.shape for t in per_layer}) != 1:
            raise ValueError(f"layers recorded different shapes {sorted({tuple(t.shape) for t in per_layer})}")
        return torch.stack(per_layer, dim=2).cpu()

    def traces(self, lengths: Sequence[int]) -> list[np.ndarray]:
        """Per-row traces `[lengths[b] - 1, moe_layers, top_k]`, compact dtype (see `encode_trace`).

        `lengths[b]` is row b's full sequence length (prompt + response, without padding). Raises
        ValueError when the row count differs from the batch or a row needs more tokens than recorded.
        """
        ids = self.expert_ids().numpy()
        if len(lengths) != ids.shape[0]:
            raise ValueError(f"{len(lengths)} lengths for a recorded batch of {ids.shape[0]} rows")
        out = []
        for b, n in enumerate(lengths):
            if not 1 <= n <= ids.shape[1] + 1:
                raise ValueError(f"row {b}: length {n} needs {n - 1} recorded tokens, have {ids.shape[1]}")
            out.append(encode_trace(ids[b, : n - 1], self.num_experts))
        return out


class RoutingReplay(_RouterHooks):
    """Makes every router use given expert ids during forwards inside `with replay:`.

    `expert_ids` is [B, T, moe_layers, top_k] (see `replay_ids_for_batch`), aligned with the [B, T]
    input; put it on the model's device to avoid a copy per layer. A row whose ids are not all in
    [0, num_experts) is routed by the model itself. Raises ValueError on a shape that does not match the
    routers or the batch, RuntimeError when a forward runs before any ids were set.
    """

    def __init__(
        self,
        model: nn.Module,
        expert_ids: Tensor | None = None,
        routers: Sequence[tuple[str, nn.Module]] | None = None,
    ) -> None:
        super().__init__(model, routers)
        self._ids: Tensor | None = None
        if expert_ids is not None:
            self.set_expert_ids(expert_ids)

    def set_expert_ids(self, expert_ids: Tensor) -> None:
        """Ids for the next forwards (e.g. per micro-batch), [B, T, moe_layers, top_k], any int dtype."""
        if expert_ids.ndim != 4 or expert_ids.shape[2:] != (self.num_layers, self.top_k):
            raise ValueError(
                f"replay ids must be [B, T, {self.num_layers}, {self.top_k}], got {tuple(expert_ids.shape)}"
            )
        if expert_ids.dtype.is_floating_point or expert_ids.dtype == torch.bool:
            raise ValueError(f"replay ids must be integers, got {expert_ids.dtype}")
        self._ids = expert_ids

    def _router_hook(self, i: int):
        def hook(module: nn.Module, args: tuple, output: Any) -> tuple[Tensor, Tensor, Tensor]:
            logits, _, own = self._unpack(i, output)
            if self._ids is None:
                raise RuntimeError("RoutingReplay: forward ran before set_expert_ids()")
            b, t = self._ids.shape[:2]
            shape = self._shapes.get(i)
            if b * t != logits.shape[0] or (shape is not None and shape != (b, t)):
                raise ValueError(f"router {self._routers[i][0]}: replay ids are for a [{b}, {t}] batch, "
                                 f"the forward has {logits.shape[0]} tokens (shape {shape})")
            ids = self._ids[:, :, i, :].reshape(b * t, self.top_k).to(device=own.device, dtype=own.dtype)
            recorded = ((ids >= 0) & (ids < self.num_experts)).all(dim=-1, keepdim=True)
            chosen = torch.where(recorded, ids, own)
            # Same arithmetic as the router's own path (softmax in float32, renormalise, cast back), so
            # replaying the router's own choice reproduces its weights bit for bit.
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            weights = probs.gather(-1, chosen)
            if getattr(module, "norm_topk_prob", False):
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(logits.dtype), chosen

        return hook


def replay_ids_for_batch(
    traces: Sequence[np.ndarray],
    lengths: Sequence[int],
    width: int | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """Right-padded replay ids [B, width, moe_layers, top_k] (int32) from per-sample traces.

    `traces[b]` covers row b's first `lengths[b] - 1` tokens (wire form) or all `lengths[b]` (after
    `pad_for_training`). Positions without a row (last token, padding) hold `NO_ROUTE`. `width` defaults
    to max(lengths). Raises ValueError on inconsistent layer/top-k counts or a trace of the wrong length.
    """
    if len(traces) != len(lengths) or not traces:
        raise ValueError(f"need one trace per row, got {len(traces)} traces for {len(lengths)} rows")
    shapes = {tuple(tr.shape[1:]) for tr in traces}
    if len(shapes) != 1 or any(tr.ndim != 3 for tr in traces):
        raise ValueError(f"traces disagree on [moe_layers, top_k]: {sorted(shapes)}")
    layers, k = shapes.pop()
    width = max(lengths) if width is None else width
    out = torch.full((len(traces), width, layers, k), NO_ROUTE, dtype=torch.int32)
    for b, (tr, n) in enumerate(zip(traces, lengths)):
        if n > width or tr.shape[0] not in (n - 1, n):
            raise ValueError(f"row {b}: trace of {tr.shape[0]} rows for length {n} (width {width})")
        out[b, : tr.shape[0]] = torch.from_numpy(tr.astype(np.int32, copy=False))
    return out if device is None else out.to(device)
