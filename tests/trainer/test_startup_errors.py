"""A user-input error found at a run's start is one message naming the key and the fix, on
rank 0, exit status 2, no traceback (MEGARL_DEBUG=1 shows it). Before: a missing data file
ended a run in a 17-line ``[rank0]: Traceback`` with ``FileNotFoundError: data file not found``,
not naming data.train_files."""

from __future__ import annotations

from trainer_helpers import train


def test_missing_data_file_is_one_line_naming_the_key(tmp_path, demo_assets):
    proc = train(tmp_path / "run", "grpo", f"data.train_files={tmp_path}/no.parquet",
                 "trainer.total_training_steps=1", check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert f"\ndata.train_files: no file '{tmp_path}/no.parquet'; give .parquet" in proc.stderr
    assert "MEGARL_DEBUG=1 prints the traceback" in proc.stderr
