"""Metrics as one JSON object per line: ``{"step": N, "<name>": value, ...}``: the run's record
(always written; plots, tests and resume checks read it)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path


def _jsonable(value: float) -> float | str:
    # JSON has no NaN/inf; keep them readable and round-trippable.
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    return value


class JsonlWriter:
    """A sink (`megarl.logging.sink.Sink`) appending one line per ``log``; flushed and fsynced
    so a hard kill loses nothing written.

    On resume the file is truncated to the lines with ``step <= resume_step`` so that a run that
    died after logging but before checkpointing does not log the same step twice.
    """

    def __init__(self, path: str | os.PathLike, resume_step: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.steps: set[int] = set()  # the steps of the rows in the file
        if resume_step is not None and self.path.exists():
            kept = [r for r in read_jsonl(self.path) if r.get("step", 0) <= resume_step]
            self.steps = {r.get("step", 0) for r in kept}
            tmp = self.path.with_suffix(".tmp")
            with open(tmp, "w") as f:
                for row in kept:
                    f.write(json.dumps(row, sort_keys=True) + "\n")
            os.replace(tmp, self.path)
        elif resume_step is None and self.path.exists():
            self.path.unlink()
        self._file = open(self.path, "a")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.steps.add(step)
        row = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row, sort_keys=True) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """All complete rows of a metrics file (a torn last line from a kill is ignored)."""
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return rows
