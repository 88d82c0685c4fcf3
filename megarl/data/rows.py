"""Reading prompt files in verl's row format and validating each row.

One row (parquet, jsonl or json) looks like::

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "..."}],
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "42"},
     "extra_info": {"split": "train", "index": 0}}

`read_rows` returns plain Python dicts; `validate_row` checks one of them and returns a
normalised copy or raises :class:`BadRowError` naming the file, row index and field.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

from megarl.errors import UserInputError

ON_BAD_ROW = ("error", "skip")
ROLES = ("system", "user", "assistant", "tool")


class BadRowError(UserInputError):
    """A row that does not follow the row format. ``str(err)`` names file, row and field."""

    def __init__(self, path: str, row: int, field: str, problem: str):
        self.path, self.row, self.field, self.problem = path, row, field, problem
        super().__init__(
            f"{path}: row {row}: field '{field}': {problem}. Fix the row, or set "
            f"on_bad_row='skip' (data.on_bad_row=skip) to drop malformed rows with a count."
        )


def _file_kind(path: str) -> str:
    lower = path.lower()
    for ext, kind in ((".parquet", "parquet"), (".jsonl", "jsonl"), (".json", "json")):
        if lower.endswith(ext):
            return kind
    raise UserInputError(
        f"{path}: unknown data file type; use .parquet, .jsonl or .json (verl row format)"
    )


def read_rows(path: str, on_bad_row: str = "error") -> Iterator[tuple[int, dict | BadRowError]]:
    """Yield ``(row_index, row_dict)`` for every row of one file, in file order.

    A jsonl line that is not a JSON object yields ``(i, BadRowError)`` when on_bad_row="skip"
    (the caller counts it) and raises when on_bad_row="error". Blank jsonl lines are ignored
    and do not take a row index.
    """
    if on_bad_row not in ON_BAD_ROW:
        raise ValueError(f"on_bad_row must be one of {ON_BAD_ROW}, got {on_bad_row!r}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file not found: {path}")
    kind = _file_kind(path)
    if kind == "parquet":
        import pyarrow.parquet as pq

        for i, row in enumerate(pq.read_table(path).to_pylist()):
            yield i, row
        return
    if kind == "json":
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if isinstance(data, dict) and isinstance(data.get("data"), list):
            data = data["data"]
        if not isinstance(data, list):
            raise UserInputError(f"{path}: a .json data file must hold a list of row objects")
        for i, row in enumerate(data):
            yield i, row
        return
    with open(path, encoding="utf-8") as f:
        i = 0
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                err = BadRowError(path, i, "<json>", f"line {line_no} is not valid JSON ({e.msg})")
                if on_bad_row == "error":
                    raise err from None
                yield i, err
            else:
                yield i, row
            i += 1


def _check_messages(path: str, i: int, key: str, prompt: Any) -> list[dict[str, str]]:
    if prompt is None:
        raise BadRowError(path, i, key, "missing")
    if hasattr(prompt, "tolist"):  # numpy arrays from pandas-written parquet
        prompt = prompt.tolist()
    if not isinstance(prompt, list) or not prompt:
        raise BadRowError(
            path, i, key,
            f"must be a non-empty list of chat messages [{{'role': 'user', 'content': ...}}], "
            f"got {type(prompt).__name__}",
        )
    messages = []
    for j, m in enumerate(prompt):
        if not isinstance(m, dict):
            raise BadRowError(path, i, f"{key}[{j}]", f"must be a dict, got {type(m).__name__}")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or role not in ROLES:
            raise BadRowError(path, i, f"{key}[{j}].role", f"must be one of {ROLES}, got {role!r}")
        if not isinstance(content, str):
            raise BadRowError(
                path, i, f"{key}[{j}].content", f"must be a string, got {type(content).__name__}"
            )
        messages.append({"role": role, "content": content})
    return messages


def _check_ground_truth(path: str, i: int, gt: Any) -> str | list[str]:
    field = "reward_model.ground_truth"
    if gt is None:
        raise BadRowError(path, i, field, "missing")
    if hasattr(gt, "tolist"):
        gt = gt.tolist()
    if isinstance(gt, bool):
        raise BadRowError(path, i, field, "must be a string (or number), got bool")
    if isinstance(gt, (int, float)):
        return str(gt)
    if isinstance(gt, str):
        return gt
    if isinstance(gt, list) and gt and all(isinstance(g, str) for g in gt):
        return gt
    raise BadRowError(
        path, i, field, f"must be a string, a number or a list of strings, got {type(gt).__name__}"
    )


def validate_row(path: str, i: int, row: Any, prompt_key: str = "prompt") -> dict[str, Any]:
    """Check one row; return ``{data_source, prompt, ability, ground_truth, extra_info}``.

    Raises BadRowError(path, i, field, problem) on the first problem found.
    """
    if not isinstance(row, dict):
        raise BadRowError(path, i, "<row>", f"must be an object, got {type(row).__name__}")
    messages = _check_messages(path, i, prompt_key, row.get(prompt_key))
    data_source = row.get("data_source")
    if not isinstance(data_source, str) or not data_source:
        raise BadRowError(
            path, i, "data_source",
            "missing" if data_source is None else f"must be a non-empty string, got {data_source!r}",
        )
    rm = row.get("reward_model")
    if rm is None:
        raise BadRowError(path, i, "reward_model", "missing (needs {'ground_truth': ...})")
    if not isinstance(rm, dict):
        raise BadRowError(path, i, "reward_model", f"must be a dict, got {type(rm).__name__}")
    ground_truth = _check_ground_truth(path, i, rm.get("ground_truth"))
    ability = row.get("ability")
    if ability is not None and not isinstance(ability, str):
        raise BadRowError(path, i, "ability", f"must be a string, got {type(ability).__name__}")
    extra = row.get("extra_info")
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise BadRowError(path, i, "extra_info", f"must be a dict, got {type(extra).__name__}")
    return {
        "data_source": data_source,
        "prompt": messages,
        "ability": ability or "",
        "ground_truth": ground_truth,
        "extra_info": dict(extra),
    }


def write_rows(rows: list[dict[str, Any]], path: str) -> None:
    """Write rows to ``.parquet`` or ``.jsonl`` (by extension), creating the parent folder."""
    kind = _file_kind(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    elif kind == "jsonl":
        with open(path, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    else:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(rows, f, ensure_ascii=False)
