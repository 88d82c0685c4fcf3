"""Loading: files, extends chains, overrides, interpolation, aliases, derived values, round trip."""

from __future__ import annotations

import dataclasses

import pytest

from megarl.config import (
    Config,
    ConfigError,
    config_dir,
    load_config,
    parse_override,
    to_dict,
    to_yaml,
    validate,
)

BASE = """
data:
  train_files: train.parquet
  train_batch_size: 32
  max_response_length: 128
actor_rollout_ref:
  model: {path: base/model}
  actor:
    ppo_mini_batch_size: 16
    optim: {lr: 3.0e-4, betas: [0.9, 0.98]}
  rollout: {n: 4, temperature: 0.7}
algorithm: {adv_estimator: grpo}
trainer: {project_name: proj, experiment_name: base}
"""


def write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


@pytest.fixture
def base(tmp_path):
    return write(tmp_path, "base.yaml", BASE)


# ---- overrides ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("a.b=1", ("set", "a.b", 1)),
        ("a.b=1e-6", ("set", "a.b", 1e-6)),
        ("a.b=3.0e-4", ("set", "a.b", 3e-4)),
        ("a.b=-1", ("set", "a.b", -1)),
        ("a.b=true", ("set", "a.b", True)),
        ("a.b=null", ("set", "a.b", None)),
        ("a.b=[x,y]", ("set", "a.b", ["x", "y"])),
        ("a.b=[1, 2]", ("set", "a.b", [1, 2])),
        ("a.b={k: 1}", ("set", "a.b", {"k": 1})),
        ("a.b='1'", ("set", "a.b", "1")),
        ("a.b=x=y", ("set", "a.b", "x=y")),
        ("a.b=", ("set", "a.b", "")),
        ("+a.b=2", ("set", "a.b", 2)),
        ("++a.b=2", ("set", "a.b", 2)),
        ("~a.b", ("del", "a.b", None)),
    ],
)
def test_parse_override(text, expected):
    op, key, value = parse_override(text)
    assert (op, key) == expected[:2]
    assert value == expected[2] and type(value) is type(expected[2])


def test_overrides_of_nested_keys_lists_null_and_floats(base):
    cfg = load_config(
        base,
        [
            "actor_rollout_ref.actor.optim.lr=1e-6",
            "actor_rollout_ref.actor.optim.betas=[0.8,0.95]",
            'actor_rollout_ref.rollout.stop=["\\n\\n",END]',  # YAML double quotes: escapes
            "actor_rollout_ref.rollout.stop_token_ids=[7, 9]",
            "actor_rollout_ref.actor.grad_clip=null",
            "data.val_files=[a.parquet,b.parquet]",
            "+custom_reward_function.reward_kwargs={scale: 2}",
            "reward_model.overlong_buffer.enable=true",
            "reward_model.overlong_buffer.len=32",
        ],
    )
    actor = cfg.actor_rollout_ref.actor
    assert actor.optim.lr == 1e-6
    assert actor.optim.betas == [0.8, 0.95]
    assert actor.optim.weight_decay == 0.01  # untouched sibling keeps the verl default
    assert cfg.actor_rollout_ref.rollout.stop == ["\n\n", "END"]
    assert cfg.actor_rollout_ref.rollout.stop_token_ids == [7, 9]
    assert actor.grad_clip is None
    assert cfg.data.val_files == ["a.parquet", "b.parquet"]
    assert cfg.custom_reward_function.reward_kwargs == {"scale": 2}
    assert cfg.reward_model.overlong_buffer.len == 32


def test_later_override_wins_and_overrides_beat_files(base):
    cfg = load_config(base, ["actor_rollout_ref.rollout.n=6", "actor_rollout_ref.rollout.n=8"])
    assert cfg.actor_rollout_ref.rollout.n == 8
    assert cfg.actor_rollout_ref.rollout.temperature == 0.7  # from the file


def test_tilde_resets_to_default(base):
    cfg = load_config(base, ["~actor_rollout_ref.rollout.temperature"])
    assert cfg.actor_rollout_ref.rollout.temperature == 1.0
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref.rollout.temprature: unknown key; did you mean temperature\?"):
        load_config(base, ["~actor_rollout_ref.rollout.temprature"])


def test_interpolation(base):
    cfg = load_config(base, ["trainer.experiment_name=${algorithm.adv_estimator}_n${actor_rollout_ref.rollout.n}"])
    assert cfg.trainer.experiment_name == "grpo_n4"
    # the default of default_local_dir interpolates project and experiment names
    assert cfg.trainer.default_local_dir == "runs/proj/grpo_n4"
    cfg = load_config(base, ["actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=${actor_rollout_ref.actor.ppo_max_token_len_per_gpu}",
                             "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=8192"])
    assert cfg.actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu == 8192


# ---- extends ------------------------------------------------------------------------------------


def test_extends_chain(tmp_path, base):
    write(tmp_path, "mid.yaml", "extends: base\nactor_rollout_ref:\n  rollout: {n: 8}\ntrainer: {experiment_name: mid}\n")
    leaf = write(tmp_path, "sub/leaf.yaml", "extends: ../mid.yaml\nactor_rollout_ref:\n  rollout: {temperature: 1.0}\n")
    cfg = load_config(leaf, ["trainer.experiment_name=leaf"])
    ro = cfg.actor_rollout_ref.rollout
    assert (ro.n, ro.temperature) == (8, 1.0)  # mid's n, leaf's temperature
    assert cfg.actor_rollout_ref.actor.optim.lr == 3e-4  # from base, two levels up
    assert cfg.trainer.experiment_name == "leaf"


def test_extends_list_merges_in_order(tmp_path, base):
    write(tmp_path, "a.yaml", "actor_rollout_ref: {rollout: {n: 2, top_p: 0.9}}\n")
    write(tmp_path, "b.yaml", "actor_rollout_ref: {rollout: {n: 6}}\n")
    leaf = write(tmp_path, "leaf.yaml", "extends: [base, a, b]\n")
    ro = load_config(leaf).actor_rollout_ref.rollout
    assert (ro.n, ro.top_p) == (6, 0.9)


def test_extends_falls_back_to_config_dir(tmp_path):
    leaf = write(tmp_path, "mine.yaml", "extends: grpo\nactor_rollout_ref: {rollout: {n: 4}}\n")
    cfg = load_config(leaf)
    assert cfg.actor_rollout_ref.actor.use_kl_loss is True  # from configs/grpo.yaml
    assert cfg.actor_rollout_ref.rollout.n == 4


def test_extends_cycle_is_reported(tmp_path):
    write(tmp_path, "x.yaml", "extends: y\n")
    write(tmp_path, "y.yaml", "extends: z\n")
    z = write(tmp_path, "z.yaml", "extends: x\n")
    with pytest.raises(ConfigError, match=r"^extends: cycle .*z.yaml -> .*x.yaml -> .*y.yaml -> .*z.yaml"):
        load_config(z)


def test_extends_self_cycle(tmp_path):
    me = write(tmp_path, "me.yaml", "extends: me\n")
    with pytest.raises(ConfigError, match="^extends: cycle"):
        load_config(me)


def test_extends_missing(tmp_path):
    leaf = write(tmp_path, "leaf.yaml", "extends: nowhere\n")
    with pytest.raises(ConfigError, match=r"^extends: cannot find 'nowhere'"):
        load_config(leaf)


def test_bare_names_resolve_in_config_dir():
    assert config_dir().name == "configs" and (config_dir() / "base.yaml").is_file()
    a = load_config("pure_prm_vr")
    b = load_config("pure_prm_vr.yaml")
    c = load_config(str(config_dir() / "pure_prm_vr.yaml"))
    d = load_config("real/pacs_qwen25_7b")
    assert a == b == c
    assert d.pacs.enable


# ---- aliases ------------------------------------------------------------------------------------


def test_pacs_prefix_alias_in_overrides_and_files(tmp_path, base):
    cfg = load_config(base, ["actor_rollout_ref.pacs.enable=true", "actor_rollout_ref.pacs.beta=2.0",
                             "actor_rollout_ref.pacs.reward_method=2"])
    assert cfg.pacs.enable and cfg.pacs.beta == 2.0 and cfg.pacs.reward_method == "2"
    leaf = write(tmp_path, "p.yaml", "extends: base\nactor_rollout_ref:\n  pacs: {enable: true, weight_mode: only_positive}\n")
    cfg = load_config(leaf, ["pacs.beta=0.5"])
    assert cfg.pacs.weight_mode == "only_positive" and cfg.pacs.beta == 0.5
    # an override in either spelling beats a file in either spelling
    leaf2 = write(tmp_path, "p2.yaml", "extends: base\npacs: {beta: 3.0}\n")
    assert load_config(leaf2, ["actor_rollout_ref.pacs.beta=4.0"]).pacs.beta == 4.0


def test_alias_and_canonical_key_conflict_in_one_layer(base):
    with pytest.raises(ConfigError, match=r"^pacs.beta: also given as actor_rollout_ref.pacs.beta"):
        load_config(base, ["pacs.beta=1.0", "actor_rollout_ref.pacs.beta=2.0"])
    # the same value twice is fine
    assert load_config(base, ["pacs.beta=2.0", "actor_rollout_ref.pacs.beta=2.0"]).pacs.beta == 2.0


@pytest.mark.parametrize(
    "override, getter, expected",
    [
        ("actor_rollout_ref.actor.strategy=fsdp", lambda c: c.actor_rollout_ref.actor.strategy, "torch"),
        ("actor_rollout_ref.actor.strategy=fsdp2", lambda c: c.actor_rollout_ref.actor.strategy, "torch"),
        ("actor_rollout_ref.rollout.name=hf", lambda c: c.actor_rollout_ref.rollout.name, "torch"),
        ("reward_model.credit_assignment='strict min-form'", lambda c: c.reward_model.credit_assignment, "min"),
        ("reward_model.credit_assignment=gamma-decay", lambda c: c.reward_model.credit_assignment, "sum"),
        ("reward_model.credit_assignment=0.5", lambda c: c.reward_model.credit_assignment, 0.5),
        ("reward_model.credit_assignment=1", lambda c: c.reward_model.credit_assignment, 1.0),
        ("actor_rollout_ref.actor.optim.warmup_style=cosine", lambda c: c.actor_rollout_ref.actor.optim.lr_scheduler_type, "cosine"),
        ("critic.optim.warmup_style=cosine", lambda c: c.critic.optim.lr_scheduler_type, "cosine"),
        ("actor_rollout_ref.model.dtype=bfloat16", lambda c: c.actor_rollout_ref.model.dtype, "bf16"),
        ("algorithm.kl_ctl.init_kl_coef=0.02", lambda c: c.algorithm.kl_ctrl.kl_coef, 0.02),
        ("reward_model.custom_reward_function.path=my_reward.py", lambda c: c.custom_reward_function.path, "my_reward.py"),
        ("actor_rollout_ref.rollout.enable_sleep=false", lambda c: c.actor_rollout_ref.rollout.free_cache_engine, False),
        ("trainer.max_actor_ckpt_to_keep=3", lambda c: c.trainer.max_ckpt_to_keep, 3),
        ("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
         lambda c: c.actor_rollout_ref.actor.parallel.tensor_model_parallel_size, 2),
        ("trainer.resume_mode=disable", lambda c: c.trainer.resume, "disable"),
        ("trainer.resume_from_path=/ckpt/step_10", lambda c: c.trainer.resume, "/ckpt/step_10"),
    ],
)
def test_aliases(base, override, getter, expected):
    # TP=2 needs 2 ranks; harmless for the other cases
    cfg = load_config(base, [override, "launch.nproc_per_node=2"])
    got = getter(cfg)
    assert got == expected and type(got) is type(expected)


def test_resume_mode_resume_path(base):
    cfg = load_config(base, ["trainer.resume_mode=resume_path", "trainer.resume_from_path=/c/global_step_5"])
    assert cfg.trainer.resume == "/c/global_step_5"
    with pytest.raises(ConfigError, match=r"^trainer.resume_mode: 'resume_path' needs trainer.resume_from_path"):
        load_config(base, ["trainer.resume_mode=resume_path"])
    with pytest.raises(ConfigError, match=r"^trainer.resume_mode: invalid choice 'sometimes'"):
        load_config(base, ["trainer.resume_mode=sometimes"])


def test_pacs_reward_method_int_reads_as_string(base):
    assert load_config(base, ["pacs.reward_method=2"]).pacs.reward_method == "2"


# ---- derived values -----------------------------------------------------------------------------


def test_derived_values_are_filled(base):
    cfg = load_config(base, ["trainer.seed=7"])
    arr = cfg.actor_rollout_ref
    assert arr.model.tokenizer_path == "base/model"
    assert arr.actor.clip_ratio_low == arr.actor.clip_ratio_high == 0.2
    assert arr.rollout.seed == 7
    assert arr.ref.log_prob_use_dynamic_bsz is True
    assert arr.ref.log_prob_max_token_len_per_gpu == arr.rollout.log_prob_max_token_len_per_gpu == 16384
    assert cfg.critic.enable is False  # grpo: auto -> off
    assert cfg.critic.model.path == "base/model" and cfg.critic.ppo_mini_batch_size == 16
    assert cfg.reward_model.model.dtype == arr.model.dtype
    assert cfg.reward_model.ray.num_workers == cfg.reward_model.num_workers == 2
    assert cfg.trainer.nnodes == 1 and cfg.trainer.n_gpus_per_node == 1
    assert cfg.launch.log_dir == "runs/proj/base/logs"


def test_explicit_values_are_kept(base):
    cfg = load_config(base, ["actor_rollout_ref.actor.clip_ratio_high=0.28", "actor_rollout_ref.model.tokenizer_path=tok",
                             "algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=8"])
    assert cfg.actor_rollout_ref.actor.clip_ratio_low == 0.2 and cfg.actor_rollout_ref.actor.clip_ratio_high == 0.28
    assert cfg.actor_rollout_ref.model.tokenizer_path == "tok"
    assert cfg.critic.enable is True and cfg.critic.ppo_mini_batch_size == 8
    assert cfg.critic.model.tokenizer_path == "tok"


def test_verl_trainer_sizes_drive_launch(base):
    cfg = load_config(base, ["trainer.n_gpus_per_node=2"])
    assert cfg.launch.nproc_per_node == 2 and cfg.trainer.n_gpus_per_node == 2
    cfg = load_config(base, ["launch.nproc_per_node=2"])
    assert cfg.trainer.n_gpus_per_node == 2


def test_verl_world_keys_are_launch_keys_later_layer_wins(tmp_path, base):
    own = tmp_path / "own.yaml"
    own.write_text(f"extends: {base}\nlaunch:\n  nproc_per_node: 1\n  nnodes: 2\n")
    cfg = load_config(own, ["trainer.n_gpus_per_node=4"])
    assert (cfg.launch.nnodes, cfg.launch.nproc_per_node) == (2, 4)
    assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node) == (2, 4)


# ---- round trip ---------------------------------------------------------------------------------


def test_round_trip_through_yaml(tmp_path, base):
    cfg = load_config(base, ['actor_rollout_ref.rollout.stop=["\\n\\n", "a\'b"]', "reward_model.credit_assignment=min",
                             "pacs.reward_method=2", "actor_rollout_ref.actor.optim.lr=1e-6",
                             "custom_reward_function.reward_kwargs={a: [1, 2], b: x}"])
    assert cfg.actor_rollout_ref.rollout.stop == ["\n\n", "a'b"]
    text = to_yaml(cfg)
    again = load_config(write(tmp_path, "dumped.yaml", text))
    assert again == cfg
    assert to_yaml(again) == text


def test_to_dict_is_plain(base):
    d = to_dict(load_config(base))
    assert d["actor_rollout_ref"]["rollout"]["n"] == 4
    assert isinstance(d["actor_rollout_ref"]["actor"]["optim"], dict)


def test_validate_python_built_config(base):
    cfg = dataclasses.replace(load_config(base))
    cfg.actor_rollout_ref.rollout.n = 1
    cfg.algorithm.adv_estimator = "rloo"
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref.rollout.n: 1 < 2"):
        validate(cfg)
    cfg.actor_rollout_ref.rollout.n = 2
    assert validate(cfg).actor_rollout_ref.rollout.n == 2


def test_unfilled_default_config_reports_required_keys():
    with pytest.raises(ConfigError) as info:
        validate(Config())
    heads = [p.split(":")[0] for p in info.value.problems]
    assert heads == ["data.train_files", "actor_rollout_ref.model.path"]


# ---- defaults follow verl (reference-algorithms.md §2.10) ---------------------------------------


def test_defaults_follow_verl():
    c = Config()
    arr = c.actor_rollout_ref
    a, o, r = arr.actor, arr.actor.optim, arr.rollout
    assert (c.data.max_prompt_length, c.data.max_response_length, c.data.train_batch_size) == (512, 512, 1024)
    assert (r.n, r.temperature, r.top_p, r.top_k) == (1, 1.0, 1.0, -1)
    assert (r.val_kwargs.temperature, r.val_kwargs.do_sample, r.val_kwargs.n) == (0.0, False, 1)
    assert (o.lr, o.betas, o.weight_decay, o.lr_scheduler_type, o.lr_warmup_steps_ratio) == (1e-6, [0.9, 0.999], 0.01, "constant", 0.0)
    assert (a.ppo_mini_batch_size, a.ppo_epochs, a.clip_ratio, a.clip_ratio_c, a.loss_agg_mode) == (256, 1, 0.2, 3.0, "token-mean")
    assert (a.entropy_coeff, a.use_kl_loss, a.kl_loss_coef, a.kl_loss_type, a.grad_clip, a.shuffle) == (0.0, False, 0.001, "low_var_kl", 1.0, False)
    assert (c.critic.optim.lr, c.critic.cliprange_value) == (1e-5, 0.5)
    alg = c.algorithm
    assert (alg.gamma, alg.lam, alg.adv_estimator, alg.norm_adv_by_std_in_grpo, alg.use_kl_in_reward, alg.kl_penalty) == (
        1.0, 1.0, "gae", True, False, "kl")
    assert (alg.kl_ctrl.type, alg.kl_ctrl.kl_coef) == ("fixed", 0.001)
    assert c.trainer.total_epochs == 30
    # PURE / PACS defaults (reference §3.8, §4.3)
    assert (c.reward_model.credit_assignment, c.reward_model.verifiable_reward_coef, c.reward_model.step_separator) == (0.1, 1.0, "\n\n")
    p = c.pacs
    assert (p.beta, p.reward_method, p.adv_estimator, p.use_weight, p.weight_mode, p.norm_adv_by_std_in_grpo) == (
        1.0, "1", "rloo", True, "question", True)
