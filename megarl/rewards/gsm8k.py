"""GSM8K: the number after `####` ("strict"), or the last number in the text ("flexible")."""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Literal

# Like verl, only the tail of the response is searched (answers come last; bounds the cost).
_TAIL_CHARS = 300
_STRICT = re.compile(r"####\s*\$?\s*(-?[0-9.,]+)")
_NUMBER = re.compile(r"-?[0-9.,]+")
_PLAIN = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)")

Method = Literal["strict", "flexible", "strict_then_flexible"]


def _clean(num: str) -> str:
    return num.replace(",", "").replace("$", "").strip().rstrip(".")


def extract_gsm8k_answer(solution_str: str, method: Method = "strict_then_flexible") -> str | None:
    """The answer string, or None. strict: last `#### <number>`; flexible: last number."""
    if method not in ("strict", "flexible", "strict_then_flexible"):
        raise ValueError(f"gsm8k method={method!r}; use 'strict', 'flexible' or 'strict_then_flexible'")
    tail = solution_str[-_TAIL_CHARS:]
    if method != "flexible":
        found = _STRICT.findall(tail)
        if found:
            return _clean(found[-1]) or None
        if method == "strict":
            return None
    for cand in reversed(_NUMBER.findall(tail)):
        cand = _clean(cand)
        if any(ch.isdigit() for ch in cand):
            return cand
    return None


def numbers_equal(a: str, b: str) -> bool:
    """Exact value equality of two decimal strings ("72" == "72.00"), else string equality."""
    a, b = _clean(a), _clean(b)
    if _PLAIN.fullmatch(a) and _PLAIN.fullmatch(b) and len(a) <= 64 and len(b) <= 64:
        return Fraction(a) == Fraction(b)
    return a == b


def gsm8k_score(
    solution_str: str,
    ground_truth,
    method: Method = "strict_then_flexible",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """`score` if the extracted answer equals the ground-truth number, `format_score` if an
    answer was found but is wrong, 0.0 if none was found."""
    gold = str(ground_truth)
    if "####" in gold:
        gold = gold.rsplit("####", 1)[1]
    answer = extract_gsm8k_answer(solution_str, method)
    if answer is None:
        return 0.0
    return score if numbers_equal(answer, gold) else format_score
