"""Reward functions: math-verify styles, the timeout pool, custom functions, the registry."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from vime.rewards import KNOWN_RM_TYPES, RewardResult, build_reward_fn, coerce_result, score_sync
from vime.rewards.custom import CustomRewardLoadError, load_custom_reward
from vime.rewards.math import (
    MathReward,
    MathVerifier,
    extract_answer_line,
    extract_boxed,
    extract_hashes,
    gold_answer,
)
from vime.rewards.pool import TimeoutProcessPool


@pytest.fixture(scope="module")
def verifier():
    v = MathVerifier(timeout_s=20.0, num_workers=1)
    yield v
    v.close()


def score(fn, response: str, label: str | None, prompt: str = "q", metadata: dict | None = None) -> RewardResult:
    return score_sync(fn, prompt, response, label, metadata or {})


# --------------------------------------------------------------------------------------- extraction


def test_extract_boxed_nested_last_and_missing() -> None:
    assert extract_boxed(r"first \boxed{1} then \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert extract_boxed(r"$\boxed{\{1, 2\}}$") == r"\{1, 2\}"
    assert extract_boxed(r"\boxed 7$") == "7"
    assert extract_boxed(r"no box here") is None
    assert extract_boxed(r"\boxed{unclosed") is None


def test_extract_markers() -> None:
    assert extract_hashes("work...\n#### 1,234.") == "1234"
    assert extract_hashes("#### $18") == "18"
    assert extract_hashes("no marker") is None
    assert extract_answer_line("Reasoning\nAnswer: $\\frac{3}{4}$\n") == r"\frac{3}{4}"
    assert extract_answer_line("answer: 1\nAnswer: 2") == "2"
    assert extract_answer_line("Answer: (3,100)") == "(3,100)"  # tuples keep their commas
    assert gold_answer("Janet has 3 eggs.\n#### 18", "gsm8k") == "18"
    assert gold_answer("42", "dapo") == "42"


# ----------------------------------------------------------------------------------- math styles


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        ("She has 16 - 3 - 4 = 9 eggs, 9 * 2 = 18.\n#### 18", "Janet ... 9 * 2 = 18\n#### 18", 1.0),
        ("#### 1,800", "1800", 1.0),
        ("#### 17", "18", 0.0),
        ("The answer is 18.", "18", 0.0),  # strict: no #### marker
    ],
)
def test_gsm8k(verifier, response: str, label: str, expected: float) -> None:
    result = score(MathReward("gsm8k", verifier), response, label)
    assert result.reward == expected
    assert not result.failed


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        ("Let me think.\nAnswer: \\frac{1}{2}", "0.5", 1.0),
        ("Answer: 34", "34", 1.0),
        ("Answer: 33", "34", -1.0),
        ("I give up", "34", -1.0),
    ],
)
def test_dapo_scores_plus_minus_one(verifier, response: str, label: str, expected: float) -> None:
    result = score(MathReward("dapo", verifier), response, label)
    assert result.reward == expected
    assert result.extra["acc"] is (expected == 1.0)


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        (r"So $x = \boxed{\frac{2}{4}}$.", r"\frac{1}{2}", 1.0),
        (r"\boxed{\sqrt{2}}", r"\boxed{\sqrt{2}}", 1.0),
        (r"\boxed{3}", r"\frac{1}{2}", 0.0),
        (r"x = 1/2", r"\frac{1}{2}", 0.0),  # right value but not boxed
    ],
)
def test_boxed_math(verifier, response: str, label: str, expected: float) -> None:
    assert score(MathReward("boxed_math", verifier), response, label).reward == expected


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        (r"\boxed{6}", "6", 1.0),
        ("Answer: 6", "6", 1.0),
        ("#### 6", "6", 1.0),
        ("after all that, the total is 6", "6", 1.0),  # no marker: math-verify extracts
        (r"\boxed{7}", "6", 0.0),
    ],
)
def test_math_any_marker(verifier, response: str, label: str, expected: float) -> None:
    assert score(MathReward("math", verifier), response, label).reward == expected


def test_missing_label_is_a_failure(verifier) -> None:
    result = score(MathReward("math", verifier), r"\boxed{1}", None)
    assert result.failed and result.reward == 0.0 and "label" in result.reason


def test_concurrent_checks_from_asyncio(verifier) -> None:
    fn = MathReward("gsm8k", verifier)

    async def many() -> list[RewardResult]:
        return await asyncio.gather(*(fn("q", f"#### {i}", str(i if i % 2 else i + 1), {}) for i in range(12)))

    results = asyncio.run(many())
    assert [r.reward for r in results] == [1.0 if i % 2 else 0.0 for i in range(12)]


# ------------------------------------------------------------------------------------ timeouts


def test_pool_timeout_kills_and_recovers() -> None:
    pool = TimeoutProcessPool(max_workers=1, name="test")
    try:
        assert pool.run(math.factorial, 5, timeout_s=30).value == 120  # starts the pool
        started = time.monotonic()
        outcome = pool.run(time.sleep, 60, timeout_s=0.5)
        assert time.monotonic() - started < 5
        assert outcome.timed_out and not outcome.ok and "timed out" in outcome.error
        assert pool.restarts == 1
        # The stuck worker was killed; the next call gets a fresh pool.
        assert pool.run(math.factorial, 6, timeout_s=30).value == 720

        async def async_timeout():
            return await pool.arun(time.sleep, 60, timeout_s=0.5)

        assert asyncio.run(async_timeout()).timed_out
        assert pool.restarts == 2
    finally:
        pool.close()


def test_pool_reports_exceptions_from_the_worker() -> None:
    pool = TimeoutProcessPool(max_workers=1, name="test")
    try:
        outcome = pool.run(math.sqrt, -1, timeout_s=30)
        assert not outcome.ok and not outcome.timed_out and "ValueError" in outcome.error
    finally:
        pool.close()


def _stuck_check(gold: str, answer: str, timeout: int) -> dict:
    time.sleep(60)  # module level so the spawned worker can import it by name
    return {}


def test_math_reward_timeout_is_a_scored_failure(monkeypatch) -> None:
    import vime.rewards.math as math_rewards

    verifier = MathVerifier(timeout_s=1.0, num_workers=1)
    try:
        # Stand in for a check stuck in C code (beyond math-verify's own signal timeouts).
        monkeypatch.setattr(math_rewards, "check_in_worker", _stuck_check)
        result = score(MathReward("dapo", verifier), "Answer: 1", "1")
        assert result.failed and result.reward == -1.0 and "timeout" in result.reason
    finally:
        verifier.close()


# -------------------------------------------------------------------------------------- coercion


def test_coerce_result() -> None:
    assert coerce_result(1) == RewardResult(1.0)
    assert coerce_result(True).reward == 1.0
    assert coerce_result({"score": 0.5, "acc": True}) == RewardResult(0.5, {"acc": True})
    assert coerce_result({"reward": 2}).reward == 2.0
    for bad in (float("nan"), "1.0", {"acc": 1}, {"score": "x"}, None):
        result = coerce_result(bad)
        assert result.failed and result.reward == 0.0 and result.reason


# ---------------------------------------------------------------------------------------- custom

CUSTOM_FILE = '''
import asyncio

def length_reward(prompt, response, label, metadata):
    return {"score": len(response) / 10, "seen_label": label, "task": metadata.get("task")}

async def async_reward(prompt, response, label, metadata):
    await asyncio.sleep(0)
    return 1.0 if response == label else 0.0

def broken(prompt, response, label, metadata):
    raise RuntimeError("boom")

def returns_text(prompt, response, label, metadata):
    return "good"

def wrong_arity(response):
    return 1.0

NOT_A_FUNCTION = 3
'''


@pytest.fixture
def custom_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM_FILE)
    return path


def test_custom_sync_and_async(custom_file) -> None:
    fn = build_reward_fn("custom", f"{custom_file}:length_reward")
    result = score(fn, "abcde", "L", metadata={"task": "t"})
    assert result == RewardResult(0.5, {"seen_label": "L", "task": "t"})
    afn = build_reward_fn(None, f"{custom_file}:async_reward")
    assert score(afn, "42", "42").reward == 1.0
    assert score(afn, "41", "42").reward == 0.0


def test_custom_failures_at_call_time_are_results(custom_file) -> None:
    raised = score(load_custom_reward(f"{custom_file}:broken"), "x", "y")
    assert raised.failed and "RuntimeError: boom" in raised.reason
    text = score(load_custom_reward(f"{custom_file}:returns_text"), "x", "y")
    assert text.failed and "str" in text.reason


def test_custom_module_form(monkeypatch, custom_file) -> None:
    monkeypatch.syspath_prepend(str(custom_file.parent))
    assert score(load_custom_reward("my_reward:async_reward"), "1", "1").reward == 1.0
    assert score(load_custom_reward("my_reward.async_reward"), "1", "1").reward == 1.0  # slime's form


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("{dir}/missing.py:fn", "custom reward file not found"),
        ("{file}:no_such_fn", "has no function 'no_such_fn'"),
        ("{file}:NOT_A_FUNCTION", "not a callable"),
        ("{file}:wrong_arity", "must accept (prompt, response, label, metadata)"),
        ("{file}", "names no function"),
        ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'"),
        ("  ", "empty"),
    ],
)
def test_custom_load_errors_name_the_problem(custom_file, spec: str, message: str) -> None:
    spec = spec.format(dir=custom_file.parent, file=custom_file)
    with pytest.raises(CustomRewardLoadError) as excinfo:
        load_custom_reward(spec)
    assert message in str(excinfo.value)


def test_custom_file_that_fails_to_import(tmp_path) -> None:
    path = tmp_path / "bad.py"
    path.write_text("import nonexistent_package_abc\n")
    with pytest.raises(CustomRewardLoadError, match="error while importing custom reward file .*nonexistent_package_abc"):
        load_custom_reward(f"{path}:fn")


# -------------------------------------------------------------------------------------- registry


def test_registry_known_types(custom_file) -> None:
    assert set(KNOWN_RM_TYPES) == {"math", "dapo", "gsm8k", "boxed_math", "arithmetic", "custom"}
    arithmetic = build_reward_fn("arithmetic")
    assert score(arithmetic, "579", "579").reward == 1.0
    assert score(arithmetic, "578", "579").reward == 0.0
    assert score(arithmetic, "579", None).failed
    assert isinstance(build_reward_fn("boxed_math"), MathReward)
    # A custom path wins over rm_type, as in slime.
    assert score(build_reward_fn("math", f"{custom_file}:async_reward"), "a", "a").reward == 1.0


def test_registry_errors() -> None:
    with pytest.raises(ValueError, match="unknown reward type 'f1'.*math, dapo, gsm8k, boxed_math, arithmetic, custom"):
        build_reward_fn("f1")
    with pytest.raises(ValueError, match="unknown reward type"):
        build_reward_fn(None)
    with pytest.raises(ValueError, match="needs --custom-rm-path"):
        build_reward_fn("custom")
