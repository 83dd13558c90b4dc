"""Megatron-core's decoder with and without TransformerEngine: one forward + backward at a Qwen3 shape.

vime's Megatron backend builds megatron-core's local layer specs by default and its TransformerEngine
specs with `--transformer-impl transformer_engine` (docs/megatron.md). This bench builds the same
random-init decoder twice on one GPU through the backend's own `decoder_spec`, once per `--specs` entry
(local: local layers, SDPA attention, megatron-core's fused SwiGLU; transformer_engine: TE's fused norm
+ linear layers and its fused attention), and times forward + backward of `--micro-batch` x `--seq-len`
tokens through the decoder layers alone (no embedding, head or optimizer: those are the same in both;
the loss is the mean square of the last hidden states). One JSON line per spec: median step seconds,
tokens/s, decoder MFU against `--peak-tflops` (6 x decoder matmul parameters x tokens plus causal
attention), peak GPU memory; then the ratio. A spec that cannot be built (TransformerEngine missing or
failing to load) prints its error line and the other still runs.

    python bench/megatron_te.py --size 1.7b --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from vime.bench.flops import H200_BF16_PEAK_FLOPS  # noqa: E402
from vime.demo.model_factory import QWEN3_SHAPES  # noqa: E402


def qwen3_layout(size: str, num_layers: int | None) -> Any:
    """The ModelLayout of a dense Qwen3 size (`QWEN3_SHAPES`), optionally with fewer layers."""
    from transformers import Qwen3Config

    from vime.trainer.megatron.hf_mapping import ModelLayout

    hidden, layers, heads, kv_heads, inter, tied = QWEN3_SHAPES[size]
    config = Qwen3Config(vocab_size=151936, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=num_layers or layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=128, tie_word_embeddings=tied,
                         architectures=["Qwen3ForCausalLM"])  # fmt: skip
    return ModelLayout.from_hf_config(config)


def decoder_flops_per_token(layout: Any, seq_len: int) -> float:
    """Training FLOPs per token of the decoder layers: 6 x matmul parameters, plus causal attention
    (forward QK^T and PV over half the sequence on average, x3 for the backward)."""
    q = layout.num_attention_heads * layout.head_dim
    kv = layout.num_key_value_heads * layout.head_dim
    per_layer = layout.hidden_size * (q + 2 * kv) + q * layout.hidden_size + 3 * layout.hidden_size * layout.intermediate_size
    attention = 2 * 2 * q * (seq_len / 2)
    return layout.num_layers * (6 * per_layer + 3 * attention)


def build_decoder(layout: Any, spec: str) -> torch.nn.Module:
    """The decoder of `layout` (GPTModel without embedding or head) from the backend's `decoder_spec` for
    `--transformer-impl spec`: "local" or "transformer_engine" (TransformerEngineMissing without TE)."""
    from megatron.core.models.gpt import GPTModel

    from vime.trainer.megatron.model import decoder_spec, padded_vocab_size, transformer_config
    from vime.trainer.megatron.parallel import MegatronParallelConfig

    config = transformer_config(layout, MegatronParallelConfig(transformer_impl=spec))
    block = decoder_spec(config)
    model = GPTModel(
        config=config, transformer_layer_spec=block, vocab_size=padded_vocab_size(layout, 1),
        max_sequence_length=layout.max_position_embeddings, pre_process=False, post_process=False,
        position_embedding_type="rope", rotary_base=int(layout.rope_theta),
    )  # fmt: skip
    return model.cuda()


def measure(layout: Any, spec: str, args: argparse.Namespace) -> dict[str, Any]:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = build_decoder(layout, spec)
    s, b, h = args.seq_len, args.micro_batch, layout.hidden_size
    hidden = torch.randn(s, b, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    position_ids = torch.arange(s, device="cuda").expand(b, s)
    model.set_input_tensor(hidden)
    times = []
    for _ in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model(None, position_ids, attention_mask=None)
        out.float().square().mean().backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
        hidden.grad = None
    step = statistics.median(times[args.warmup :])
    tokens = s * b
    flops = tokens * decoder_flops_per_token(layout, s)
    row = {"spec": spec, "layers": layout.num_layers, "tokens": tokens, "step_s": step, "tokens_per_s": tokens / step,
           "mfu": flops / step / (args.peak_tflops * 1e12), "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
           "first_step_s": times[0]}  # fmt: skip
    del model, out
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1.7b", help=f"a dense Qwen3 shape: {', '.join(QWEN3_SHAPES)}")
    parser.add_argument("--layers", type=int, default=None, help="replace the size's layer count")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--specs", default="local,transformer_engine")
    parser.add_argument("--peak-tflops", type=float, default=H200_BF16_PEAK_FLOPS / 1e12)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    from vime.bench.megatron_check import _setup

    _setup()
    layout = qwen3_layout(args.size, args.layers)
    rows = {}
    for spec in args.specs.split(","):
        try:
            row = measure(layout, spec, args)
        except Exception as exc:  # a spec that cannot be built or run is reported, the other still runs
            row = {"spec": spec, "error": f"{type(exc).__name__}: {exc}"[:2000]}
        rows[spec] = row
        print(json.dumps({"size": args.size, **row}) if args.json else row, flush=True)
    if all("step_s" in rows.get(s, {}) for s in ("local", "transformer_engine")):
        ratio = rows["local"]["step_s"] / rows["transformer_engine"]["step_s"]
        print(json.dumps({"size": args.size, "transformer_engine_speedup": ratio}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
