"""Each seed recipe, pointed at a real-looking model (a random tiny HF folder, not an embedded
asset), resolves to its paper's / verl's settings with no demo-scale value left, and the startup
report names where every non-default value came from.

Planted bugs (each run once against this file): the demo overlay applied whatever the model
(``_demo_decision`` always true) fails all 18 tests (lr 3e-4, lengths 64, fp32 and the torch
engine come back); the report attributing a key to the layer that merely wrote its enclosing
mapping (``Sources.written`` walking up through mappings) fails the source check of all 7
recipes (e.g. ``actor.clip_ratio_low`` reported as from ``recipe pure_prm_vr``, not derived);
PURE's KL rule dropped (``use_kl_in_reward: false`` in the PURE recipes) fails 6 (the 3 PURE
recipes' settings and the rule test)"""

from __future__ import annotations

import dataclasses
import re

import pytest
import yaml
from real_settings import DEMO_SCALE, DEMO_STEPS, PAPER, make_inputs

from megarl.config import Config, ConfigError, config_dir, load_config, to_dict
from megarl.config.loader import available_configs, resolve_config
from megarl.config.provenance import UNUSED

ROW = re.compile(r"^  (\S+)\s+= (.*)  <- (.+)$")


def flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        key = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict) and v:
            out.update(flat(v, key))
        else:
            out[key] = v
    return out


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return make_inputs(tmp_path_factory.mktemp("real"))


def real_overrides(name: str, inputs) -> list[str]:
    over = [f"actor_rollout_ref.model.path={inputs['policy']}",
            f"data.train_files={inputs['train']}", f"data.val_files={inputs['val']}"]
    if name in ("pure_prm_vr", "pure_prm"):
        over.append(f"reward_model.model.path={inputs['prm']}")
    return over


@pytest.mark.parametrize("name", sorted(PAPER))
def test_real_model_gets_the_papers_settings(name, inputs):
    resolved = resolve_config(name, real_overrides(name, inputs))
    got = flat(to_dict(resolved.config))
    assert not resolved.demo
    wrong = {k: (v, got[k]) for k, v in PAPER[name].items() if got[k] != v}
    assert not wrong, f"{name}: key: (paper, resolved) {wrong}"
    survived = {k: v for k, v in DEMO_SCALE.items() if got[k] == v and PAPER[name].get(k) != v}
    assert not survived, f"{name}: demo-scale values on a real model: {survived}"
    assert got["trainer.total_training_steps"] not in DEMO_STEPS
    assert "embedded://" not in yaml.safe_dump(to_dict(resolved.config)), name


@pytest.mark.parametrize("name", sorted(PAPER))
def test_report_names_the_source_of_every_non_default_value(name, inputs):
    """Reference: the raw YAML of configs/base.yaml and configs/NAME.yaml and the override list,
    read here with yaml (last writer wins); the schema defaults from ``Config()``."""
    over = real_overrides(name, inputs)
    resolved = resolve_config(name, over)
    report = resolved.report()
    rows = {m[1]: (m[2], m[3]) for m in map(ROW.match, report.splitlines()) if m}
    unused = "".join(line for line in report.splitlines() if line.startswith(f"  {UNUSED} ("))
    now = flat(to_dict(resolved.config))
    default = flat(dataclasses.asdict(Config()))
    expected_source: dict[str, str] = {}
    for layer in ("base", name):
        raw = yaml.safe_load((config_dir() / f"{layer}.yaml").read_text())
        raw.pop("extends", None)
        for key in flat(raw):
            expected_source[key] = f"recipe {layer}"
    for text in over:
        expected_source[text.split("=", 1)[0]] = f"override {text}"
    for key, value in now.items():
        if key in expected_source and value != default[key]:
            if re.search(rf"[:,] {re.escape(key)}[,;( ]", unused):
                continue  # named as set but not read by this run
            assert key in rows, f"{key} = {value!r} ({expected_source[key]}) missing from:\n{report}"
            assert rows[key][1] == expected_source[key], (key, rows[key])
    for key, (_, source) in rows.items():
        assert now[key] != default[key], key
        if key not in expected_source:
            assert source.startswith("derived"), (key, source)
        assert "demo overlay" not in source, (key, source)
    assert "demo overlay: not applied" in report
    assert f"actor_rollout_ref.model.path is {inputs['policy']}" in report


@pytest.mark.parametrize("name", ["pure_prm_vr", "pure_prm", "pure_vr"])
def test_pure_kl_in_reward_whenever_no_kl_loss(name, inputs):
    """PURE's rule: KL (k1, fixed 0.001) in the reward iff use_kl_loss is false; an explicit
    use_kl_in_reward wins; the demo keeps what it was measured with (no KL)."""
    base = real_overrides(name, inputs)
    alg = load_config(name, base).algorithm
    assert alg.use_kl_in_reward and alg.kl_penalty == "kl" and alg.kl_ctrl.kl_coef == 0.001
    with_loss = load_config(name, [*base, "actor_rollout_ref.actor.use_kl_loss=true"])
    assert not with_loss.algorithm.use_kl_in_reward
    explicit = load_config(name, [*base, "algorithm.use_kl_in_reward=false"])
    assert not explicit.algorithm.use_kl_in_reward
    assert not load_config(name).algorithm.use_kl_in_reward  # the embedded demo
    with pytest.raises(ConfigError, match="use_kl_in_reward"):
        load_config(name, [*base, "actor_rollout_ref.actor.use_kl_loss=maybe"])


def test_demo_overlay_follows_the_policy(tmp_path, inputs):
    own = tmp_path / "mine.yaml"
    own.write_text(f"extends: grpo\nactor_rollout_ref:\n  model: {{path: {inputs['policy']}}}\n"
                   f"data: {{train_files: {inputs['train']}}}\n")
    real = resolve_config(str(own))
    assert not real.demo and real.config.actor_rollout_ref.actor.optim.lr == 1e-6
    assert real.layers[-1] == f"file {own}"
    embedded = resolve_config("grpo", ["actor_rollout_ref.model.path=embedded://policy"])
    assert embedded.demo and embedded.config.actor_rollout_ref.actor.optim.lr == 3e-4
    assert "demo overlay demo/base" in embedded.layers
    forced = resolve_config("grpo", real_overrides("grpo", inputs), demo=True)
    assert forced.demo and forced.config.actor_rollout_ref.actor.optim.lr == 3e-4
    assert forced.config.actor_rollout_ref.model.path == str(inputs["policy"])  # override wins
    with pytest.raises(ConfigError, match="actor_rollout_ref.model.path: required"):
        load_config("grpo", demo=False)
    assert not any(n.startswith("demo/") for n in available_configs())
