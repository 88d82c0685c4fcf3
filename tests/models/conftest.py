"""Fixtures for tests/models: tiny HF folders written by transformers, cached per session."""

from __future__ import annotations

import json

import pytest

from megarl.models.testing import make_tiny_hf_model


@pytest.fixture(scope="session")
def hf_folder(tmp_path_factory):
    """hf_folder(family, head="lm", num_labels=2, **overrides) -> path of a cached tiny folder."""
    cache: dict[str, object] = {}

    def make(family: str, head: str = "lm", num_labels: int = 2, **overrides):
        key = json.dumps([family, head, num_labels, overrides], sort_keys=True, default=str)
        if key not in cache:
            path = tmp_path_factory.mktemp(f"{family}_{head}")
            cache[key] = make_tiny_hf_model(path / "m", family, head, num_labels, **overrides)
        return cache[key]

    return make
