"""``trainer.rollout_data_dir`` / ``validation_data_dir``: each step's training or validation
generations as ``{step}.jsonl`` (verl's format:
one line per response with ``input``, ``output``, ``gts``, ``score`` and ``step``), written by
rank 0 for reading and diffing runs."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from megarl.trainer.batch import RolloutSample


def dump_generations(
    directory: str | os.PathLike,
    step: int,
    samples: list[RolloutSample],
    scores: list[float],
    tokenizer: Any,
) -> Path:
    """Write ``directory/{step}.jsonl`` (prompt and response decoded without special tokens,
    as verl does) and return its path."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    inputs = tokenizer.batch_decode([s.prompt_ids for s in samples], skip_special_tokens=True)
    outputs = tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
    path = out / f"{step}.jsonl"
    tmp = path.with_suffix(".jsonl.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for s, text_in, text_out, score in zip(samples, inputs, outputs, scores):
            row = {"input": text_in, "output": text_out, "gts": s.ground_truth,
                   "score": float(score), "step": step}
            f.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
    tmp.replace(path)
    return path
