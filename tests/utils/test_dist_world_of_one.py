"""megarl.utils.dist.init_distributed without torchrun: a world of one that leaves the
environment alone, so child processes do not inherit a half torchrun environment."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CHILD = r"""
import os, subprocess, sys
import torch, torch.distributed as dist
from megarl.utils.dist import init_distributed
init_distributed(torch.device("cpu"))
assert (dist.get_rank(), dist.get_world_size()) == (0, 1)
t = torch.tensor([3.0]); dist.all_reduce(t); assert t.item() == 3.0
leaked = sorted(k for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR") if k in os.environ)
assert not leaked, leaked
dist.destroy_process_group()
init_distributed(torch.device("cpu"))  # again in the same process (a second run)
assert dist.get_world_size() == 1
# a grandchild started from here initialises as a world of one too
code = "import torch; from megarl.utils.dist import init_distributed as i; i(torch.device('cpu'))"
subprocess.run([sys.executable, "-c", code], check=True)
print("ok")
"""


def test_world_of_one_leaves_environment_alone():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                        "MASTER_PORT")}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
