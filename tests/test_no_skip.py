"""MEGARL_NO_SKIP=1 (CI) turns every skip into a failure, collection-time skips included: a
broken megatron-core install must fail the run, naming what it skipped, not exit 0."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # runs pytest in subprocesses

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"


def _pytest(args: list[str], cwd: Path, no_skip: bool, pythonpath: Path | None = None):
    env = {k: v for k, v in os.environ.items() if k not in ("MEGARL_NO_SKIP", "PYTHONPATH")}
    env.update(OMP_NUM_THREADS="1", TRITON_INTERPRET="1", PYTEST_ADDOPTS="")
    if no_skip:
        env["MEGARL_NO_SKIP"] = "1"
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


def _only(target: Path) -> list[str]:
    """``--ignore`` for everything under tests/ beside the folders leading to ``target``, so a
    run over ``tests`` collects ``target`` alone, through the folders' conftests as `make test`
    does (naming a file under tests/megatron on the command line would load its conftest before
    collection, where pytest aborts on any exception, skip or not)."""
    ignores, here = [], target
    while here != TESTS:
        for sibling in here.parent.iterdir():
            if sibling != here and sibling.name not in ("conftest.py", "__pycache__"):
                ignores.append(f"--ignore={sibling.relative_to(REPO)}")
        here = here.parent
    return ignores


def _broken_megatron(tmp_path: Path) -> Path:
    """A ``megatron`` package without ``core`` ahead of site-packages: ``import megatron.core``
    raises ModuleNotFoundError, as on a broken install."""
    (tmp_path / "megatron").mkdir()
    (tmp_path / "megatron" / "__init__.py").write_text("")
    return tmp_path


def test_broken_megatron_fails_the_run_naming_the_skipped_folder(tmp_path):
    """tests/megatron/conftest.py's ``importorskip("megatron.core")`` skips the folder at
    collection; under MEGARL_NO_SKIP=1 the run fails naming it (through an xdist worker, as
    `make test` runs), and without the switch the same run ends with a skip (the control: the
    shadow package is what breaks megatron). Planted: the collection hook not registered ->
    rc 0 and the folder only skipped -> this test fails; so does the hook as a plain conftest
    function (pytest calls a folder's report without the conftest hooks when its conftest
    raised)."""
    args = ["-n", "1", "-rs", "tests", *_only(TESTS / "megatron" / "test_mcore_units.py")]
    shadow = _broken_megatron(tmp_path)
    rc, out = _pytest(args, REPO, no_skip=False, pythonpath=shadow)
    # 5: pytest's "no tests ran", its exit status where all there was got skipped
    assert rc == 5 and "could not import 'megatron.core'" in out, out[-3000:]
    rc, out = _pytest(args, REPO, no_skip=True, pythonpath=shadow)
    assert rc != 0, out[-3000:]
    assert "tests/megatron skipped at collection under MEGARL_NO_SKIP=1" in out, out[-3000:]
    assert "could not import 'megatron.core'" in out, out[-3000:]


SKIPPING_FILES = {
    "test_importorskip.py": "import pytest\n"
                            "pytest.importorskip('megarl_no_such_module')\n"
                            "def test_a():\n    pass\n",
    "test_module_skip.py": "import pytest\n"
                           "pytest.skip('module skipped', allow_module_level=True)\n"
                           "def test_b():\n    pass\n",
    "test_skipif_mark.py": "import pytest\n"
                           "pytestmark = pytest.mark.skipif(True, reason='marked skip')\n"
                           "def test_c():\n    pass\n",
    "sub/conftest.py": "import pytest\npytest.importorskip('megarl_no_such_module')\n",
    "sub/test_in_sub.py": "def test_d():\n    pass\n",
    "test_runs.py": "def test_e():\n    pass\n",
}


def test_every_kind_of_skip_fails_under_no_skip(tmp_path):
    """The suite's conftest over a tree with each way a module or folder gets skipped (the ones
    tests/ uses: importorskip in a test module or a folder's conftest; and
    ``skip(allow_module_level=True)``, a module-level ``skipif``): each fails, named, under
    MEGARL_NO_SKIP=1, while the plain test passes. Planted: the collection hook not registered
    -> the three collection skips pass as skips -> this test fails."""
    for name in ("conftest.py", "timing_table.py"):  # the conftest and the plugin it loads
        (tmp_path / name).write_text((TESTS / name).read_text())
    for name, text in SKIPPING_FILES.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    args = ["--continue-on-collection-errors", "-rA", "."]
    rc, out = _pytest(args, tmp_path, no_skip=True)
    assert rc != 0, out[-3000:]
    for where in ("test_importorskip.py skipped at collection", "test_module_skip.py skipped at "
                  "collection", "sub skipped at collection", "PASSED test_runs.py::test_e",
                  "ERROR test_skipif_mark.py::test_c - skipped under MEGARL_NO_SKIP=1"):
        assert where in out, (where, out[-3000:])
    assert "1 passed, 4 errors" in out, out[-3000:]  # the skipif one errs in its setup
