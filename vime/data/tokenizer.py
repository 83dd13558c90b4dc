"""The tokenizer the broker encodes prompts with, loaded without torch where transformers allows it.

`AutoTokenizer` imports transformers' model machinery and with it torch (~300 MiB of memory in a
process that never runs a model). A local checkpoint whose `tokenizer_config.json` names the generic
fast tokenizer, with its `tokenizer.json` beside it, gets that class directly: the class AutoTokenizer
would build for it. Every other checkpoint (a model-specific class such as Qwen2Tokenizer, a hub id)
goes through AutoTokenizer, so its encoding never depends on this shortcut.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# The names transformers gives its generic fast tokenizer (v5 calls the class TokenizersBackend).
GENERIC_TOKENIZER_CLASSES = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})


def tokenizer_class_name(path: str | Path) -> str | None:
    """The `tokenizer_class` of a local checkpoint's tokenizer_config.json; None if it has none."""
    try:
        name = json.loads((Path(path) / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None
    return name if isinstance(name, str) else None


def load_tokenizer(path: str | Path) -> Any:
    """The checkpoint's tokenizer; transformers' own errors for a missing or broken one."""
    if tokenizer_class_name(path) in GENERIC_TOKENIZER_CLASSES and (Path(path) / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
