"""Rule-based math rewards checked with math-verify.

Styles (the `--rm-type` names):
- `gsm8k`: the response's final answer follows `####` (strict, like verl's gsm8k scorer); the label is
  either a bare answer or a full GSM8K solution ending in `#### 42`. Reward 1/0.
- `dapo`: the response's last `Answer: ...` line, as DAPO/slime prompt for it. Reward 1 / -1 (the DAPO
  convention slime users expect), with `acc` and `pred` in `extra`.
- `boxed_math`: the last `\\boxed{...}` of the response. Reward 1/0.
- `math`: the first of those markers found (boxed, then `Answer:`, then `####`); without any, the
  whole response goes to math-verify's own extraction. Reward 1/0.

Checking is `verify(parse(gold), parse(answer))` (gold first, as math-verify requires), run in a
spawned process pool with a per-call deadline (see `vime.rewards.pool`): a timeout or a crash gives a
*failed* result (`failed=True`, the style's wrong-answer reward, a reason) and never hangs the caller.
A response without the expected answer marker is a normal wrong answer, not a failure.
"""

from __future__ import annotations

import atexit
import os
import re
import threading
from collections.abc import Mapping
from typing import Any

from vime.logging import get_logger
from vime.rewards.pool import TimeoutProcessPool
from vime.rewards.types import RewardResult

log = get_logger(__name__)

STYLES: tuple[str, ...] = ("math", "gsm8k", "dapo", "boxed_math")
DEFAULT_TIMEOUT_S = 10.0

# --------------------------------------------------------------------------------------------------
# answer extraction (pure string work, runs in the caller's process)

_HASHES = re.compile(r"####\s*([^\n]*)")
_ANSWER_LINE = re.compile(r"(?i)\banswer\s*[:：]\s*([^\n]*)")
# A plain number with thousands separators ("1,234.5"); only then are commas dropped, so tuples and
# intervals such as "(3,100)" keep theirs.
_GROUPED_NUMBER = re.compile(r"-?\d{1,3}(,\d{3})+(\.\d+)?")


def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), braces balanced; None if there is none.

    `\\boxed 5` (the space form) is accepted too. An unclosed box counts as no box.
    """
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start:]
    rest = rest[len("\\boxed") :] if rest.startswith("\\boxed") else rest[len("\\fbox") :]
    if rest.startswith(" "):
        token = rest.strip().split("$")[0].split()
        return token[0] if token else None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, ch in enumerate(rest):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return rest[1:i].strip()
    return None


def _clean_final(answer: str) -> str:
    """Trim what commonly trails a final answer: spaces, a full stop, `$` signs, thousands commas."""
    answer = answer.strip().rstrip(".").strip()
    if answer.startswith("$") and answer.endswith("$") and len(answer) > 1:
        answer = answer.strip("$").strip()
    elif re.fullmatch(r"\$?\s*-?[\d,]+(\.\d+)?", answer):
        answer = answer.lstrip("$").strip()  # a currency sign in front of a plain number
    if _GROUPED_NUMBER.fullmatch(answer):
        answer = answer.replace(",", "")
    return answer


def extract_hashes(text: str) -> str | None:
    """The answer after the last `####` (GSM8K's marker), cleaned; None if absent or empty."""
    found = _HASHES.findall(text)
    if not found:
        return None
    answer = _clean_final(found[-1])
    return answer or None


def extract_answer_line(text: str) -> str | None:
    """The text after the last `Answer:` (DAPO's marker), cleaned; None if absent or empty."""
    found = _ANSWER_LINE.findall(text)
    if not found:
        return None
    answer = _clean_final(found[-1])
    return answer or None


def extract_answer(text: str, style: str) -> str | None:
    """The candidate final answer of `text` for a style; None when the style's marker is missing.

    For `math` with no marker the whole (stripped) text is returned and math-verify extracts from it.
    """
    if style == "gsm8k":
        return extract_hashes(text)
    if style == "dapo":
        return extract_answer_line(text)
    if style == "boxed_math":
        return extract_boxed(text)
    if style == "math":
        for extract in (extract_boxed, extract_answer_line, extract_hashes):
            found = extract(text)
            if found is not None:
                return found
        stripped = text.strip()
        return stripped or None
    raise ValueError(f"unknown math style {style!r}; known: {', '.join(STYLES)}")


def gold_answer(label: str, style: str) -> str:
    """The gold answer inside a label: labels may be bare (`42`) or carry a marker (`... #### 42`)."""
    for extract in (extract_hashes, extract_boxed, extract_answer_line):
        found = extract(label)
        if found is not None:
            return found
    return _clean_final(label)


# --------------------------------------------------------------------------------------------------
# the check itself (runs in a pool worker's main thread, where math-verify's signal timeouts work)


def _import_math_verify() -> None:
    import math_verify  # noqa: F401  (pool initializer: pay the sympy import once per worker)


def _parse(text: str, timeout: int) -> list[Any]:
    from math_verify import parse

    # math-verify finds latex inside $...$ or a box; a bare latex answer ("\frac{1}{2}") may need the $.
    for candidate in (text, f"${text}$"):
        parsed = parse(candidate, parsing_timeout=timeout, raise_on_error=False)
        if parsed:
            return parsed
    return []


def _normalize_text(text: str) -> str:
    return re.sub(r"\s+", " ", text.strip()).lower()


def check_in_worker(gold: str, answer: str, timeout: int) -> dict[str, Any]:
    """Compare `answer` to `gold` with math-verify; returns `{"correct", "pred", "error"}`.

    Module-level so the pool can run it. Unparseable input falls back to a normalised string match;
    a math-verify timeout inside the worker is reported as `error="timeout"`.
    """
    from math_verify import verify
    from math_verify.errors import TimeoutException

    try:
        gold_parsed = _parse(gold, timeout)
        answer_parsed = _parse(answer, timeout)
        if gold_parsed and answer_parsed:
            correct = bool(verify(gold_parsed, answer_parsed, timeout_seconds=timeout, raise_on_error=True))
            pred = str(answer_parsed[-1])
        else:
            correct = _normalize_text(gold) == _normalize_text(answer)
            pred = answer
        return {"correct": correct, "pred": pred, "error": None}
    except TimeoutException:
        return {"correct": False, "pred": None, "error": "timeout"}
    except Exception as exc:  # sympy can raise almost anything on odd input
        return {"correct": False, "pred": None, "error": f"{type(exc).__name__}: {exc}"}


# --------------------------------------------------------------------------------------------------
# the shared verifier and the reward functions


class MathVerifier:
    """Owns the process pool math-verify runs in; one per process is plenty (`default_verifier`).

    `timeout_s` bounds each check end to end; math-verify's own inner timeouts get a share of it so a
    slow parse usually ends inside the worker (cheap) before the outer kill (a pool restart) is needed.
    """

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S, num_workers: int | None = None) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        workers = num_workers or max(1, min(4, (os.cpu_count() or 2) // 2))
        self.pool = TimeoutProcessPool(max_workers=workers, initializer=_import_math_verify, name="math_verify")

    def _inner_timeout(self) -> int:
        # signal.alarm takes whole seconds; up to three alarmed steps (2 parses + verify) per check.
        return max(1, int(self.timeout_s // 4))

    async def acheck(self, gold: str, answer: str) -> dict[str, Any]:
        """Check one answer; returns `{"correct", "pred", "error"}` (error "timeout" on any timeout)."""
        outcome = await self.pool.arun(check_in_worker, gold, answer, self._inner_timeout(), timeout_s=self.timeout_s)
        return _outcome_dict(outcome)

    def check(self, gold: str, answer: str) -> dict[str, Any]:
        """Blocking `acheck`."""
        outcome = self.pool.run(check_in_worker, gold, answer, self._inner_timeout(), timeout_s=self.timeout_s)
        return _outcome_dict(outcome)

    def close(self) -> None:
        self.pool.close()


def _outcome_dict(outcome: Any) -> dict[str, Any]:
    if outcome.ok:
        return outcome.value
    return {"correct": False, "pred": None, "error": "timeout" if outcome.timed_out else outcome.error}


_default_verifier: MathVerifier | None = None
_default_lock = threading.Lock()


def default_verifier() -> MathVerifier:
    """The process-wide verifier (created on first use; its workers start on the first check)."""
    global _default_verifier
    with _default_lock:
        if _default_verifier is None:
            _default_verifier = MathVerifier()
            # Kill (not join) the workers at exit: a worker stuck in C code would otherwise block it.
            atexit.register(_default_verifier.close)
        return _default_verifier


class MathReward:
    """`RewardFn` for one math style. Wrong answers score `wrong_reward` (-1 for dapo, else 0)."""

    def __init__(self, style: str, verifier: MathVerifier | None = None) -> None:
        if style not in STYLES:
            raise ValueError(f"unknown math style {style!r}; known: {', '.join(STYLES)}")
        self.style = style
        self.verifier = verifier
        self.correct_reward = 1.0
        self.wrong_reward = -1.0 if style == "dapo" else 0.0

    def _result(self, correct: bool, **extra: Any) -> RewardResult:
        reward = self.correct_reward if correct else self.wrong_reward
        if self.style == "dapo":
            extra["acc"] = correct
        return RewardResult(reward=reward, extra=extra)

    async def __call__(
        self, prompt: str, response: str, label: str | None, metadata: Mapping[str, Any]
    ) -> RewardResult:
        if label is None or not str(label).strip():
            return RewardResult.failure("no label to check against", reward=self.wrong_reward)
        answer = extract_answer(response, self.style)
        if answer is None:
            result = self._result(False, pred=None)
            return RewardResult(result.reward, result.extra, reason=f"no {self.style} answer marker in response")
        verifier = self.verifier or default_verifier()
        checked = await verifier.acheck(gold_answer(str(label), self.style), answer)
        if checked["error"] is not None:
            log.warning("math_verify_failed", style=self.style, error=checked["error"])
            extra = {"pred": answer}
            if self.style == "dapo":
                extra["acc"] = False
            return RewardResult.failure(f"math-verify {checked['error']}", reward=self.wrong_reward, **extra)
        return self._result(checked["correct"], pred=checked["pred"])
