"""A save killed at any point leaves only whole ``global_step_N`` folders: the deletion of an
old checkpoint (pruned by trainer.max_ckpt_to_keep, or replaced when a step is saved again)
goes through a temporary name, and the next save removes every folder a killed save left."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from megarl.trainer.checkpoint import COMPLETE, CheckpointManager

REPO = Path(__file__).resolve().parents[2]
FILES = 6000  # files of the old checkpoint: its deletion takes long enough to be caught midway

# Saves step 1 (FILES files), then step 2 with keep_last=1 (the deletion of step 1 follows),
# in one process; the first argument is the checkpoints folder.
SAVER = """
import sys
from pathlib import Path
from megarl.trainer.checkpoint import CheckpointManager

def roles(n):
    def write(tmp):
        (tmp / "actor").mkdir()
        for i in range(n):
            (tmp / "actor" / f"shard{i:05d}").write_bytes(b"x")
    return write

root = Path(sys.argv[1])
CheckpointManager(root).save(1, roles(int(sys.argv[2])), {"step": 1})
print("saved 1", flush=True)
CheckpointManager(root, keep_last=1).save(2, roles(3), {"step": 2})
print("saved 2", flush=True)
"""


def _count(actor: Path) -> int:
    try:
        return sum(1 for _ in os.scandir(actor))
    except FileNotFoundError:
        return -1


def _assert_whole(root: Path, files: dict[int, int]) -> None:
    """Every ``global_step_N`` is complete, with all ``files[N]`` of its actor shards."""
    for d in root.iterdir():
        if d.name.startswith("global_step_"):
            step = int(d.name.rsplit("_", 1)[1])
            assert (d / COMPLETE).is_file(), f"{d.name} has no {COMPLETE}"
            assert _count(d / "actor") == files[step], (
                f"{d.name} holds {_count(d / 'actor')} of its {files[step]} shards")


def test_a_kill_while_an_old_checkpoint_is_deleted_leaves_whole_checkpoints(tmp_path):
    """keep_last=1: the save of step 2 deletes step 1 (6000 files, ~0.3 s); the saving process
    is SIGKILLed once that deletion has begun. Every global_step_N left is whole and the next
    save removes the leftover. Before the fix (shutil.rmtree of global_step_1 in place) it
    printed (2 runs of 2): "global_step_1 holds 5998 of its 6000 shards" (COMPLETE gone or not
    depends on the directory order; the folder kept its step name either way)."""
    root = tmp_path / "checkpoints"
    proc = subprocess.Popen([sys.executable, "-c", SAVER, str(root), str(FILES)], cwd=REPO,
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    try:
        assert proc.stdout.readline() == "saved 1\n", "the first save did not finish"
        deadline = time.monotonic() + 60
        while True:  # the deletion has begun: step 1's actor folder lost files (wherever it is)
            left = max(_count(root / "global_step_1" / "actor"),
                       _count(root / ".old_global_step_1" / "actor"))
            if 0 <= left < FILES:
                break
            assert proc.poll() is None, "the save of step 2 ended before its deletion was seen"
            assert time.monotonic() < deadline, "no deletion of step 1 within 60 s"
        proc.kill()
        proc.wait(timeout=30)
    finally:
        proc.kill()
    _assert_whole(root, {1: FILES, 2: 3})
    mgr = CheckpointManager(root)
    assert mgr.latest() == root / "global_step_2"
    mgr.save(3, lambda tmp: (tmp / "actor").mkdir(), {"step": 3})
    names = sorted(c.name for c in root.iterdir())
    assert not [n for n in names if n.startswith(".")], names
    assert {"global_step_2", "global_step_3"} <= set(names), names
    assert json.loads((root / "global_step_3" / "trainer_state.json").read_text()) == {"step": 3}


def test_a_step_saved_again_is_replaced_whole(tmp_path):
    """Saving a step that exists (a resume from an older checkpoint) replaces it: the new one
    is published whole and the old copy leaves nothing behind."""
    root = tmp_path / "checkpoints"
    mgr = CheckpointManager(root)
    mgr.save(4, lambda tmp: (tmp / "old").write_text("a"), {"step": 4, "v": "old"})
    (root / ".tmp_global_step_5").mkdir()  # a save killed earlier
    mgr.save(4, lambda tmp: (tmp / "new").write_text("b"), {"step": 4, "v": "new"})
    assert sorted(c.name for c in root.iterdir()) == ["global_step_4"]
    assert sorted(c.name for c in (root / "global_step_4").iterdir()) == [
        COMPLETE, "new", "rng", "trainer_state.json"]
    assert mgr.load_trainer_state(root / "global_step_4")["v"] == "new"
