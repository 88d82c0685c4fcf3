"""Fixtures for tests/data: a small HF tokenizer folder (the demo BPE, built in ~1 s)."""

import pytest


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory):
    from megarl.demo.tokenizer import save_tokenizer

    path = tmp_path_factory.mktemp("tok")
    save_tokenizer(str(path))
    return str(path)


@pytest.fixture(scope="session")
def tok(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_dir)
