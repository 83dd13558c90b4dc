"""The broker's tokenizer: the generic fast tokenizer loads without torch and encodes exactly as
AutoTokenizer's; any other tokenizer class still goes through AutoTokenizer."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vime.data.tokenizer import load_tokenizer, tokenizer_class_name

from conftest import run_env


def test_the_broker_tokenizes_the_demo_prompts_without_torch(demo_model: Path) -> None:
    code = (
        "import json, sys\n"
        "from vime.config import load_config\n"
        "from vime.workers.broker import build_state\n"
        f"cfg = load_config(None, {{'hf_checkpoint': {str(demo_model)!r}, 'prompt_data': 'demo:arithmetic'}})\n"
        "state = build_state(cfg)\n"
        "print(json.dumps({'torch': 'torch' in sys.modules, 'prompts': len(state.admission.cursor)}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=run_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["prompts"] > 0 and result["torch"] is False


def test_the_generic_tokenizer_encodes_as_autotokenizer_does(demo_model: Path) -> None:
    from transformers import AutoTokenizer

    ours, auto = load_tokenizer(demo_model), AutoTokenizer.from_pretrained(str(demo_model))
    assert tokenizer_class_name(demo_model) == "PreTrainedTokenizerFast" and type(ours) is type(auto)
    texts = ["123+456=", "9+9= <eos>", "  7 + 8 =\n"]
    assert [ours(t)["input_ids"] for t in texts] == [auto(t)["input_ids"] for t in texts]
    chat = [{"role": "user", "content": "1+2="}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == auto.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    )
    assert (ours.eos_token_id, ours.pad_token_id, ours.padding_side) == (auto.eos_token_id, auto.pad_token_id, auto.padding_side)


def test_a_model_specific_tokenizer_class_goes_through_autotokenizer(
    demo_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers

    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_model / name, checkpoint / name)
    config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    (checkpoint / "tokenizer_config.json").write_text(json.dumps(dict(config, tokenizer_class="Qwen2Tokenizer")))
    asked: list[str] = []
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda path, *a, **k: asked.append(path) or "auto")
    assert load_tokenizer(checkpoint) == "auto" and asked == [str(checkpoint)]
    assert load_tokenizer(tmp_path / "no-such-checkpoint") == "auto"  # a hub id or a missing folder: transformers decides
