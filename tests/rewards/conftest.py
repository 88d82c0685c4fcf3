"""Shared fixtures for the reward tests: a hostile custom reward file and warm local pools."""

import pytest
from reward_cases import HOSTILE_FN


def pytest_configure(config):
    config.addinivalue_line("markers", "ray: runs a real local Ray cluster in a loopback-only network namespace")


@pytest.fixture(scope="session")
def hostile_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("custom_reward") / "hostile_reward.py"
    path.write_text(HOSTILE_FN)
    return str(path)


@pytest.fixture(scope="session")
def pool2():
    from megarl.rewards import make_reward_pool

    with make_reward_pool("local", num_workers=2, timeout_s=3.0, memory_mb=512) as pool:
        yield pool
