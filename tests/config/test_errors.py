"""Every validation rule of megarl.config gives a ConfigError whose line starts with the dotted key
and says what to do. The configs are written by hand here (no recipe files involved)."""

from __future__ import annotations

import textwrap

import pytest
from minimal import MINIMAL

from megarl.config import ConfigError, load_config


@pytest.fixture
def minimal(tmp_path):
    path = tmp_path / "minimal.yaml"
    path.write_text(MINIMAL)
    return str(path)


def errors_of(path, overrides=()) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    err = info.value
    assert isinstance(err, ValueError)
    assert str(err) == "\n".join(err.problems)
    return err.problems


def one_error(path, overrides=()) -> str:
    problems = errors_of(path, overrides)
    assert len(problems) == 1, problems
    return problems[0]


def test_minimal_is_valid(minimal):
    cfg = load_config(minimal)
    assert cfg.data.train_batch_size == 32 and cfg.actor_rollout_ref.rollout.n == 4


# ---- unknown keys -------------------------------------------------------------------------------


def test_unknown_key_in_override_suggests_closest(minimal):
    msg = one_error(minimal, ["actor_rollout_ref.rollout.nn=3"])
    assert msg.startswith("actor_rollout_ref.rollout.nn: unknown key; did you mean n?")
    assert "override actor_rollout_ref.rollout.nn=3" in msg


def test_unknown_key_in_file_suggests_closest(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text(MINIMAL + "trainer: {experment_name: x}\n")
    msg = one_error(str(path))
    assert msg.startswith("trainer.experment_name: unknown key; did you mean experiment_name?")
    assert "typo.yaml" in msg


def test_unknown_key_without_close_match_lists_valid_keys(minimal):
    msg = one_error(minimal, ["algorithm.zzzz=1"])
    assert msg.startswith("algorithm.zzzz: unknown key; valid keys: gamma, lam, adv_estimator")


def test_unknown_section(minimal):
    msg = one_error(minimal, ["algorithms.gamma=0.9"])
    assert msg.startswith("algorithms: unknown key; did you mean algorithm?")


def test_hydra_defaults_list_is_refused(tmp_path):
    path = tmp_path / "hydra.yaml"
    path.write_text("defaults:\n  - ppo_trainer\n")
    with pytest.raises(ConfigError, match=r"^defaults: .*use `extends: <base>`"):
        load_config(str(path))


# ---- types --------------------------------------------------------------------------------------


def test_wrong_type_names_field_and_expected_type(minimal):
    assert one_error(minimal, ["data.train_batch_size=abc"]).startswith(
        "data.train_batch_size: expected int, got str 'abc'"
    )


@pytest.mark.parametrize("value", ["32.0", "true", "[32]", "null"])
def test_int_fields_are_strict(minimal, value):
    msg = one_error(minimal, [f"data.train_batch_size={value}"])
    assert msg.startswith("data.train_batch_size: expected int, got ")


def test_float_fields_take_ints_and_exponent_strings(minimal):
    cfg = load_config(minimal, ["actor_rollout_ref.actor.optim.lr=1", "actor_rollout_ref.actor.clip_ratio='2e-1'"])
    assert cfg.actor_rollout_ref.actor.optim.lr == 1.0 and isinstance(cfg.actor_rollout_ref.actor.optim.lr, float)
    assert cfg.actor_rollout_ref.actor.clip_ratio == 0.2
    msg = one_error(minimal, ["actor_rollout_ref.actor.optim.lr=fast"])
    assert msg.startswith("actor_rollout_ref.actor.optim.lr: expected float, got str 'fast'")


def test_bool_fields_are_strict(minimal):
    msg = one_error(minimal, ["data.shuffle=1"])
    assert msg.startswith("data.shuffle: expected bool (true or false), got int 1")


def test_list_element_type(minimal):
    msg = one_error(minimal, ["actor_rollout_ref.rollout.stop_token_ids=[1,x]"])
    assert msg.startswith("actor_rollout_ref.rollout.stop_token_ids[1]: expected int, got str 'x'")


def test_section_must_be_a_mapping(minimal):
    msg = one_error(minimal, ["actor_rollout_ref.actor.optim=3"])
    assert msg.startswith("actor_rollout_ref.actor.optim: expected a mapping")


# ---- choices ------------------------------------------------------------------------------------


def test_invalid_choice_lists_choices(minimal):
    msg = one_error(minimal, ["algorithm.adv_estimator=ppo"])
    assert msg.startswith("algorithm.adv_estimator: invalid choice 'ppo'")
    for name in ("'gae'", "'grpo'", "'rloo'", "'reinforce_plus_plus'", "'remax'", "'opo'", "'grpo_passk'", "'pure_rloo'"):
        assert name in msg


def test_invalid_choice_mentions_aliases(minimal):
    msg = one_error(minimal, ["actor_rollout_ref.rollout.name=tgi"])
    assert msg.startswith("actor_rollout_ref.rollout.name: invalid choice 'tgi'")
    assert "'torch'" in msg and "'vllm'" in msg and "'sglang'" in msg and "'hf' = 'torch'" in msg


def test_invalid_logger_choice(minimal):
    msg = one_error(minimal, ["trainer.logger=[console,clearml]"])
    assert msg.startswith("trainer.logger[1]: invalid choice 'clearml'")
    assert "'tensorboard'" in msg and "'jsonl'" in msg and "'swanlab'" in msg


def test_credit_assignment_bad_string(minimal):
    msg = one_error(minimal, ["reward_model.credit_assignment=median"])
    assert msg.startswith("reward_model.credit_assignment: invalid choice 'median'") or msg.startswith(
        "reward_model.credit_assignment: expected float or one of 'min', 'sum'"
    )
    assert "'min'" in msg and "'sum'" in msg and "'strict min-form' = 'min'" in msg


# ---- contradictions -----------------------------------------------------------------------------


def test_blank_reward_manager_without_prm(minimal):
    msg = one_error(minimal, ["reward_model.reward_manager=blank"])
    assert msg.startswith("reward_model.reward_manager:")
    assert "nothing would produce a reward" in msg and "reward_model.enable" in msg


@pytest.mark.parametrize("estimator", ["rloo", "grpo_passk", "pure_rloo"])
def test_group_estimators_need_n_at_least_2(minimal, estimator):
    msg = one_error(minimal, [f"algorithm.adv_estimator={estimator}", "actor_rollout_ref.rollout.n=1"])
    assert msg.startswith("actor_rollout_ref.rollout.n: 1 < 2")
    assert f"algorithm.adv_estimator={estimator}" in msg


def test_pacs_needs_n_at_least_2(minimal):
    msg = one_error(minimal, ["pacs.enable=true", "actor_rollout_ref.rollout.n=1"])
    assert msg.startswith("actor_rollout_ref.rollout.n: 1 < 2") and "PACS" in msg


def test_grpo_with_n1_runs_as_verl_with_a_notice(minimal):
    """verl's GRPO gives a group of one mean 0 and std 1 (its tuning scripts use n=1): the
    advantage is the score. Accepted, and said at start-up."""
    from megarl.config.notices import startup_notices

    cfg = load_config(minimal, ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=1"])
    lines = [n for n in startup_notices(cfg) if n.startswith("actor_rollout_ref.rollout.n=1")]
    assert len(lines) == 1 and "its advantage is its own score" in lines[0]
    two = load_config(minimal, ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2"])
    assert not [n for n in startup_notices(two) if n.startswith("actor_rollout_ref.rollout.n=")]


def test_n1_is_fine_for_reinforce_plus_plus(minimal):
    cfg = load_config(minimal, ["algorithm.adv_estimator=reinforce_plus_plus", "actor_rollout_ref.rollout.n=1"])
    assert cfg.actor_rollout_ref.rollout.n == 1


def test_gae_with_critic_disabled(minimal):
    msg = one_error(minimal, ["algorithm.adv_estimator=gae", "critic.enable=false"])
    assert msg.startswith("critic.enable: false but algorithm.adv_estimator=gae needs a critic")


def test_pacs_with_explicit_critic(minimal):
    msg = one_error(minimal, ["pacs.enable=true", "critic.enable=true"])
    assert msg.startswith("pacs.enable:") and "uses no critic" in msg and "critic.enable=false" in msg


def test_pacs_grpo_of_a_zero_reward_proxy_is_refused(minimal):
    """reward_method=1's proxy is identically 0 on a first update, so grpo's std is 0: the
    gradient of megarl.algos.pacs_loss is then 62500 against rloo's 0.083 on the same batch
    (8 responses in 2 groups). Planted: no check loads the config without an error."""
    msg = one_error(minimal, ["pacs.enable=true", "pacs.adv_estimator=grpo"])
    assert msg.startswith("pacs.adv_estimator:") and "pacs.adv_estimator=rloo" in msg
    for fix in (["pacs.adv_estimator=grpo", "pacs.norm_adv_by_std_in_grpo=false"],
                ["pacs.adv_estimator=grpo", "pacs.reward_method=2"], []):
        load_config(minimal, ["pacs.enable=true", *fix])


def test_pacs_with_gae_auto_critic(minimal):
    msg = one_error(minimal, ["pacs.enable=true", "algorithm.adv_estimator=gae"])
    assert msg.startswith("pacs.enable:") and "algorithm.adv_estimator=gae turns it on" in msg


def test_mini_batch_larger_than_train_batch(minimal):
    msg = one_error(minimal, ["actor_rollout_ref.actor.ppo_mini_batch_size=64"])
    assert msg.startswith("actor_rollout_ref.actor.ppo_mini_batch_size: 64 prompts > data.train_batch_size 32")


def test_mini_batch_not_dividing_train_batch(minimal):
    msg = one_error(minimal, ["actor_rollout_ref.actor.ppo_mini_batch_size=12"])
    assert msg.startswith("actor_rollout_ref.actor.ppo_mini_batch_size: 12 prompts does not divide")
    assert "data.train_batch_size 32" in msg


def test_critic_mini_batch_checked_when_critic_on(minimal):
    msg = one_error(minimal, ["algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=5"])
    assert msg.startswith("critic.ppo_mini_batch_size: 5 prompts does not divide")


@pytest.mark.parametrize("value", ["0.0", "-0.5"])
def test_credit_assignment_temperature_must_be_positive(minimal, value):
    msg = one_error(minimal, [f"reward_model.credit_assignment={value}"])
    assert msg.startswith("reward_model.credit_assignment: temperature must be > 0")


def test_remax_needs_sampling(minimal):
    msg = one_error(minimal, ["algorithm.adv_estimator=remax", "actor_rollout_ref.rollout.do_sample=false"])
    assert msg.startswith("algorithm.adv_estimator: remax needs actor_rollout_ref.rollout.do_sample=true")


def test_static_batching_needs_micro_batch_size(minimal):
    msg = one_error(minimal, ["actor_rollout_ref.actor.use_dynamic_bsz=false"])
    assert msg.startswith("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu: required when")
    cfg = load_config(
        minimal, ["actor_rollout_ref.actor.use_dynamic_bsz=false", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8"]
    )
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 8


def test_static_log_prob_batching_needs_micro_batch_size(minimal):
    problems = errors_of(minimal, ["actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=false"])
    # the ref inherits the rollout's log-prob batching, so both are reported
    assert [p.split(":")[0] for p in problems] == [
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
    ]


def test_prm_needs_a_model_path(minimal):
    msg = one_error(minimal, ["reward_model.enable=true"])
    assert msg.startswith("reward_model.model.path: required when reward_model.enable is true")


def test_required_keys(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("algorithm: {adv_estimator: reinforce_plus_plus}\nactor_rollout_ref: {actor: {ppo_mini_batch_size: 1024}}\n")
    problems = errors_of(str(path))
    assert problems[0].startswith("data.train_files: required")
    assert problems[1].startswith("actor_rollout_ref.model.path: required")


def test_layout_must_divide(minimal):
    problems = errors_of(minimal, ["launch.nproc_per_node=3"])  # 32 prompts over 3 data-parallel ranks
    assert problems[0].startswith("data.train_batch_size: 32 prompts cannot be split evenly over 3 data-parallel ranks")
    assert problems[1].startswith("actor_rollout_ref.actor.ppo_mini_batch_size: 16 prompts x rollout.n 4 = 64 "
                                  "responses cannot be split evenly over 3 data-parallel ranks")
    msg = one_error(minimal, ["launch.nproc_per_node=4", "actor_rollout_ref.actor.parallel.tensor_model_parallel_size=3"])
    assert msg.startswith("actor_rollout_ref.actor.parallel.tensor_model_parallel_size: TP 3 x PP 1 does not divide the 4 ranks")


def test_expert_layout_must_divide_the_world(minimal):
    """megatron's expert-TP x EP x PP must divide the ranks (megatron-core asserts it deep in
    its parallel state otherwise). Planted: no check: the config loads."""
    mega = "actor_rollout_ref.actor.megatron"
    msg = one_error(minimal, ["actor_rollout_ref.actor.strategy=megatron", "launch.nproc_per_node=2",
                              f"{mega}.expert_model_parallel_size=4"])
    assert msg.startswith(f"{mega}.expert_model_parallel_size: expert TP 1 x EP 4 x PP 1 does not "
                          "divide the 2 ranks")
    msg = one_error(minimal, ["actor_rollout_ref.actor.strategy=megatron", "launch.nproc_per_node=4",
                              "actor_rollout_ref.actor.parallel.tensor_model_parallel_size=2",
                              f"{mega}.expert_model_parallel_size=4"])  # expert-TP = TP = 2
    assert "expert TP 2 x EP 4 x PP 1 does not divide the 4 ranks" in msg
    msg = one_error(minimal, ["actor_rollout_ref.actor.strategy=megatron",
                              f"{mega}.expert_model_parallel_size=0"])
    assert msg.startswith(f"{mega}.expert_model_parallel_size: must be > 0")
    load_config(minimal, ["actor_rollout_ref.actor.strategy=megatron", "launch.nproc_per_node=4",
                          "actor_rollout_ref.actor.parallel.tensor_model_parallel_size=2",
                          f"{mega}.expert_model_parallel_size=2",
                          f"{mega}.expert_tensor_parallel_size=1"])
    # the torch backend has no expert layout: asking it for one is refused, not ignored
    msg = one_error(minimal, ["launch.nproc_per_node=2", f"{mega}.expert_model_parallel_size=2"])
    assert msg.startswith(f"{mega}.expert_model_parallel_size: expert parallelism (EP 2, expert "
                          "TP None) is the megatron backend's; strategy=torch shards experts")
    load_config(minimal, ["launch.nproc_per_node=2", f"{mega}.expert_tensor_parallel_size=1"])


def test_trainer_and_launch_sizes_must_agree(minimal):
    """trainer.n_gpus_per_node is verl's spelling of launch.nproc_per_node: both in one layer
    must agree (across layers the later one wins, tests/config/test_loading.py)."""
    msg = one_error(minimal, ["trainer.n_gpus_per_node=4", "launch.nproc_per_node=2"])
    assert msg.startswith("launch.nproc_per_node: also given as trainer.n_gpus_per_node")
    assert "(2 vs 4)" in msg


def test_ranges(minimal):
    problems = errors_of(
        minimal,
        ["actor_rollout_ref.rollout.top_p=0", "actor_rollout_ref.rollout.top_k=0",
         "actor_rollout_ref.actor.optim.betas=[0.9]", "actor_rollout_ref.actor.clip_ratio_c=0.5"],
    )
    keys = sorted(p.split(":")[0] for p in problems)
    assert keys == sorted([
        "actor_rollout_ref.rollout.top_p", "actor_rollout_ref.rollout.top_k",
        "actor_rollout_ref.actor.optim.betas", "actor_rollout_ref.actor.clip_ratio_c",
    ])


# ---- all problems at once -----------------------------------------------------------------------


def test_all_errors_are_reported_together(minimal):
    problems = errors_of(
        minimal,
        ["actor_rollout_ref.rollout.nn=2", "data.train_batch_size=abc", "algorithm.adv_estimator=ppo2",
         "reward_model.reward_manager=blank", "reward_model.credit_assignment=-1"],
    )
    heads = [p.split(":")[0] for p in problems]
    assert set(heads) == {
        "actor_rollout_ref.rollout.nn", "data.train_batch_size", "algorithm.adv_estimator",
        "reward_model.reward_manager", "reward_model.credit_assignment",
    }, problems


def test_rules_skip_keys_that_already_had_a_type_error(minimal):
    # a bad train_batch_size falls back to the default (1024) internally; no rule may then
    # complain about a batch size the user never wrote
    problems = errors_of(minimal, ["data.train_batch_size=abc", "actor_rollout_ref.actor.ppo_mini_batch_size=5"])
    assert len(problems) == 1 and problems[0].startswith("data.train_batch_size: expected int")


# ---- files --------------------------------------------------------------------------------------


def test_missing_file_lists_available(tmp_path):
    with pytest.raises(ConfigError, match=r"^config: no file 'no_such_recipe'.*available: .*pure_prm_vr"):
        load_config("no_such_recipe")


def test_bad_yaml(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(textwrap.dedent("""\
        data:
          train_files: [a, b
        """))
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(path))


def test_bad_override_syntax(minimal):
    with pytest.raises(ConfigError, match=r"must be key=value"):
        load_config(minimal, ["data.train_batch_size"])


def test_unresolvable_interpolation(minimal):
    msg = one_error(minimal, ["trainer.experiment_name=${trainer.nope}"])
    assert msg.startswith("trainer.experiment_name: cannot resolve interpolation")


def test_filter_groups_metric_other_than_score_is_refused(minimal):
    msg = one_error(minimal, ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc"])
    assert msg.startswith("algorithm.filter_groups.metric: 'acc' is not implemented")
    assert "algorithm.filter_groups.metric=score" in msg
    load_config(minimal, ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=score"])
