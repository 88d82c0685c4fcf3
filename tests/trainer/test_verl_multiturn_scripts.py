"""verl's multi-turn example command lines (examples/sglang_multiturn/, verl commit b178a3cd5),
read by megarl's config check.

``verl_scripts/NAME.args``: the arguments each script passes to ``verl.trainer.main_ppo``
(expanded as its shell would with HOME=/home/user, run from PROJECT_DIR=/home/user/verl, the
script's own defaults; ``$(now)`` as 01-00-00; the vllm_fsdp script's unset ``${use_kl_loss}``
stays empty), one per line, nothing removed but ``--config-path`` / ``--config-name``.
``verl_scripts/sglang_multiturn/config/``: verl's files those point at, verbatim. verl's
``--config-name`` YAML is read here as what it is: its keys (less hydra/defaults) put before the
script's arguments, ``ppo_megatron_trainer`` as megarl's megatron strategy switch; the scripts'
paths under PROJECT_DIR/examples/sglang_multiturn point at the copies here.

Each script passes the check except for the features named in `REFUSED` (each refused with its
key named, nothing else): features outside multi-turn that megarl does not build
(over-sampling, bf16 master weights, verl's SGLang server mode, a KL loss
switch left empty by the script). Dropping exactly those arguments makes each one pass; the
scripts with nothing refused pass as they are.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from megarl.config import ConfigError
from megarl.config.loader import resolve_config

HERE = Path(__file__).resolve().parent / "verl_scripts"
VERL_DIR = "/home/user/verl/examples/sglang_multiturn"
R = "actor_rollout_ref.rollout"
MT = f"{R}.multi_turn"

# name: (verl's --config-name, the keys the check refuses)
REFUSED = {
    "run_qwen2.5-3b_gsm8k_multiturn": ("gsm8k_multiturn_grpo", set()),
    "run_qwen2.5-3b_gsm8k_multiturn_4xgpu": ("gsm8k_multiturn_grpo", set()),
    "run_qwen2.5-0.5b_gsm8k_multiturn_w_interaction": (
        "gsm8k_multiturn_grpo_w_interaction", set()),
    "run_qwen0.5b_gsm8k_multiturn_curriculum": ("gsm8k_multiturn_grpo", set()),
    "run_qwen2.5-3b_gsm8k_multiturn_vllm_fsdp": ("gsm8k_multiturn_grpo",
                                                 {"actor_rollout_ref.actor.use_kl_loss"}),
    "run_qwen3-4b_gsm8k_multiturn": ("gsm8k_multiturn_grpo", set()),
    "run_qwen2.5-3b_gsm8k_tool_agent_mlflow": ("gsm8k_multiturn_grpo", set()),
    "run_qwen2.5-3b_megatron_gsm8k_multiturn": ("gsm8k_multiturn_megatron_grpo", set()),
    "run_qwen2.5-3b_gsm8k_multiturn_server": ("gsm8k_multiturn_grpo_server", set()),
    "run_qwen2.5-3b_gsm8k_multiturn_4xgpu_server": ("gsm8k_multiturn_grpo_server", set()),
}


def _flat(d: dict, prefix: str = ""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}={v}"


def command_line(name: str) -> list[str]:
    config_name, _ = REFUSED[name]
    doc = yaml.safe_load((HERE / "sglang_multiturn" / "config" / f"{config_name}.yaml").read_text())
    entry = ["actor_rollout_ref.actor.strategy=megatron"] \
        if doc["defaults"][0] == "ppo_megatron_trainer" else []
    entry += list(_flat({k: v for k, v in doc.items() if k not in ("hydra", "defaults")}))
    args = (HERE / f"{name}.args").read_text().splitlines()
    return entry + [a.replace(VERL_DIR, str(HERE / "sglang_multiturn")) for a in args]


def _refused_keys(err: ConfigError) -> set[str]:
    keys = set()
    for line in str(err).splitlines():
        key = line.split(":", 1)[0].split("=", 1)[0].split(" ", 1)[0].strip()
        if key:
            keys.add(key)
    return keys


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_verl_multiturn_script_is_refused_only_for_what_is_not_built(name):
    _, refused = REFUSED[name]
    args = command_line(name)
    if refused:
        with pytest.raises(ConfigError) as e:
            resolve_config("grpo", args)
        assert _refused_keys(e.value) == refused, str(e.value)
    kept = [a for a in args if a.lstrip("+").split("=", 1)[0].split(".server.")[0] not in refused
            and not any(a.startswith(k + ".") for k in refused)]
    if f"{MT}.tool_config_path" in refused:  # the interaction-only script: verl's gsm8k tool
        kept.append(f"{MT}.tool_config_path="
                    f"{HERE / 'sglang_multiturn/config/tool_config/gsm8k_tool_config.yaml'}")
    cfg = resolve_config("grpo", kept).config
    arr = cfg.actor_rollout_ref
    assert arr.rollout.multi_turn.enable and arr.rollout.name in ("sglang", "vllm")
    assert arr.rollout.multi_turn.max_assistant_turns in (5, None)


def test_verl_gsm8k_tool_config_loads_megarls_gsm8k_tool(caplog):
    import asyncio

    from megarl.rollout.agent import Gsm8kTool, load_tools

    tools = load_tools(HERE / "sglang_multiturn/config/tool_config/gsm8k_tool_config.yaml")
    tool = tools["calc_gsm8k_reward"]
    assert isinstance(tool, Gsm8kTool) and "runs as megarl's built-in" in caplog.text

    async def submit():
        iid, _ = await tool.create(create_kwargs={"ground_truth": "72"})
        out = [await tool.execute(iid, {"answer": a}) for a in ("70", "72", "72")]
        return out, await tool.calc_reward(iid)

    out, reward = asyncio.run(submit())
    # verl's rewards: -0.05 for a submission that does not improve, 0 otherwise
    assert [(o.text, r) for o, r, _ in out] == [
        ("Current parsed answer='70' reward=0.0", -0.05),
        ("Current parsed answer='72' reward=1.0", 0.0),
        ("Current parsed answer='72' reward=1.0", -0.05)]
    assert reward == 1.0
