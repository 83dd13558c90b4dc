"""Prompt sources: slime-format JSONL and Parquet, key selection, chat templates, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from vime.config import ConfigError, load_config
from vime.data.prompts import PromptCursor, load_prompts
from vime.demo.arithmetic import write_jsonl
from vime.demo.tokenizer import load_tokenizer, save_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    return load_tokenizer(save_tokenizer(tmp_path_factory.mktemp("tok")))


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_rows_with_custom_keys(tmp_path: Path, tokenizer) -> None:
    data = write_rows(tmp_path / "d.jsonl", [{"question": "12+3=", "answer": "15", "info": {"id": 7}}, {"question": "1+1=", "answer": 2}])
    cfg = load_config(None, {"prompt_data": str(data), "input_key": "question", "label_key": "answer", "metadata_key": "info"})
    prompts = load_prompts(cfg, tokenizer)
    assert [p.text for p in prompts] == ["12+3=", "1+1="]
    assert [p.label for p in prompts] == ["15", "2"]
    assert prompts[0].metadata == {"id": 7} and prompts[1].metadata == {}
    assert prompts[0].tokens.dtype.name == "int32"
    assert tokenizer.decode(prompts[0].tokens.tolist()) == "12+3="


def test_parquet_rows(tmp_path: Path, tokenizer) -> None:
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["2+2=", "3+4="], "label": ["4", "7"]}), path)
    prompts = load_prompts(load_config(None, {"prompt_data": str(path)}), tokenizer)
    assert [(p.text, p.label) for p in prompts] == [("2+2=", "4"), ("3+4=", "7")]


def test_chat_messages_need_and_use_the_chat_template(tmp_path: Path, tokenizer) -> None:
    data = write_rows(tmp_path / "chat.jsonl", [{"prompt": [{"role": "user", "content": "5+5="}], "label": "10"}])
    with pytest.raises(ConfigError, match="--apply-chat-template"):
        load_prompts(load_config(None, {"prompt_data": str(data)}), tokenizer)
    prompts = load_prompts(load_config(None, {"prompt_data": str(data), "apply_chat_template": True}), tokenizer)
    expected = tokenizer.apply_chat_template([{"role": "user", "content": "5+5="}], tokenize=False, add_generation_prompt=True)
    assert prompts[0].text == expected


def test_bad_rows_are_reported_with_file_and_row(tmp_path: Path, tokenizer) -> None:
    data = write_rows(tmp_path / "d.jsonl", [{"prompt": "1+1=", "label": "2"}, {"text": "oops"}])
    with pytest.raises(ConfigError, match=r"row 1: no key 'prompt'"):
        load_prompts(load_config(None, {"prompt_data": str(data)}), tokenizer)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "1+1=", "label": "2"}\n{not json\n')
    with pytest.raises(ConfigError, match=r"broken.jsonl:2: not valid JSON"):
        load_prompts(load_config(None, {"prompt_data": str(broken)}), tokenizer)
    with pytest.raises(ConfigError, match="does not exist"):
        load_prompts(load_config(None, {"prompt_data": str(tmp_path / "missing.jsonl")}), tokenizer)
    with pytest.raises(ConfigError, match="unknown demo dataset"):
        load_prompts(load_config(None, {"prompt_data": "demo:chess"}), tokenizer)


def test_demo_task_and_its_jsonl_agree(tmp_path: Path, tokenizer) -> None:
    path = write_jsonl(tmp_path / "arith.jsonl", 20, seed=3)
    from_file = load_prompts(load_config(None, {"prompt_data": str(path)}), tokenizer)
    generated = load_prompts(load_config(None, {"prompt_data": "demo:arithmetic", "demo_num_prompts": 20, "seed": 3}), tokenizer)
    assert [(p.text, p.label) for p in from_file] == [(p.text, p.label) for p in generated]


def test_cursor_covers_each_prompt_once_per_epoch_and_reshuffles(tokenizer) -> None:
    prompts = load_prompts(load_config(None, {"demo_num_prompts": 10}), tokenizer)
    cursor = PromptCursor(prompts, shuffle=True, seed=1)
    epoch0 = [cursor.next() for _ in range(10)]
    epoch1 = [cursor.next() for _ in range(10)]
    assert {e for e, _ in epoch0} == {0} and {e for e, _ in epoch1} == {1}
    assert sorted(p.index for _, p in epoch0) == list(range(10)) == sorted(p.index for _, p in epoch1)
    assert [p.index for _, p in epoch0] != [p.index for _, p in epoch1]


def test_a_row_without_its_label_is_a_load_error(tmp_path: Path, tokenizer) -> None:
    """Issue 15: such a row loaded and then failed every sample at scoring time, mid-run."""
    data = write_rows(tmp_path / "d.jsonl", [{"prompt": "1+1=", "label": "2"}, {"prompt": "2+2="}, {"prompt": "3+3=", "label": None}])
    with pytest.raises(ConfigError, match=r"d.jsonl row 1: no label under 'label'.*--label-key"):
        load_prompts(load_config(None, {"prompt_data": str(data)}), tokenizer)
    data = write_rows(tmp_path / "e.jsonl", [{"prompt": "1+1=", "label": "2"}, {"prompt": "3+3=", "label": None}])
    with pytest.raises(ConfigError, match=r"row 1: no label under 'label'"):
        load_prompts(load_config(None, {"prompt_data": str(data)}), tokenizer)
    # A dataset without labels (a judge reward) says so with an empty --label-key.
    unlabeled = load_prompts(load_config(None, {"prompt_data": str(data), "label_key": ""}), tokenizer)
    assert [p.label for p in unlabeled] == [None, None]
