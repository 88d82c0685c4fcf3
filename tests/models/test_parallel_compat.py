"""The model takes TP (DTensor) and FSDP2 from outside: 2 gloo ranks via torchrun."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from warm_runs import run_script

from megarl.models.testing import make_tiny_hf_model

WORKER = Path(__file__).resolve().parents[1] / "dist" / "models_parallel_worker.py"


@pytest.mark.dist
def test_tp_and_fsdp2_match_single_process(tmp_path):
    # qwen3: q/k norm over head_dim survives head sharding; 2 kv heads split 1 per rank; tied
    folder = make_tiny_hf_model(tmp_path / "m", "qwen3", tie_word_embeddings=True, tokenizer=False)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # as torchrun --standalone --nproc_per_node=2, the ranks forked from a warm interpreter
    proc = run_script([str(WORKER), str(folder)], Path.cwd(), env, timeout=180, nproc=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
