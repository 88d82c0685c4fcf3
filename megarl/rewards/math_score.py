"""Math answer verification: `\\boxed{}` extraction, an exact fast path, then math-verify.

The fast path decides without math-verify when both answers normalise to the same string or
are both plain integers (the `arith` demo task never reaches math-verify). Everything else
goes to math-verify (`parse` / `verify`), imported lazily. math-verify bounds its own calls with
SIGALRM, which only works in a main thread; elsewhere its timeouts are switched off and the
caller (the reward pool) must bound time. A timeout or a fault inside math-verify raises
(the pool reports "timeout" / "error"), never passes for a wrong answer.
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction

from megarl.rewards.extract import extract_boxed

# Seconds math-verify may spend per parse / per comparison (SIGALRM needs whole seconds).
MATH_VERIFY_TIMEOUT_S = 2
# Answers longer than this are only compared by the fast path (no real answer is this long).
MAX_VERIFY_CHARS = 2048
# Decimal strings longer than this are not converted to Fraction.
_MAX_NUMBER_CHARS = 64

_INT = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)")
_DEC = re.compile(r"[+-]?(?:\d+\.\d*|\.\d+)")
_SPACING = re.compile(r"\\(?:left|right|displaystyle)(?![A-Za-z])|\\[!,;: ]")


def normalize_answer(s: str) -> str:
    """Whitespace/spacing-command-free form used for exact comparison."""
    s = s.strip()
    while len(s) >= 2 and s[0] == "$" and s[-1] == "$":
        s = s[1:-1].strip()
    s = _SPACING.sub("", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = "".join(s.split())
    return s.rstrip(".")


def _canonical_int(s: str) -> str:
    s = s.replace(",", "")
    sign = "-" if s[0] == "-" else ""
    digits = s.lstrip("+-").lstrip("0") or "0"
    return digits if digits == "0" else sign + digits


def fast_equal(pred: str, gold: str) -> bool | None:
    """Exact decision where one is cheap: True/False, or None when math-verify must decide.

    Equal normalised strings -> True. Two plain integers -> their equality (string compare of
    canonical digits, so 10**6-digit strings cost linear time). Two short decimals with equal
    exact values -> True (unequal decimals go to math-verify, which rounds).
    """
    p, g = normalize_answer(pred), normalize_answer(gold)
    if p == g:
        return True
    p_int, g_int = _INT.fullmatch(p) is not None, _INT.fullmatch(g) is not None
    if p_int and g_int:
        return _canonical_int(p) == _canonical_int(g)
    if (
        (p_int or _DEC.fullmatch(p))
        and (g_int or _DEC.fullmatch(g))
        and len(p) <= _MAX_NUMBER_CHARS
        and len(g) <= _MAX_NUMBER_CHARS
    ):
        if Fraction(p.replace(",", "")) == Fraction(g.replace(",", "")):
            return True
    return None


def gold_answers(ground_truth) -> list[str]:
    """Ground truth as a list of answer strings (a `\\boxed{}` in a gold solution is unwrapped)."""
    items = ground_truth if isinstance(ground_truth, list | tuple) else [ground_truth]
    out = []
    for g in items:
        g = str(g)
        boxed = extract_boxed(g) if ("\\boxed" in g or "\\fbox" in g) else None
        out.append(boxed if boxed is not None else g)
    return out


def _wrap_gold(gold: str) -> str:
    g = gold.strip()
    if g.startswith("$") or g.startswith("\\[") or g.startswith("\\("):
        return g
    return f"${g}$"


class AnswerCheckTimeout(TimeoutError):
    """math-verify ran past MATH_VERIFY_TIMEOUT_S on one answer (the pool reports "timeout")."""


class AnswerCheckError(RuntimeError):
    """math-verify failed inside on one answer (the pool reports "error", counted in
    reward/errors): an unparsable answer is not an error (math-verify returns no parse), so an
    exception is a fault of the checker, never a verdict on the answer."""


def math_verify_equal(pred: str, gold: str) -> bool:
    """math-verify's decision for a bare predicted answer and a bare gold answer.

    An answer math-verify cannot parse, or parsed values it cannot compare, are False (it
    returns no parse / False for those). An exception inside math-verify raises
    AnswerCheckError and a run out of time AnswerCheckTimeout, instead of either passing for a
    wrong answer (math-verify alone would return False and only log); MemoryError propagates
    (the worker's memory bound).
    """
    from math_verify import LatexExtractionConfig, parse, verify
    from math_verify.errors import TimeoutException

    timeout = MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    # LaTeX extraction only: math-verify's plain-expression mode goes through sympy.parse_expr.
    config = [LatexExtractionConfig()]
    try:
        gold_parsed = parse(_wrap_gold(gold), extraction_config=config, parsing_timeout=timeout,
                            raise_on_error=True)
        if not gold_parsed:
            return False
        pred_parsed = parse("\\boxed{" + pred + "}", extraction_config=config,
                            parsing_timeout=timeout, raise_on_error=True)
        if not pred_parsed:
            return False
        return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout, raise_on_error=True))
    except TimeoutException:  # a BaseException: it must not escape the worker's error handling
        raise AnswerCheckTimeout(f"math-verify took over {timeout} s") from None
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - a fault of the checker, not a wrong answer
        raise AnswerCheckError(f"math-verify failed: {type(e).__name__}: {e}"[:300]) from e


def math_answer_equal(pred: str, gold: str) -> bool:
    fast = fast_equal(pred, gold)
    if fast is not None:
        return fast
    if len(pred) > MAX_VERIFY_CHARS or len(gold) > MAX_VERIFY_CHARS:
        return False
    return math_verify_equal(pred, gold)


def math_score(solution_str: str, ground_truth) -> float:
    """1.0 if the last `\\boxed{}` of `solution_str` equals any gold answer, else 0.0.

    No box -> 0.0 (the answer format is part of the task).
    """
    pred = extract_boxed(solution_str)
    if pred is None:
        return 0.0
    return float(any(math_answer_equal(pred, g) for g in gold_answers(ground_truth)))
