"""Verdict parsers: the text a judge generated -> a score, or None when it holds no verdict.

The text is untrusted model output: it is only scanned (linear time, no regex backtracking, no
``eval``), and a number is accepted only in plain ASCII decimal form, ``[+-]digits[.digits]`` (at
most 32 characters), so ``nan``, ``inf``, ``1e999``, ``0x1``, ``7/10`` or an expression never
become a score. Modes (``reward_model.rollout.score_parse``):

- ``boxed``: the content of the last ``\\boxed{...}`` (`megarl.rewards.extract.extract_boxed`:
  balanced braces; in nested boxes the innermost last one) is a number;
- ``score``: the last non-empty line is ``Score: <number>`` ("score" in any case, spaces
  around the colon allowed, nothing after the number);
- ``yes_no``: whichever of ``[[YES]]`` (1.0) and ``[[NO]]`` (0.0) comes last.

A parsed number outside [score_min, score_max] (where given) counts as no verdict.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

from megarl.rewards.extract import extract_boxed, last_nonempty_line

MAX_NUMBER_CHARS = 32
_NUMBER = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)")


def parse_number(text: str) -> float | None:
    """``text`` (spaces around allowed) as a finite float if it is a plain decimal, else None."""
    s = text.strip()
    if not s or len(s) > MAX_NUMBER_CHARS or _NUMBER.fullmatch(s) is None:
        return None
    value = float(s)
    return value if math.isfinite(value) else None


def parse_boxed(text: str) -> float | None:
    content = extract_boxed(text)
    return None if content is None else parse_number(content)


def parse_score_line(text: str) -> float | None:
    line = last_nonempty_line(text)
    if line is None or line[:5].lower() != "score":
        return None
    rest = line[5:].lstrip(" \t")
    if not rest.startswith(":"):
        return None
    return parse_number(rest[1:])


def parse_yes_no(text: str) -> float | None:
    yes, no = text.rfind("[[YES]]"), text.rfind("[[NO]]")
    if yes < 0 and no < 0:
        return None
    return 1.0 if yes > no else 0.0


PARSERS: dict[str, Callable[[str], float | None]] = {
    "boxed": parse_boxed, "score": parse_score_line, "yes_no": parse_yes_no}


def parse_verdict(text: str, mode: str = "boxed", score_min: float | None = None,
                  score_max: float | None = None) -> float | None:
    """The score of verdict ``text`` under ``mode`` (see the module docstring), or None."""
    if mode not in PARSERS:
        raise ValueError(f"reward_model.rollout.score_parse={mode!r}; use one of {sorted(PARSERS)}")
    value = PARSERS[mode](text)
    if value is None:
        return None
    if (score_min is not None and value < score_min) or (score_max is not None and value > score_max):
        return None
    return value
