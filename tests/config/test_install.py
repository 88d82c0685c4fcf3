"""A non-editable install (``pip install .``, no network: --no-deps --no-build-isolation) into a
fresh venv finds the recipes and runs one: ``megarl-train --config grpo`` trains 2 steps on the
embedded demo from a folder outside the source tree. The venv sees this interpreter's
site-packages (torch and the rest) through a .pth line, which does not run their .pth files, so
the repository's editable install stays out of it; the test asserts megarl is imported from the
venv. ``MEGARL_CONFIG_DIR`` still wins over the packaged recipes.

Planted: without the build step that copies configs/ into the package, ``config list`` prints
nothing (the test fails there). 40 s here."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # builds and installs the package

REPO = Path(__file__).resolve().parents[2]
SOURCES = ["setup.py", "pyproject.toml", "MANIFEST.in", "README.md", "configs", "megarl",
           "megarl_kernels", "launch", "conversion"]
FAST = ["data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.rollout.n=4", "data.max_response_length=48", "trainer.test_freq=-1",
        "trainer.val_before_train=false", "trainer.logger=[jsonl]", "trainer.export_hf=false",
        "trainer.total_training_steps=2"]


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("install")
    src = root / "src"
    src.mkdir()
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(path, src / name)
    env_dir = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    py = env_dir / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    Path(purelib, "_megarl_test_deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    proc = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps",
                           "--no-build-isolation", "--no-index", str(src)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return env_dir


def run(venv: Path, *args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
             **env)
    for key in ("PYTHONPATH", "MEGARL_CONFIG_DIR", "TRITON_INTERPRET"):
        if key not in env:
            e.pop(key, None)
    return subprocess.run([str(a) for a in args], cwd=cwd, env=e, capture_output=True, text=True,
                          timeout=600)


def test_installed_package_finds_and_runs_a_recipe(venv, tmp_path):
    from megarl.demo.assets import assets_root, build_all

    build_all()  # the embedded demo (built once under the repo's assets/)
    py = venv / "bin" / "python"
    where = run(venv, py, "-c", "import megarl, megarl.config as c; print(megarl.__file__);"
                "print(c.config_dir())", cwd=tmp_path)
    assert where.returncode == 0, where.stderr
    module, recipes = where.stdout.split()
    assert module.startswith(str(venv)) and recipes.startswith(str(venv))
    listed = run(venv, py, "-m", "megarl.config", "list", cwd=tmp_path).stdout.split()
    assert {"base", "grpo", "pure_prm_vr", "real/pacs_qwen25_7b"} <= set(listed)
    assert not any(n.startswith("demo") for n in listed)

    out = tmp_path / "run"
    proc = run(venv, venv / "bin" / "megarl-train", "--config", "grpo",
               f"trainer.default_local_dir={out}", *FAST, cwd=tmp_path,
               MEGARL_ASSETS=str(assets_root()))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "demo overlay: applied" in proc.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "actor/grad_norm" in r] == [1, 2]

    mine = tmp_path / "my_configs"
    mine.mkdir()
    (mine / "mine.yaml").write_text("trainer: {experiment_name: mine}\n")
    listed = run(venv, py, "-m", "megarl.config", "list", cwd=tmp_path,
                 MEGARL_CONFIG_DIR=str(mine)).stdout.split()
    assert listed == ["mine"]
