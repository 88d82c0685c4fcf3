"""A timeline of one training step: what the trainer and the engine process do, and when.

Runs the embedded demo (GRPO, one rank) in this process for ``--steps`` steps with
``async_training.staleness_threshold=--staleness``, the trainer pinned to ``--trainer-cpu`` and
the engine process (staleness > 0) to ``--engine-cpu``, and draws step ``--step`` as two lanes
of text: every phase the trainer times (`megarl.trainer.metrics.Timer.sink`) and every request
the engine process served (`megarl.rollout.process.ProcessRolloutEngine.spans`: loading the
weights of its version, then generating). Both clocks are ``time.perf_counter()``, the
system-wide monotonic clock on Linux. A table of the spans, in seconds from the step's start,
follows the picture.

    OMP_NUM_THREADS=1 python bench/async_timeline.py --steps 6 --step 5
    OMP_NUM_THREADS=1 python bench/async_timeline.py --staleness 0   # the synchronous step
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

# one letter per trainer phase (timing_s/<name>); engine: L = loading weights, G = generating
LETTERS = {"gen": "g", "reward": "s", "prm": "p", "old_log_prob": "o", "ref": "r",
           "values": "v", "adv": "a", "update_critic": "c", "update_actor": "u",
           "update_weights": "w", "engine_sleep": "z", "engine_wake": "z"}


def run(args: argparse.Namespace) -> tuple[list, list, dict[int, tuple[float, float]]]:
    """Train; return the trainer's spans, the engine's spans and each step's (start, end)."""
    from megarl.config.loader import resolve_config
    from megarl.trainer.metrics import Timer
    from megarl.trainer.trainer import RLTrainer
    from megarl.utils import dist as mdist

    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.trainer_cpu})
    torch.set_num_threads(1)
    mdist.init_distributed(torch.device("cpu"))
    out = tempfile.mkdtemp(prefix="timeline_")
    cfg = resolve_config("grpo", [
        f"trainer.default_local_dir={out}", f"trainer.total_training_steps={args.steps}",
        "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.logger=[jsonl]",
        "trainer.export_hf=false", "trainer.save_freq=-1",
        f"async_training.staleness_threshold={args.staleness}",
        f"async_training.engine_cpus=[{args.engine_cpu}]", *args.overrides]).config
    trainer = RLTrainer(cfg)
    Timer.sink = []
    bounds = {}
    try:
        for _ in range(args.steps):
            trainer.step += 1
            start = time.perf_counter()
            trainer.train_step()
            bounds[trainer.step] = (start, time.perf_counter())
        engine = list(getattr(trainer.parts.engine, "spans", []))
    finally:
        trainer.parts.close()
    return Timer.sink, engine, bounds


def lane(spans: list[tuple[str, float, float]], t0: float, t1: float, width: int) -> str:
    """``width`` characters over [t0, t1]: each character shows the span covering most of it."""
    cells = []
    dt = (t1 - t0) / width
    for i in range(width):
        a, b = t0 + i * dt, t0 + (i + 1) * dt
        best, cover = " ", 0.0
        for letter, s, e in spans:
            c = min(b, e) - max(a, s)
            if c > cover:
                best, cover = letter, c
        cells.append(best if cover > dt / 4 else " ")
    return "".join(cells)


def draw(trainer: list, engine: list, bounds: dict, step: int, width: int) -> str:
    t0, t1 = bounds[step]
    mine = [(n, s, e) for n, s, e in trainer if t0 <= s < t1]
    busy = []  # (label, start, end) clipped to the step
    for sp in engine:
        for label, s, e in (("L", sp.start, sp.generate), ("G", sp.generate, sp.end)):
            if e > t0 and s < t1 and e > s:
                busy.append((label, max(s, t0), min(e, t1), sp.version))
    lines = [f"step {step}: {t1 - t0:.2f} s, one character = {1000 * (t1 - t0) / width:.0f} ms",
             f"trainer |{lane([(LETTERS.get(n, '?'), s, e) for n, s, e in mine], t0, t1, width)}|"]
    if engine:
        lines.append(f"engine  |{lane([(b[0], b[1], b[2]) for b in busy], t0, t1, width)}|")
    legend = sorted({f"{LETTERS.get(n, '?')} {n}" for n, _, _ in mine})
    lines.append("legend: " + ", ".join(legend) + (", L engine loads weights, G engine "
                                                    "generates" if engine else ""))
    lines.append("")
    lines.append("| lane | phase | from s | to s | s |")
    lines.append("|---|---|---|---|---|")
    for n, s, e in mine:
        lines.append(f"| trainer | {n} | {s - t0:.3f} | {e - t0:.3f} | {e - s:.3f} |")
    for label, s, e, version in busy:
        what = "load weights" if label == "L" else "generate"
        lines.append(f"| engine | {what} (v{version}) | {s - t0:.3f} | {e - t0:.3f} | "
                     f"{e - s:.3f} |")
    gen_busy = sum(e - s for label, s, e, _ in busy if label == "G")
    waits = sum(e - s for n, s, e in mine if n == "gen")
    lines.append("")
    lines.append(f"trainer waits for rollouts {waits:.3f} s of {t1 - t0:.3f} s; engine busy "
                 f"{sum(e - s for _, s, e, _ in busy):.3f} s (generating {gen_busy:.3f} s)")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--step", type=int, default=None, help="the step drawn (default: the one before the last; the last has no next batch to overlap)")
    ap.add_argument("--staleness", type=int, default=1)
    ap.add_argument("--trainer-cpu", type=int, default=0)
    ap.add_argument("--engine-cpu", type=int, default=1)
    ap.add_argument("--width", type=int, default=96)
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides")
    args = ap.parse_args()
    trainer, engine, bounds = run(args)
    print(draw(trainer, engine, bounds, args.step or max(1, args.steps - 1), args.width))


if __name__ == "__main__":
    main()
