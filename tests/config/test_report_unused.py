"""The startup report (``Resolved.report``, printed by launch/train.py and ``python -m
megarl.config show --sources``) lists among the run's values only keys the run reads; the values
of switched-off parts are named on one line as set but not read, with the switch that turns them
off. Reference: which parts each recipe runs (GRPO: no critic, no PRM; PPO: a critic; PURE
PRM+VR: a PRM), known from the recipes' algorithms, not from the code under test."""

from __future__ import annotations

import re

from megarl.config.loader import resolve_config
from megarl.config.provenance import UNUSED

ROW = re.compile(r"^  (\S+)\s+= (.*)  <- (.+)$")


def _split(report: str) -> tuple[dict[str, str], str]:
    rows = {m[1]: m[3] for m in map(ROW.match, report.splitlines()) if m}
    unused = [line for line in report.splitlines() if line.startswith(f"  {UNUSED} (")]
    assert len(unused) <= 1, unused
    return rows, unused[0] if unused else ""


def test_grpo_lists_no_critic_or_prm_values():
    """GRPO trains no value model and has no PRM: the demo overlay's critic.model.path and
    reward_model.model.path (and their derived fills) are named as unused, once; the actor's and
    the switch critic.enable itself stay listed. Planted: without the filter the critic rows come
    back; with a filter on the whole critic block critic.enable goes missing."""
    report = resolve_config("grpo").report()
    rows, unused = _split(report)
    assert "critic.enable" in rows and "actor_rollout_ref.actor.optim.lr" in rows
    assert not [k for k in rows if k.startswith(("critic.", "reward_model.")) and k != "critic.enable"]
    assert not [k for k in rows if ".megatron." in k]  # the torch backend
    for key in ("critic.model.path", "critic.ppo_mini_batch_size", "reward_model.model.path",
                "actor_rollout_ref.actor.megatron.param_dtype"):
        assert key in unused, (key, unused)
    assert "(critic.enable=false)" in unused and "(reward_model.enable=false)" in unused
    assert f"{len(rows)} values this run reads differ" in report
    count = int(re.search(r"\((\d+)\):", unused)[1])
    assert count == len(re.findall(r"[a-z_]+\.[\w.]+(?=[,;( ]|$)", unused.split(": ", 1)[1]))


def test_ppo_lists_its_critic():
    rows, unused = _split(resolve_config("ppo").report())
    assert rows["critic.model.path"].startswith("demo overlay")
    assert "critic.optim.lr" in rows and "critic.ppo_mini_batch_size" in rows
    assert "critic.model" not in unused and "reward_model.model.path" in unused
    assert "critic.megatron.param_dtype (critic.strategy=torch)" in unused


def test_prm_recipe_lists_the_prm_and_megatron_lists_its_options():
    rows, unused = _split(resolve_config("pure_prm_vr").report())
    assert "reward_model.model.path" in rows and "reward_model.model.path" not in unused
    rows, unused = _split(resolve_config(
        "grpo", ["actor_rollout_ref.actor.strategy=megatron"]).report())
    assert "actor_rollout_ref.actor.megatron.param_dtype" in rows
    assert ".megatron." not in unused.replace("critic.megatron.", "")
