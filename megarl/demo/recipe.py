"""What the embedded demo build makes, and from what: the components, their dependencies, every
knob of the build (``BuildConfig``) and the metadata each built component carries.

Shared by ``megarl.demo.assets`` (which decides what to build, and where) and
``megarl.demo.build`` (the build steps), which both sit above this module.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

ASSETS_VERSION = 3
COMPONENTS = ("tokenizer", "arith", "policy", "critic", "prm", "policy_moe", "policy_tools")
DEPENDS = {"tokenizer": (), "arith": (), "policy": ("tokenizer", "arith"),
           "critic": ("policy",), "prm": ("policy",), "policy_moe": ("policy",),
           "policy_tools": ("policy",)}
ARITH_FILES = ("train.parquet", "val.parquet", "sft.parquet")


# Components trained with torch: float reductions split by the thread count, so the result
# depends on it (on some CPUs a 1-thread SFT stops before the jump RL needs).
THREADED = ("policy", "prm", "policy_tools")


def default_threads() -> int:
    """Torch threads of the build: $MEGARL_ASSETS_THREADS, else 2 (the shipped demo's)."""
    return int(os.environ.get("MEGARL_ASSETS_THREADS", "2"))


@dataclass
class BuildConfig:
    """Every knob of the build; the defaults make the shipped demo. Seeds and `threads` fix the
    result on a given machine, whatever thread setting the calling process has."""

    seed: int = 0
    # torch threads inside every build step (set for the build, restored after it)
    threads: int = field(default_factory=default_threads)
    n_train: int = 20000  # 3-op RL prompts
    n_val: int = 500  # held-out 3-op problems (excluded from every other set)
    n_sft: int = 50000  # 1-3 op SFT rows
    n_dev: int = 500  # 3-op problems for the SFT stopping rule (500: +-1.8 points at 20%)
    sft_max_steps: int = 3000
    sft_batch: int = 64
    sft_lr: float = 2e-3
    sft_warmup: int = 30
    sft_eval_every: int = 100
    sft_eval_after: int = 500
    sft_fine_eval_every: int = 20  # once the running loss is below sft_fine_below_loss
    sft_fine_below_loss: float = 0.12
    sft_fine_from_acc: float = 0.10  # ... or once a dev accuracy reaches this (the jump began;
    # the plateau before it reads 2-9%)
    # Stop at the first dev accuracy >= this: on the steep part of the curve, past the jump that
    # RL needs (RL from a start before it, ~11%, barely moves) with room left above it.
    sft_stop_at: float = 0.20
    sft_bucket_by_ops: bool = True  # each batch has one operation count (no padding waste)
    prm_steps: int = 400
    prm_batch: int = 64
    prm_lr: float = 1e-3
    n_prm_train: int = 20000
    n_prm_eval: int = 500
    moe_experts: int = 4  # the upcycled MoE policy: routed experts, top-k, expert weight noise
    moe_top_k: int = 2
    moe_noise: float = 0.05
    # The tool-using policy (policy_tools): a short SFT of the policy on 3-op traces that call
    # the calculator on a prefix of the problem (megarl.demo.tool_sft), stopped at the first
    # dev accuracy (agent loop, greedy) >= tools_stop_at.
    n_tools_sft: int = 6000  # traces
    tools_ops: tuple[int, ...] = (1, 2)  # operations the calculator computes (drawn per trace)
    n_tools_dev: int = 200  # 3-op problems for the stopping rule (+-3 points at 30%)
    tools_max_steps: int = 1500
    tools_batch: int = 32
    tools_lr: float = 2e-3
    tools_warmup: int = 30
    # no evaluation before tools_eval_after steps: the policy is still learning to read the
    # tool's answer (it copies the last digit wrong: 2-9% dev accuracy for ~300 steps)
    tools_eval_after: int = 300
    tools_eval_every: int = 20
    # Stop at the first dev accuracy >= this: past the jump (GRPO from 9% or 18%, where the
    # policy still misreads the tool's answer, gained nothing in 20 steps; docs/demo.md).
    tools_stop_at: float = 0.35
    tools_max_response_length: int = 128  # tokens of a trajectory (model + tool turns)


def read_meta(path: Path) -> dict | None:
    """The ``metadata.json`` of the component folder ``path``; None when it is missing (not
    built) or not valid JSON."""
    try:
        with open(path / "metadata.json", encoding="utf-8") as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None
