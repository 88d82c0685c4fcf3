"""Runs in the suite fork from a warm interpreter (tests/warm_runs.py): a run forked there is
the run a fresh ``python launch/train.py`` makes, bit for bit, and fails the same way; a world of
ranks forked there gets what torchrun gives its workers and ends as torchrun ends it. (The
2-rank runs of test_resume.py and test_async_faults.py compare a forked world's run with one
under the real torchrun, bit for bit.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import warm_runs
from test_resume import _untimed, _weights
from trainer_helpers import FAST, REPO, env, train_rows

# every test starts a warm server, and runs or worlds forked from it
pytestmark = pytest.mark.e2e


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
    # the heap the trainer froze for the run is thawed before the interpreter's exit, which
    # frees it: nothing reported leaked by an extension (triton's nanobind counts its objects)
    assert "leaked" not in fresh.stderr, fresh.stderr[-3000:]
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
    fresh interpreter would, and so did the imports before it. The first server stays up: a
    run back in the first environment forks from it again (trainer runs and torchrun workers
    alternate between two environments). Before, every later run of the worker fell back to
    a fresh interpreter (the saving lost for the rest of the session)."""
    script = tmp_path / "show.py"
    script.write_text("import os, sys\nprint(os.environ.get('MEGARL_WARM_PROBE'), "
                      "os.getppid())\n")
    first = warm_runs.run_script([str(script)], REPO, env(), timeout=60)
    server = warm_runs._server
    with monkeypatch.context() as patch:
        patch.setenv("MEGARL_WARM_PROBE", "set")
        second = warm_runs.run_script([str(script)], REPO, env(), timeout=60)
    assert first.stdout.split()[0] == "None" and second.stdout.split()[0] == "set"
    assert warm_runs._server is not server and warm_runs._server.ok
    assert int(second.stdout.split()[1]) == warm_runs._server.proc.pid  # forked, not fresh
    third = warm_runs.run_script([str(script)], REPO, env(), timeout=60)
    assert warm_runs._server is server and server.proc.poll() is None
    assert third.stdout.split() == ["None", str(server.proc.pid)]


# What a rank prints: the variables a torchrun worker gets (launch/train.py, torch.distributed's
# env:// rendezvous and megarl read these), then one gloo all-reduce over the world.
_RANK_PROBE = """
import json, os, sys
import torch, torch.distributed as dist
names = sorted(k for k in os.environ if k in {names!r} or k.startswith("TORCHELASTIC_"))
print(json.dumps({{k: os.environ[k] for k in names}}), flush=True)
dist.init_process_group("gloo")
t = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(t)
print(f"sum {{int(t)}}", flush=True)  # one write: the ranks share stdout
dist.destroy_process_group()
"""
_WORLD_NAMES = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE",
                "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE")
# differ between any two launches, or name torchrun's own agent (its store, its error files)
_PER_LAUNCH = {"TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE",
               "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ENABLE_FILE_TIMER",
               "TORCHELASTIC_TIMER_FILE"}


def _ranks_env(stdout: str) -> list[dict[str, str]]:
    import json

    rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return sorted(({k: v for k, v in r.items() if k not in _PER_LAUNCH} for r in rows),
                  key=lambda r: int(r["RANK"]))


def test_a_warm_world_gives_each_rank_what_torchrun_gives_it(tmp_path):
    """Two ranks forked from the server against ``torchrun --standalone --nproc_per_node=2``:
    each rank sees the same world variables (the rendezvous address, run id and torchrun's
    agent files aside), and the two ranks form one gloo world (all-reduce of 1 + 2 = 3).
    Planted: LOCAL_WORLD_SIZE left out of `_rank_env` -> the variables differ."""
    script = tmp_path / "rank.py"
    script.write_text(_RANK_PROBE.format(names=_WORLD_NAMES))
    warm = warm_runs.run_script([str(script)], REPO, env(), timeout=120, nproc=2)
    assert warm_runs._server is not None and warm_runs._server.ok, "no warm server"
    fresh = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            "--nproc_per_node=2", str(script)], cwd=REPO, env=env(),
                           capture_output=True, text=True, timeout=120)
    assert warm.returncode == fresh.returncode == 0, warm.stderr[-3000:] + fresh.stderr[-3000:]
    assert warm.stdout.count("sum 3") == fresh.stdout.count("sum 3") == 2
    assert _ranks_env(warm.stdout) == _ranks_env(fresh.stdout)
    assert len(_ranks_env(warm.stdout)) == 2


def test_a_failing_rank_ends_the_warm_world(tmp_path):
    """Rank 1 exits 3 while rank 0 waits forever: the world ends with exit code 3 well inside
    the 30 s grace (rank 0 ends by the SIGTERM it is sent), as under torchrun."""
    import time

    script = tmp_path / "fail.py"
    script.write_text("import os, sys, time\n"
                      "if os.environ['RANK'] == '1':\n    sys.exit(3)\n"
                      "time.sleep(600)\n")
    t0 = time.monotonic()
    proc = warm_runs.run_script([str(script)], REPO, env(), timeout=120, nproc=2)
    assert proc.returncode == 3
    assert time.monotonic() - t0 < 20
