"""The runs whose resolved config is pinned by ``tests/config/snapshots/``: every recipe as is
(the embedded demo when no model is named), and the overrides the trainer tests and ``make demo``
put on top. ``python tests/config/embedded_cases.py`` rewrites the snapshots; do that only for a
change meant to alter what these runs resolve to, and say so in the commit."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SNAPSHOTS = HERE / "snapshots"

SEEDS = ["grpo", "pacs", "ppo", "pure_prm", "pure_prm_vr", "pure_vr", "rloo"]
REAL = ["real/grpo_qwen25_7b", "real/pacs_qwen25_7b", "real/pure_prm_vr_qwen25_math_7b"]

# tests/trainer/trainer_helpers.py FAST, plus the 2 steps of test_trainer_recipes
FAST = [
    "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "critic.ppo_mini_batch_size=4", "actor_rollout_ref.rollout.n=4",
    "data.max_response_length=48", "trainer.test_freq=-1", "trainer.val_before_train=false",
    "trainer.logger=[jsonl]", "trainer.export_hf=false", "trainer.total_training_steps=2",
]
VLLM = ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.enforce_eager=true",
        "actor_rollout_ref.model.dtype=fp32"]


def cases() -> dict[str, tuple[str, list[str]]]:
    """case id -> (config name or path, overrides)."""
    out: dict[str, tuple[str, list[str]]] = {"base": ("base", [])}
    for name in SEEDS:
        out[name] = (name, [])
        out[f"{name}-fast"] = (name, FAST)
        mega = ["actor_rollout_ref.actor.strategy=megatron"]
        if name == "ppo":
            mega.append("critic.strategy=megatron")
        out[f"{name}-fast-megatron"] = (name, FAST + mega)
        out[f"{name}-fast-vllm"] = (name, FAST + VLLM)
    for name in REAL:
        out[name.replace("/", "-")] = (name, [])
    out["grpo-embedded-path-lr"] = ("grpo", ["actor_rollout_ref.model.path=embedded://policy",
                                             "actor_rollout_ref.actor.optim.lr=1e-3"])
    out["grpo-own-data"] = ("grpo", ["data.train_files=/data/mine.parquet", "data.shuffle=false",
                                     "data.truncation=error"])
    out["pure_prm_vr-make-demo"] = ("pure_prm_vr", ["trainer.default_local_dir=runs/demo-x"])
    out["mine_extends_grpo"] = (str(HERE / "inputs" / "mine_extends_grpo.yaml"), [])
    return out


def resolve(name: str, overrides: list[str]) -> dict:
    from megarl.config import load_config, to_dict

    return to_dict(load_config(name, overrides))


def write_all() -> None:
    import yaml

    SNAPSHOTS.mkdir(exist_ok=True)
    for case, (name, overrides) in cases().items():
        text = yaml.safe_dump(resolve(name, overrides), sort_keys=False, allow_unicode=True)
        (SNAPSHOTS / f"{case}.yaml").write_text(text)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parents[1]))
    write_all()
