"""The conversion tests share the megatron tests' helpers and fixtures."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "megatron"))

import mcore_testlib as lib  # noqa: E402

pytest.importorskip("megatron.core")


@pytest.fixture(scope="session")
def conv_zoo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("conv_zoo")
    for name in ("qwen2_bias", "llama_tied_gqa", "qwen2_critic", "qwen3_prm"):
        lib.zoo_model(root, name)
    lib.make_model(root / "qwen3_sharded_bf16", "qwen3", max_shard_size="20KB",
                   dtype=__import__("torch").bfloat16)
    return root


@pytest.fixture
def conv_dist():
    lib.ensure_dist()
    import megarl.backends.megatron  # noqa: F401
    from megarl.backends.megatron import parallel

    parallel.ensure_model_parallel(1, 1, seed=1)
