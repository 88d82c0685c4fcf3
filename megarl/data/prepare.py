"""Turn local GSM8K / MATH-style files into verl-format prompt files (no network).

    python -m megarl.data.prepare --input gsm8k/train.jsonl --output data/gsm8k_train.parquet
    python -m megarl.data.prepare --input math/test.json --format math --split test \\
        --output data/math_test.parquet

Inputs: .jsonl / .json / .parquet with ``question``/``answer`` (GSM8K: the answer ends with
"#### 42") or ``problem``/``solution`` (MATH: the last \\boxed{...} of the solution, or an
``answer`` field when present). ``--format auto`` (default) decides per row by its fields.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from collections.abc import Sequence
from typing import Any

from megarl.data.rows import BadRowError, read_rows, write_rows

logger = logging.getLogger(__name__)

DEFAULT_INSTRUCTION = (
    "Solve step by step, separating steps with a blank line, and put the final answer in "
    "\\boxed{}."
)
DATA_SOURCES = {"gsm8k": "openai/gsm8k", "math": "DigitalLearningGmbH/MATH-lighteval"}
_GSM8K_ANSWER = re.compile(r"####\s*(.+?)\s*$", re.S)


def gsm8k_answer(answer: str) -> str | None:
    """The final answer after '####' (thousands separators removed), or None."""
    m = _GSM8K_ANSWER.search(answer)
    if not m:
        return None
    final = m.group(1).strip().replace(",", "")
    return final or None


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; else None."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        # "\boxed 5" form
        m = re.match(r"\\boxed\s+([^\s$]+)", text[start:])
        return m.group(1) if m else None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                content = text[i + 1 : j].strip()
                return content or None
    return None


def _str_field(path: str, i: int, row: dict, key: str) -> str:
    value = row.get(key)
    if value is None:
        raise BadRowError(path, i, key, "missing")
    if not isinstance(value, str) or not value.strip():
        raise BadRowError(path, i, key, f"must be a non-empty string, got {value!r:.60}")
    return value


def convert_row(
    path: str, i: int, row: Any, fmt: str, instruction: str, split: str,
    data_source: str | None,
) -> dict[str, Any]:
    """One source row -> one verl row. Raises BadRowError on a malformed row."""
    if not isinstance(row, dict):
        raise BadRowError(path, i, "<row>", f"must be an object, got {type(row).__name__}")
    kind = fmt
    if kind == "auto":
        kind = "gsm8k" if "question" in row else "math" if "problem" in row else ""
        if not kind:
            raise BadRowError(path, i, "question/problem",
                              "missing (need question+answer or problem+solution)")
    if kind == "gsm8k":
        question = _str_field(path, i, row, "question")
        raw_answer = _str_field(path, i, row, "answer")
        final = gsm8k_answer(raw_answer)
        if final is None:
            raise BadRowError(path, i, "answer", "has no final answer after '####'")
    else:
        question = _str_field(path, i, row, "problem")
        answer_field = row.get("answer")
        if isinstance(answer_field, (int, float)) and not isinstance(answer_field, bool):
            answer_field = str(answer_field)
        if isinstance(answer_field, str) and answer_field.strip():
            final = answer_field.strip()
            raw_answer = row.get("solution") if isinstance(row.get("solution"), str) else final
        else:
            raw_answer = _str_field(path, i, row, "solution")
            final = last_boxed(raw_answer)
            if final is None:
                raise BadRowError(path, i, "solution", "has no \\boxed{...} final answer")
    content = question.strip() + (f"\n\n{instruction}" if instruction else "")
    return {
        "data_source": data_source or DATA_SOURCES[kind],
        "prompt": [{"role": "user", "content": content}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": final},
        "extra_info": {"split": split, "index": i, "question": question, "answer": raw_answer},
    }


def prepare(
    inputs: Sequence[str], output: str, fmt: str = "auto", instruction: str = DEFAULT_INSTRUCTION,
    split: str = "train", data_source: str | None = None, on_bad_row: str = "error",
    limit: int | None = None,
) -> tuple[int, int]:
    """Convert ``inputs`` into ``output`` (.parquet or .jsonl). Returns (rows written, skipped)."""
    if fmt not in ("auto", "gsm8k", "math"):
        raise ValueError(f"format must be auto, gsm8k or math, got {fmt!r}")
    rows, skipped = [], 0
    for path in inputs:
        for i, row in read_rows(path, on_bad_row):
            try:
                if isinstance(row, BadRowError):
                    raise row
                rows.append(convert_row(path, i, row, fmt, instruction, split, data_source))
            except BadRowError as e:
                if on_bad_row == "error":
                    raise
                skipped += 1
                logger.warning("skipping %s", str(e).split(". Fix the row")[0])
            if limit is not None and len(rows) >= limit:
                break
        if limit is not None and len(rows) >= limit:
            break
    if not rows:
        raise ValueError(f"no rows converted from {list(inputs)} ({skipped} skipped)")
    for k, r in enumerate(rows):
        r["extra_info"]["index"] = k
    write_rows(rows, output)
    return len(rows), skipped


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megarl.data.prepare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help=".jsonl/.json/.parquet file(s)")
    p.add_argument("--output", required=True, help="output .parquet or .jsonl")
    p.add_argument("--format", default="auto", choices=["auto", "gsm8k", "math"])
    p.add_argument("--split", default="train", help="stored in extra_info.split")
    p.add_argument("--data-source", default=None,
                   help=f"data_source of every row (default by format: {DATA_SOURCES})")
    p.add_argument("--instruction", default=DEFAULT_INSTRUCTION,
                   help="appended to each question after a blank line ('' for none)")
    p.add_argument("--on-bad-row", default="error", choices=["error", "skip"])
    p.add_argument("--limit", type=int, default=None, help="keep at most this many rows")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    try:
        n, skipped = prepare(args.input, args.output, args.format, args.instruction, args.split,
                             args.data_source, args.on_bad_row, args.limit)
    except (BadRowError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {n} rows to {args.output}" + (f" ({skipped} malformed rows skipped)"
                                                if skipped else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
