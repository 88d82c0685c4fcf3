"""Single-process runs in the suite fork from a warm interpreter (tests/warm_runs.py): a run
forked there is the run a fresh ``python launch/train.py`` makes, bit for bit, and fails the
same way."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
import warm_runs
from test_resume import _untimed, _weights
from trainer_helpers import FAST, REPO, env, train_rows


def _both(tmp_path, *overrides: str) -> tuple[subprocess.CompletedProcess, ...]:
    out = []
    for way in ("warm", "fresh"):
        argv = ["launch/train.py", "--config", "grpo", *FAST, *overrides,
                f"trainer.default_local_dir={tmp_path / way}"]
        if way == "warm":
            out.append(warm_runs.run_script(argv, REPO, env(), timeout=300))
            assert warm_runs._server is not None and warm_runs._server.ok, "no warm server"
        else:
            out.append(subprocess.run([sys.executable, *argv], cwd=REPO, env=env(),
                                      capture_output=True, text=True, timeout=300))
    return tuple(out)


def test_a_warm_run_is_a_fresh_run_bitwise(tmp_path, demo_assets):
    """GRPO on the demo, 2 steps, HF export: the forked run's metrics (timings aside) and
    exported weights equal a fresh interpreter's, its exit code is 0 and it ran in a process
    of its own. Planted (the child dropping the run's overrides from sys.argv): the forked run
    trains the recipe's full-size defaults and the test fails (timed out after 300 s)."""
    warm, fresh = _both(tmp_path, "trainer.total_training_steps=2", "trainer.export_hf=true",
                        "actor_rollout_ref.model.dtype=fp32")
    assert warm.returncode == fresh.returncode == 0, warm.stderr[-3000:]
    a, b = train_rows(tmp_path / "warm"), train_rows(tmp_path / "fresh")
    assert [r["step"] for r in a] == [1, 2]
    assert [_untimed(r) for r in a] == [_untimed(r) for r in b]
    wa, wb = _weights(tmp_path / "warm"), _weights(tmp_path / "fresh")
    assert wa.keys() == wb.keys() and wa
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert warm_runs._server.proc.pid != os.getpid()


def test_a_warm_run_fails_as_a_fresh_one(tmp_path):
    """A config error: the same exit code and the same one-line message on stderr."""
    warm, fresh = _both(tmp_path, "data.train_batch_size=-3")
    assert warm.returncode == fresh.returncode != 0
    last = [p.stderr.strip().splitlines()[-1] for p in (warm, fresh)]
    assert last[0] == last[1] and "data.train_batch_size" in last[0], last


def test_a_changed_environment_gets_a_server_of_its_own(tmp_path, monkeypatch):
    """A run in an environment the server was not started in (a test set a variable for good)
    runs in a new server started in that environment: the child sees the variable, as a
    fresh interpreter would, and so did the imports before it. Before, every later run of the
    worker fell back to a fresh interpreter (the saving lost for the rest of the session)."""
    script = tmp_path / "show.py"
    script.write_text("import os, sys\nprint(os.environ.get('MEGARL_WARM_PROBE'), "
                      "os.getppid())\n")
    first = warm_runs.run_script([str(script)], REPO, env(), timeout=60)
    server = warm_runs._server
    monkeypatch.setenv("MEGARL_WARM_PROBE", "set")
    second = warm_runs.run_script([str(script)], REPO, env(), timeout=60)
    assert first.stdout.split()[0] == "None" and second.stdout.split()[0] == "set"
    assert warm_runs._server is not server and warm_runs._server.ok
    assert int(second.stdout.split()[1]) == warm_runs._server.proc.pid  # forked, not fresh
    assert server.proc.poll() is not None  # the old server is gone
