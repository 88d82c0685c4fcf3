"""The tree passes ruff (the rules in pyproject.toml), so style drift fails the suite."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_ruff_clean():
    dirs = ["megarl", "megarl_kernels", "launch", "conversion", "tests", "bench"]
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", *dirs], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
