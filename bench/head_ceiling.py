"""How sharp a model can get when its LM head and final norm are frozen (as under LoRA, issue 19).

Logits are `(head * norm_weight) @ x` for an RMS-normalized hidden state x of norm sqrt(hidden): an
adapter on the decoder layers can only turn x. For each token asked for, this searches the sphere
(gradient ascent from a few random starts) for the direction that gives the token the most probability,
and prints that probability and the entropy left there. A LoRA run's policy cannot beat these numbers.
With `--temperature T` the probabilities are those of sampling at T (softmax of logits / T), as the
rollouts and the trainer's logprobs use them.

    python bench/head_ceiling.py --model runs/demo-model --tokens 0123456789 --eos
    python bench/head_ceiling.py --model runs/demo-model --eos --temperature 0.7
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file


def ceiling(
    weights: torch.Tensor, token: int, temperature: float = 1.0, starts: int = 4, steps: int = 400, seed: int = 0
) -> tuple[float, float]:
    """The most probability `token` can get over unit directions when sampling at `temperature`, and the
    entropy at that direction."""
    hidden = weights.shape[1]
    generator = torch.Generator().manual_seed(seed)
    best = (0.0, 0.0)
    for _ in range(starts):
        u = torch.randn(hidden, generator=generator).requires_grad_(True)
        opt = torch.optim.Adam([u], lr=0.05)
        for _ in range(steps):
            logp = torch.log_softmax(weights @ (u / u.norm() * hidden**0.5) / temperature, 0)
            opt.zero_grad()
            (-logp[token]).backward()
            opt.step()
        with torch.no_grad():
            logp = torch.log_softmax(weights @ (u / u.norm() * hidden**0.5) / temperature, 0)
            p = float(logp[token].exp())
            if p > best[0]:
                best = (p, float(-(logp.exp() * logp).sum()))
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="a checkpoint directory (model.safetensors, tokenizer)")
    parser.add_argument("--tokens", default="0123456789", help="characters whose token ids to check")
    parser.add_argument("--eos", action="store_true", help="check the EOS token too")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    tensors = load_file(str(args.model / "model.safetensors"))
    embed = tensors["model.embed_tokens.weight"].float()
    head = tensors.get("lm_head.weight", embed).float()
    weights = head * tensors["model.norm.weight"].float()
    tokenizer = AutoTokenizer.from_pretrained(str(args.model))
    ids = {text: tokenizer.convert_tokens_to_ids(text) for text in args.tokens}
    if args.eos:
        ids["<eos>"] = tokenizer.eos_token_id
    for text, token in ids.items():
        p, entropy = ceiling(weights, int(token), args.temperature)
        print(json.dumps({"token": text, "id": int(token), "max_probability": round(p, 4), "entropy_there": round(entropy, 3)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
