"""verl's deprecated global micro-batch sizes (``actor_rollout_ref.actor.ppo_micro_batch_size``
and siblings) are read as the per-rank sizes verl's workers compute: the global value divided by
the role's data-parallel size, rounded down; both spellings set, or a quotient of 0, is an error.
The expected per-rank sizes are worked out by hand from verl 0.9.1's rule (fsdp_workers:
``global //= world // ulysses``; megatron_workers: ``global //= DP``)."""

from __future__ import annotations

import pytest

from megarl.config import ConfigError, load_config
from megarl.config.loader import resolve_config

BASE = """
data: {train_files: train.parquet, train_batch_size: 8, max_response_length: 64}
actor_rollout_ref:
  model: {path: base/model}
  actor: {ppo_mini_batch_size: 8}
  rollout: {n: 2}
algorithm: {adv_estimator: gae}
critic: {enable: true, use_dynamic_bsz: true}
reward_model: {enable: true, use_dynamic_bsz: true, model: {path: base/prm}}
"""
WORLD2 = ["launch.nproc_per_node=2"]
ARR = "actor_rollout_ref"


@pytest.fixture
def own(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(BASE)
    return lambda *o: resolve_config(str(path), list(o))


@pytest.mark.parametrize("world, expected", [([], 8), (WORLD2, 4)])
def test_actor_global_size_over_the_world(own, world, expected):
    """World 1: per-rank = global; world 2: half. Planted: no division (8 on 2 ranks) or a
    division by the world instead of the data-parallel size (see the TP case) fails."""
    r = own(f"{ARR}.actor.ppo_micro_batch_size=8", *world)
    actor = r.config.actor_rollout_ref.actor
    assert actor.ppo_micro_batch_size_per_gpu == expected
    assert actor.use_dynamic_bsz is False  # a micro size given, as with the per-rank key
    [line] = [n for n in r.notices if n.startswith(f"{ARR}.actor.ppo_micro_batch_size=8")]
    assert f"read as {ARR}.actor.ppo_micro_batch_size_per_gpu={expected} " in line
    assert r.sources.written(f"{ARR}.actor.ppo_micro_batch_size_per_gpu").startswith("override")


def test_every_role_and_the_data_parallel_size(own):
    r = own(*WORLD2, f"{ARR}.rollout.log_prob_micro_batch_size=6",
            f"{ARR}.ref.log_prob_micro_batch_size=4", "critic.ppo_micro_batch_size=10",
            "reward_model.micro_batch_size=2")
    c = r.config
    assert c.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu == 3
    assert c.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu == 2
    assert c.critic.ppo_micro_batch_size_per_gpu == 5
    assert c.reward_model.micro_batch_size_per_gpu == 1
    assert len([n for n in r.notices if "verl's deprecated global size" in n]) == 4
    # Ulysses SP 2 on 2 ranks: one data-parallel rank, so the global size is the per-rank one
    sp = own(*WORLD2, f"{ARR}.actor.ppo_micro_batch_size=8",
             f"{ARR}.actor.parallel.ulysses_sequence_parallel_size=2")
    assert sp.config.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 8
    # critic.forward_micro_batch_size: megarl's critic has one micro size
    fwd = own(*WORLD2, "critic.forward_micro_batch_size=4")
    assert fwd.config.critic.ppo_micro_batch_size_per_gpu == 2


def test_rounds_down_as_verl_and_says_so(own):
    r = own(*WORLD2, f"{ARR}.actor.ppo_micro_batch_size=7")
    assert r.config.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 3
    assert any("rounded down as verl does: 6 responses per forward, not 7" in n for n in r.notices)


def _problems(own, *overrides) -> list[str]:
    with pytest.raises(ConfigError) as err:
        own(*overrides)
    return list(err.value.problems)


def test_errors(own):
    """Both spellings; a global size below the data-parallel size; a non-integer; the critic's
    two global sizes disagreeing. Each one line naming the key."""
    [both] = _problems(own, f"{ARR}.actor.ppo_micro_batch_size=8",
                       f"{ARR}.actor.ppo_micro_batch_size_per_gpu=2")
    assert both.startswith(f"{ARR}.actor.ppo_micro_batch_size=8 (from override")
    assert f"remove {ARR}.actor.ppo_micro_batch_size" in both
    [zero] = _problems(own, *WORLD2, f"{ARR}.rollout.log_prob_micro_batch_size=1")
    assert "1 // 2 = 0 responses per rank" in zero and "at least 2" in zero
    [bad] = _problems(own, "reward_model.micro_batch_size=abc")
    assert bad.startswith("reward_model.micro_batch_size='abc'") and "positive integer" in bad
    [clash] = _problems(own, *WORLD2, "critic.ppo_micro_batch_size=8",
                        "critic.forward_micro_batch_size=4")
    assert "critic.ppo_micro_batch_size_per_gpu" in clash and "set one of them" in clash


def test_verl_default_null_says_nothing(own):
    r = own(f"{ARR}.actor.ppo_micro_batch_size=null")
    assert r.config.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu is None
    assert not [n for n in r.notices if "micro_batch_size" in n]


def test_in_a_file_like_verl_scripts(tmp_path):
    path = tmp_path / "verl.yaml"
    path.write_text(BASE.replace("actor: {ppo_mini_batch_size: 8}",
                                 "actor: {ppo_mini_batch_size: 8, ppo_micro_batch_size: 4}")
                    + "launch: {nproc_per_node: 2}\n")
    assert load_config(str(path)).actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 2
