"""Megatron-core policy trainer: the torch backend's rollout step on a tensor/pipeline/expert-parallel GPTModel.

`MegatronTrainer` is a `PolicyTrainer` (base.py): the rollout step, advantages, sharding, old/ref
logprobs, metrics and the per-micro-batch objective (objective.py) are the torch backend's, shared code.
What is Megatron's here:
- the model: a GPTModel built from the HF config (model.py, SDPA attention), bf16 parameters in a
  `Float16Module`, Megatron's `DistributedDataParallel` (fp32 gradient buffers) and its optimizer
  (Adam with fp32 master weights, optionally the distributed optimizer), `OptimizerParamScheduler`;
- the forwards: `get_forward_backward_func()` runs every micro-batch through the pipeline schedule
  (no pipelining when PP = 1). `calculate_per_token_loss` is on: each micro-batch's loss function
  returns the objective's numerator and its denominator (samples or tokens), and Megatron divides the
  gradient by the global denominator after the data-parallel reduction: one big batch, exactly;
- tensor parallelism: logits are vocab-parallel; they are all-gathered (autograd-aware) before the
  shared objective, which needs the full vocabulary;
- R3: with `use_rollout_routing_replay`, Megatron's router replay (`moe_enable_routing_replay`) is fed
  per micro-batch with this rank's slice of the traces (`_replay_slices`: Megatron's sequence-major
  token order, this TP rank's sequence chunk under sequence parallelism, this pipeline stage's MoE
  layers). Forwards use REPLAY_FORWARD; with activation recompute, an identity autograd function on the
  stage output switches the routers to REPLAY_BACKWARD when backward starts, so the recompute pops the
  same ids. The policy's and the reference's routers are driven per instance (not through the global
  static helpers, which would mix the two models);
- `train/routing_agreement` is measured by a forward hook on every router (the `routing_map` it
  returns, i.e. after replay) against the traces.

Data parallelism: `rank`/`world_size` are the data-parallel coordinates; ranks of one TP/PP group get
the same shard. Every data-parallel rank runs the same number of micro-batches (expert-parallel
all-to-alls span data-parallel ranks), padding with zero-weight dummies.

Needs CUDA and megatron-core (Python >= 3.12 for 0.19); construct after `init_process_group("nccl")`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplayAction
from torch import Tensor, nn

from vime.logging import get_logger
from vime.r3.hf_router import NO_ROUTE
from vime.trainer import losses
from vime.trainer.base import PolicyTrainer
from vime.trainer.batch import MicroBatch, RolloutBatch
from vime.trainer.fused_head import head_logprobs_and_entropy
from vime.trainer.megatron.hf_mapping import ModelLayout
from vime.trainer.megatron.model import ResponseRowsOutputLayer, build_gpt_model, transformer_config
from vime.trainer.megatron.parallel import MegatronParallelConfig, init_model_parallel
from vime.trainer.megatron.weights import export_hf_weights, load_hf_weights
from vime.trainer.objective import ObjectiveConfig, micro_batch_objective
from vime.trainer.torch_backend import TorchTrainerConfig, _copy_side_files, _set_config_dtype

log = get_logger(__name__)


@dataclass
class MegatronTrainerConfig(TorchTrainerConfig):
    """The torch backend's settings (losses, batching, optimizer) plus Megatron's parallel layout.

    `use_fsdp`, `gradient_checkpointing`, `pack_sequences` and `attn_implementation` do not apply
    (Megatron has its own distributed optimizer and `recompute_granularity`, and SDPA attention);
    `dtype` "auto"/"bfloat16" trains bf16 parameters with fp32 master weights, "float32" trains in fp32.
    `chunked_head` applies without tensor parallelism; `torch_compile` compiles each transformer layer.
    """

    parallel: MegatronParallelConfig = field(default_factory=MegatronParallelConfig)


def _bare(module: nn.Module) -> nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(module, "module"):
        module = module.module
    return module


class _SwitchToReplayBackward(torch.autograd.Function):
    """Identity whose backward flips the given routers to REPLAY_BACKWARD before any recompute runs."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, replays: list[Any]) -> Tensor:  # type: ignore[override]
        ctx.replays = replays
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        for r in ctx.replays:
            r.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
        return grad, None


class MegatronTrainer(PolicyTrainer):
    """Policy (and optional frozen reference) as Megatron GPTModels on this rank. See module docstring."""

    # Resume state is per rank (this rank's model shards, optimizer shards and RNG tracker): `--load`
    # needs the same parallel layout (TP, PP, EP, DP) as the run that saved it.
    sharded_training_state = True

    def __init__(self, cfg: MegatronTrainerConfig) -> None:
        from transformers import AutoConfig

        if not torch.cuda.is_available():
            raise RuntimeError("the Megatron backend needs CUDA (megatron-core does not run on CPU)")
        if not dist.is_initialized():
            raise RuntimeError("initialise torch.distributed (NCCL) before building MegatronTrainer")
        self.cfg = cfg
        self.objective = ObjectiveConfig.from_trainer_config(cfg)
        self.layout = ModelLayout.from_hf_config(AutoConfig.from_pretrained(cfg.hf_checkpoint))
        par = cfg.parallel
        par.validate(dist.get_world_size(), num_layers=self.layout.num_layers, num_experts=self.layout.num_experts)
        if cfg.advantage_estimator == "ppo":
            raise ValueError("advantage_estimator 'ppo' (a critic) is available on the torch backend only")
        self.device = torch.device("cuda", torch.cuda.current_device())
        init_model_parallel(par, cfg.seed)
        self.distributed = True
        self.rank, self.world_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.bf16 = cfg.dtype != "float32"
        self.checkpoint_dtype = torch.bfloat16 if self.bf16 else torch.float32
        self.first_stage = ps.is_pipeline_first_stage()
        self.last_stage = ps.is_pipeline_last_stage()
        self.tp_size = ps.get_tensor_model_parallel_world_size()
        # The chunked LM head (fused_head.py) needs the whole vocabulary on one rank: with tensor
        # parallelism the logits stay vocab-parallel and are gathered in full (`_logits`)
        self.chunked_head = cfg.chunked_head and self.tp_size == 1

        replay = cfg.use_rollout_routing_replay and self.layout.is_moe
        self.mconfig = transformer_config(self.layout, par, bf16=self.bf16, replay=replay)
        self.model = self._build(train=True)  # the bare GPTModel (names, routers, export)
        self.ddp = DistributedDataParallel(
            self.mconfig,
            DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                use_distributed_optimizer=par.use_distributed_optimizer,
            ),
            module=self._wrapped,
        )  # fmt: skip
        self.module = self.ddp
        self.mconfig.finalize_model_grads_func = finalize_model_grads
        self.mconfig.no_sync_func = self.ddp.no_sync
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam", lr=cfg.lr, min_lr=0.0, weight_decay=cfg.weight_decay, adam_beta1=cfg.adam_beta1,
                adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps, clip_grad=cfg.clip_grad if cfg.clip_grad > 0 else 0.0,
                bf16=self.bf16, params_dtype=torch.bfloat16 if self.bf16 else torch.float32,
                use_distributed_optimizer=par.use_distributed_optimizer,
            ),
            [self.ddp],
        )  # fmt: skip
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if cfg.lr_warmup_steps else cfg.lr, max_lr=cfg.lr, min_lr=cfg.lr,
            lr_warmup_steps=cfg.lr_warmup_steps, lr_decay_steps=max(cfg.lr_warmup_steps + 1, 1),
            lr_decay_style="constant", start_wd=cfg.weight_decay, end_wd=cfg.weight_decay, wd_incr_steps=1,
            wd_incr_style="constant",
        )  # fmt: skip
        self.policy_routers = self._routers(self.model)

        self.ref_module: nn.Module | None = None
        self.ref_routers: list[TopKRouter] = []
        if cfg.use_kl_loss:
            ref = self._build(train=False)
            self.ref_module = self._wrapped
            self.ref_routers = self._routers(ref)
        # MoE layer index (in the trace) of each global layer
        self.moe_index = {layer: j for j, layer in enumerate(self.layout.moe_layers)}
        self.optimizer_steps = 0
        self._counts: Tensor | None = None  # routing agreement accumulator while recording
        for router in self.policy_routers + self.ref_routers:
            router.register_forward_hook(self._count_routes)
        log.info(
            "trainer_ready", backend="megatron", checkpoint=cfg.hf_checkpoint, rank=dist.get_rank(),
            dp=self.world_size, tp=par.tensor_model_parallel_size, pp=par.pipeline_model_parallel_size,
            ep=par.expert_model_parallel_size, params=sum(p.numel() for p in self.model.parameters()),
            bf16=self.bf16, routing_replay=replay,
        )  # fmt: skip

    # ------------------------------------------------------------------------------------ setup

    def _build(self, train: bool) -> nn.Module:
        """This stage's GPTModel with the checkpoint loaded; leaves the Float16Module in `_wrapped`."""
        model = build_gpt_model(self.layout, self.mconfig, pre_process=self.first_stage, post_process=self.last_stage)
        model.cuda(self.device)
        load_hf_weights(model, self.cfg.hf_checkpoint, self.layout)
        if self.last_stage and not self.cfg.parallel.sequence_parallel:
            model.output_layer = ResponseRowsOutputLayer(model.output_layer, project=not self.chunked_head)
        if self.cfg.torch_compile:
            _compile_layers(model)
        wrapped: nn.Module = Float16Module(self.mconfig, model) if self.bf16 else model
        if not train:
            wrapped.eval().requires_grad_(False)
        self._wrapped = wrapped
        return model

    @staticmethod
    def _routers(model: nn.Module) -> list[TopKRouter]:
        return [m for m in model.modules() if isinstance(m, TopKRouter)]

    def _moe_shape(self) -> tuple[int, int, int] | None:
        if not self.layout.is_moe:
            return None
        return len(self.layout.moe_layers), self.layout.top_k, self.layout.num_experts

    def _model_name(self) -> str:
        return self.layout.family

    def _dp_group(self) -> Any:
        return ps.get_data_parallel_group()

    # ---------------------------------------------------------------------------- micro-batches

    def _micro_batches(self, shard: RolloutBatch) -> list[tuple[MicroBatch, float]]:
        """This DP rank's micro-batches on the device with a weight (0.0: a dummy that only keeps the
        expert-parallel collectives in step), padded to the same count on every DP rank."""
        mbs = list(shard.micro_batches(max_tokens=self.cfg.max_tokens_per_micro_batch, size=self.cfg.micro_batch_size))
        count = torch.tensor([len(mbs)], device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group())
        out = [(self._pad_for_sequence_parallel(mb.to(self.device)), 1.0) for mb in mbs]
        dummy = out[0][0] if out else self._dummy_micro_batch()
        return out + [(dummy, 0.0)] * (int(count.item()) - len(mbs))

    def _dummy_micro_batch(self) -> MicroBatch:
        t = 2 * self.tp_size
        z = torch.zeros(1, dtype=torch.int64, device=self.device)
        zf = torch.zeros(1, dtype=torch.float32, device=self.device)
        replay = None
        if self.layout.is_moe and self.cfg.use_rollout_routing_replay:
            replay = torch.full((1, t, len(self.layout.moe_layers), self.layout.top_k), NO_ROUTE, device=self.device)
        return MicroBatch(
            input_ids=torch.zeros(1, t, dtype=torch.int64, device=self.device),
            position_ids=torch.arange(t, device=self.device)[None], logit_index=z, targets=z, token_sample=z,
            token_index=z, sample_index=z, loss_mask=zf, rollout_logprobs=zf, advantages=zf, replay_ids=replay,
        )  # fmt: skip

    def _pad_for_sequence_parallel(self, mb: MicroBatch) -> MicroBatch:
        """Sequence parallelism splits the sequence over TP ranks: pad T to a multiple of TP."""
        b, t = mb.input_ids.shape
        if not self.cfg.parallel.sequence_parallel or t % self.tp_size == 0:
            return mb
        new_t = (t + self.tp_size - 1) // self.tp_size * self.tp_size
        pad = new_t - t
        rows, cols = mb.logit_index // t, mb.logit_index % t
        replay = mb.replay_ids
        if replay is not None:
            replay = torch.nn.functional.pad(replay, (0, 0, 0, 0, 0, pad), value=NO_ROUTE)
        return dataclasses.replace(
            mb, input_ids=torch.nn.functional.pad(mb.input_ids, (0, pad)),
            position_ids=torch.arange(new_t, device=mb.input_ids.device)[None].expand(b, new_t),
            logit_index=rows * new_t + cols, replay_ids=replay,
        )  # fmt: skip

    # -------------------------------------------------------------------------------------- R3

    def _token_order(self, x: Tensor) -> Tensor:
        """[B, T, ...] -> [tokens, ...] in Megatron's order for this rank: sequence-major, and under
        sequence parallelism only this TP rank's sequence chunk."""
        x = x.transpose(0, 1)
        if self.cfg.parallel.sequence_parallel:
            x = x.chunk(self.tp_size, dim=0)[ps.get_tensor_model_parallel_rank()]
        return x.reshape(-1, *x.shape[2:])

    def _replay_slices(self, mb: MicroBatch, routers: list[TopKRouter]) -> list[Tensor]:
        """Per router of this stage: [tokens, top_k] int64 ids in Megatron's token order for this rank.

        Positions without a trace row (padding, the last token) get experts 0..k-1: they never
        influence a logit that is trained or scored (causal attention, right padding).
        """
        ids = mb.replay_ids.long()  # type: ignore[union-attr]  # [B, T, L, k]
        k = ids.shape[-1]
        missing = (ids == NO_ROUTE).any(dim=-1, keepdim=True)
        ids = torch.where(missing, torch.arange(k, device=ids.device).expand_as(ids), ids)
        flat = self._token_order(ids)
        return [flat[:, self.moe_index[r.layer_number - 1]].contiguous() for r in routers]

    def _logit_rows(self, mb: MicroBatch) -> Tensor:
        """Bool per token (Megatron order): the rows whose logits predict a response token, the only
        ones routing agreement counts (as in the torch backend)."""
        mask = torch.zeros(mb.input_ids.numel(), dtype=torch.bool, device=mb.input_ids.device)
        mask[mb.logit_index] = True
        return self._token_order(mask.view(mb.input_ids.shape))

    @contextlib.contextmanager
    def _routing(self, routers: list[TopKRouter], mb: MicroBatch, replay: bool, record: bool) -> Iterator[None]:
        """Replay `mb`'s traces on `routers` (REPLAY_FORWARD) and/or count agreement with them."""
        has_traces = mb.replay_ids is not None
        slices = self._replay_slices(mb, routers) if has_traces and (replay or record) else [None] * len(routers)
        rows = self._logit_rows(mb) if has_traces and record else None
        for r, ids in zip(routers, slices):
            r._vime_target = (ids, rows) if rows is not None else None  # read by _count_routes
            if replay and ids is not None:
                r.router_replay.set_target_indices(ids)
                r.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        try:
            yield
        finally:
            for r in routers:
                r._vime_target = None

    def _count_routes(self, router: TopKRouter, inputs: Any, output: Any) -> None:
        """Forward hook: add [matches, routes] of the routes this router used (after any replay)."""
        target = getattr(router, "_vime_target", None)
        if target is None or self._counts is None:
            return
        ids, rows = target
        routing_map = output[1]
        want = torch.zeros_like(routing_map).scatter_(1, ids, True)
        agree = (routing_map == want).all(dim=1)[rows]
        self._counts += torch.tensor([float(agree.sum()), float(agree.numel())], dtype=torch.float64)

    def _end_replay(self, routers: list[TopKRouter]) -> None:
        for r in routers:
            if r.router_replay is not None:
                r.router_replay.clear_indices()
                r.router_replay.clear_router_replay_action()

    # ------------------------------------------------------------------------------- forwards

    def _logits(self, output: Tensor, mb: MicroBatch) -> Tensor:
        """Full-vocabulary float logits at `mb.logit_index` from the last stage's output: [1, N, V/tp]
        when the output layer already picked those rows (`ResponseRowsOutputLayer`), else [B, T, V/tp]."""
        if self.tp_size > 1:
            output = gather_from_tensor_model_parallel_region(output)
        output = output[..., : self.layout.vocab_size]
        if isinstance(self.model.output_layer, ResponseRowsOutputLayer):
            return output.flatten(0, 1).float()
        return output.flatten(0, 1).index_select(0, mb.logit_index).float()

    def _token_logprobs(
        self, output: Tensor, mb: MicroBatch, head: nn.Module | None, with_entropy: bool
    ) -> tuple[Tensor, Tensor | None]:
        """Logprobs of `mb.targets` (and the entropy) under softmax(logits / rollout temperature), [N]
        float32. With the chunked head `output` holds the response rows' hidden states (float32 after
        Float16Module) and the head weight is the one the output layer kept; the product runs in the
        weight's dtype, as the output layer's would."""
        temperature = self.cfg.rollout_temperature
        if isinstance(head, ResponseRowsOutputLayer) and not head.project:
            weight = head.weight_used
            assert weight is not None, "the output layer ran without recording its weight"
            hidden = output.flatten(0, 1).to(weight.dtype)
            return head_logprobs_and_entropy(hidden, weight[: self.layout.vocab_size], mb.targets, temperature,
                                             with_entropy=with_entropy)  # fmt: skip
        return losses.token_logprobs_from_logits(self._logits(output, mb), mb.targets, temperature, with_entropy,
                                                 entropy_grad=self.objective.entropy_coef != 0.0)  # fmt: skip

    def _run(
        self, module: nn.Module, routers: list[TopKRouter], items: list[tuple[MicroBatch, float]],
        loss_fn: Any, forward_only: bool, replay: bool, record: bool, with_entropy: bool = False,
    ) -> None:  # fmt: skip
        """Every micro-batch through Megatron's schedule; `loss_fn(mb, weight, logprobs, entropy)` on the
        last stage returns (loss numerator, denominator) as tensors (entropy None without `with_entropy`)."""
        recompute = self.cfg.parallel.recompute_granularity is not None and not forward_only

        def forward_step(data_iterator: Iterator[tuple[MicroBatch, float]], model: nn.Module) -> Any:
            mb, weight = next(data_iterator)
            head = getattr(_bare(model), "output_layer", None)
            if isinstance(head, ResponseRowsOutputLayer):
                head.rows = mb.logit_index
            with self._routing(routers, mb, replay, record and weight > 0):
                output = model(mb.input_ids, mb.position_ids, attention_mask=None)
            if replay and recompute and mb.replay_ids is not None:
                output = _SwitchToReplayBackward.apply(output, [r.router_replay for r in routers])

            def loss_func(out: Tensor) -> tuple[Tensor, Tensor, dict]:
                loss, denom = loss_fn(mb, weight, *self._token_logprobs(out, mb, head, with_entropy))
                return loss, denom, {}

            return output, loss_func

        seq = max(mb.input_ids.shape[1] for mb, _ in items)
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(items), model=module, num_microbatches=len(items),
            seq_length=seq, micro_batch_size=max(mb.input_ids.shape[0] for mb, _ in items), forward_only=forward_only,
        )  # fmt: skip
        self._end_replay(routers)
        head = getattr(_bare(module), "output_layer", None)
        if isinstance(head, ResponseRowsOutputLayer):
            head.rows = None  # plain calls of the model get every position's logits again

    def _pp_broadcast(self, t: Tensor) -> Tensor:
        """Send a tensor filled on the last pipeline stage to every stage."""
        if ps.get_pipeline_model_parallel_world_size() == 1:
            return t
        group = ps.get_pipeline_model_parallel_group()
        src = dist.get_process_group_ranks(group)[-1]
        t = t.to(self.device)
        dist.broadcast(t, src=src, group=group)
        return t.cpu()

    def _model_parallel_sum(self, counts: Tensor) -> Tensor:
        """Routing counts from every stage (its own MoE layers) and, under sequence parallelism, every TP
        rank (its own tokens); without it TP ranks saw the same tokens, so only TP rank 0 counts."""
        if not self.cfg.parallel.sequence_parallel and ps.get_tensor_model_parallel_rank() != 0:
            counts = torch.zeros_like(counts)
        counts = counts.to(self.device)
        dist.all_reduce(counts, group=ps.get_model_parallel_group())
        return counts.cpu()

    @torch.no_grad()
    def _shard_logprobs(
        self, shard: RolloutBatch, module: Any, replay: bool = False, record: bool = False
    ) -> tuple[Tensor, Tensor]:
        out = torch.zeros(shard.rollout_logprobs.numel(), dtype=torch.float32)
        routers = self.policy_routers if module is self.module else self.ref_routers
        self._counts = torch.zeros(2, dtype=torch.float64) if record else None

        def loss_fn(mb: MicroBatch, weight: float, lp: Tensor, _entropy: None) -> tuple[Tensor, Tensor]:
            if weight > 0:
                out[mb.token_index.cpu()] = lp.cpu()
            zero = torch.zeros((), device=self.device)
            return zero, torch.ones((), dtype=torch.int, device=self.device)

        module.eval()
        try:
            self._run(module, routers, self._micro_batches(shard), loss_fn, forward_only=True, replay=replay, record=record)
        finally:
            if module is self.module:
                module.train()
        counts = self._model_parallel_sum(self._counts) if record else torch.zeros(2, dtype=torch.float64)
        self._counts = None
        return self._pp_broadcast(out), counts

    # ------------------------------------------------------------------------------- training

    def _optimizer_step(
        self, shard: RolloutBatch, old_lp: Tensor, ref_lp: Tensor | None, fill_old: bool,
        replay: bool = False, counts: Tensor | None = None,
    ) -> dict[str, float]:  # fmt: skip
        cfg = self.cfg
        per_token = cfg.calculate_per_token_loss
        denom = losses.loss_denominator(shard.loss_mask, shard.num_samples, per_token)
        denom = float(self._all_reduce(torch.tensor([denom], dtype=torch.float64))[0])
        names = self.objective.metric_names
        sums = torch.zeros(len(names), dtype=torch.float64)
        self._counts = torch.zeros(2, dtype=torch.float64) if counts is not None else None

        def loss_fn(mb: MicroBatch, weight: float, lp: Tensor, entropy: Tensor) -> tuple[Tensor, Tensor]:
            nonlocal sums
            index = mb.token_index.cpu()
            old = None if fill_old else old_lp[index].to(self.device)
            ref = ref_lp[index].to(self.device) if ref_lp is not None else None
            loss, mb_sums, lp = micro_batch_objective(lp, entropy, mb, old, ref, self.objective)
            if weight == 0.0:
                return loss * 0.0, torch.zeros((), dtype=torch.int, device=self.device)
            if fill_old:
                old_lp[index] = lp.detach().cpu()
            sums += mb_sums
            mb_denom = losses.loss_denominator(mb.loss_mask, mb.num_samples, per_token)
            return loss, torch.tensor(int(mb_denom), dtype=torch.int, device=self.device)

        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._run(self.module, self.policy_routers, self._micro_batches(shard), loss_fn, forward_only=False,
                  replay=replay, record=counts is not None, with_entropy=True)  # fmt: skip
        lr = float(self.optimizer.param_groups[0]["lr"])
        ok, grad_norm, _ = self.optimizer.step()
        grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
        if ok and math.isfinite(grad_norm):
            self.scheduler.step(increment=1)
            self.optimizer_steps += 1
        else:
            log.warning("skipped_optimizer_step", reason="non-finite grad norm", grad_norm=grad_norm)
        if counts is not None:
            counts += self._model_parallel_sum(self._counts)  # type: ignore[arg-type]
            self._counts = None
        if fill_old:
            old_lp.copy_(self._pp_broadcast(old_lp))
        sums = self._pp_broadcast(self._all_reduce(sums))
        out = {f"train/{n}": float(v) / max(denom, 1.0) for n, v in zip(names, sums.tolist())}
        out["train/grad_norm"] = grad_norm
        out["train/lr"] = lr
        return out

    # -------------------------------------------------------------------------------- weights

    def export_weights(self, dtype: torch.dtype = torch.bfloat16, on_device: bool = False) -> Iterator[tuple[str, Tensor]]:
        """Yield (HF checkpoint name, contiguous CPU tensor, or GPU tensor with `on_device`) on global
        rank 0; every rank must iterate (TP/EP gathers and pipeline hand-offs are collectives)."""
        yield from export_hf_weights(self.model, self.layout, dtype, self.device, on_device)

    def _layout_key(self) -> dict[str, int]:
        return {
            "rank": dist.get_rank(), "world_size": dist.get_world_size(), "dp": self.world_size,
            "tp": self.tp_size, "pp": ps.get_pipeline_model_parallel_world_size(),
            "ep": ps.get_expert_model_parallel_world_size(),
        }  # fmt: skip

    def training_state(self) -> dict[str, Any]:
        """This rank's resume state (every rank has one): its model shards, Megatron's optimizer state
        (fp32 main weights and Adam moments of this rank's shard: the distributed optimizer's
        bucket-space state, no gather), scheduler, step count and the tensor-parallel RNG tracker."""
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        optimizers = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        return {
            "layout": self._layout_key(),
            "model": {k: v for k, v in self.model.state_dict().items() if isinstance(v, Tensor)},
            "optimizer": self.optimizer.state_dict(),
            "param_state": [
                o.get_parameter_state_dp_reshardable() if hasattr(o, "get_parameter_state_dp_reshardable") else None
                for o in optimizers
            ],
            "scheduler": self.scheduler.state_dict(),
            "optimizer_steps": self.optimizer_steps,
            "rng_tracker": get_cuda_rng_tracker().get_states(),
        }

    def load_training_state(self, state: dict[str, Any]) -> None:
        """Restore `training_state` on every rank. ValueError if the parallel layout differs."""
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        if state["layout"] != self._layout_key():
            raise ValueError(f"the checkpoint was saved with layout {state['layout']}, this run is {self._layout_key()}: "
                             "resume with the same TP / PP / EP / DP sizes")  # fmt: skip
        missing, unexpected = self.model.load_state_dict(state["model"], strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise ValueError(f"checkpoint model state does not match: missing {missing[:5]}, unexpected {unexpected[:5]}")
        self.optimizer.load_state_dict(state["optimizer"])
        optimizers = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        for optimizer, param_state in zip(optimizers, state["param_state"]):
            if param_state is not None:
                # megatron-core 0.19.2 reads a `padding` flag its own getter does not write
                for key, by_dtype in param_state.items():
                    if isinstance(key, int):
                        for buckets in by_dtype.values():
                            for bucket in buckets:
                                for entry in bucket:
                                    entry.setdefault("padding", False)
                optimizer.load_parameter_state_from_dp_reshardable(param_state)
            # Without Apex/TE the distributed optimizer's load_state_dict gives every parameter the SAME
            # `step` tensor, which torch's Adam then increments once per parameter per step (measured on
            # the H200: resumed weights 27 % of a step's update off). One tensor each, as a fresh run has.
            inner = getattr(optimizer, "optimizer", None)
            for param_state in getattr(inner, "state", {}).values():
                if isinstance(param_state.get("step"), Tensor):
                    param_state["step"] = param_state["step"].clone()
        self.scheduler.load_state_dict(state["scheduler"])
        self.optimizer_steps = int(state["optimizer_steps"])
        get_cuda_rng_tracker().set_states(state["rng_tracker"])

    def save_hf_checkpoint(self, path: str | os.PathLike, dtype: torch.dtype | None = None) -> None:
        """Write a transformers-loadable checkpoint on global rank 0 (collective); ends with a barrier."""
        from safetensors.torch import save_file
        from transformers import AutoConfig

        dtype = dtype or self.checkpoint_dtype
        start = time.perf_counter()
        state = dict(self.export_weights(dtype))
        if dist.get_rank() == 0:
            path = os.fspath(path)
            os.makedirs(path, exist_ok=True)
            save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
            AutoConfig.from_pretrained(self.cfg.hf_checkpoint).save_pretrained(path)
            _set_config_dtype(path, dtype)
            _copy_side_files(self.cfg.hf_checkpoint, path)
            log.info("saved_hf_checkpoint", path=path, tensors=len(state), seconds=round(time.perf_counter() - start, 2))
        dist.barrier()


def _compile_layers(model: nn.Module) -> None:
    """torch.compile every transformer layer of this stage in place (dynamic sequence lengths): without
    TransformerEngine, Megatron's local layers run their RMSNorms and rotary embeddings as separate
    elementwise kernels, which compilation fuses. Parameters stay where they are, so DDP buffers, the
    optimizer and weight export see the same model."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    for layer in model.modules():
        if isinstance(layer, TransformerLayer):
            layer.compile(dynamic=True)
