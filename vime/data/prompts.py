"""Prompt datasets in slime's format, tokenized once, served by an epoch cursor.

Rows are JSONL or Parquet records such as `{"prompt": [{"role": "user", "content": ...}], "label":
"34", "metadata": {...}}`; `--input-key`, `--label-key` and `--metadata-key` pick the fields and
`--apply-chat-template` formats chat prompts with the tokenizer's template. `demo:arithmetic` generates
the CPU demo's task instead of reading a file. Eval sets (`--eval-prompt-data NAME PATH ...`) are read
the same way. Rows that cannot be used (missing prompt key, empty prompt, no label under `--label-key`
(null counts as none), metadata that is not an object) are errors naming the file and row, found at load
time rather than mid-run. A dataset without labels (a judge reward) says so with `--label-key ''`.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from vime.config import ConfigError, VimeConfig


@dataclass(frozen=True)
class Prompt:
    index: int
    text: str
    tokens: np.ndarray  # int32
    label: str | None
    metadata: dict[str, Any] = field(default_factory=dict)


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Read JSONL (.jsonl/.json lines) or Parquet rows."""
    if not path.is_file():
        raise ConfigError(f"prompt data {path} does not exist")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()  # type: ignore[no-any-return]
    rows = []
    with path.open() as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}:{line_no}: not valid JSON: {exc}") from None
            if not isinstance(row, dict):
                raise ConfigError(f"{path}:{line_no}: each line must be a JSON object")
            rows.append(row)
    return rows


def _prompt_text(row: dict[str, Any], cfg: VimeConfig, tokenizer: Any, where: str) -> str:
    if cfg.input_key not in row:
        raise ConfigError(f"{where}: no key {cfg.input_key!r} (set --input-key); keys are {sorted(row)}")
    value = row[cfg.input_key]
    if isinstance(value, list):
        if not cfg.apply_chat_template:
            raise ConfigError(f"{where}: prompt is a chat message list; pass --apply-chat-template")
        return str(tokenizer.apply_chat_template(value, tokenize=False, add_generation_prompt=True))
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: prompt must be a non-empty string or a list of chat messages")
    if cfg.apply_chat_template:
        messages = [{"role": "user", "content": value}]
        return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    return value


# demo:arithmetic as an eval set: this many problems, drawn with a seed the training set does not
# use, so eval measures held-out problems (a repeat of a training problem is possible but rare:
# 4096 of 810,000 pairs).
DEMO_EVAL_PROMPTS = 128
DEMO_EVAL_SEED_OFFSET = 1_000_003


def _source_rows(source: str, demo_n: int, demo_seed: int) -> list[dict[str, Any]]:
    if source == "demo:arithmetic":
        from vime.demo.arithmetic import make_prompts

        return make_prompts(demo_n, seed=demo_seed)
    if source == "demo:running_sum":
        from vime.demo import running_sum

        return running_sum.make_prompts(demo_n, seed=demo_seed)
    if source.startswith("demo:"):
        raise ConfigError(f"unknown demo dataset {source!r}; known: demo:arithmetic, demo:running_sum")
    return read_rows(Path(source))


def _tokenize_rows(rows: list[dict[str, Any]], source: str, cfg: VimeConfig, tokenizer: Any) -> list[Prompt]:
    if not rows:
        raise ConfigError(f"prompt data {source} has no rows")
    prompts = []
    for i, row in enumerate(rows):
        where = f"{source} row {i}"
        text = _prompt_text(row, cfg, tokenizer, where)
        label = None
        if cfg.label_key:
            label = row.get(cfg.label_key)
            if label is None:
                raise ConfigError(
                    f"{where}: no label under {cfg.label_key!r} (set --label-key, or --label-key '' for a dataset "
                    f"without labels); keys are {sorted(row)}"
                )
        metadata = row.get(cfg.metadata_key) if cfg.metadata_key else None
        if metadata is not None and not isinstance(metadata, dict):
            raise ConfigError(f"{where}: metadata must be an object, got {type(metadata).__name__}")
        token_ids = tokenizer.encode(text, add_special_tokens=False)
        if not token_ids:
            raise ConfigError(f"{where}: prompt tokenizes to nothing")
        prompts.append(
            Prompt(
                index=i,
                text=text,
                tokens=np.asarray(token_ids, dtype=np.int32),
                label=None if label is None else str(label),
                metadata=dict(metadata or {}),
            )
        )
    return prompts


def load_prompts(cfg: VimeConfig, tokenizer: Any) -> list[Prompt]:
    """All prompts of the dataset, tokenized (without special tokens: templates add their own)."""
    rows = _source_rows(cfg.prompt_data, cfg.demo_num_prompts, cfg.seed)
    return _tokenize_rows(rows, cfg.prompt_data, cfg, tokenizer)


def load_eval_prompts(cfg: VimeConfig, tokenizer: Any) -> dict[str, list[Prompt]]:
    """`--eval-prompt-data NAME PATH ...` as {name: prompts}, read like training prompts (same keys and
    chat template); `demo:arithmetic` gives `DEMO_EVAL_PROMPTS` held-out demo problems."""
    eval_seed = cfg.seed + DEMO_EVAL_SEED_OFFSET
    sets = {}
    for name, source in cfg.eval_prompt_data.items():
        try:
            rows = _source_rows(source, DEMO_EVAL_PROMPTS, eval_seed)
        except ConfigError as exc:
            raise ConfigError(f"eval set {name!r}: {exc}") from None
        sets[name] = _tokenize_rows(rows, f"eval set {name!r} ({source})", cfg, tokenizer)
    return sets


class PromptCursor:
    """Walks the prompts epoch by epoch (reshuffled per epoch with a seed) and remembers where it is."""

    def __init__(self, prompts: list[Prompt], *, shuffle: bool, seed: int) -> None:
        self._prompts = prompts
        self._by_index = {p.index: p for p in prompts}
        self._shuffle = shuffle
        self._seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._order_for(0)

    def _order_for(self, epoch: int) -> list[int]:
        order = list(range(len(self._prompts)))
        if self._shuffle:
            random.Random(self._seed * 1_000_003 + epoch).shuffle(order)
        return order

    def __len__(self) -> int:
        return len(self._prompts)

    def prompt(self, index: int) -> Prompt:
        """The prompt with dataset index `index` (Prompt.index)."""
        return self._by_index[index]

    def seek(self, epoch: int, position: int) -> None:
        """Continue from a saved place (the broker's journal): `position` prompts of `epoch` used."""
        if epoch < 0 or not 0 <= position <= len(self._prompts):
            raise ValueError(f"cursor place epoch {epoch} position {position} is outside a dataset of {len(self._prompts)}")
        self.epoch, self.position = epoch, position
        self._order = self._order_for(epoch)

    def fingerprint(self) -> dict[str, Any]:
        """What identifies this prompt stream: a journal written for another stream is refused."""
        digest = hashlib.sha256()
        for prompt in self._prompts:
            digest.update(prompt.text.encode())
            digest.update(b"\0")
        return {"prompts": len(self._prompts), "shuffle": self._shuffle, "seed": self._seed, "sha256": digest.hexdigest()[:16]}

    def next(self) -> tuple[int, Prompt]:
        """The next prompt and its epoch."""
        if self.position >= len(self._order):
            self.epoch += 1
            self.position = 0
            self._order = self._order_for(self.epoch)
        prompt = self._prompts[self._order[self.position]]
        self.position += 1
        return self.epoch, prompt
