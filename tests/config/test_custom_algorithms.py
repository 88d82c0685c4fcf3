"""algorithm.adv_estimator and policy_loss.loss_mode take registered names, the user's own
included (algorithm.custom_algorithms.path, imported before the names are checked); an unknown
name is an error naming the key, the choices and the closest ones. Planted bugs each check
catches are named in the docstrings."""

from __future__ import annotations

import textwrap

import pytest
from minimal import MINIMAL

from megarl import algos
from megarl.config import ConfigError, load_config

USER_FILE = '''
from pathlib import Path

from megarl.algos import register_advantage_estimator, register_policy_loss

IMPORTS = Path(__file__).with_name("imports.txt")
IMPORTS.write_text(IMPORTS.read_text() + "x" if IMPORTS.exists() else "x")


@register_advantage_estimator("cfg_group_adv", needs=("groups",))
def cfg_group_adv(*, token_rewards, **_):
    return token_rewards, token_rewards


@register_advantage_estimator("cfg_value_adv", needs=("values",))
def cfg_value_adv(*, token_rewards, **_):
    return token_rewards, token_rewards


@register_policy_loss("cfg_loss")
def cfg_loss(**_):
    raise NotImplementedError
'''


@pytest.fixture
def minimal(tmp_path):
    path = tmp_path / "minimal.yaml"
    path.write_text(MINIMAL)
    return str(path)


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_algos.py"
    path.write_text(textwrap.dedent(USER_FILE))
    yield path
    for name in ("cfg_group_adv", "cfg_value_adv"):
        algos.ADVANTAGE_ESTIMATORS.pop(name, None)
        algos.ESTIMATOR_NEEDS.pop(name, None)
    algos.POLICY_LOSSES.pop("cfg_loss", None)


def problems(path, overrides) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    return info.value.problems


def test_unknown_names_say_the_key_the_choices_and_the_closest(minimal):
    """Planted: difflib's cutoff too high (no suggestion for 'grpoo'), the loss name checked
    against the estimators."""
    (est,) = problems(minimal, ["algorithm.adv_estimator=grpoo"])
    assert est.startswith("algorithm.adv_estimator: invalid choice 'grpoo'; expected one of 'gae'")
    assert "did you mean 'grpo'" in est and "'pure_rloo'" in est
    assert "algorithm.custom_algorithms.path" in est
    (loss,) = problems(minimal, ["actor_rollout_ref.actor.policy_loss.loss_mode=vanila"])
    assert loss.startswith("actor_rollout_ref.actor.policy_loss.loss_mode: invalid choice "
                           "'vanila'; expected one of 'vanilla', 'gspo'")
    assert "did you mean 'vanilla'?" in loss
    (far,) = problems(minimal, ["algorithm.adv_estimator=zzz"])
    assert "did you mean" not in far


def test_the_user_file_s_names_are_accepted_with_their_needs(minimal, user_file):
    """The file's estimator and loss load; its needs drive the rules ("groups": rollout.n = 1
    refused naming the estimator; "values": the critic's auto rule turns it on); the file is
    imported once per process however often configs name it. Planted: the file imported after
    the names are checked (invalid choice), needs ignored (n = 1 accepted), a second import
    (registering the same names again fails)."""
    path = f"algorithm.custom_algorithms.path={user_file}"
    cfg = load_config(minimal, [path, "algorithm.adv_estimator=cfg_group_adv",
                                "actor_rollout_ref.actor.policy_loss.loss_mode=cfg_loss"])
    assert cfg.algorithm.adv_estimator == "cfg_group_adv"
    assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "cfg_loss"
    assert cfg.algorithm.custom_algorithms.path == str(user_file)
    assert not cfg.critic.enable
    (n1,) = problems(minimal, [path, "algorithm.adv_estimator=cfg_group_adv",
                               "actor_rollout_ref.rollout.n=1"])
    assert n1.startswith("actor_rollout_ref.rollout.n: 1 < 2")
    assert "algorithm.adv_estimator=cfg_group_adv" in n1
    cfg = load_config(minimal, [path, "algorithm.adv_estimator=cfg_value_adv"])
    assert cfg.critic.enable
    (no_critic,) = problems(minimal, [path, "algorithm.adv_estimator=cfg_value_adv",
                                      "critic.enable=false"])
    assert no_critic.startswith("critic.enable: false but algorithm.adv_estimator=cfg_value_adv "
                                "needs a critic's values")
    assert (user_file.parent / "imports.txt").read_text() == "x"


def test_a_broken_user_file_is_reported_on_its_key(minimal, tmp_path):
    """A missing file and a file whose import raises are errors on
    algorithm.custom_algorithms.path that carry the cause; the names it would have registered
    are then unknown too."""
    msgs = problems(minimal, [f"algorithm.custom_algorithms.path={tmp_path / 'nope.py'}"])
    assert len(msgs) == 1 and msgs[0].startswith(
        f"algorithm.custom_algorithms.path: '{tmp_path / 'nope.py'}' is not a file")
    bad = tmp_path / "bad.py"
    bad.write_text("raise RuntimeError('boom')\n")
    msgs = problems(minimal, [f"algorithm.custom_algorithms.path={bad}",
                              "algorithm.adv_estimator=from_bad"])
    assert msgs[0] == (f"algorithm.custom_algorithms.path: importing '{bad}' failed with "
                       "RuntimeError: boom")
    assert msgs[1].startswith("algorithm.adv_estimator: invalid choice 'from_bad'")
