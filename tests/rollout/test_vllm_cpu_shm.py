"""Leftover shared memory of vLLM's CPU communicators (`megarl.rollout.vllm.cpu_shm`) in a
scratch folder standing in for /dev/shm; the real segments of a TP=2 engine are checked in
tests/rollout/test_vllm_update_dist.py (a dead job's segment planted, none left after close)."""

from __future__ import annotations

from megarl.rollout.vllm import cpu_shm

IDENT = "megarl-127.0.0.1-29500"


def _touch(d, *names):
    for n in names:
        (d / n).write_bytes(b"\0")


def test_only_this_jobs_communicator_segments_are_stale(tmp_path):
    _touch(tmp_path, f"{IDENT}-tp:0-[0-1]-cpushm_0", f"{IDENT}-pp:0-[0-1]-cpushm_1",
           "megarl-127.0.0.1-29501-tp:0-[0-1]-cpushm_0",  # another job's port
           f"{IDENT}-notes", "torch_123")  # not a communicator's segment
    assert [p.name for p in cpu_shm.stale_segments(IDENT, tmp_path)] == [
        f"{IDENT}-pp:0-[0-1]-cpushm_1", f"{IDENT}-tp:0-[0-1]-cpushm_0"]


def test_first_rank_on_the_host_clears_them(tmp_path):
    _touch(tmp_path, f"{IDENT}-tp:0-[0-1]-cpushm_0", "megarl-127.0.0.1-29501-tp:0-[0-1]-cpushm_0")
    assert cpu_shm.clear_stale(IDENT, {"LOCAL_RANK": "1"}, tmp_path) == 0  # not its job
    assert (tmp_path / f"{IDENT}-tp:0-[0-1]-cpushm_0").exists()
    assert cpu_shm.clear_stale(IDENT, {"LOCAL_RANK": "0"}, tmp_path) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "megarl-127.0.0.1-29501-tp:0-[0-1]-cpushm_0"]


def test_unlink_skips_missing(tmp_path):
    _touch(tmp_path, "a")
    assert cpu_shm.unlink([tmp_path / "a", tmp_path / "b"]) == 1
    assert not (tmp_path / "a").exists()
