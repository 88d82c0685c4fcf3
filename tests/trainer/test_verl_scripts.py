"""verl users' launch scripts, as written, read by megarl.

``verl_scripts/NAME.args`` holds the arguments five of verl's example scripts pass to
``python3 -m verl.trainer.main_ppo`` (verl commit b178a3cd5; the shell expanded them with
HOME=/home/user and the scripts' own variables), one per line, nothing removed. Only the entry
point changes: ``python -m megarl.config check RECIPE`` (or ``launch/train.py --config RECIPE``),
and verl's ``--config-name=ppo_megatron_trainer.yaml`` becomes megarl's strategy switch.

Each passes the config check for the world size it asks for (trainer.nnodes x
trainer.n_gpus_per_node), its values land on megarl's keys, and the keys megarl accepts without
effect are named in startup notices.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file
from trainer_helpers import metrics, train, train_rows
from wandb_records import read_offline_run

from megarl.config.loader import resolve_config
from megarl.data.locations import resolve_path

HERE = Path(__file__).resolve().parent / "verl_scripts"
MEGATRON = ["actor_rollout_ref.actor.strategy=megatron"]  # verl: --config-name=ppo_megatron_trainer

# name: (verl script, megarl recipe, entry-point arguments, notices expected (key prefixes))
SCRIPTS = {
    "run_qwen2-7b_math": ("examples/grpo_trainer/run_qwen2-7b_math.sh", "grpo", [],
                          ["actor_rollout_ref.ref.fsdp_config.param_offload=True"]),
    "run_qwen2-7b_math_megatron": ("examples/grpo_trainer/run_qwen2-7b_math_megatron.sh", "grpo",
                                   MEGATRON, []),
    "run_deepseek7b_llm": ("examples/ppo_trainer/run_deepseek7b_llm.sh", "ppo", [], []),
    "run_qwen2-7b_math_rf": ("examples/reinforce_plus_plus_trainer/run_qwen2-7b_math_rf.sh",
                             "grpo", [], ["actor_rollout_ref.ref.fsdp_config.param_offload=True"]),
    "test_gspo_3b_math": ("examples/gspo_trainer/test_gspo_3b_math.sh", "grpo", [],
                          ["actor_rollout_ref.actor.entropy_checkpointing=True",
                           "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True",
                           "actor_rollout_ref.actor.fsdp_config.param_offload=True",
                           "actor_rollout_ref.ref.fsdp_config.param_offload=True"]),
}


def script_args(name: str) -> list[str]:
    return (HERE / f"{name}.args").read_text().splitlines()


def _value(args: list[str], key: str, default: str | None = None) -> str:
    found = [a.split("=", 1)[1] for a in args if a.lstrip("+").split("=", 1)[0] == key]
    assert found or default is not None, f"{key} not in the script"
    return found[-1] if found else default


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_verl_script_passes_config_check(name):
    _, recipe, entry, expected_notices = SCRIPTS[name]
    args = script_args(name)
    r = resolve_config(recipe, [*entry, *args])
    cfg = r.config
    world = int(_value(args, "trainer.nnodes")) * int(_value(args, "trainer.n_gpus_per_node"))
    assert cfg.launch.nnodes * cfg.launch.nproc_per_node == world
    arr = cfg.actor_rollout_ref
    assert arr.model.path == _value(args, "actor_rollout_ref.model.path")
    assert arr.actor.optim.lr == float(_value(args, "actor_rollout_ref.actor.optim.lr"))
    assert arr.rollout.n == int(_value(args, "actor_rollout_ref.rollout.n", "1"))  # verl: 1
    assert arr.rollout.name == "vllm"
    assert cfg.algorithm.adv_estimator == _value(args, "algorithm.adv_estimator")
    assert cfg.data.train_batch_size == int(_value(args, "data.train_batch_size"))
    assert list(cfg.trainer.logger) == ["console", "wandb"]
    if entry == MEGATRON:
        assert arr.actor.parallel.tensor_model_parallel_size == 2
        assert arr.actor.parallel.pipeline_model_parallel_size == 2
    assert sorted(n.split(" (from", 1)[0] for n in r.notices) == sorted(expected_notices)


# Two of them shrunk to the embedded demo: paths and sizes appended at the end of the line,
# nothing removed (verl_scripts/shrink_to_demo.args; rollout TP 2 and a small memory share fit
# 2 CPU ranks, enforce_eager skips vLLM's compile at start).
SHRUNK = {
    "run_qwen2-7b_math": [],
    "run_deepseek7b_llm": ["critic.model.path=embedded://critic",
                           "critic.ppo_micro_batch_size_per_gpu=4"],
}


def fp32_logprob_gap_bound(model_dir: str, max_model_len: int) -> float:
    """Bound on |engine - trainer| of a sampled token's logprob when vLLM and the trainer run
    the same fp32 weights: the two forwards differ only in the order of their reductions.

    - A reordered sum of K fp32 terms moves by about sqrt(K) u of the terms' magnitude
      (u = 2^-24; rounding errors as a random walk), K at most max(H, I, positions).
    - A logit sits behind n = 8 L + 2 reductions (per layer: 2 RMSNorms, QKV, scores, the
      weighted sum over positions, o_proj, gate/up, down; then the final norm and the head),
      whose independent moves add in quadrature: sqrt(n).
    - Logits are at most max_v |e_v| max|g| sqrt(H) (tied head e, final norm gain g:
      Cauchy-Schwarz on a normalised hidden state of norm sqrt(H)).
    - logprob = z_y - logsumexp(z) moves by at most twice the largest logit's move.
    The demo policy: 2 x sqrt(34) x sqrt(384) x 2^-24 x 63.5 = 8.7e-4."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    weights = load_file(str(Path(model_dir) / "model.safetensors"))
    assert cfg["tie_word_embeddings"], "the logit bound reads the head from the embedding"
    h = cfg["hidden_size"]
    logit_max = float(weights["model.embed_tokens.weight"].norm(dim=1).max()
                      * weights["model.norm.weight"].abs().max()) * h**0.5
    reductions = 8 * cfg["num_hidden_layers"] + 2
    k = max(h, cfg["intermediate_size"], max_model_len)
    return 2 * reductions**0.5 * k**0.5 * 2.0**-24 * logit_max


@pytest.mark.dist
@pytest.mark.vllm
@pytest.mark.parametrize("name", sorted(SHRUNK))
def test_verl_script_shrunk_to_the_demo_trains_two_steps_on_two_ranks(name, tmp_path,
                                                                     demo_assets, monkeypatch):
    """Two steps on two ranks with vLLM (TP=2, fp32) and the scripts' wandb logging; on step 1
    the engine's sampled-token logprobs match the trainer's recompute within
    `fp32_logprob_gap_bound` (8.7e-4; measured 5.7e-6 on an Intel Xeon, mean 4.3e-7).
    Planted: the engine logprobs carried in bf16 (rounded before the check) -> gap 1.3e-2 ->
    fails."""
    monkeypatch.setenv("WANDB_MODE", "offline")  # the scripts log to wandb
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    _, recipe, entry, _ = SCRIPTS[name]
    shrink = script_args("shrink_to_demo") + SHRUNK[name]
    proc = train(tmp_path / "run", recipe, *entry, *script_args(name), *shrink, nproc=2,
                 fast=False)
    rows = train_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["actor/grad_norm"] > 0 for r in rows)
    if recipe == "ppo":
        assert all("critic/vf_loss" in r for r in rows)
    # vLLM's logprobs checked on step 1, at the model's dtype (fp32 here)
    cfg = resolve_config(recipe, [*entry, *script_args(name), *shrink]).config
    assert cfg.actor_rollout_ref.model.dtype == "fp32"
    bound = fp32_logprob_gap_bound(resolve_path(cfg.actor_rollout_ref.model.path),
                                   cfg.data.max_prompt_length + cfg.data.max_response_length)
    assert rows[0]["rollout/logprob_abs_diff_max"] < bound, (rows[0], bound)
    assert "notice: trainer.total_epochs=15" in proc.stdout
    # the scripts' logger=['console','wandb']: one offline run (rank 0) holding every step
    run = read_offline_run(tmp_path)
    assert run["project"] == _value(script_args(name), "trainer.project_name")
    assert run["name"] == _value(script_args(name), "trainer.experiment_name")
    logged = run["history"]
    assert sorted(logged) == [r["step"] for r in metrics(tmp_path / "run")]  # 0: validation
    for row in rows:
        for key in ("actor/grad_norm", "actor/pg_loss", "response_length/mean"):
            assert logged[row["step"]][key] == pytest.approx(row[key], rel=1e-6), key
