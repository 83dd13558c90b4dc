"""Character-level tokenizer for the CPU arithmetic demo.

One token per character, so the tiny demo model sees digits individually (arithmetic is learnable in a
few hundred steps only that way) and token counts equal string lengths. It is a real Hugging Face fast
tokenizer (`tokenizer.json` + `tokenizer_config.json` + `chat_template.jinja`), so the same directory
works for `AutoTokenizer.from_pretrained` in the trainer and for vLLM, which loads the tokenizer from
the model directory.

Choices that matter to callers:
- No special tokens are ever added by `encode`/`__call__` (no BOS, no EOS): prompts tokenize to exactly
  their characters. The model ends answers with `<eos>`; generation stops on `eos_token_id`.
- The chat template emits the message contents and nothing else, so `apply_chat_template` and raw
  prompts give identical token ids; `--apply-chat-template` is a no-op for the demo.
- Characters outside the vocabulary map to `<unk>` rather than failing; decoding concatenates tokens
  without spaces. Reserved filler ids decode to `<reserved_i>` (visible), never to nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
BOS_TOKEN = "<bos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, EOS_TOKEN, BOS_TOKEN, UNK_TOKEN)
# Digits and operators for arithmetic, lowercase letters and a little punctuation so short word
# prompts ("what is 1+2?") still tokenize without <unk>.
CHARACTERS: tuple[str, ...] = tuple("0123456789+-*/=()., ?:\n") + tuple("abcdefghijklmnopqrstuvwxyz")

# Filler entries so the vocabulary is exactly the model's embedding size (64): every id a model can
# sample decodes to visible text. They are ordinary tokens, not special ones, on purpose: a response
# with a stray reserved token must not decode (skip_special_tokens) into a clean, rewardable answer.
# A tokenizer for a model of real size (Qwen3's 151936 embeddings) is the same one with more fillers.
VOCAB_SIZE = 64
_BASE_TOKENS = len(SPECIAL_TOKENS) + len(CHARACTERS)


def reserved_tokens(size: int = VOCAB_SIZE) -> tuple[str, ...]:
    """The filler tokens that bring the vocabulary to `size` entries."""
    if size < _BASE_TOKENS:
        raise ValueError(f"a demo vocabulary needs at least {_BASE_TOKENS} entries, got {size}")
    return tuple(f"<reserved_{i}>" for i in range(size - _BASE_TOKENS))


RESERVED_TOKENS: tuple[str, ...] = reserved_tokens()

PAD_ID = 0
EOS_ID = 1
BOS_ID = 2
UNK_ID = 3

# The chat template is deliberately the identity on message contents (see module docstring).
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def vocab(size: int = VOCAB_SIZE) -> dict[str, int]:
    """Token string -> id; special tokens first so their ids are fixed (pad 0, eos 1, bos 2, unk 3)."""
    return {token: i for i, token in enumerate(id_to_token(size))}


def id_to_token(size: int = VOCAB_SIZE) -> tuple[str, ...]:
    """Token string for each id, in id order (special tokens, characters, reserved fillers)."""
    return SPECIAL_TOKENS + CHARACTERS + (RESERVED_TOKENS if size == VOCAB_SIZE else reserved_tokens(size))


def vocab_size() -> int:
    """Number of tokens the tokenizer knows; equal to the demo models' embedding size."""
    return VOCAB_SIZE


def build_tokenizer_object(size: int = VOCAB_SIZE) -> Tokenizer:
    """The raw `tokenizers.Tokenizer`: WordLevel over single characters, no post-processing."""
    tok = Tokenizer(models.WordLevel(vocab=vocab(size), unk_token=UNK_TOKEN))
    # Every character is its own pre-token; WordLevel then maps it to an id (or <unk>).
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Fuse joins decoded tokens without the spaces WordLevel's default decoding would insert.
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def save_tokenizer(out_dir: str | Path, model_max_length: int = 256, vocab_size: int = VOCAB_SIZE) -> Path:
    """Write the tokenizer files into `out_dir` (created if missing) and return the directory.

    `vocab_size` pads the vocabulary with reserved tokens to a model's embedding size (151936 for Qwen3
    shapes). Loadable afterwards with `AutoTokenizer.from_pretrained(out_dir)`. Raises OSError if the
    directory cannot be written, ValueError for a size below the demo's own tokens.
    """
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer_object(vocab_size),
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        bos_token=BOS_TOKEN,
        unk_token=UNK_TOKEN,
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
        padding_side="left",
    )
    fast.save_pretrained(str(out))
    # transformers 5 records its internal backend class name; the generic fast-tokenizer name loads in
    # transformers 4 and 5 alike (and in vLLM, whatever transformers it runs with).
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config.setdefault("chat_template", CHAT_TEMPLATE)
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    return out


def load_tokenizer(path: str | Path):
    """Load a saved demo tokenizer with `AutoTokenizer` (what the trainer and vLLM do)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
