"""Every file in configs/ loads, validates and prints with `python -m megarl.config show`; the
recipes set what their names promise."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megarl.config import available_configs, config_dir, load_config, to_dict
from megarl.config.__main__ import main

REPO = Path(__file__).resolve().parents[2]
# recipes: every YAML but the demo overlays in demo/ (applied on top of a recipe, not run alone)
FILES = sorted(p.relative_to(config_dir()).as_posix() for p in config_dir().rglob("*.yaml")
               if p.relative_to(config_dir()).parts[0] != "demo")
DEMO = ["pure_prm_vr", "pure_prm", "pure_vr", "pacs", "grpo", "rloo", "ppo"]


def test_expected_recipes_exist():
    names = set(available_configs())
    assert {"base", *DEMO} <= names
    assert {"real/pure_prm_vr_qwen25_math_7b", "real/pacs_qwen25_7b", "real/grpo_qwen25_7b"} <= names
    assert len(FILES) == len(names)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "megarl.config", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.e2e  # starts the config CLI in another process
def test_show_subprocess_prints_resolved_yaml():
    out = run_cli("show", "pure_prm_vr", "actor_rollout_ref.actor.optim.lr=1e-6")
    assert out.returncode == 0, out.stderr
    shown = yaml.safe_load(out.stdout)
    assert shown == to_dict(load_config("pure_prm_vr", ["actor_rollout_ref.actor.optim.lr=1e-6"]))
    assert shown["actor_rollout_ref"]["actor"]["optim"]["lr"] == 1e-6


@pytest.mark.e2e  # starts the config CLI in another process
def test_cli_error_exit_2_without_traceback():
    out = run_cli("show", "grpo", "actor_rollout_ref.rollout.nn=3")
    assert out.returncode == 2
    assert "actor_rollout_ref.rollout.nn: unknown key; did you mean n?" in out.stderr
    assert "Traceback" not in out.stderr
    assert yaml.safe_load(out.stdout)["actor_rollout_ref"]["rollout"]["n"] == 8  # what resolved
    out = run_cli("check", "grpo")
    assert out.returncode == 0 and "ok" in out.stdout
    out = run_cli("check", "no_such_recipe")
    assert out.returncode == 2 and "Traceback" not in out.stderr and "available:" in out.stderr


@pytest.mark.parametrize("name", FILES)
def test_show_every_file(name, capsys):
    assert main(["show", name]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown == to_dict(load_config(name))
    code = main(["check", name])
    out, err = capsys.readouterr()
    if not name.startswith("real/"):
        assert code == 0 and out.endswith(f"{name}: ok\n"), err
        return
    # the real-model recipes read data (and models) that are not on this machine: the
    # preflight names them, and nothing else
    paths = ("data.train_files:", "data.val_files:", "actor_rollout_ref.model.path:",
             "reward_model.model.path:")
    assert code == 2 and err.splitlines()[-1].startswith(f"{name}: ")
    assert all(line.startswith(paths) for line in err.splitlines()[:-1]), err


@pytest.mark.parametrize("name", FILES)
def test_every_recipe_round_trips(name, tmp_path):
    cfg = load_config(name)
    dumped = tmp_path / "dumped.yaml"
    dumped.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    assert load_config(str(dumped)) == cfg


@pytest.mark.parametrize("name", DEMO + ["base"])
def test_demo_recipes_run_on_the_embedded_default(name):
    cfg = load_config(name)
    arr = cfg.actor_rollout_ref
    assert cfg.data.train_files == "embedded://arith/train.parquet"
    assert cfg.data.val_files == "embedded://arith/val.parquet"
    assert arr.model.path == "embedded://policy" and arr.model.dtype == "fp32"
    assert cfg.reward_model.model.path == "embedded://prm"
    assert cfg.critic.model.path == "embedded://critic"
    assert (cfg.data.train_batch_size, cfg.data.max_prompt_length, cfg.data.max_response_length) == (64, 64, 64)
    assert arr.actor.optim.lr == 3e-4 and arr.actor.optim.betas == [0.9, 0.98]
    assert arr.rollout.temperature == 1.0 and arr.rollout.name == "torch"
    assert arr.actor.strategy == "torch"
    assert cfg.launch.nnodes * cfg.launch.nproc_per_node == 1
    if name != "ppo":
        assert arr.rollout.n == 8
    assert (config_dir() / "demo" / f"{name}.yaml").is_file()
    assert "demo-scale" in (config_dir() / "demo" / "base.yaml").read_text()


@pytest.mark.parametrize(
    "name, enable, manager",
    [("pure_prm_vr", True, "prime"), ("pure_prm", True, "blank"), ("pure_vr", False, "prime")],
)
def test_pure_modes(name, enable, manager):
    cfg = load_config(name)
    assert cfg.algorithm.adv_estimator == "pure_rloo"
    assert (cfg.reward_model.enable, cfg.reward_model.reward_manager) == (enable, manager)
    assert cfg.reward_model.credit_assignment == 0.1
    assert cfg.critic.enable is False and not cfg.pacs.enable


@pytest.mark.parametrize("name, estimator", [("grpo", "grpo"), ("rloo", "rloo"), ("ppo", "gae")])
def test_estimator_recipes(name, estimator):
    cfg = load_config(name)
    assert cfg.algorithm.adv_estimator == estimator
    assert cfg.critic.enable is (estimator == "gae")
    assert not cfg.pacs.enable and not cfg.reward_model.enable


def test_pacs_recipe():
    cfg = load_config("pacs")
    assert cfg.pacs.enable and cfg.critic.enable is False
    assert (cfg.pacs.beta, cfg.pacs.reward_method, cfg.pacs.adv_estimator, cfg.pacs.weight_mode) == (1.0, "1", "rloo", "question")


def test_real_configs():
    pure = load_config("real/pure_prm_vr_qwen25_math_7b")
    assert pure.reward_model.model.path == "jinachris/PURE-PRM-7B"
    assert pure.actor_rollout_ref.model.path == "Qwen/Qwen2.5-Math-7B"
    assert pure.algorithm.adv_estimator == "pure_rloo" and pure.reward_model.credit_assignment == 0.1
    assert (pure.reward_model.enable, pure.reward_model.reward_manager) == (True, "prime")
    assert pure.actor_rollout_ref.actor.optim.lr in (1e-6, 5e-7)
    assert pure.actor_rollout_ref.rollout.n in (4, 8)
    pacs = load_config("real/pacs_qwen25_7b")
    assert pacs.pacs.enable and pacs.data.train_batch_size == 1024 and pacs.actor_rollout_ref.rollout.n == 8
    assert pacs.actor_rollout_ref.actor.optim.lr == 1e-6 and pacs.trainer.total_training_steps == 300
    assert pacs.launch.nnodes == 8 and pacs.trainer.n_gpus_per_node == 8
    grpo = load_config("real/grpo_qwen25_7b")
    assert grpo.algorithm.adv_estimator == "grpo" and grpo.actor_rollout_ref.actor.use_kl_loss
    for name in ("real/pure_prm_vr_qwen25_math_7b", "real/pacs_qwen25_7b", "real/grpo_qwen25_7b"):
        cfg = load_config(name)
        assert "embedded://" not in yaml.safe_dump(to_dict(cfg)), name
        header = (config_dir() / f"{name}.yaml").read_text().split("\n\n", 1)[0]
        assert "your own weights" in header
