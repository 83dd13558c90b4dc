"""Plain-PyTorch policy trainer on Hugging Face models: GRPO/PPO steps, weight export, HF checkpoints.

One `TorchTrainer` per trainer rank. Data parallelism is DDP over whatever default process group is
initialised (gloo on CPU, NCCL on GPU), or FSDP2 (`fully_shard`, one unit per decoder layer) with
`use_fsdp`. Master weights stay float32; on CUDA the forward runs in bfloat16 (autocast for DDP, a
mixed-precision policy for FSDP2), and on the CPU too with `--train-dtype bfloat16` (attention then in
float32: `vime.trainer.fp32_attention`).

A rollout step (`train_step`) follows slime:
1. GRPO advantages on the whole batch (group statistics need every sample of a group);
2. split into optimizer steps of `global_batch_size` samples, each split across ranks by token count;
3. old-policy logprobs with no grad (or, when there is a single optimizer step, the detached logprobs of
   the training forward itself: the policy has not moved yet so they are the same numbers) and
   reference logprobs when a KL loss is used;
4. per micro-batch: loss = pg_loss - entropy_coef * entropy + kl_loss_coef * kl, scaled so that the
   gradient equals that of one big batch over all micro-batches and ranks; clip; AdamW step.

R3 (rollout routing replay), for MoE policies whose batch carries the rollout's routing traces
(`SampleRecord.routed_experts`): with `use_rollout_routing_replay`, every forward of the policy (old
logprobs, training, `compute_logprobs`) and of the KL reference model runs inside
`vime.r3.hf_router.RoutingReplay` with the micro-batch's `replay_ids`, so the trainer uses the experts the
rollout engine used. The reference is replayed too so that the KL term compares policy and reference
along the same expert path as the importance ratio (the gradient then only measures weight drift, not
routing flips). Whether replay is on or off, a batch with traces also yields two metrics, each the
fraction of (token, MoE layer) routes whose top-k expert set equals the rollout's, recorded with
`RoutingRecorder` in a forward of the pre-update policy:
- `train/routing_agreement`: the routes the trainer actually used. It is recorded inside the forward
  that supplies the old logprobs (the no-grad old-logprob pass, or with a single optimizer step the
  training forward itself), after `RoutingReplay` has replaced the router's choice, so with replay on
  it measures (not assumes) that the replay took effect: 1.0 unless a route fell back to the model's
  own choice. Free: no extra forward.
- `train/routing_agreement_unreplayed`: the routes the trainer would pick on its own, from an
  unreplayed forward. With replay off this is the same forward (and the same number); with replay on
  it costs one extra no-grad unreplayed forward per micro-batch.
Only the rows that predict response tokens count (positions P-1 .. P+R-2: the last prompt token and
every response token but the last); the fractions are over all ranks and optimizer steps.

Every rank runs the same number of forwards per phase (short ranks run a zero-weighted dummy forward),
because DDP's gradient all-reduce and FSDP2's parameter all-gathers are collectives.

LoRA (`lora_rank`, `vime.trainer.lora`): the policy gets a peft adapter in place and only the adapter
trains (gradients, AdamW state, the resumable state); the KL reference is the same model with the
adapter off (no second model). `export_weights` and `save_hf_checkpoint` give the merged weights under
the base model's names, so everything downstream of them works unchanged; `export_adapter` gives the
adapter alone, as a peft adapter directory holds it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import itertools
import math
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any, Iterator, Literal

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from vime.config import check_shared_prompt_settings
from vime.logging import get_logger
from vime.r3.hf_router import RoutingRecorder, RoutingReplay, find_routers
from vime.r3.trace import routing_agreement
from vime.trainer import losses
from vime.trainer import estimators, fp32_attention, varlen_attention
from vime.trainer.base import PolicyTrainer
from vime.trainer.critic import Critic
from vime.trainer.decoder_layers import decoder_layers
from vime.trainer.batch import MicroBatch, RolloutBatch, SampleRecord, _ranges
from vime.trainer.fused_head import head_logprobs_and_entropy
from vime.trainer.lora import AdapterExport, AdapterOffView, LoraAdapter, LoraSettings, apply_lora, merged_named_tensors
from vime.trainer.objective import ObjectiveConfig, micro_batch_objective
from vime.trainer.optim import OptimizerImplementation, adamw
from vime.trainer.varlen_attention import attention_kwargs

log = get_logger(__name__)


@dataclass
class TorchTrainerConfig:
    """Trainer settings; names follow slime's flags (`--eps-clip` -> `eps_clip`, ...)."""

    hf_checkpoint: str
    lr: float = 1e-6
    lr_warmup_steps: int = 0  # linear warmup over this many optimizer steps, then constant
    weight_decay: float = 0.01  # not applied to biases and norm weights (1-D parameters)
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  # <= 0 disables clipping (the norm is still reported)
    eps_clip: float = 0.2
    eps_clip_high: float | None = None  # None: symmetric clip
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "k1"
    entropy_coef: float = 0.0
    use_tis: bool = False
    tis_level: str = "token"  # token | sequence (see vime/trainer/corrections.py)
    tis_clip: float = 2.0
    tis_clip_low: float = 0.0
    use_mis: bool = False  # mask tokens (or sequences) whose old/rollout ratio is outside [mis_low, mis_high]
    mis_level: str = "token"
    mis_low: float = 0.5
    mis_high: float = 2.0
    use_decoupled_ppo: bool = False  # AReaL: weight by the behaviour ratio, mask it above the cap
    behav_imp_weight_cap: float = 5.0
    advantage_estimator: str = "grpo"  # grpo | gspo | ppo | reinforce_plus_plus | reinforce_plus_plus_baseline
    normalize_advantages: bool = False  # whiten advantages over the batch's loss-masked tokens
    gamma: float = 1.0  # discount (REINFORCE++ returns, GAE)
    lambd: float = 1.0  # GAE lambda
    # PPO critic: a value head on a copy of the policy's backbone (or critic_hf_checkpoint)
    critic_hf_checkpoint: str | None = None
    critic_lr: float = 1e-5
    value_clip: float | None = 0.2
    disable_grpo_std_normalization: bool = False  # Dr.GRPO
    calculate_per_token_loss: bool = False  # token mean instead of per-sample mean then sample mean
    rollout_temperature: float = 1.0  # the engine sampled from softmax(logits / T); logprobs must match
    micro_batch_size: int | None = None  # samples per micro-batch
    max_tokens_per_micro_batch: int | None = None  # padded tokens (rows * longest row) per micro-batch
    global_batch_size: int | None = None  # samples per optimizer step; None: the whole rollout batch
    num_steps_per_rollout: int | None = None  # alternative to global_batch_size
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # compute dtype; auto = bf16 on CUDA, fp32 on CPU
    device: Literal["auto", "cpu", "cuda"] = "auto"
    seed: int = 1234
    use_fsdp: bool = False
    gradient_checkpointing: bool = False
    # AdamW's kernels (optim.py): auto = fused (one kernel, no temporaries), foreach under FSDP2
    optimizer_implementation: OptimizerImplementation = "auto"
    # torch.compile each decoder layer (its norms, rotary and SwiGLU become fused kernels)
    torch_compile: bool = False
    attn_implementation: str = "sdpa"
    # Samples end to end in one row with variable-length attention, no padding (varlen_attention.py);
    # auto: on for CUDA (flash varlen kernel), off on CPU (a per-sample attention loop). Off by default:
    # on the H200 it matched padded micro-batches' speed, not beat them (docs/benchmarks.md)
    pack_sequences: Literal["auto", "on", "off"] = "off"
    # A group's samples share one copy of their prompt per micro-batch row, under a tree attention mask
    # (shared_prompts.py): the prompt is computed once per group instead of once per sample
    share_prompts: bool = False
    # Logprobs and entropy through the chunked LM head (fused_head.py); False: full [tokens, vocab]
    # float32 logits, the path before it (for comparisons)
    chunked_head: bool = True
    # R3: run policy and reference forwards with the rollout's experts when the batch carries traces
    use_rollout_routing_replay: bool = False
    # LoRA (peft's names, vime/trainer/lora.py): None or 0 trains every weight
    lora_rank: int | None = None
    lora_alpha: float = 32.0
    lora_dropout: float = 0.0
    target_modules: str | list[str] = "all-linear"  # comma list of module names, or all-linear

    @classmethod
    def from_vime_config(cls, cfg: Any, **extra: Any) -> TorchTrainerConfig:
        """The settings a job's `VimeConfig` gives this trainer: every field whose name is also a field
        of the job's config (the flag names are the same), paths as strings, plus `extra`. The job's
        `max_tokens_per_gpu` (slime's name) is this trainer's `max_tokens_per_micro_batch` and then
        replaces `micro_batch_size`."""
        shared = {f.name for f in dataclasses.fields(cls)} & set(type(cfg).model_fields)
        values = {name: getattr(cfg, name) for name in shared}
        values = {name: os.fspath(v) if isinstance(v, os.PathLike) else v for name, v in values.items()}
        if getattr(cfg, "max_tokens_per_gpu", None) is not None:
            values.update(max_tokens_per_micro_batch=cfg.max_tokens_per_gpu, micro_batch_size=None)
        if getattr(cfg, "train_dtype", None) is not None:
            values["dtype"] = cfg.train_dtype
        return cls(**values, **extra)

    def __post_init__(self) -> None:
        from vime.trainer.corrections import CorrectionConfig
        from vime.trainer.estimators import ADVANTAGE_ESTIMATORS

        if self.advantage_estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage_estimator {self.advantage_estimator!r}: expected one of {ADVANTAGE_ESTIMATORS}")
        CorrectionConfig(tis_level=self.tis_level, mis_level=self.mis_level, mis_low=self.mis_low, mis_high=self.mis_high)
        if self.kl_loss_type not in losses.KL_LOSS_TYPES:
            raise ValueError(f"kl_loss_type must be one of {losses.KL_LOSS_TYPES}, got {self.kl_loss_type!r}")
        if self.global_batch_size is not None and self.num_steps_per_rollout is not None:
            raise ValueError("set global_batch_size or num_steps_per_rollout, not both")
        for name in ("micro_batch_size", "max_tokens_per_micro_batch", "global_batch_size", "num_steps_per_rollout"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.rollout_temperature <= 0:
            raise ValueError("rollout_temperature must be positive")
        check_shared_prompt_settings(self.share_prompts, self.pack_sequences, self.use_rollout_routing_replay)
        if self.lora_settings() is not None and self.advantage_estimator == "ppo":
            raise ValueError(LORA_PPO_ERROR)

    def lora_settings(self) -> LoraSettings | None:
        """The LoRA adapter these settings ask for, or None (full fine-tuning). Raises ValueError for
        bad LoRA values."""
        if not self.lora_rank:
            return None
        return LoraSettings(rank=self.lora_rank, alpha=self.lora_alpha, dropout=self.lora_dropout,
                            target_modules=self.target_modules)  # fmt: skip


LORA_PPO_ERROR = ("lora_rank with advantage_estimator 'ppo' is not supported: PPO's critic is a second full "
                  "model trained with full AdamW state, which defeats LoRA's memory saving; use a critic-free "
                  "estimator (grpo, gspo, reinforce_plus_plus[_baseline]) or full fine-tuning")  # fmt: skip


class _ResponseLogprobs(nn.Module):
    """Runs the decoder and turns the hidden states at the positions that predict response tokens into
    those tokens' logprobs and entropies (float32, [N] each).

    Prompt and padding positions never reach the LM head, and the head's full-vocabulary logits are
    never held for more than a chunk of tokens (`fused_head.py`). Being one module, it is what DDP/FSDP
    wrap, so their hooks see every parameter, the head's included.
    """

    def __init__(self, hf_model: nn.Module, chunked: bool = True, entropy_grad: bool = True) -> None:
        super().__init__()
        self.hf = hf_model
        self.chunked = chunked
        self.entropy_grad = entropy_grad  # False: a loss that does not train the entropy (entropy_coef 0)

    def forward(
        self, input_ids: Tensor, position_ids: Tensor, logit_index: Tensor, targets: Tensor, temperature: float,
        with_entropy: bool = True, cu_seqlens: Tensor | None = None, max_seqlen: int = 0,
        attention_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        out = self.hf.get_decoder()(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                                    **attention_kwargs(cu_seqlens, max_seqlen, attention_mask))  # fmt: skip
        hidden = out.last_hidden_state.flatten(0, 1).index_select(0, logit_index)
        head = self.hf.get_output_embeddings()
        if self.chunked and getattr(head, "bias", None) is None:  # no Qwen3/Llama/GLM head has a bias
            return head_logprobs_and_entropy(hidden, head.weight, targets, temperature, with_entropy=with_entropy)
        return losses.token_logprobs_from_logits(head(hidden), targets, temperature, with_entropy, self.entropy_grad)


class TorchTrainer(PolicyTrainer):
    """Policy (and optional frozen reference) on this rank, with its optimizer. See module docstring.

    Construct after `torch.distributed.init_process_group` on every rank (or without it for one rank).
    Raises ValueError for bad settings and whatever `from_pretrained` raises for a bad checkpoint.
    """

    def __init__(self, cfg: TorchTrainerConfig) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        self.cfg = cfg
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.device = _resolve_device(cfg.device)
        if cfg.dtype == "auto":
            # bf16 on the CPU shortens the train step but not the CPU demo's step: docs/benchmarks.md
            self.compute_dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        else:
            self.compute_dtype = getattr(torch, cfg.dtype)
        self.use_fsdp = cfg.use_fsdp and self.distributed
        if cfg.use_fsdp and not self.distributed:
            log.warning("fsdp_without_process_group", note="torch.distributed not initialised; training unsharded")
        torch.manual_seed(cfg.seed)
        self.objective = ObjectiveConfig.from_trainer_config(cfg)

        self.checkpoint_dtype = AutoConfig.from_pretrained(cfg.hf_checkpoint).dtype or torch.float32
        if isinstance(self.checkpoint_dtype, str):
            self.checkpoint_dtype = getattr(torch, self.checkpoint_dtype)
        self.pack_sequences = cfg.pack_sequences == "on" or (
            cfg.pack_sequences == "auto" and self.device.type == "cuda" and not cfg.share_prompts
        )
        attn_implementation = varlen_attention.register() if self.pack_sequences else cfg.attn_implementation
        if attn_implementation == "sdpa" and self.device.type == "cpu" and self.compute_dtype == torch.bfloat16:
            attn_implementation = fp32_attention.register()  # the CPU's bf16 attention backward is the slow part
        load = dict(attn_implementation=attn_implementation)
        self.hf_model = AutoModelForCausalLM.from_pretrained(cfg.hf_checkpoint, dtype=torch.float32, **load)
        self.hf_model.config.use_cache = False
        if cfg.gradient_checkpointing:
            self.hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.hf_model.to(self.device).train()
        # LoRA layers go in before compiling, so the compiled decoder layers include them
        lora = cfg.lora_settings()
        self.lora: LoraAdapter | None = None
        if lora is not None:
            self.lora = apply_lora(self.hf_model, lora, decoder_layers(self.hf_model))
        if cfg.torch_compile:
            _compile_layers(self.hf_model)
        self.module = _ResponseLogprobs(self.hf_model, cfg.chunked_head, entropy_grad=cfg.entropy_coef != 0.0)

        self.ref_module: nn.Module | AdapterOffView | None = None
        if cfg.use_kl_loss and self.lora is not None:
            # the frozen base is the policy with its adapter off: no second model in memory
            self.ref_module = AdapterOffView(self.module, self.lora)
        elif cfg.use_kl_loss:
            ref = AutoModelForCausalLM.from_pretrained(cfg.hf_checkpoint, dtype=self.compute_dtype, **load)
            ref.config.use_cache = False
            ref.to(self.device).eval().requires_grad_(False)
            self.ref_module = _ResponseLogprobs(ref, cfg.chunked_head, entropy_grad=False)
        # MoE routers (empty for dense models), found before FSDP wraps anything; used by R3
        self._routers = {id(self.module): find_routers(self.hf_model)}
        if isinstance(self.ref_module, AdapterOffView):
            self._routers[id(self.ref_module)] = self._routers[id(self.module)]
        elif self.ref_module is not None:
            self._routers[id(self.ref_module)] = find_routers(self.ref_module.hf)

        self.policy: nn.Module = self.module
        if self.use_fsdp:
            self._shard_fsdp()
        elif self.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            # buffers (rotary tables) are deterministic: broadcasting them every forward is wasted work
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            self.policy = DDP(self.module, device_ids=device_ids, broadcast_buffers=False)

        decay = [p for p in self.module.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in self.module.parameters() if p.requires_grad and p.dim() < 2]
        self.optimizer = adamw(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
            implementation=cfg.optimizer_implementation, sharded=self.use_fsdp,
        )  # fmt: skip
        warmup = cfg.lr_warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0
        )
        self.optimizer_steps = 0
        self.critic: Critic | None = None
        if cfg.advantage_estimator == "ppo":
            self.critic = Critic(
                cfg.critic_hf_checkpoint or cfg.hf_checkpoint, lr=cfg.critic_lr, weight_decay=cfg.weight_decay,
                device=self.device, world_size=self.world_size, autocast=self._autocast,
                attn_implementation=attn_implementation, optimizer_implementation=cfg.optimizer_implementation,
            )  # fmt: skip
        if cfg.torch_compile and self.world_size == 1:
            self._warm_up_compiled_layers()
        log.info(
            "trainer_ready", checkpoint=cfg.hf_checkpoint, rank=self.rank, world_size=self.world_size,
            device=str(self.device), compute_dtype=str(self.compute_dtype), fsdp=self.use_fsdp,
            params=sum(p.numel() for p in self.module.parameters()),
            trainable_params=sum(p.numel() for p in self.module.parameters() if p.requires_grad),
        )  # fmt: skip

    # ------------------------------------------------------------------------------------ setup

    def _shard_fsdp(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # explicit mesh: the default one picks CUDA whenever it exists, even for a CPU/gloo trainer
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        kwargs: dict[str, Any] = {"mesh": mesh}
        if self.compute_dtype != torch.float32:
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
        for wrapper, extra in ((self.module, kwargs), (self.ref_module, {"mesh": mesh})):
            if wrapper is None or isinstance(wrapper, AdapterOffView):  # the view shares the policy's shards
                continue
            for layer in decoder_layers(wrapper.hf):
                fully_shard(layer, **extra)
            fully_shard(wrapper, **extra)

    def _autocast(self) -> contextlib.AbstractContextManager:
        # FSDP2 casts parameters itself through its mixed-precision policy
        if self.compute_dtype == torch.float32 or self.use_fsdp:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype)

    # ------------------------------------------------------------------------------- forwards

    def _warm_up_compiled_layers(self) -> None:
        """Compile the decoder layers (forward and backward) before the first batch arrives, while the
        rollout engines start, instead of inside the first step: one forward and backward of a small
        random batch in the job's micro-batch layout. Gradients are dropped; weights, optimizer and the
        global random state are untouched. One rank only: on several, a stray backward would join DDP's
        or FSDP's collectives."""
        started = time.perf_counter()
        rng = np.random.default_rng(0)
        vocab = int(self.hf_model.config.vocab_size)
        records = []
        for group in range(2):  # sizes >= 2 everywhere: torch.compile specialises dimensions of size 1
            prompt = rng.integers(1, vocab, 4)
            for _ in range(2):
                records.append(SampleRecord(group_index=group, prompt_tokens=prompt, response_tokens=rng.integers(1, vocab, 3),
                                            rollout_logprobs=np.zeros(3), loss_mask=np.ones(3), reward=0.0))  # fmt: skip
        batch = RolloutBatch.from_samples(records)
        batch.advantages = torch.zeros(batch.rollout_logprobs.numel())
        mb = self._synced_micro_batches(batch)[0]
        assert mb is not None
        logprobs, entropy = self._logprobs(self.module, mb.to(self.device))
        (logprobs.sum() + (entropy.sum() if entropy is not None else 0.0)).backward()
        self.module.zero_grad(set_to_none=True)
        log.info("compiled_layers_warmed_up", seconds=round(time.perf_counter() - started, 2))

    def _synced_micro_batches(self, shard: RolloutBatch) -> list[MicroBatch | None]:
        """This rank's micro-batches, padded with None so every rank has the same count."""
        mbs: list[MicroBatch | None] = list(
            shard.micro_batches(max_tokens=self.cfg.max_tokens_per_micro_batch, size=self.cfg.micro_batch_size,
                                packed=self.pack_sequences, shared_prompts=self.cfg.share_prompts)  # fmt: skip
        )
        count = len(mbs)
        if self.distributed:
            t = torch.tensor([count], dtype=torch.int64, device=self._comm_device())
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            count = int(t.item())
        return mbs + [None] * (count - len(mbs))

    def _dummy_forward(self, module: nn.Module) -> Tensor:
        """A two-token forward whose logprob joins the collectives of ranks with a micro-batch more."""
        ids = torch.zeros(1, 2, dtype=torch.int64, device=self.device)
        positions = torch.arange(2, device=self.device)[None]
        zero = torch.zeros(1, dtype=torch.int64, device=self.device)
        with self._autocast():
            return module(ids, positions, zero, zero, self.cfg.rollout_temperature, False)[0]

    def _routing_replay(self, module: nn.Module, mb: MicroBatch) -> contextlib.AbstractContextManager[object]:
        """R3 replay of `mb.replay_ids` on `module`'s routers (a no-op context without traces)."""
        if mb.replay_ids is None:
            return contextlib.nullcontext()
        bare = self.module if module is self.policy else module  # hooks go on the model DDP wraps
        return RoutingReplay(_hf(bare), mb.replay_ids, routers=self._routers[id(bare)])

    def _logprobs(
        self, module: nn.Module, mb: MicroBatch, replay: bool = False, counts: Tensor | None = None,
        with_entropy: bool = True,
    ) -> tuple[Tensor, Tensor | None]:
        """Logprobs and entropies (None without `with_entropy`) of `mb`'s response tokens; with
        `replay`, routed with `mb.replay_ids` (R3). With `counts`, the routes the forward used (after any
        replay) are recorded and their agreement with the rollout's, [matches, routes], is added to
        `counts` in place."""
        bare = self.module if module is self.policy else module  # hooks go on the model DDP wraps
        with contextlib.ExitStack() as stack:
            if replay:
                stack.enter_context(self._routing_replay(module, mb))
            # entered after the replay so its hook runs second and sees the replayed ids
            recorder = None
            if counts is not None:
                recorder = stack.enter_context(RoutingRecorder(_hf(bare), routers=self._routers[id(bare)]))
            with self._autocast():
                head = module(mb.input_ids, mb.position_ids, mb.logit_index, mb.targets, self.cfg.rollout_temperature,
                              with_entropy, mb.cu_seqlens, mb.max_seqlen, mb.attention_mask)  # fmt: skip
            if recorder is not None:
                counts += self._routing_counts(mb, recorder.expert_ids())
        return head

    def _moe_shape(self) -> tuple[int, int, int] | None:
        routers = self._routers[id(self.module)]
        if not routers:
            return None
        return len(routers), int(routers[0][1].top_k), int(routers[0][1].num_experts)

    def _model_name(self) -> str:
        return type(self.hf_model).__name__

    # -------------------------------------------------------------------------------- PPO critic

    def _ppo_advantages(self, batch: RolloutBatch) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """GAE advantages from the critic's values of the whole batch (each rank computes its share);
        also returns (returns, values) for the critic's update."""
        assert self.critic is not None
        idx = batch.shard_indices(self.world_size)[self.rank]
        shard = batch.select(idx)
        values = torch.zeros(batch.rollout_logprobs.numel(), dtype=torch.float32)
        positions = _ranges(batch.resp_offsets[torch.tensor(idx, dtype=torch.int64)], shard.response_lengths)
        values[positions] = self.critic.values(self._synced_micro_batches(shard), shard.rollout_logprobs.numel())
        if self.distributed:
            values = self._all_reduce(values)
        rewards = estimators.token_rewards(batch.rewards, batch.response_lengths)
        advantages, returns = estimators.gae(rewards, values, batch.response_lengths, self.cfg.gamma, self.cfg.lambd)
        return advantages, (returns, values)

    def _critic_update(self, batch: RolloutBatch, shards: list[RolloutBatch], targets: tuple[Tensor, Tensor]) -> dict[str, float]:
        """One critic optimizer step per policy optimizer step, on the same shards."""
        assert self.critic is not None
        returns, values = targets
        where = {int(s): i for i, s in enumerate(batch.sample_ids.tolist())}
        per_token = self.cfg.calculate_per_token_loss
        sums, denoms = torch.zeros(2, dtype=torch.float64), 0.0
        for shard in shards:
            rows = torch.tensor([where[int(s)] for s in shard.sample_ids.tolist()], dtype=torch.int64)
            pos = _ranges(batch.resp_offsets[rows], shard.response_lengths)
            denom = losses.loss_denominator(shard.loss_mask, shard.num_samples, per_token)
            if self.distributed:
                denom = float(self._all_reduce(torch.tensor([denom], dtype=torch.float64))[0])
            sums += self.critic.step(
                shard, self._synced_micro_batches(shard), returns[pos], values[pos], self.cfg.value_clip,
                scale=self.world_size / max(denom, 1.0), per_token=per_token, clip_grad=self.cfg.clip_grad,
            )  # fmt: skip
            denoms += max(denom, 1.0)
        if self.distributed:
            sums = self._all_reduce(sums)
        mask = batch.loss_mask > 0
        return {
            "critic/value_loss": float(sums[0]) / denoms, "critic/value_clipfrac": float(sums[1]) / denoms,
            "critic/values_mean": float(values[mask].mean()) if mask.any() else 0.0,
            "critic/returns_mean": float(returns[mask].mean()) if mask.any() else 0.0,
        }  # fmt: skip

    def _routing_counts(self, mb: MicroBatch, ids: Tensor) -> Tensor:
        """[matches, routes] of the recorded routing `ids` [B, T, L, k] vs the rollout's, at logit rows."""
        rows = mb.input_ids.numel()
        mask = torch.zeros(rows, dtype=torch.bool)
        mask[mb.logit_index.cpu()] = True
        total = int(mask.sum()) * ids.shape[2]
        if total == 0:
            return torch.zeros(2, dtype=torch.float64)
        rollout = mb.replay_ids.cpu().reshape(rows, *ids.shape[2:]).numpy()  # type: ignore[union-attr]
        agree = routing_agreement(ids.reshape(rows, *ids.shape[2:]).numpy(), rollout, mask.numpy())
        return torch.tensor([round(agree * total), total], dtype=torch.float64)

    @torch.no_grad()
    def _shard_logprobs(
        self, shard: RolloutBatch, module: nn.Module, replay: bool = False, record: bool = False
    ) -> tuple[Tensor, Tensor]:
        """No-grad logprobs of every response token of `shard` (flat, shard order), and the routing
        agreement counts [matches, routes] (zeros unless `record`).

        `replay` routes with the rollout's traces; `record` records the routes the forward used (after
        any replay) and compares them to the traces. Pass the bare module, not the DDP wrapper: DDP only
        matters when gradients flow, and FSDP2's hooks live on the module.
        """
        out = torch.zeros(shard.rollout_logprobs.numel(), dtype=torch.float32)
        counts = torch.zeros(2, dtype=torch.float64)
        with self.lora.dropout_off() if self.lora is not None else contextlib.nullcontext():
            for mb in self._synced_micro_batches(shard):
                if mb is None:
                    self._dummy_forward(module)
                    continue
                mb = mb.to(self.device)
                lp, _ = self._logprobs(module, mb, replay=replay, counts=counts if record else None, with_entropy=False)
                out[mb.token_index.cpu()] = lp.cpu()
        return out, counts

    def _optimizer_step(
        self,
        shard: RolloutBatch,
        old_lp: Tensor,
        ref_lp: Tensor | None,
        fill_old: bool,
        replay: bool = False,
        counts: Tensor | None = None,
    ) -> dict[str, float]:
        """One optimizer step over `shard`. With `counts`, the routing agreement [matches, routes] of
        the training forwards is added to it (see `_logprobs`)."""
        cfg = self.cfg
        per_token = cfg.calculate_per_token_loss
        denom = losses.loss_denominator(shard.loss_mask, shard.num_samples, per_token)
        denom = float(self._all_reduce(torch.tensor([denom], dtype=torch.float64))[0]) if self.distributed else denom
        # DDP and FSDP2 average gradients over ranks; multiplying by world_size turns that into a sum
        scale = self.world_size / max(denom, 1.0)
        names = self.objective.metric_names
        sums = torch.zeros(len(names), dtype=torch.float64)

        mbs = self._synced_micro_batches(shard)
        for j, mb in enumerate(mbs):
            with self._grad_sync(last=j == len(mbs) - 1):
                if mb is None:
                    (self._dummy_forward(self.policy).sum() * 0.0).backward()
                    continue
                mb = mb.to(self.device)
                token_index = mb.token_index.cpu()
                # The replay stays on through backward: with activation checkpointing the routers run again
                # in the recompute and must pick the same experts as in the forward.
                with self._routing_replay(self.policy, mb) if replay else contextlib.nullcontext():
                    lp, entropy = self._logprobs(self.policy, mb, counts=counts)
                    old = None if fill_old else old_lp[token_index].to(self.device)
                    ref = ref_lp[token_index].to(self.device) if ref_lp is not None else None
                    loss, mb_sums, lp = micro_batch_objective(lp, entropy, mb, old, ref, self.objective)
                    if fill_old:
                        old_lp[token_index] = lp.detach().cpu()
                    (loss * scale).backward()
                sums += mb_sums

        grad_norm = self._clip_grads()
        lr = float(self.optimizer.param_groups[0]["lr"])  # the rate this step uses, before the schedule moves
        if math.isfinite(grad_norm):
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer_steps += 1
        else:
            log.warning("skipped_optimizer_step", reason="non-finite grad norm", grad_norm=grad_norm)
        self.optimizer.zero_grad(set_to_none=True)

        if self.distributed:
            sums = self._all_reduce(sums)
        out = {f"train/{n}": float(v) / max(denom, 1.0) for n, v in zip(names, sums.tolist())}
        out["train/grad_norm"] = grad_norm
        out["train/lr"] = lr
        return out

    def _grad_sync(self, last: bool) -> contextlib.AbstractContextManager:
        """Gradients are reduced across ranks only on an optimizer step's last micro-batch."""
        if self.use_fsdp:
            self.module.set_requires_gradient_sync(last)  # type: ignore[operator]
            return contextlib.nullcontext()
        if self.policy is not self.module and not last:
            return self.policy.no_sync()  # type: ignore[operator]
        return contextlib.nullcontext()

    def _clip_grads(self) -> float:
        params = [p for p in self.module.parameters() if p.grad is not None]
        max_norm = self.cfg.clip_grad if self.cfg.clip_grad > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return float(norm)

    # -------------------------------------------------------------------------------- weights

    def _full_tensors(self, dtype: torch.dtype | None, on_device: bool = False) -> Iterator[tuple[str, Tensor]]:
        """(model parameter name, full CPU tensor) on rank 0; FSDP2 shards are gathered on every rank.

        Tied parameters appear once (named_parameters de-duplicates), under the name registered first
        (`model.embed_tokens.weight`), which is how HF checkpoints store them.
        With LoRA the adapted weights come merged (W + B @ A * scale) under the base model's names.
        """
        named: Iterator[tuple[str, Tensor]]
        if self.lora is not None:
            named = merged_named_tensors(self.lora, _full)
        else:
            named = ((name, _full(p)) for name, p in self.hf_model.named_parameters())
        buffers = (
            (f"{module_name}.{buffer_name}" if module_name else buffer_name, _full(buffer))
            for module_name, module in self.hf_model.named_modules()
            for buffer_name, buffer in module.named_buffers(recurse=False)
            if buffer_name not in module._non_persistent_buffers_set  # e.g. rotary tables are not saved
        )
        for name, tensor in itertools.chain(named, buffers):
            if self.rank != 0:
                continue
            if dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(dtype)
            yield name, (tensor if on_device else tensor.to("cpu")).contiguous()

    def export_weights(self, dtype: torch.dtype = torch.bfloat16, on_device: bool = False) -> Iterator[tuple[str, Tensor]]:
        """Yield (HF checkpoint name, contiguous CPU tensor) for every weight, on rank 0; with
        `on_device` the tensors stay on the trainer's device (for a publisher that shares them there).

        Names and shapes are those of the checkpoint files (e.g. Qwen3-MoE experts as
        `model.layers.0.mlp.experts.3.gate_proj.weight`, undoing transformers' in-memory fusing), which
        is what vLLM's `load_weights` expects. With tied embeddings `lm_head.weight` is not yielded;
        vLLM skips it for tied models anyway. Other ranks must iterate too (FSDP2 gathers are collective)
        and get nothing. With LoRA: the merged weights (`export_adapter` gives the adapter alone).
        """
        from transformers.core_model_loading import revert_weight_conversion

        for name, tensor in self._full_tensors(dtype, on_device):
            # one tensor at a time keeps peak memory at one parameter; the supported families' reverse
            # conversions are all one-to-many (split fused experts), so this is exact
            for ckpt_name, ckpt_tensor in revert_weight_conversion(self.hf_model, {name: tensor}).items():
                yield ckpt_name, ckpt_tensor.contiguous()

    def export_adapter(self, dtype: torch.dtype | None = None) -> AdapterExport | None:
        """The LoRA adapter alone, on rank 0 (None on other ranks, which must call it too: FSDP2 gathers
        are collective): tensors named and shaped as peft's `adapter_model.safetensors` holds them, and
        the `adapter_config.json` dict; `.write(dir)` makes a directory peft and vLLM load. `dtype=None`
        keeps the float32 master weights (what peft's `save_pretrained` of this model writes). Raises
        ValueError when the trainer has no adapter (no `lora_rank`)."""
        if self.lora is None:
            raise ValueError("export_adapter needs a LoRA adapter: this trainer trains full weights (no lora_rank)")
        tensors = self.lora.adapter_state_dict(_full, dtype)
        if self.rank != 0:
            return None
        return AdapterExport(tensors, self.lora.config_dict())

    def save_adapter(self, path: str | os.PathLike) -> None:
        """Write the adapter (float32) as a peft adapter directory on rank 0; collective under FSDP2,
        ends with a barrier when distributed. Raises ValueError without a LoRA adapter."""
        export = self.export_adapter()
        if export is not None:
            export.write(path)
            log.info("saved_lora_adapter", path=os.fspath(path), tensors=len(export.tensors), bytes=export.nbytes)
        self._barrier()

    def _barrier(self) -> None:
        if self.distributed:
            dist.barrier(device_ids=[self.device.index] if dist.get_backend() == "nccl" else None)

    def save_hf_checkpoint(self, path: str | os.PathLike, dtype: torch.dtype | None = None) -> None:
        """Write a transformers-loadable checkpoint (safetensors + config + tokenizer files) on rank 0;
        with LoRA, the adapter merged into the base weights (a plain model, no peft needed to load it).

        `dtype=None` keeps the dtype of the checkpoint the trainer started from. Collective under FSDP2;
        ends with a barrier when distributed so no rank reads a half-written directory.
        """
        dtype = dtype or self.checkpoint_dtype
        state = dict(self._full_tensors(dtype))
        if self.rank == 0:
            path = os.fspath(path)
            os.makedirs(path, exist_ok=True)
            self.hf_model.save_pretrained(path, state_dict=state, safe_serialization=True)
            _set_config_dtype(path, dtype)
            _copy_side_files(self.cfg.hf_checkpoint, path)
            log.info("saved_hf_checkpoint", path=path, dtype=str(dtype), tensors=len(state), lora_merged=self.lora is not None)
        self._barrier()

    def training_state(self) -> dict[str, Any] | None:
        """Everything `--load` needs besides the RNG (vime.trainer.checkpoint): full fp32 weights and
        optimizer state (gathered under FSDP2: collective), scheduler, step counts; None on ranks > 0.
        With LoRA the weights are the adapter's alone (the base comes from `hf_checkpoint` again) and
        `lora` holds its adapter config, checked on load."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        # frozen parameters are the base model: not state to resume, and never gathered
        model_options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=self.lora is not None)
        state: dict[str, Any] = {
            "model": get_model_state_dict(self.module, options=model_options),
            "optimizer": get_optimizer_state_dict(self.module, self.optimizer, options=options),
            "scheduler": self.scheduler.state_dict(),
            "optimizer_steps": self.optimizer_steps,
        }
        if self.lora is not None:
            # ignore_frozen_params still lets a tied frozen weight through under its second name (lm_head)
            trainable = {name for name, p in self.module.named_parameters() if p.requires_grad}
            state["model"] = {k: v for k, v in state["model"].items() if k in trainable}
            state["lora"] = self.lora.config_dict()
        if self.critic is not None:
            state["critic_model"] = get_model_state_dict(self.critic.module, options=options)
            state["critic_optimizer"] = get_optimizer_state_dict(self.critic.module, self.critic.optimizer, options=options)
        return state if self.rank == 0 else None

    def load_training_state(self, state: dict[str, Any]) -> None:
        """Every rank: restore what `training_state` saved (each rank reads the full file). Raises
        ValueError for a checkpoint of the other kind (LoRA vs full weights) or of another adapter shape."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True)
        self._check_lora_state(state)
        # LoRA: the state holds the adapter only; the base weights stay as loaded from hf_checkpoint
        model_options = StateDictOptions(full_state_dict=True, strict=self.lora is None)
        set_model_state_dict(self.module, state["model"], options=model_options)
        set_optimizer_state_dict(self.module, self.optimizer, state["optimizer"], options=options)
        self.scheduler.load_state_dict(state["scheduler"])
        self.optimizer_steps = int(state["optimizer_steps"])
        if self.critic is not None:
            if "critic_model" not in state:
                raise ValueError("the checkpoint has no critic (it was not saved by a PPO run)")
            set_model_state_dict(self.critic.module, state["critic_model"], options=options)
            set_optimizer_state_dict(self.critic.module, self.critic.optimizer, state["critic_optimizer"], options=options)


    def _check_lora_state(self, state: dict[str, Any]) -> None:
        saved = state.get("lora")
        if self.lora is None:
            if saved is not None:
                raise ValueError("the checkpoint holds a LoRA adapter (saved with --lora-rank "
                                 f"{saved.get('r')}); resume it with the same --lora-rank")  # fmt: skip
            return
        if saved is None:
            raise ValueError("the checkpoint holds full weights (saved without --lora-rank); it cannot resume a "
                             "LoRA run (start one from its HF weights with --hf-checkpoint instead)")  # fmt: skip
        mine = self.lora.config_dict()
        differ = [k for k in ("r", "lora_alpha", "target_modules") if saved.get(k) != mine.get(k)]
        if differ:
            raise ValueError("the checkpoint's LoRA adapter differs from this run's in "
                             + ", ".join(f"{k} (saved {saved.get(k)!r}, now {mine.get(k)!r})" for k in differ))
        wanted = {name for name, p in self.module.named_parameters() if p.requires_grad}
        if set(state["model"]) != wanted:
            missing, extra = sorted(wanted - set(state["model"])), sorted(set(state["model"]) - wanted)
            raise ValueError(f"the checkpoint's adapter tensors do not match: missing {missing[:3]}, unexpected {extra[:3]}")


# ---------------------------------------------------------------------------------------- helpers


def _full(tensor: Tensor) -> Tensor:
    """A parameter's or buffer's whole tensor, detached: FSDP2 shards are gathered (a collective)."""
    tensor = tensor.detach()
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _resolve_device(device: str) -> torch.device:
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("device='cuda' requested but CUDA is not available")
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is not None:
        torch.cuda.set_device(int(local_rank))
    return torch.device("cuda", torch.cuda.current_device())


def _compile_layers(hf_model: nn.Module) -> None:
    """torch.compile every decoder layer in place: the modules and their parameters stay as they are, so
    DDP, FSDP2, weight export and checkpoints see the same model. Identical layers share one compiled
    graph, and sequence lengths are dynamic, so a new micro-batch shape does not compile again."""
    for layer in decoder_layers(hf_model):
        layer.compile(dynamic=True)


def _hf(module: nn.Module) -> nn.Module:
    """The transformers model inside a `_ResponseLogprobs` or a LoRA reference view (hooks attach to its
    routers)."""
    return module.hf if isinstance(module, (_ResponseLogprobs, AdapterOffView)) else module


def _set_config_dtype(path: str, dtype: torch.dtype) -> None:
    # save_pretrained records the in-memory (float32 master) dtype; the files hold `dtype`
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config: dict[str, Any] = json.load(f)
    config["dtype"] = str(dtype).removeprefix("torch.")
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def _copy_side_files(src: str, dst: str) -> None:
    """Copy tokenizer, chat template and other non-weight files of the source checkpoint."""
    if not os.path.isdir(src):
        log.warning("tokenizer_not_copied", source=src, reason="hf_checkpoint is not a local directory")
        return
    skip_suffixes = (".safetensors", ".bin", ".pt", ".pth", ".index.json")
    for name in os.listdir(src):
        full = os.path.join(src, name)
        if not os.path.isfile(full) or name.endswith(skip_suffixes) or name == "config.json":
            continue
        if not os.path.exists(os.path.join(dst, name)):
            shutil.copy2(full, os.path.join(dst, name))
