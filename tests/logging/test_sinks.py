"""MetricLogger as a loop over sinks: each of the run's own sinks (JSONL record, TensorBoard,
console, curves) read back with an independent reader (json, TensorBoard's EventAccumulator,
the captured stdout, the PNG header), which sinks each rank builds, and one sink interface
(a sink added to `SINK_TYPES` receives every row). wandb and MLflow: test_trackers.py.

Planted: a logger that skips the last sink of its list (the recording sink misses every row);
the JSONL resume keeping rows after the resume step (row 3 read back twice); TensorBoard
without purge_step on resume (step 3 read back twice); the console built on global rank 0 only
(rank 1 of node 2 prints nothing): each fails here.
"""

from __future__ import annotations

import json

import pytest

from megarl.logging import SINK_TYPES, MetricLogger, Sink, SinkType

ROWS = {1: {"critic/score/mean": 0.5, "actor/pg_loss": -0.25, "timing_s/step": 2.0},
        2: {"critic/score/mean": 0.75, "actor/pg_loss": 0.125, "timing_s/step": 1.5,
            "val/test_score/arith": 0.5, "note": "text"},
        3: {"critic/score/mean": 1.0, "actor/pg_loss": 0.0, "timing_s/step": 1.0}}


def _run(run_dir, sinks, steps=(1, 2, 3), resume_step=None, rank=0, local_rank=0, plot=True):
    logger = MetricLogger(run_dir, sinks, total_steps=3, rank=rank, local_rank=local_rank,
                          resume_step=resume_step, title="p/e")
    for step in steps:
        logger.log(step, ROWS[step])
    return logger, logger.close(plot=plot)


def _rows(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]


def test_jsonl_record_is_always_written_and_truncated_on_resume(tmp_path):
    run = tmp_path / "run"
    _run(run, ["console"], plot=False)
    assert _rows(run) == [{"step": s, **r} for s, r in ROWS.items()]
    # the run died after logging step 3 but resumes from its step-2 checkpoint
    logger, _ = _run(run, [], steps=(3,), resume_step=2, plot=False)
    assert [r["step"] for r in _rows(run)] == [1, 2, 3]
    assert logger.has_step(3) and not logger.has_step(4)


def test_tensorboard_scalars_and_purge_on_resume(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    _run(run, ["tensorboard"], plot=False)
    _run(run, ["tensorboard"], steps=(3,), resume_step=2, plot=False)
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    assert "note" not in acc.Tags()["scalars"]
    for key in ("critic/score/mean", "actor/pg_loss", "val/test_score/arith"):
        got = [(e.step, e.value) for e in acc.Scalars(key)]
        assert got == [(s, r[key]) for s, r in ROWS.items() if key in r], key


def test_console_lines_and_print(tmp_path, capsys):
    logger = MetricLogger(tmp_path / "run", ["console"], total_steps=3)
    logger.print("hello")
    logger.log(1, ROWS[1])
    logger.close(plot=False)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "hello"
    assert out[1].startswith("step 1/3 | score=0.5 pg=-0.25 s/step=2 | eta ")


def test_curves_drawn_at_close(tmp_path):
    _, path = _run(tmp_path / "run", [])
    assert path == str(tmp_path / "run" / "curves.png")
    assert (tmp_path / "run" / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    _, none = _run(tmp_path / "run2", [], plot=False)
    assert none is None and not (tmp_path / "run2" / "curves.png").exists()


@pytest.mark.parametrize("rank, local_rank, files, console", [
    (0, 0, True, True), (1, 0, False, True), (3, 1, False, False)])
def test_which_rank_builds_which_sink(tmp_path, capsys, rank, local_rank, files, console):
    """Files on global rank 0 only; the console on every node's first rank."""
    logger, _ = _run(tmp_path / "run", ["console", "tensorboard"], rank=rank,
                     local_rank=local_rank, plot=False)
    assert (tmp_path / "run" / "metrics.jsonl").exists() == files
    assert (tmp_path / "run" / "tensorboard").exists() == files
    assert ("step 3/3" in capsys.readouterr().out) == console
    assert logger.has_step(9) != files  # off rank 0 there is no record to ask


def test_a_registered_sink_gets_every_row_and_is_closed(tmp_path, monkeypatch):
    seen: list = []

    class Recorder:
        def log(self, step, metrics):
            seen.append((step, dict(metrics)))

        def close(self):
            seen.append("closed")

    assert isinstance(Recorder(), Sink)
    monkeypatch.setitem(SINK_TYPES, "recorder", SinkType(lambda run: Recorder(), always=True))
    _run(tmp_path / "run", [], plot=False)
    assert seen == [*ROWS.items(), "closed"]


def test_unknown_sink_names_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"trainer.logger: unknown sink\(s\) \['clearml'\]"):
        MetricLogger(tmp_path, ["clearml"], total_steps=1)


def test_console_kl_is_the_kl_to_the_reference_the_run_trains_with(tmp_path, capsys):
    """A GRPO row (use_kl_loss) shows ``kl=`` from actor/kl_loss, a PPO row with the in-reward
    penalty shows ``kl_rwd=`` from actor/reward_kl_penalty, and a row without a reference KL
    shows no kl column. Before: ``kl=`` was actor/ppo_kl, 0 on every on-policy step of a GRPO
    run whose actor/kl_loss was 0.003-0.013 (``step 1/3 | score=0.5 pg=-0.25 kl=0 ...``)."""
    grpo = {"critic/score/mean": 0.5, "actor/pg_loss": -0.25, "actor/ppo_kl": 0.0,
            "actor/kl_loss": 0.0125, "actor/entropy": 1.5}
    ppo = {"critic/score/mean": 0.5, "actor/pg_loss": -0.25, "actor/ppo_kl": 0.0,
           "actor/reward_kl_penalty": 0.002, "critic/vf_loss": 0.75}
    plain = {"critic/score/mean": 0.5, "actor/pg_loss": -0.25, "actor/ppo_kl": 0.0}
    logger = MetricLogger(tmp_path / "run", ["console"], total_steps=3)
    for step, row in enumerate((grpo, ppo, plain), 1):
        logger.log(step, row)
    logger.close(plot=False)
    out = [line.split(" | ")[1] for line in capsys.readouterr().out.splitlines()]
    assert out == ["score=0.5 pg=-0.25 kl=0.0125 ent=1.5",
                   "score=0.5 pg=-0.25 kl_rwd=0.002 vf=0.75",
                   "score=0.5 pg=-0.25"]


def test_curves_draw_the_trained_reward_the_verifiable_one_and_nonzero_losses(tmp_path):
    """Rows shaped as the pure_prm_vr demo's: critic/score/mean == critic/rewards/mean (PRM +
    verifiable), critic/verifiable_reward/mean rising 0.27 -> 0.47, actor/ppo_kl 0, no KL loss.
    Before: the reward panel drew critic/score/mean and critic/rewards/mean (one line twice)
    and not the verifiable reward; no loss panel."""
    from megarl.logging.plots import curves_data, plot_curves

    vr = [0.27, 0.35, 0.47]
    rows = [{"step": 0, "val/test_score/arith": 0.3}]
    rows += [{"step": s, "critic/score/mean": 0.1 * s, "critic/rewards/mean": 0.1 * s,
              "critic/verifiable_reward/mean": vr[s - 1], "actor/pg_loss": -0.01 * s,
              "actor/ppo_kl": 0.0, "actor/kl_loss": 0.0, "val/test_score/arith": 0.3 + 0.1 * s}
             for s in (1, 2, 3)]
    data = curves_data(rows)
    assert list(data["training reward"]) == ["critic/rewards/mean",
                                             "critic/verifiable_reward/mean"]
    assert data["training reward"]["critic/verifiable_reward/mean"] == [(1, .27), (2, .35), (3, .47)]
    assert [s for s, _ in data["validation"]["val/test_score/arith"]] == [0, 1, 2, 3]
    assert list(data["loss terms"]) == ["actor/pg_loss"]  # the KL loss is 0 throughout
    assert plot_curves(rows, tmp_path / "c.png") == str(tmp_path / "c.png")
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
