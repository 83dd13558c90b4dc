"""The demo task (prompts, labels, reward, JSONL) and the character tokenizer."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vime.demo import arithmetic
from vime.demo.tokenizer import (
    CHARACTERS,
    EOS_ID,
    EOS_TOKEN,
    PAD_ID,
    SPECIAL_TOKENS,
    UNK_ID,
    load_tokenizer,
    save_tokenizer,
    vocab_size,
)

# ---------------------------------------------------------------------------------------------- task


def test_make_prompts_rows_are_correct_sums() -> None:
    rows = arithmetic.make_prompts(200, seed=3)
    assert len(rows) == 200
    for row in rows:
        a, b = row["metadata"]["a"], row["metadata"]["b"]
        assert 100 <= a <= 999 and 100 <= b <= 999
        assert 100 <= a + b <= 999  # a fixed answer length: every answer position is one decimal place
        assert row["prompt"] == f"{a}+{b}="
        assert row["label"] == str(a + b)
        assert row["metadata"]["task"] == arithmetic.TASK_NAME


def test_make_prompts_is_deterministic_and_seeded() -> None:
    assert arithmetic.make_prompts(50, seed=7) == arithmetic.make_prompts(50, seed=7)
    assert arithmetic.make_prompts(50, seed=7) != arithmetic.make_prompts(50, seed=8)
    # A longer list extends a shorter one: the stream does not depend on n.
    assert arithmetic.make_prompts(80, seed=7)[:50] == arithmetic.make_prompts(50, seed=7)


def test_make_prompts_digits_and_bad_arguments() -> None:
    for row in arithmetic.make_prompts(100, seed=1, digits=2):
        a, b = row["metadata"]["a"], row["metadata"]["b"]
        assert 10 <= a <= 99 and 10 <= b <= 99 and a + b <= 99
    assert arithmetic.make_prompts(0) == []
    with pytest.raises(ValueError):
        arithmetic.make_prompts(-1)
    with pytest.raises(ValueError):
        arithmetic.make_prompts(3, digits=0)


def test_problems_cover_every_pair_whose_sum_keeps_its_digits() -> None:
    import random

    rng = random.Random(0)
    pairs = {arithmetic.make_problem(rng, digits=1) for _ in range(3000)}
    # digits=1: operands 0-9 with a one-digit sum, i.e. every pair with a + b <= 9, and nothing else.
    assert pairs == {(a, b) for a in range(10) for b in range(10) if a + b <= 9}


def test_write_jsonl_round_trips(tmp_path) -> None:
    path = arithmetic.write_jsonl(tmp_path / "sub" / "train.jsonl", 25, seed=4)
    lines = path.read_text().splitlines()
    assert len(lines) == 25
    assert [json.loads(line) for line in lines] == arithmetic.make_prompts(25, seed=4)


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        ("579", "579", 1.0),
        (" 579\n", "579", 1.0),
        ("579" + EOS_TOKEN, "579", 1.0),
        ("579 " + EOS_TOKEN + EOS_TOKEN, "579", 1.0),
        ("578", "579", 0.0),
        ("5790", "579", 0.0),
        ("0579", "579", 0.0),
        ("57", "579", 0.0),
        ("579 1", "579", 0.0),
        ("", "579", 0.0),
        ("579", "", 0.0),
    ],
)
def test_arithmetic_reward(response: str, label: str, expected: float) -> None:
    assert arithmetic.arithmetic_reward(response, label) == expected


# ----------------------------------------------------------------------------------------- tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(save_tokenizer(tmp_path_factory.mktemp("tok")))


def test_tokenizer_files_and_special_ids(tokenizer, tmp_path) -> None:
    out = save_tokenizer(tmp_path)
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (out / "tokenizer.json").is_file()
    assert tokenizer.eos_token_id == EOS_ID and tokenizer.pad_token_id == PAD_ID
    assert len(tokenizer) == vocab_size()


def test_encode_one_token_per_char_without_specials(tokenizer) -> None:
    ids = tokenizer.encode("123+456=")
    assert len(ids) == 8
    assert EOS_ID not in ids and tokenizer.bos_token_id not in ids
    assert tokenizer.convert_ids_to_tokens(ids) == list("123+456=")
    assert tokenizer("12")["input_ids"] == tokenizer.encode("12", add_special_tokens=False)


def test_decode_concatenates_and_skips_specials(tokenizer) -> None:
    ids = tokenizer.encode("57 9") + [EOS_ID]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "57 9"
    assert tokenizer.decode(ids) == "57 9" + EOS_TOKEN


def test_unknown_characters_map_to_unk(tokenizer) -> None:
    assert tokenizer.encode("A#") == [UNK_ID, UNK_ID]


def test_every_model_id_decodes_visibly(tokenizer) -> None:
    # The model's embedding covers the whole tokenizer, and filler ids are not silently dropped:
    # "5<reserved_0>79" must not decode to a rewardable "579".
    assert len(tokenizer) == vocab_size() == 64
    filler = len(SPECIAL_TOKENS) + len(CHARACTERS)
    text = tokenizer.decode(tokenizer.encode("5") + [filler] + tokenizer.encode("79"), skip_special_tokens=True)
    assert text == "5<reserved_0>79"
    assert arithmetic.arithmetic_reward(text, "579") == 0.0


def test_chat_template_equals_raw_prompt(tokenizer) -> None:
    messages = [{"role": "user", "content": "123+456="}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "123+456="
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert list(ids) == tokenizer.encode("123+456=")


@settings(max_examples=50, deadline=None)
@given(st.text(alphabet="".join(CHARACTERS), max_size=40))
def test_round_trip_over_the_alphabet(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert len(ids) == len(text)
    assert tokenizer.decode(ids) == text


def test_a_tokenizer_padded_to_qwen3s_vocabulary_encodes_the_demo_task_alike(tmp_path) -> None:
    """The demo task on a model of real size: the same ids for every demo text, 151936 entries, and
    the fillers decode to visible text."""
    from vime.demo.model_factory import QWEN3_VOCAB_SIZE
    from vime.demo.tokenizer import load_tokenizer, save_tokenizer

    small = load_tokenizer(save_tokenizer(tmp_path / "small"))
    big = load_tokenizer(save_tokenizer(tmp_path / "big", vocab_size=QWEN3_VOCAB_SIZE))
    assert len(big) == QWEN3_VOCAB_SIZE
    text = "what is 123+456?\n579"
    assert big.encode(text) == small.encode(text)
    assert big.decode([QWEN3_VOCAB_SIZE - 1]) == f"<reserved_{QWEN3_VOCAB_SIZE - 1 - 4 - 49}>"
    with pytest.raises(ValueError, match="at least"):
        save_tokenizer(tmp_path / "tiny", vocab_size=10)


@pytest.mark.parametrize(("size", "billions"), [("0.6b", 0.596), ("1.7b", 1.72), ("4b", 4.02), ("8b", 8.19)])
def test_qwen3_shapes_have_the_published_parameter_counts(size: str, billions: float) -> None:
    """Counted on the meta device (nothing allocated): Qwen3-0.6B/1.7B/4B (tied embeddings) and 8B."""
    import torch
    from transformers import Qwen3ForCausalLM

    from vime.demo.model_factory import _qwen3_config, qwen3_shape_recipe

    with torch.device("meta"):
        model = Qwen3ForCausalLM(_qwen3_config(qwen3_shape_recipe(size)))
    params = sum(p.numel() for p in model.parameters()) / 1e9  # parameters() yields a tied tensor once
    assert abs(params - billions) < 0.01, params
    with pytest.raises(KeyError, match="known"):
        qwen3_shape_recipe("3b")


def test_the_qwen3_30b_a3b_shape_has_the_published_parameter_counts() -> None:
    """Qwen3-30B-A3B: 30.5B parameters, 3.3B activated per token (the model card); with `num_layers` the
    same layer shape with fewer layers, as the training-speed bench runs it."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    from vime.bench.flops import matmul_params
    from vime.demo.model_factory import _qwen3_moe_config, qwen3_shape_recipe

    config = _qwen3_moe_config(qwen3_shape_recipe("30b-a3b"))
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(config)
    total = sum(p.numel() for p in model.parameters()) / 1e9
    active = (matmul_params(config) + config.vocab_size * config.hidden_size) / 1e9  # + the input embedding
    assert abs(total - 30.5) < 0.1, total
    assert abs(active - 3.3) < 0.1, active
    short = qwen3_shape_recipe("30b-a3b", num_layers=4)
    assert short.num_layers == 4 and short.num_experts == 128 and short.num_experts_per_tok == 8
