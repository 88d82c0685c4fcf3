"""Fixtures for tests/rollout: tiny HF folders (written by transformers), cached per session."""

from __future__ import annotations

import json

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
    """tiny_folder(family="qwen2", **overrides) -> path of a cached tiny LM folder with the
    character-level tokenizer (ids: 0 pad, 1 im_start, 2 im_end = eos; then printable ASCII)."""
    from megarl.models.testing import make_tiny_hf_model

    cache: dict[str, object] = {}

    def make(family: str = "qwen2", **overrides):
        key = json.dumps([family, overrides], sort_keys=True, default=str)
        if key not in cache:
            path = tmp_path_factory.mktemp(f"rollout_{family}")
            cache[key] = make_tiny_hf_model(path / "m", family, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def hf_model():
    """hf_model(path) -> cached transformers model (eval, fp32)."""
    import transformers

    cache: dict[str, object] = {}

    def load(path):
        key = str(path)
        if key not in cache:
            transformers.logging.set_verbosity_error()
            cache[key] = transformers.AutoModelForCausalLM.from_pretrained(
                key, dtype=torch.float32
            ).eval()
        return cache[key]

    return load

