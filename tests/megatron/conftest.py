"""Fixtures of the megatron backend tests: a process group for in-process backends (a world of
one; megatron's parallel_state then runs at TP=PP=1) and the tiny model zoo."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mcore_testlib as lib  # noqa: E402

pytest.importorskip("megatron.core")


@pytest.fixture(scope="session")
def zoo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mcore_zoo")
    for name in lib.ZOO:
        lib.zoo_model(root, name)
    return root


@pytest.fixture
def mcore_dist():
    lib.ensure_dist()
    import megarl.backends.megatron  # noqa: F401
    from megarl.backends.megatron import parallel

    parallel.ensure_model_parallel(1, 1, seed=1)
