"""verl / PURE / DAPO users' keys resolve to their meaning, and keys accepted without effect are
announced (``megarl.config.notices.startup_notices``), one line per key.

The expected values are those of verl 0.9.1's trainer config and PURE's verl branch
(``reward_model.split_step_char`` "\\n\\n" = text that ends a step, ``step_separator`` "\\n" =
PRM-input token, ``algorithm.adv_norm``), DAPO's ``reward_kwargs.overlong_buffer_cfg``.
Planted bugs that these tests catch are named in each docstring."""

from __future__ import annotations

import pytest

from megarl.config import ConfigError, load_config, to_yaml
from megarl.config.notices import startup_notices

BASE = """
data: {train_files: train.parquet, val_files: val.parquet, train_batch_size: 8, max_response_length: 64}
actor_rollout_ref:
  model: {path: base/model}
  actor: {ppo_mini_batch_size: 4}
  rollout: {n: 2}
algorithm: {adv_estimator: grpo}
"""


@pytest.fixture
def own(tmp_path):
    def load(*overrides: str, text: str = BASE):
        path = tmp_path / "mine.yaml"
        path.write_text(text)
        return load_config(str(path), list(overrides))
    return load


def notices_about(cfg, key: str) -> list[str]:
    return [n for n in startup_notices(cfg) if n.startswith(key + "=")]


# ----------------------------------------------------------------------- micro-batch sizes
def test_micro_sizes_turn_dynamic_batching_off(own):
    """A micro size given without use_dynamic_bsz is used (dynamic off), for the actor, the
    rollout's and the ref's log-prob passes; nothing given = dynamic. Planted: the default
    use_dynamic_bsz=True (the former megarl default) fails the first assert."""
    cfg = own("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
              "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=3")
    arr = cfg.actor_rollout_ref
    assert arr.actor.use_dynamic_bsz is False
    assert arr.rollout.log_prob_use_dynamic_bsz is False
    assert (arr.ref.log_prob_use_dynamic_bsz, arr.ref.log_prob_micro_batch_size_per_gpu) == (False, 3)
    assert startup_notices(cfg) == []
    plain = own()
    assert plain.actor_rollout_ref.actor.use_dynamic_bsz is True
    assert plain.actor_rollout_ref.rollout.log_prob_use_dynamic_bsz is True
    ref_only = own("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=5")
    assert ref_only.actor_rollout_ref.ref.log_prob_use_dynamic_bsz is False
    assert ref_only.actor_rollout_ref.rollout.log_prob_use_dynamic_bsz is True


def test_explicit_dynamic_wins_and_is_announced(own):
    """use_dynamic_bsz=true with a micro size: dynamic wins (verl) and one notice per role
    names the ignored micro size. Planted: dropping the notice fails."""
    cfg = own("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
              "actor_rollout_ref.actor.use_dynamic_bsz=true",
              "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=3",
              "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true")
    assert cfg.actor_rollout_ref.actor.use_dynamic_bsz is True
    [line] = notices_about(cfg, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu")
    assert "accepted without effect" in line and "use_dynamic_bsz=false" in line
    assert len(notices_about(cfg, "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu")) == 1
    assert notices_about(cfg, "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu") == []


def test_critic_and_prm_inherit_the_actors_choice(own):
    """verl: critic / reward-model use_dynamic_bsz default to the actor's. A PRM micro size
    under the actor's dynamic batching is announced."""
    cfg = own("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
              "critic.enable=true", "critic.ppo_micro_batch_size_per_gpu=2")
    assert cfg.critic.use_dynamic_bsz is False
    prm = own("reward_model.enable=true", "reward_model.model.path=prm",
              "reward_model.micro_batch_size_per_gpu=2")
    assert prm.reward_model.use_dynamic_bsz is True
    assert len(notices_about(prm, "reward_model.micro_batch_size_per_gpu")) == 1


# ----------------------------------------------------------------------- announced keys
@pytest.mark.parametrize("override, key", [
    ("actor_rollout_ref.actor.checkpoint.save_contents=[model]",
     "actor_rollout_ref.actor.checkpoint.save_contents"),
    ("actor_rollout_ref.model.use_remove_padding=false", "actor_rollout_ref.model.use_remove_padding"),
    ("trainer.balance_batch=false", "trainer.balance_batch"),
    ("algorithm.adv_norm=false", "algorithm.pure.normalize (PURE's algorithm.adv_norm)"),
])
def test_inert_keys_are_announced(own, override, key):
    """Each key without effect gives exactly one notice when set off its default and none at
    its default. Planted: a notices function that skips the key fails."""
    assert notices_about(own(), key.split(" ")[0]) == []
    lines = [n for n in startup_notices(own(override)) if n.startswith(key + "=")]
    assert len(lines) == 1 and "accepted without effect" in lines[0], startup_notices(own(override))


def test_total_epochs_vs_total_training_steps(own):
    """verl's rule: total_training_steps, when set, is the run's length; total_epochs set as
    well is announced with the fix. Without total_training_steps, total_epochs counts (checked
    in tests/trainer/test_user_keys_trainer.py)."""
    cfg = own("trainer.total_epochs=3", "trainer.total_training_steps=10")
    [line] = notices_about(cfg, "trainer.total_epochs")
    assert "total_training_steps=null" in line
    assert notices_about(own("trainer.total_epochs=3"), "trainer.total_epochs") == []


def test_free_cache_engine_and_log_val_generations_have_effect(own):
    """Keys with an effect (tested in tests/trainer) never appear among the notices."""
    cfg = own("actor_rollout_ref.rollout.free_cache_engine=false", "trainer.log_val_generations=3")
    assert startup_notices(cfg) == []
    assert notices_about(own("trainer.log_val_generations=3", "data.val_files=null"),
                         "trainer.log_val_generations")


# ----------------------------------------------------------------------- plain strings
def test_logger_as_plain_string(own):
    """trainer.logger=console (verl's plain-string spelling) is [console]; a wrong name still
    fails with the choices. Planted: no scalar -> list reading fails with 'expected list'."""
    assert own("trainer.logger=console").trainer.logger == ["console"]
    assert own("trainer.logger=[console,jsonl]").trainer.logger == ["console", "jsonl"]
    assert own("actor_rollout_ref.rollout.stop=</s>").actor_rollout_ref.rollout.stop == ["</s>"]
    with pytest.raises(ConfigError, match="trainer.logger"):
        own("trainer.logger=wandbx")


# ----------------------------------------------------------------------- PURE
def test_pure_step_keys_have_pures_meaning(own):
    """PURE: split_step_char = text that ends a step (megarl step_separator); step_separator =
    the PRM-input token (megarl prm_step_token). Planted: reading step_separator as the split
    text (the former behaviour) fails the first assert."""
    cfg = own('reward_model.step_separator="\\n"')
    assert (cfg.reward_model.prm_step_token, cfg.reward_model.step_separator) == ("\n", "\n\n")
    cfg = own('reward_model.split_step_char=".\\n\\n"', 'reward_model.step_separator="\\n"')
    assert (cfg.reward_model.step_separator, cfg.reward_model.prm_step_token) == (".\n\n", "\n")
    pure_yaml = BASE + "reward_model:\n  type: prm\n  split_step_char: \"\\n\\n\"\n  step_separator: \"\\n\"\n"
    cfg = own(text=pure_yaml)
    assert (cfg.reward_model.step_separator, cfg.reward_model.prm_step_token) == ("\n\n", "\n")


def test_megarl_layers_keep_their_step_separator(own, tmp_path):
    """A layer writing step_separator next to prm_step_token (megarl's recipes and a run's saved
    config.yaml) keeps megarl's meaning: the saved config loads back equal."""
    cfg = own("reward_model.step_separator=STEP", 'reward_model.prm_step_token="\\n"')
    assert (cfg.reward_model.step_separator, cfg.reward_model.prm_step_token) == ("STEP", "\n")
    saved = tmp_path / "saved.yaml"
    saved.write_text(to_yaml(cfg))
    again = load_config(str(saved))
    assert (again.reward_model.step_separator, again.reward_model.prm_step_token) == ("STEP", "\n")
    assert load_config("pure_prm_vr").reward_model.step_separator == "\n\n"


def test_reward_model_type_and_adv_norm(own):
    """reward_model.type=prm is accepted (megarl's reward model is a PRM), any other type is an
    error naming the key; algorithm.adv_norm is PURE's whitening switch (algorithm.pure.normalize)."""
    assert own("reward_model.type=prm").reward_model.enable is False
    with pytest.raises(ConfigError, match="reward_model.type"):
        own("reward_model.type=orm")
    cfg = own("algorithm.adv_norm=false", "algorithm.adv_estimator=pure_rloo")
    assert cfg.algorithm.pure.normalize is False
    assert startup_notices(cfg) == []


# ----------------------------------------------------------------------- DAPO
def test_overlong_buffer_cfg_spelling(own):
    """verl main_ppo / DAPO: reward_model.reward_kwargs.overlong_buffer_cfg.* and max_resp_len
    land on reward_model.overlong_buffer.*; a max_resp_len other than max_response_length is an
    error (the buffer counts back from the generation limit)."""
    cfg = own("+reward_model.reward_kwargs.overlong_buffer_cfg.enable=true",
              "+reward_model.reward_kwargs.overlong_buffer_cfg.len=16",
              "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=0.5",
              "+reward_model.reward_kwargs.overlong_buffer_cfg.log=true",
              "+reward_model.reward_kwargs.max_resp_len=64")
    ob = cfg.reward_model.overlong_buffer
    assert (ob.enable, ob.len, ob.penalty_factor, ob.log, ob.max_resp_len) == (True, 16, 0.5, True, 64)
    with pytest.raises(ConfigError, match="max_resp_len"):
        own("+reward_model.reward_kwargs.max_resp_len=32")
    with pytest.raises(ConfigError, match="reward_model.overlong_buffer.enable"):
        own("reward_model.overlong_buffer.enable=false",
            "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=true")


def test_gen_batch_size(own):
    """data.gen_batch_size is DAPO's prompts per generation round: fine with filter_groups, an
    error naming the fix without it (megarl generates in rounds only for dynamic sampling)."""
    cfg = own("data.gen_batch_size=12", "algorithm.filter_groups.enable=true")
    assert (cfg.data.gen_batch_size, cfg.data.train_batch_size) == (12, 8)
    with pytest.raises(ConfigError, match="data.gen_batch_size.*filter_groups"):
        own("data.gen_batch_size=12")
    assert own("data.gen_batch_size=8").data.gen_batch_size == 8


def test_on_bad_row_key(own):
    """data.on_bad_row (the key the malformed-row error suggests) exists: error | skip."""
    assert own("data.on_bad_row=skip").data.on_bad_row == "skip"
    with pytest.raises(ConfigError, match="data.on_bad_row"):
        own("data.on_bad_row=drop")
