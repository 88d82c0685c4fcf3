"""megarl.demo.run's reading of a run's metrics (the before/after accuracy it prints)."""

import json

import pytest

from megarl.demo.run import main, read_accuracy, report


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_first_and_last_validation(tmp_path):
    m = tmp_path / "metrics.jsonl"
    _write(m, [{"step": 0, "val/test_score/arith": 0.23},
               {"step": 1, "critic/score/mean": 0.1},
               {"step": 10, "val/test_score/arith": 0.31, "critic/score/mean": 0.2},
               {"step": 11, "critic/score/mean": 0.3},
               {"step": 20, "val/test_score/arith": 0.452}])
    before, after = read_accuracy(m)
    assert before == (0, 0.23) and after == (20, 0.452)
    text = report(before, after, {"training": 120.0})
    assert "23.0% at step 0 -> 45.2% at step 20 (+22.2 points)" in text
    assert "training 2.0 min" in text


def test_missing_validation_is_said(tmp_path):
    m = tmp_path / "metrics.jsonl"
    _write(m, [{"step": 1, "critic/score/mean": 0.1}])
    assert read_accuracy(m) == (None, None)
    assert read_accuracy(tmp_path / "absent.jsonl") == (None, None)
    assert "no before/after validation" in report(None, None, {})


def test_bad_arguments_are_rejected():
    with pytest.raises(SystemExit):
        main(["--nproc", "0"])
    with pytest.raises(SystemExit):
        main(["not_an_override"])
