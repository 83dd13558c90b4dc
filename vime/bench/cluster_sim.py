"""A discrete-event simulator of a GRPO job at cluster scale, around the real broker logic.

What is real: `vime.broker.state.BrokerState`, driven through its public methods only (register,
add_credit, dispatch, on_generated, dispatch_scoring, on_scored, request_batch, try_fill_batch,
on_step_done, on_weights_published, status, counters) with simulated time as `now`. Admission, the
staleness gate and the earliest-deadline batches are therefore the broker's own, not a model of them.

What is modelled (every constant below says where it comes from; docs/_draft_cluster_sim.md has the
tables):
- Rollout engines: one vLLM engine per `engine_tp` GPUs with continuous batching. All active sequences
  advance one token per decode step; a step takes `overhead + scale * roofline / tp_efficiency`, where
  the roofline is (weights read + KV cache read) / HBM bandwidth + 2 * active params * sequences / peak.
  `overhead` and `scale` are fitted on vLLM 0.26 alone on one H200 (0.6B / 1.7B / 4B Qwen3 shapes,
  256 sequences x (256 + 1024) tokens: 25.1k / 20.5k / 16.6k tokens/s; ../shared/reference/vllm.md),
  residuals within 6 %. Qwen3-30B-A3B is the same formula with its own shape: all attention weights
  plus the experts the step's tokens touch (1 - (1 - 8/128)^B of them), its 96 KiB/token KV cache, and
  tensor parallelism at an assumed 0.8 efficiency. Prefill (one per group: prefix caching) is
  compute-bound at an assumed 40 % MFU. Concurrency is capped by credits, `max_num_seqs` and the KV
  cache that fits beside the weights.
- Response lengths: lognormal, a per-prompt median (hard prompts answer long) times a per-sample
  factor, capped at `max_response_len` (a capped sample is truncated, as vLLM does). The same prompt
  has the same lengths in every run of a seed, so sync and async runs see the same work.
- Reward workers: a fixed seconds per group (fast: never the bottleneck at these settings).
- Trainer: model FLOPs per sample (`vime.bench.flops`' formula: 6 * matmul params * tokens + causal
  attention), samples spread over the data-parallel ranks longest first, at an assumed MFU (default
  15 %: half the Megatron backend's measured 30.7 % on dense 4B with full recompute; its MoE path was
  not measured, transformers' eager MoE reached 7.7 %), losing `train_scaling_loss` per doubling of
  trainer GPUs beyond one node, plus a fixed per-step overhead.
- Weight updates: per GB of bf16 weights, measured on one H200 (docs/benchmarks.md): split layout over
  ZeroMQ chunks, trainer export 1.02 s/GB (4B: 8.22 s for 8.04 GB), engine fetch 0.31 s/GB in the
  background and load 0.20 s/GB with generation paused; colocated over CUDA IPC, publish 0.23 s/GB and
  wake + load 0.076 s/GB (1.7B), falling asleep 0.06 s. Exports shard over up to 8 trainer ranks and
  loads over the engine's TP ranks (assumption).

Sync and async: `colocate=True` puts engines and trainer on the same GPUs with `max_staleness` 0
(they alternate); `rollout_gpus` splits the GPUs into separate pools, synchronous with
`max_staleness` 0 and asynchronous above it.

The simulated samples carry a compressed per-token version array (one entry per weight-version span
of the response, not one per token): the broker reads only its minimum, and full-length arrays would
cost gigabytes at 512 GPUs. Response lengths live in the simulator (`Simulation.lengths`).

Failure modes: `SimConfig.validate` raises ValueError for layouts that cannot run (no trainer GPUs, a
rollout pool that is not a multiple of the engine size, a batch that cannot fit in the engines); a run
that stops making progress (no event left before the last step) raises RuntimeError with the broker's
status, which would be a broker or simulator bug, not a slow configuration.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from vime.bench.flops import H200_BF16_PEAK_FLOPS, matmul_params
from vime.broker.state import BrokerSettings, BrokerState
from vime.data.prompts import Prompt, PromptCursor
from vime.protocol.messages import DispatchGroups, Group, GroupScores, Sample, ScoreGroups, TrainBatch

GB = 1e9

# --- hardware and calibration -------------------------------------------------------------------


@dataclass(frozen=True)
class Hardware:
    """One H200 SXM: NVIDIA's datasheet figures (dense bf16 peak, HBM3e bandwidth, memory)."""

    peak_flops: float = H200_BF16_PEAK_FLOPS
    hbm_bytes_per_s: float = 4.8e12
    memory_bytes: float = 141e9


H200 = Hardware()

# vLLM 0.26.0 alone on one H200, random weights, 256 sequences x (256 prompt + 1024 response) tokens,
# ignore_eos, sampled logprobs (../shared/reference/vllm.md, "vLLM on the H200 GPU machine").
VLLM_H200_TOKENS_PER_S: dict[str, float] = {"0.6b": 25_100.0, "1.7b": 20_500.0, "4b": 16_600.0}
VLLM_CALIBRATION_SEQS = 256
VLLM_CALIBRATION_MEAN_CONTEXT = 256 + 1024 / 2  # tokens in a sequence's KV cache, averaged over its decode

# Weight moves, seconds per GB of bf16 weights, one H200 (docs/benchmarks.md, "vLLM on the H200").
PUBLISH_CHUNKS_S_PER_GB = 8.22 / 8.04  # 4B async: trainer export to host + checksums
FETCH_CHUNKS_S_PER_GB = 0.31  # 4B async: engine fetch over ZeroMQ, in the background
LOAD_PAUSED_S_PER_GB = 0.20  # 4B async: generation paused while the engine loads
PUBLISH_IPC_S_PER_GB = 0.78 / 3.44  # 1.7B colocated: the trainer's export stays on the GPU
WAKE_LOAD_IPC_S_PER_GB = (0.03 + 0.23) / 3.44  # 1.7B colocated: map + load while waking
SLEEP_S = 0.06  # vLLM sleep(level=2), 0.04-0.06 s at 0.6B-4B

# Assumptions (not measured here): named so the report can print them.
TP_EFFICIENCY = 0.8  # tensor-parallel decode: all-reduces per layer at small batches
PREFILL_MFU = 0.4  # prefill is large matmuls, compute-bound
ACTIVATION_RESERVE_BYTES = 4e9  # per GPU, vLLM's activations and CUDA graphs beside the KV cache
EXPORT_SHARDS_MAX = 8  # trainer ranks that export distinct shards in parallel (EP 8)


def _qwen3(hidden: int, layers: int, heads: int, kv_heads: int, inter: int, **moe: int) -> dict[str, Any]:
    return {
        "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": 128, "intermediate_size": inter, "vocab_size": 151_936, **moe,
    }  # fmt: skip


# The shapes of vime.demo.model_factory (QWEN3_SHAPES / QWEN3_MOE_SHAPES), as HF-style configs.
QWEN3_CONFIGS: dict[str, dict[str, Any]] = {
    "0.6b": _qwen3(1024, 28, 16, 8, 3072),
    "1.7b": _qwen3(2048, 28, 16, 8, 6144),
    "4b": _qwen3(2560, 36, 32, 8, 9728),
    "30b-a3b": _qwen3(2048, 48, 32, 4, 6144, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768),
}
# bf16 bytes the weight updates moved (docs/benchmarks.md, the transport table); 30B-A3B from its shape.
MEASURED_WEIGHT_BYTES: dict[str, float] = {"0.6b": 1.19 * GB, "1.7b": 3.44 * GB, "4b": 8.04 * GB}


@dataclass(frozen=True)
class ModelShape:
    """What the cost model needs of a Qwen3 shape: weight bytes, active matmul params, KV bytes/token."""

    name: str
    config: dict[str, Any]

    @property
    def layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def experts(self) -> int:
        return int(self.config.get("num_experts", 0))

    @cached_property
    def active_params(self) -> int:
        """Matmul parameters one token goes through (routed experts only): `vime.bench.flops`."""
        return matmul_params(self.config)

    @cached_property
    def expert_bytes(self) -> float:
        c = self.config
        return 2.0 * self.layers * self.experts * 3 * c["hidden_size"] * c.get("moe_intermediate_size", 0)

    @cached_property
    def weight_bytes(self) -> float:
        if self.name in MEASURED_WEIGHT_BYTES:
            return MEASURED_WEIGHT_BYTES[self.name]
        c = self.config
        h, hd = c["hidden_size"], c["head_dim"]
        attention = h * hd * (c["num_attention_heads"] * 2 + c["num_key_value_heads"] * 2)
        router = h * self.experts
        dense_mlp = 0 if self.experts else 3 * h * c["intermediate_size"]
        embeddings = 2 * c["vocab_size"] * h  # untied input embedding and LM head
        return 2.0 * (self.layers * (attention + router + dense_mlp) + embeddings) + self.expert_bytes

    @cached_property
    def kv_bytes_per_token(self) -> float:
        c = self.config
        return 2.0 * self.layers * c["num_key_value_heads"] * c["head_dim"] * 2  # K and V, bf16

    @property
    def q_dim(self) -> int:
        return int(self.config["num_attention_heads"] * self.config["head_dim"])

    def weight_bytes_read(self, sequences: int) -> float:
        """Weights one decode step reads: all of a dense model; for a MoE the non-expert weights and
        the experts that at least one of `sequences` tokens routes to (uniform routing assumed)."""
        if not self.experts:
            return self.weight_bytes
        k = self.config["num_experts_per_tok"]
        touched = 1.0 - (1.0 - k / self.experts) ** max(sequences, 1)
        return self.weight_bytes - self.expert_bytes + self.expert_bytes * touched

    def train_flops(self, tokens: int) -> float:
        """Model FLOPs of training one sequence: `vime.bench.flops.training_flops_per_token` * tokens."""
        return 6.0 * self.active_params * tokens + 6.0 * self.layers * self.q_dim * tokens * tokens


def shape(name: str) -> ModelShape:
    """The named Qwen3 shape; KeyError naming the known ones otherwise."""
    if name not in QWEN3_CONFIGS:
        raise KeyError(f"unknown model shape {name!r}; known: {', '.join(QWEN3_CONFIGS)}")
    return ModelShape(name, QWEN3_CONFIGS[name])


def _decode_roofline_s(model: ModelShape, sequences: int, context_tokens: float, tp: int, hw: Hardware) -> float:
    weights = model.weight_bytes_read(sequences) / (tp * hw.hbm_bytes_per_s)
    compute = sequences * 2.0 * model.active_params / (tp * hw.peak_flops)
    kv = context_tokens * model.kv_bytes_per_token / (tp * hw.hbm_bytes_per_s)
    return weights + compute + kv


@dataclass(frozen=True)
class DecodeCalibration:
    """step_s = overhead_s + roofline_scale * roofline / tp_efficiency, fitted by least squares."""

    overhead_s: float
    roofline_scale: float
    residuals: dict[str, float]  # predicted / measured - 1, per calibration shape


def calibrate_decode(hw: Hardware = H200) -> DecodeCalibration:
    """Fit the decode step model on the measured vLLM throughputs (one GPU, no tensor parallelism)."""
    rows, times = [], []
    for name, tokens_per_s in VLLM_H200_TOKENS_PER_S.items():
        b = VLLM_CALIBRATION_SEQS
        roof = _decode_roofline_s(shape(name), b, b * VLLM_CALIBRATION_MEAN_CONTEXT, 1, hw)
        rows.append([1.0, roof])
        times.append(b / tokens_per_s)
    (overhead, scale), *_ = np.linalg.lstsq(np.array(rows), np.array(times), rcond=None)
    predicted = np.array(rows) @ np.array([overhead, scale])
    residuals = {n: float(p / t - 1) for n, p, t in zip(VLLM_H200_TOKENS_PER_S, predicted, times)}
    return DecodeCalibration(float(overhead), float(scale), residuals)


@dataclass(frozen=True)
class EngineCosts:
    """The per-engine cost model: decode step time as a function of (sequences, context tokens)."""

    model: ModelShape
    tp: int
    calibration: DecodeCalibration
    hw: Hardware = H200

    @property
    def _tp_eff(self) -> float:
        return 1.0 if self.tp == 1 else TP_EFFICIENCY

    @cached_property
    def _per_context_token_s(self) -> float:
        # The step time's KV term per token of context; hot path, so computed once.
        return self.calibration.roofline_scale * self.model.kv_bytes_per_token / (self.tp * self.hw.hbm_bytes_per_s * self._tp_eff)

    @cached_property
    def _fixed_s(self) -> dict[int, float]:
        return {}

    def _base_s(self, sequences: int) -> float:
        """The step time without the KV term (weights and compute), cached per batch size."""
        cached = self._fixed_s.get(sequences)
        if cached is None:
            roof = _decode_roofline_s(self.model, sequences, 0.0, self.tp, self.hw)
            cached = self.calibration.overhead_s + self.calibration.roofline_scale * roof / self._tp_eff
            self._fixed_s[sequences] = cached
        return cached

    def step_s(self, sequences: int, context_tokens: float) -> float:
        return self._base_s(sequences) + context_tokens * self._per_context_token_s

    def step_growth_s(self, sequences: int) -> float:
        """How much the step time grows per decode step (each active sequence's KV grows by a token)."""
        return sequences * self._per_context_token_s

    def prefill_s(self, tokens: int) -> float:
        return tokens * 2.0 * self.model.active_params / (self.tp * self._tp_eff * self.hw.peak_flops * PREFILL_MFU)

    def kv_capacity_tokens(self, gpu_memory_utilization: float) -> float:
        free = self.tp * (self.hw.memory_bytes * gpu_memory_utilization - ACTIVATION_RESERVE_BYTES) - self.model.weight_bytes
        return max(0.0, free / self.model.kv_bytes_per_token)

    def tokens_per_s(self, sequences: int, context_per_seq: float) -> float:
        return sequences / self.step_s(sequences, sequences * context_per_seq)


# --- the simulated job ----------------------------------------------------------------------------


@dataclass
class SimConfig:
    """One simulated job. `rollout_gpus` None with `colocate=False` is an error (say how to split)."""

    gpus: int = 8
    rollout_gpus: int | None = 4
    colocate: bool = False
    max_staleness: int = 1
    model: str = "30b-a3b"
    engine_tp: int = 4  # the seed recipe's vLLM tensor_parallel_size
    rollout_batch_size: int = 32
    n_samples_per_prompt: int = 8
    prompt_len: int = 512
    max_response_len: int = 8192
    response_median: float = 3000.0
    prompt_sigma: float = 0.5  # spread of the per-prompt median (log scale)
    sample_sigma: float = 0.5  # spread of samples around their prompt's median (log scale)
    engine_groups: int = 64  # credits per engine: groups it generates at once (512 sequences)
    max_num_seqs: int = 1024
    gpu_memory_utilization: float = 0.85
    train_mfu: float = 0.15
    train_scaling_loss: float = 0.05  # per doubling of trainer GPUs beyond 8
    train_overhead_s: float = 2.0  # optimizer step, gradient reduction tail, logging
    min_train_gpus: int = 4  # fp32 master weights + AdamW of 30B: ~490 GB
    weight_update_scale: float = 1.0  # 0: free weight updates (the tests' ideal case)
    reward_s: float = 0.5
    reward_workers: int = 4
    reward_credits: int = 64
    steps_measured: int = 8
    seed: int = 0

    @property
    def trainer_gpus(self) -> int:
        return self.gpus if self.colocate else self.gpus - (self.rollout_gpus or 0)

    @property
    def engine_gpus(self) -> int:
        return self.gpus if self.colocate else (self.rollout_gpus or 0)

    @property
    def engines(self) -> int:
        return self.engine_gpus // self.engine_tp

    @property
    def head_steps(self) -> int:
        """Steps left out before the measured window: the pipeline fills up to its staleness bound."""
        return min(self.max_staleness, 8) + 2

    @property
    def tail_steps(self) -> int:
        """Steps left out after it: admission stops at the last step, so the pipeline drains."""
        return min(self.max_staleness, 8) + 1

    @property
    def num_rollout(self) -> int:
        return self.head_steps + self.steps_measured + self.tail_steps

    def validate(self) -> None:
        """Raise ValueError for a layout that cannot run."""
        if self.colocate and self.max_staleness != 0:
            raise ValueError("colocated engines sleep while the trainer steps: max_staleness must be 0")
        if not self.colocate:
            if self.rollout_gpus is None:
                raise ValueError("a split layout needs rollout_gpus (or colocate=True)")
            if self.trainer_gpus < self.min_train_gpus:
                raise ValueError(f"{self.trainer_gpus} trainer GPUs left; the model needs {self.min_train_gpus}")
        if self.engine_gpus % self.engine_tp or self.engines < 1:
            raise ValueError(f"{self.engine_gpus} rollout GPUs are not a multiple of the engine size {self.engine_tp}")
        if self.max_staleness < 0 or self.steps_measured < 1:
            raise ValueError("max_staleness must be >= 0 and steps_measured >= 1")
        if self.engine_groups * self.n_samples_per_prompt > self.max_num_seqs:
            raise ValueError("engine_groups * n_samples_per_prompt exceeds max_num_seqs")


@dataclass
class SimResult:
    """What a run measured over its steady window (steps head_steps .. head_steps + steps_measured)."""

    config: dict[str, Any]
    step_s: float
    step_times: list[float]
    staleness_mean: float  # over every step's batch
    staleness_max: float
    staleness_mean_per_step: list[float]
    rollout_idle: float  # fraction of the window the engines had nothing to do (mean over engines)
    trainer_idle: float
    gpu_idle: float  # GPU-weighted: rollout and trainer pools (colocated: the same GPUs)
    engine_mean_sequences: float  # active sequences while generating (mean over engines)
    generated_tokens_per_s: float  # in the window, all engines
    response_mean: float
    total_s: float  # the whole run: start to the last step's published weights
    groups_lost: int
    groups_trained_twice: int
    groups_dropped_stale: int
    counters: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


LENGTH_CHUNK = 1024


def response_lengths(cfg: SimConfig, n_prompts: int) -> np.ndarray:
    """Response lengths [prompt, sample]: lognormal around a per-prompt median, capped at the max
    response length. Drawn in chunks of prompts, each from its own stream of (seed, chunk), so prompt
    i's lengths do not depend on how many prompts a run uses: every layout of a seed sees the same work."""
    chunks = []
    for c in range(math.ceil(n_prompts / LENGTH_CHUNK)):
        rng = np.random.default_rng([cfg.seed, c])
        medians = np.log(cfg.response_median) + cfg.prompt_sigma * rng.standard_normal(LENGTH_CHUNK)
        chunks.append(np.exp(medians[:, None] + cfg.sample_sigma * rng.standard_normal((LENGTH_CHUNK, cfg.n_samples_per_prompt))))
    raw = np.concatenate(chunks)[:n_prompts]
    return np.clip(np.rint(raw), 1, cfg.max_response_len).astype(np.int64)


class _Seq:
    __slots__ = ("group_id", "length", "target", "start_p", "versions")

    def __init__(self, group_id: str, length: int, target: float, start_p: float, version: int) -> None:
        self.group_id = group_id
        self.length = length
        self.target = target
        self.start_p = start_p
        self.versions = [version]

    def __lt__(self, other: _Seq) -> bool:  # heap order: the sequence that finishes first
        return self.target < other.target


class _Engine:
    """One rollout worker's engine. Progress `p` counts decode steps since the engine started: every
    active sequence gains one token per step, so a sequence finishes at its start `p` + its length,
    and between events (a sequence joins or ends, a stall) the step time grows linearly with `p`."""

    def __init__(self, sim: Simulation, identity: bytes, costs: EngineCosts, kv_capacity: float) -> None:
        self.sim = sim
        self.identity = identity
        self.costs = costs
        self.kv_capacity = kv_capacity
        self.version = 0
        self.latest_announced = 0
        self.fetching = False
        self.queue: deque[Group] = deque()
        self.active: list[_Seq] = []
        self.remaining: dict[str, int] = {}
        self.seqs_of: dict[str, list[_Seq]] = {}
        self.b = 0
        self.ctx = 0.0
        self.p = 0.0
        self.t = 0.0
        self.stall_until = 0.0
        self.epoch = 0
        # Cumulative accounting, read at the edges of the measured window.
        self.busy_s = 0.0
        self.gen_s = 0.0
        self.seq_s = 0.0  # integral of active sequences over generating time
        self.tokens = 0.0

    def advance(self, now: float) -> None:
        if now <= self.t:
            return
        stalled = max(0.0, min(now, self.stall_until) - self.t)
        start = max(self.t, self.stall_until)
        if self.b > 0 and now > start:
            dt = now - start
            s0 = self.costs.step_s(self.b, self.ctx)
            g = self.costs.step_growth_s(self.b)
            # Steps k covered in dt: dt = s0 k + g k^2 / 2 (the step time grows by g per step).
            k = 2.0 * dt / (s0 + math.sqrt(s0 * s0 + 2.0 * g * dt))
            self.p += k
            self.ctx += self.b * k
            self.tokens += self.b * k
            self.gen_s += dt
            self.seq_s += self.b * dt
            self.busy_s += dt
        self.busy_s += stalled
        self.t = now

    def stall(self, now: float, seconds: float) -> float:
        """Pause generation for `seconds` (prefill, weight load); returns when the pause ends."""
        self.advance(now)
        self.stall_until = max(self.stall_until, now) + seconds
        return self.stall_until

    def receive(self, groups: list[Group], now: float) -> None:
        self.advance(now)
        self.queue.extend(groups)
        self._start(now)
        self._schedule(now)

    def _start(self, now: float) -> None:
        cfg = self.sim.cfg
        prefill = 0
        while self.queue:
            group = self.queue[0]
            n = group.n_samples
            if group.min_weight_version > self.version:
                break  # later groups were dispatched later: none of them may start either
            if self.b + n > cfg.max_num_seqs or (self.b and self.ctx + n * cfg.prompt_len > self.kv_capacity):
                break
            self.queue.popleft()
            lengths = self.sim.lengths_of(group)
            seqs = [_Seq(group.group_id, int(n_tok), self.p + int(n_tok), self.p, self.version) for n_tok in lengths]
            for seq in seqs:
                heapq.heappush(self.active, seq)
            self.seqs_of[group.group_id] = seqs
            self.remaining[group.group_id] = n
            self.b += n
            self.ctx += n * cfg.prompt_len
            prefill += cfg.prompt_len  # the n samples share the prompt's KV (prefix caching)
        if prefill:
            self.stall(now, self.costs.prefill_s(prefill))

    def _schedule(self, now: float) -> None:
        self.epoch += 1
        if not self.active:
            return
        k = max(0.0, self.active[0].target - self.p)
        s0 = self.costs.step_s(self.b, self.ctx)
        g = self.costs.step_growth_s(self.b)
        when = max(now, self.stall_until) + s0 * k + 0.5 * g * k * k
        self.sim.push(when, "engine", (self, self.epoch, self.active[0].target))

    def on_event(self, now: float, epoch: int, target: float) -> list[Group]:
        if epoch != self.epoch:
            return []
        self.advance(now)
        self.p = max(self.p, target)  # float rounding only: the event was computed for this target
        done: list[Group] = []
        while self.active and self.active[0].target <= self.p + 1e-6:
            seq = heapq.heappop(self.active)
            self.b -= 1
            self.ctx -= self.sim.cfg.prompt_len + seq.length
            self.remaining[seq.group_id] -= 1
            if self.remaining[seq.group_id] == 0:
                del self.remaining[seq.group_id]
                done.append(self._finish(seq.group_id))
        if self.b == 0:
            self.ctx = 0.0  # drop the float drift of a long busy period
        self._start(now)
        self._schedule(now)
        return done

    def _finish(self, group_id: str) -> Group:
        group = self.sim.leased[group_id]
        seqs = self.seqs_of.pop(group_id)
        max_len = self.sim.cfg.max_response_len
        samples = []
        for i, seq in enumerate(seqs):
            m = len(seq.versions)
            samples.append(Sample(
                index=i, response_tokens=np.zeros(m, dtype=np.int32), rollout_logprobs=np.zeros(m, dtype=np.float32),
                loss_mask=np.ones(m, dtype=np.uint8), token_versions=np.asarray(seq.versions, dtype=np.int32),
                finish_reason="length" if seq.length >= max_len else "stop",
            ))  # fmt: skip
        group.samples = samples
        return group

    # --- weight updates ---

    def announce(self, version: int, now: float) -> None:
        self.latest_announced = max(self.latest_announced, version)
        if not self.fetching and self.latest_announced > self.version:
            self._fetch(now)

    def _fetch(self, now: float) -> None:
        self.fetching = True
        self.sim.push(now + self.sim.fetch_s, "fetched", (self, self.latest_announced))

    def on_fetched(self, now: float, version: int) -> None:
        end = self.stall(now, self.sim.load_s)
        self._schedule(now)
        self.sim.push(end, "loaded", (self, version))

    def on_loaded(self, now: float, version: int) -> None:
        self.advance(now)
        self.version = version
        for seq in self.active:
            if seq.start_p >= self.p - 1e-9:
                seq.versions = [version]  # no token yet: its first comes from the new weights
            else:
                seq.versions.append(version)
        self.fetching = False
        self._start(now)
        self._schedule(now)
        if self.latest_announced > self.version:
            self._fetch(now)  # versions published while loading: jump to the newest


class Simulation:
    """One run: the broker, the engines, reward workers and the trainer on one event queue."""

    TRAINER = b"trainer-0"

    def __init__(self, cfg: SimConfig, calibration: DecodeCalibration | None = None) -> None:
        cfg.validate()
        self.cfg = cfg
        self.model = shape(cfg.model)
        self.calibration = calibration or calibrate_decode()
        self.costs = EngineCosts(self.model, cfg.engine_tp, self.calibration)
        kv_capacity = self.costs.kv_capacity_tokens(cfg.gpu_memory_utilization)
        if kv_capacity < cfg.n_samples_per_prompt * (cfg.prompt_len + cfg.max_response_len):
            raise ValueError(f"one group does not fit in an engine's KV cache ({kv_capacity:.0f} tokens)")
        self.events: list[tuple[float, int, str, Any]] = []
        self._seq = 0
        self.now = 0.0
        n_prompts = cfg.num_rollout * cfg.rollout_batch_size
        self.lengths = response_lengths(cfg, n_prompts)
        tokens = np.zeros(cfg.prompt_len, dtype=np.int32)  # shared: the broker only carries it
        prompts = [Prompt(i, f"p{i}", tokens, "1") for i in range(n_prompts)]
        settings = BrokerSettings(
            rollout_batch_size=cfg.rollout_batch_size, n_samples_per_prompt=cfg.n_samples_per_prompt,
            max_staleness=cfg.max_staleness, update_weights_interval=1, num_rollout=cfg.num_rollout,
            worker_timeout_s=1e12, sampling={"temperature": 1.0, "top_p": 1.0, "max_tokens": cfg.max_response_len},
        )  # fmt: skip
        self.broker = BrokerState(settings, PromptCursor(prompts, shuffle=False, seed=cfg.seed))
        self.engines: dict[bytes, _Engine] = {}
        for i in range(cfg.engines):
            identity = f"rollout-{i}".encode()
            self.broker.register(identity, f"rollout-{i}", "rollout", now=0.0, weight_version=0)
            self.broker.add_credit(identity, cfg.engine_groups)
            self.engines[identity] = _Engine(self, identity, self.costs, kv_capacity)
        for i in range(cfg.reward_workers):
            identity = f"reward-{i}".encode()
            self.broker.register(identity, f"reward-{i}", "reward", now=0.0)
            self.broker.add_credit(identity, cfg.reward_credits)
        self.broker.register(self.TRAINER, "trainer-0", "trainer", now=0.0)
        self.leased: dict[str, Group] = {}
        # Weight update costs of this layout.
        scale, nbytes = cfg.weight_update_scale, self.model.weight_bytes / GB
        shards = min(cfg.trainer_gpus, EXPORT_SHARDS_MAX)
        if cfg.colocate:
            self.publish_s = scale * nbytes * PUBLISH_IPC_S_PER_GB / shards
            self.fetch_s = 0.0
            self.load_s = scale * nbytes * WAKE_LOAD_IPC_S_PER_GB / cfg.engine_tp
            self.sleep_s = scale * SLEEP_S
        else:
            self.publish_s = scale * nbytes * PUBLISH_CHUNKS_S_PER_GB / shards
            self.fetch_s = scale * nbytes * FETCH_CHUNKS_S_PER_GB
            self.load_s = scale * nbytes * LOAD_PAUSED_S_PER_GB / cfg.engine_tp
            self.sleep_s = 0.0
        # Trainer state.
        self.version = 0
        self.step = 0
        self.waiting = False
        self.step_end: list[float] = []
        self.train_intervals: list[tuple[float, float]] = []
        self.staleness: list[tuple[float, float]] = []
        # Groups the broker accepted as scored minus those batched: an upper bound on its buffer (stale
        # drops only shrink the real one), so a fill is never skipped when it could succeed.
        self.buffered = 0
        self.fill_due = False

    # --- plumbing ---

    def push(self, when: float, kind: str, payload: Any) -> None:
        self._seq += 1  # ties break by insertion order: deterministic
        heapq.heappush(self.events, (when, self._seq, kind, payload))

    def lengths_of(self, group: Group) -> np.ndarray:
        return self.lengths[group.prompt_index]

    def _pump(self) -> None:
        """Let the broker hand out whatever it can now: rollout work, scoring work, the batch."""
        now = self.now
        for identity, msg in self.broker.dispatch():
            assert isinstance(msg, DispatchGroups)
            for group in msg.groups:
                self.leased[group.group_id] = group
            self.engines[identity].receive(msg.groups, now)
        for identity, msg in self.broker.dispatch_scoring():
            assert isinstance(msg, ScoreGroups)
            for sg in msg.groups:
                self.push(now + self.cfg.reward_s, "scored", (identity, sg.group_id, len(sg.samples)))
        if self.waiting and self.buffered >= self.cfg.rollout_batch_size and not self.fill_due:
            # One fill per instant: the broker's fill sorts its whole buffer, and at 2048-group batches
            # calling it after each of a burst of same-time results dominated the simulator's time.
            self.fill_due = True
            self.push(now, "fill", None)

    def _fill(self) -> None:
        self.fill_due = False
        if self.waiting:
            for _, msg in self.broker.try_fill_batch(self.now):
                if isinstance(msg, TrainBatch):
                    self._train(msg)

    # --- trainer ---

    def _request(self) -> None:
        self.waiting = True
        for _, msg in self.broker.request_batch(self.TRAINER, self.step, self.cfg.rollout_batch_size, self.version, self.now):
            if isinstance(msg, TrainBatch):
                self._train(msg)
        self._pump()

    def train_seconds(self, groups: list[Group]) -> float:
        """Seconds of one step: the busiest data-parallel rank's model FLOPs at the assumed MFU."""
        cfg = self.cfg
        flops = sorted((self.model.train_flops(cfg.prompt_len + int(n)) for g in groups for n in self.lengths_of(g)), reverse=True)
        ranks = [0.0] * cfg.trainer_gpus
        for f in flops:  # longest first onto the least loaded rank
            heapq.heapreplace(ranks, ranks[0] + f)
        efficiency = 1.0 / (1.0 + cfg.train_scaling_loss * max(0.0, math.log2(cfg.trainer_gpus / 8)))
        hw = self.costs.hw
        return max(ranks) / (hw.peak_flops * cfg.train_mfu * efficiency) + cfg.train_overhead_s + self.sleep_s

    def _train(self, batch: TrainBatch) -> None:
        self.waiting = False
        self.buffered -= len(batch.groups)
        self.staleness.append((float(batch.stats["staleness_mean"]), float(batch.stats["staleness_max"])))
        end = self.now + self.train_seconds(batch.groups) + self.publish_s
        self.train_intervals.append((self.now, end))
        self.push(end, "published", batch)

    def _on_published(self, batch: TrainBatch) -> None:
        # The step's update is done; publish (already timed into the interval) and ask for the next.
        self.broker.on_step_done(batch.step, [g.group_id for g in batch.groups])
        for g in batch.groups:
            self.leased.pop(g.group_id, None)
        self.version += 1
        self.broker.on_weights_published(self.version, "sim://trainer-0", step=batch.step, now=self.now)
        for engine in self.engines.values():
            engine.announce(self.version, self.now)
        self.step_end.append(self.now)
        self.step += 1
        if self.step < self.cfg.num_rollout:
            self._request()

    # --- the run ---

    def run(self) -> SimResult:
        """Run the job to its last step and measure the steady window."""
        cfg = self.cfg
        self._request()
        window: dict[str, Any] = {}
        first, last = cfg.head_steps - 1, cfg.head_steps - 1 + cfg.steps_measured
        while self.step < cfg.num_rollout:
            if not self.events:
                raise RuntimeError(f"the simulation stalled at step {self.step}: {self.broker.status(self.now)['queues']}")
            when, _, kind, payload = heapq.heappop(self.events)
            self.now = when
            if kind == "engine":
                engine, epoch, target = payload
                done = engine.on_event(when, epoch, target)
                if done:
                    self.broker.on_generated(engine.identity, done)
                    self.broker.add_credit(engine.identity, len(done))
                    self._pump()
            elif kind == "scored":
                identity, group_id, n = payload
                rewards = [1.0 if (i + self._seq) % 2 else -1.0 for i in range(n)]
                scores = [GroupScores(group_id=group_id, rewards=rewards, failed=[False] * n, reasons=[None] * n)]
                self.buffered += len(self.broker.on_scored(identity, scores, now=when))
                self.broker.add_credit(identity, 1)
                self._pump()
            elif kind == "published":
                self._on_published(payload)
                for mark in (first, last):
                    if len(self.step_end) == mark + 1:
                        window[mark] = self._snapshot()
                self._pump()
            elif kind == "fill":
                self._fill()
            elif kind == "fetched":
                engine, version = payload
                engine.on_fetched(when, version)
            elif kind == "loaded":
                engine, version = payload
                engine.on_loaded(when, version)
                self._pump()
        return self._result(window[first], window[last])

    def _snapshot(self) -> dict[str, Any]:
        for engine in self.engines.values():
            engine.advance(self.now)
        engines = list(self.engines.values())
        return {
            "t": self.now,
            "busy": sum(e.busy_s for e in engines),
            "gen": sum(e.gen_s for e in engines),
            "seq": sum(e.seq_s for e in engines),
            "tokens": sum(e.tokens for e in engines),
        }

    def _result(self, a: dict[str, Any], b: dict[str, Any]) -> SimResult:
        cfg = self.cfg
        span = b["t"] - a["t"]
        n_eng = len(self.engines)
        # Clamped: float rounding of the busy sums can land a hair outside [0, 1].
        rollout_busy = min(1.0, max(0.0, (b["busy"] - a["busy"]) / (n_eng * span)))
        train_busy = min(1.0, sum(max(0.0, min(e, b["t"]) - max(s, a["t"])) for s, e in self.train_intervals) / span)
        if cfg.colocate:
            gpu_idle = 1.0 - min(1.0, rollout_busy + train_busy)
        else:
            gpu_idle = (cfg.engine_gpus * (1 - rollout_busy) + cfg.trainer_gpus * (1 - train_busy)) / cfg.gpus
        gen = b["gen"] - a["gen"]
        status = self.broker.status(self.now)
        first = cfg.head_steps - 1
        steps = [self.step_end[i + 1] - self.step_end[i] for i in range(first, first + cfg.steps_measured)]
        counters = self.broker.counters
        return SimResult(
            config=asdict(cfg),
            step_s=span / cfg.steps_measured,
            step_times=steps,
            staleness_mean=float(np.mean([m for m, _ in self.staleness])),
            staleness_max=float(max(x for _, x in self.staleness)),
            staleness_mean_per_step=[m for m, _ in self.staleness],
            rollout_idle=1.0 - rollout_busy,
            trainer_idle=1.0 - train_busy,
            gpu_idle=gpu_idle,
            engine_mean_sequences=(b["seq"] - a["seq"]) / gen if gen > 0 else 0.0,
            generated_tokens_per_s=(b["tokens"] - a["tokens"]) / span,
            response_mean=float(self.lengths.mean()),
            total_s=self.step_end[-1],
            groups_lost=int(status["groups_lost"]),
            groups_trained_twice=int(status["groups_trained_twice"]),
            groups_dropped_stale=int(counters["groups_dropped_stale"]),
            counters=dict(counters),
        )


def simulate(cfg: SimConfig, calibration: DecodeCalibration | None = None) -> SimResult:
    """Run one simulated job (see the module docstring); ValueError for a layout that cannot run."""
    return Simulation(cfg, calibration).run()


# --- sweeps ---------------------------------------------------------------------------------------


def rollout_splits(gpus: int, tp: int, fractions: list[float], min_train: int) -> list[int]:
    """Rollout GPU counts for a split layout: each fraction of `gpus` rounded to whole engines, kept
    where at least one engine and `min_train` trainer GPUs remain; deduplicated, ascending."""
    out = set()
    for f in fractions:
        r = max(tp, int(round(f * gpus / tp)) * tp)
        r = min(r, (gpus - min_train) // tp * tp)
        if r >= tp:
            out.add(r)
    return sorted(out)


def compare(
    base: SimConfig, gpus: int, staleness: list[int], fractions: list[float], calibration: DecodeCalibration,
) -> dict[str, Any]:
    """Sync (colocated; split at staleness 0) against async split at each bound, at one GPU count; for
    split layouts the best of the candidate splits. Returns the runs and the summary row."""

    def run(**kw: Any) -> SimResult:
        cfg = SimConfig(**{**asdict(base), "gpus": gpus, **kw})
        return simulate(cfg, calibration)

    splits = rollout_splits(gpus, base.engine_tp, fractions, base.min_train_gpus)
    colocated = run(colocate=True, rollout_gpus=None, max_staleness=0)
    split_sync = [run(rollout_gpus=r, max_staleness=0) for r in splits]
    best_sync_split = min(split_sync, key=lambda r: r.step_s) if split_sync else None
    asyncs: dict[int, SimResult] = {}
    for s in staleness:
        runs = [run(rollout_gpus=r, max_staleness=s) for r in splits]
        if runs:
            asyncs[s] = min(runs, key=lambda r: r.step_s)
    sync_best = min([colocated] + ([best_sync_split] if best_sync_split else []), key=lambda r: r.step_s)
    row: dict[str, Any] = {
        "gpus": gpus,
        "rollout_batch_size": base.rollout_batch_size,
        "sync_colocated_s": colocated.step_s,
        "sync_colocated_gpu_idle": colocated.gpu_idle,
        "sync_colocated_engine_sequences": colocated.engine_mean_sequences,
        "sync_colocated_staleness_max": colocated.staleness_max,
        "sync_split_s": best_sync_split.step_s if best_sync_split else None,
        "sync_split_rollout_gpus": best_sync_split.config["rollout_gpus"] if best_sync_split else None,
        "sync_best_s": sync_best.step_s,
    }
    for s, r in asyncs.items():
        row[f"async{s}_s"] = r.step_s
        row[f"async{s}_rollout_gpus"] = r.config["rollout_gpus"]
        row[f"async{s}_gain"] = sync_best.step_s / r.step_s
        row[f"async{s}_rollout_idle"] = r.rollout_idle
        row[f"async{s}_trainer_idle"] = r.trainer_idle
        row[f"async{s}_gpu_idle"] = r.gpu_idle
        row[f"async{s}_staleness_mean"] = r.staleness_mean
        row[f"async{s}_staleness_max"] = r.staleness_max
        row[f"async{s}_engine_sequences"] = r.engine_mean_sequences
    if asyncs:
        best = min(asyncs, key=lambda s: asyncs[s].step_s)
        row["async_best_staleness"] = best
        row["async_gain"] = sync_best.step_s / asyncs[best].step_s
    runs = [colocated, *split_sync, *[r for r in asyncs.values()]]
    return {"row": row, "runs": [r.to_dict() for r in runs]}
