"""tests/torchrun.py retries a worker once after a native abort, and only then."""

from __future__ import annotations

import pytest
from torchrun import NATIVE_ABORT, run_torchrun

pytestmark = pytest.mark.dist  # worlds of ranks

# argv: marker folder, mode, the abort message; a rank's first run leaves a marker file
WORKER = """
import os, sys
from pathlib import Path

folder, mode, message = sys.argv[1:4]
marker = Path(folder) / ("rank" + os.environ["RANK"])
first = not marker.exists()
marker.touch()
if mode == "python_error":
    raise ValueError("a planted bug")
if mode == "abort_always" or (mode == "abort_once" and first):
    sys.stderr.write(message + "\\n")
    sys.stderr.flush()
    os.abort()
print("done", os.environ["RANK"])
"""


@pytest.mark.parametrize("mode,passes", [("abort_once", True), ("abort_always", False),
                                         ("python_error", False)])
def test_retry_only_a_single_native_abort(tmp_path, mode, passes):
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    args = [str(tmp_path), mode, NATIVE_ABORT]
    if passes:
        with pytest.warns(UserWarning, match="aborted in native code"):
            out = run_torchrun(worker, 1, args, timeout=120)
        assert "done 0" in out
    else:
        with pytest.raises(AssertionError, match="exited"):
            run_torchrun(worker, 1, args, timeout=120)
