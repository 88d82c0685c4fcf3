"""verl's own defaults load: every key megarl implements or maps, written with the value verl's
0.9.1 trainer config gives it, is accepted and read (interpolations and the required '???' left
out). Left out as well: use_dynamic_bsz false without a micro size, which verl refuses too.

Found while writing: verl's null data.seed and filter_groups.metric "reward" were refused, and
the legacy custom_reward_function.name=null beside reward.custom_reward_function.name conflicted.
"""

from __future__ import annotations

import yaml

from megarl.config.loader import resolve_config
from megarl.config.verl_compat import classify, verl_keys

# verl's defaults that verl itself refuses together (use_dynamic_bsz false needs a micro size)
JOINTLY_INVALID = ("use_dynamic_bsz", "log_prob_use_dynamic_bsz")


def _verl_default_overrides() -> list[str]:
    out = []
    for key, value in verl_keys().items():
        verdict = classify(key)
        if verdict is None or verdict.status not in ("implemented", "mapped"):
            continue
        if isinstance(value, str) and ("${" in value or value == "???"):
            continue
        if key.rsplit(".", 1)[-1] in JOINTLY_INVALID:
            continue
        text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
        out.append(f"{key}={text.removesuffix('...').strip()}")
    return out


def test_verl_defaults_of_every_implemented_and_mapped_key_load():
    overrides = _verl_default_overrides()
    assert len(overrides) > 150
    cfg = resolve_config("grpo", [*overrides, "trainer.logger=[console]"]).config
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-6  # verl's default, read
    assert cfg.data.seed == cfg.trainer.seed  # verl's null seed
    assert cfg.algorithm.filter_groups.metric == "score"
