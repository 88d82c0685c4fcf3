"""The demo's shipped checkpoints (megarl/demo/checkpoints): the manifest matches the files,
a run installs them (checked) instead of training, a damaged file is refused naming it, a
newer shipped set replaces an installed one while a local build is kept, and a run makes
only the assets it reads."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.demo.assets import _deps_match, build_all, ensure, is_built
from megarl.demo.recipe import ASSETS_VERSION
from megarl.demo.shipped import MANIFEST, SHIPPED, SHIPPED_DIR, install, manifest, sha256
from megarl.errors import UserInputError

ROOT = Path(__file__).resolve().parents[2]
MAX_BYTES = 15 * 2**20  # the whole shipped set stays small
ONE_SMALL_STEP = ["trainer.total_training_steps=1", "data.train_batch_size=2",
                  "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.n=2",
                  "data.max_response_length=16", "algorithm.filter_groups.enable=false",
                  "trainer.test_freq=-1",
                  "trainer.val_before_train=false", "trainer.logger=[jsonl]",
                  "trainer.export_hf=false"]


def test_the_manifest_names_every_file_with_its_sha256():
    """Every shipped file is in the manifest with its digest, nothing else is shipped, the set
    is at most 15 MiB, and it says what built it."""
    m = manifest()
    assert m is not None, f"no {MANIFEST} in {SHIPPED_DIR}"
    assert sorted(m["components"]) == sorted(SHIPPED)
    total = 0
    for component, entry in m["components"].items():
        folder = SHIPPED_DIR / component
        on_disk = {p.name for p in folder.iterdir()} - {"metadata.json"}
        assert on_disk == set(entry["files"]), component
        for name, digest in entry["files"].items():
            assert sha256(folder / name) == digest, (component, name)
            total += (folder / name).stat().st_size
        meta = json.loads((folder / "metadata.json").read_text())
        assert meta["build_id"] == entry["build_id"] and meta["version"] == ASSETS_VERSION
    assert total <= MAX_BYTES, total
    assert m["commit"] and m["cpu"] and m["build_threads"] == 2
    assert 0.15 <= m["components"]["policy"]["val_accuracy"] <= 0.5


def test_a_run_installs_the_shipped_policy_byte_for_byte(tmp_path):
    """`ensure` without a build config installs the shipped policy (no SFT: the bytes are the
    shipped ones) after building the arithmetic data it depends on, whose content digest is
    the one the shipped policy was trained on; the critic is derived from it in seconds."""
    path = ensure("critic", tmp_path, log=lambda s: None)
    assert path == tmp_path / "critic"
    policy = tmp_path / "policy"
    meta = json.loads((policy / "metadata.json").read_text())
    assert meta["source"] == "shipped"
    for name, digest in manifest()["components"]["policy"]["files"].items():
        assert sha256(policy / name) == digest, name
    assert is_built("policy", tmp_path, shipped=True) and is_built("critic", tmp_path)
    arith = json.loads((tmp_path / "arith" / "metadata.json").read_text())
    assert meta["deps"]["arith"] == arith["build_id"]  # rebuilt here, the same rows
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
        "arith", "critic", "policy", "tokenizer"]


def test_a_damaged_shipped_file_is_refused_naming_it(tmp_path):
    shipped = tmp_path / "shipped"
    shutil.copytree(SHIPPED_DIR, shipped)
    weights = shipped / "prm" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(UserInputError, match=r"prm/model\.safetensors: sha256 .*git checkout"):
        install("prm", tmp_path / "staging", shipped)
    (shipped / "tokenizer" / "tokenizer.json").unlink()
    with pytest.raises(UserInputError, match=r"tokenizer\.json is missing"):
        install("tokenizer", tmp_path / "staging2", shipped)


def test_a_newer_shipped_set_replaces_an_installed_copy_but_not_a_local_build(tmp_path):
    ensure("tokenizer", tmp_path, log=lambda s: None)
    meta_path = tmp_path / "tokenizer" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    assert is_built("tokenizer", tmp_path, shipped=True)
    meta_path.write_text(json.dumps({**meta, "build_id": "an-older-shipped-set"}))
    assert not is_built("tokenizer", tmp_path, shipped=True)
    ensure("tokenizer", tmp_path, log=lambda s: None)
    assert json.loads(meta_path.read_text())["build_id"] == meta["build_id"]
    local = {k: v for k, v in meta.items() if k != "source"}  # as `--build` writes it
    meta_path.write_text(json.dumps({**local, "build_id": "a-local-build"}))
    assert is_built("tokenizer", tmp_path, shipped=True)


def test_shipped_dependencies_of_a_local_build_are_not_mixed_in(tmp_path):
    """The shipped PRM is installed only over the shipped policy it was trained on: over a
    local build of the policy, `ensure` builds the PRM from that policy instead."""
    build_all(tmp_path, only=("tokenizer", "arith", "policy"), log=lambda s: None)
    shipped_prm = install("prm", tmp_path / "staging")
    assert _deps_match(shipped_prm, "prm", tmp_path)
    meta_path = tmp_path / "policy" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "build_id": "a-local-build", "source": "build"}))
    assert is_built("policy", tmp_path, shipped=True)  # a local build is used as it is
    assert not _deps_match(shipped_prm, "prm", tmp_path)


@pytest.mark.e2e
def test_the_demo_makes_only_what_its_run_reads(tmp_path):
    """`python -m megarl.demo.run` (what make demo runs) on an empty assets folder, 1 step of
    pure_prm_vr on one rank: the folder then holds the tokenizer, the arithmetic data, the
    shipped policy and PRM, and nothing else (no critic, MoE or tool-using policy)."""
    assets = tmp_path / "assets"
    env = dict(os.environ, MEGARL_ASSETS=str(assets), OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, "-m", "megarl.demo.run", "--nproc", "1", "--out", str(tmp_path / "run"),
         *ONE_SMALL_STEP],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    made = sorted(p.name for p in assets.iterdir() if not p.name.startswith("."))
    assert made == ["arith", "policy", "prm", "tokenizer"], made
    for name in ("policy", "prm", "tokenizer"):
        assert json.loads((assets / name / "metadata.json").read_text())["source"] == "shipped"
