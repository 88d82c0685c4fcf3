"""The SandboxFusion code reward wired into the reward managers and the config check (the
client itself: `test_sandbox_fusion.py`, whose loopback server is used here)."""

from __future__ import annotations

import pytest
from test_sandbox_fusion import ANSWER, FakeSandbox, cases, doubler

from megarl.config.errors import ConfigError
from megarl.config.loader import resolve_config
from megarl.rewards import make_reward_manager, make_reward_pool
from megarl.rewards.sandbox_fusion import builtin_fn_spec


@pytest.fixture
def server():
    srv = FakeSandbox(doubler)
    yield srv
    srv.close()


@pytest.mark.parametrize("name", ["naive", "prime", "dapo"])
def test_managers_score_code_sources_through_the_server(server, name):
    rm = resolve_config("ppo", [f"reward_model.sandbox_fusion.url={server.url}",
                                f"reward_model.reward_manager={name}"]).config.reward_model
    gt = cases(["1", "2", "3", "4"], ["2", "4", "6", "9"])
    with make_reward_pool("local", num_workers=1, timeout_s=5.0, memory_mb=512) as pool:
        manager = make_reward_manager(name, pool, builtin_fn_spec(rm, name))
        scores, metrics = manager([ANSWER, "#### 7"], ["taco", "openai/gsm8k"], [gt, "7"])
    assert scores.tolist() == [0.75, 1.0]
    assert metrics["reward/score/taco"] == 0.75 and metrics["reward/errors"] == 0.0
    assert len(server.requests) == 4


@pytest.mark.parametrize("override, key", [
    ("reward_model.sandbox_fusion.url=localhost:8080/run_code", "reward_model.sandbox_fusion.url"),
    ("reward_model.sandbox_fusion.max_concurrent=0", "reward_model.sandbox_fusion.max_concurrent"),
    ("reward.sandbox_fusion.memory_limit_mb=0", "reward_model.sandbox_fusion.memory_limit_mb"),
])
def test_bad_sandbox_values_are_config_errors(override, key):
    extra = [] if override.split("=")[0].endswith(".url") else [
        "reward_model.sandbox_fusion.url=http://127.0.0.1:8080/run_code"]
    with pytest.raises(ConfigError) as e:
        resolve_config("ppo", [*extra, override])
    assert [p for p in e.value.problems if p.startswith(key + ":")], e.value.problems
