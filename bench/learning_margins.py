"""How much room the learning tests have: each run of `tests/trainer/test_learning.py`'s
`test_recipe_learns` (and of `test_learning_tools.py`'s calculator run) at several seeds and
thread counts, its held-out gain against the tests' 5-point bar.

    python bench/learning_margins.py                         # every case, seeds 42 1 2, 1 thread
    python bench/learning_margins.py --threads 2 --seeds 42  # another float order
    python bench/learning_margins.py --only grpo pacs --jobs 2
    python bench/learning_margins.py --only grpo-lora --steps 15 \
        --extra actor_rollout_ref.actor.optim.lr=2e-3            # a variant of a case

Another CPU sums in another order; another seed and another thread count (torch splits its
reductions by thread) stand in for it. A case whose smallest gain stays well above the bar
holds on every CPU; one near it needs more steps. Each run is the test's own command line
(the same recipe, steps, validation points) with ``trainer.seed`` and ``data.seed`` set, in
a process of its own with OMP_NUM_THREADS threads. Prints one row per run and a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VAL = "val/test_score/arith"
BAR = 0.05


def cases() -> list[tuple[str, str, list[str], int]]:
    """(id, recipe, extra overrides, steps) of test_recipe_learns and of the calculator's
    learning test, read from the tests."""
    sys.path.insert(0, str(REPO / "tests" / "trainer"))
    sys.path.insert(0, str(REPO / "tests"))
    import test_learning
    import test_learning_tools

    (mark,) = [m for m in test_learning.test_recipe_learns.pytestmark if m.name == "parametrize"]
    return [*((p.id, *p.values) for p in mark.args[1]),
            ("grpo_tools", "grpo_tools", test_learning_tools.BATCH, test_learning_tools.STEPS)]


def run(case: tuple[str, str, list[str], int], seed: int, threads: int) -> dict:
    name, recipe, extra, steps = case
    half = steps // 2
    with tempfile.TemporaryDirectory(prefix="megarl_margin_") as out:
        cmd = [sys.executable, "launch/train.py", "--config", recipe,
               f"trainer.default_local_dir={out}", f"trainer.total_training_steps={steps}",
               f"trainer.test_freq={half}", "trainer.val_before_train=true",
               "trainer.save_freq=-1", "trainer.logger=[jsonl]", "trainer.export_hf=false",
               *extra, f"trainer.seed={seed}", f"data.seed={seed}"]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(REPO),
                   TOKENIZERS_PARALLELISM="false")
        env.pop("TRITON_INTERPRET", None)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=3600)
        seconds = time.perf_counter() - t0
        if proc.returncode != 0:
            return {"case": name, "seed": seed, "threads": threads, "error":
                    proc.stderr[-1500:]}
        rows = [json.loads(line) for line in Path(out, "metrics.jsonl").read_text().splitlines()
                if line.strip()]
    val = {r["step"]: r[VAL] for r in rows if VAL in r}
    score = [r["critic/score/mean"] for r in rows if r["step"] > 0]
    rises = sum(score[half:]) / len(score[half:]) > sum(score[:half]) / len(score[:half])
    return {"case": name, "seed": seed, "threads": threads, "val": val,
            "gain": val[steps] - val[0], "reward_rises": rises, "seconds": round(seconds)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[42, 1, 2])
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    ap.add_argument("--only", nargs="+", default=None, help="case ids (default: all)")
    ap.add_argument("--jobs", type=int, default=2, help="runs at once")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    ap.add_argument("--steps", type=int, default=None, help="steps instead of the test's")
    ap.add_argument("--extra", nargs="+", default=[],
                    help="overrides appended to every case's (key=value)")
    a = ap.parse_args(argv)
    todo = [(name, recipe, [*extra, *a.extra], a.steps or steps)
            for name, recipe, extra, steps in cases() if a.only is None or name in a.only]
    runs = [(c, s, t) for c in todo for t in a.threads for s in a.seeds]
    print(f"{len(runs)} runs, {a.jobs} at once", flush=True)
    rows = []
    with ThreadPoolExecutor(a.jobs) as pool:
        for row in pool.map(lambda r: run(*r), runs):
            rows.append(row)
            if "error" in row:
                print(f"{row['case']:<20} seed {row['seed']:>2} threads {row['threads']}: "
                      f"FAILED\n{row['error']}", flush=True)
                continue
            v = " / ".join(f"{100 * x:.1f}" for _, x in sorted(row["val"].items()))
            print(f"{row['case']:<20} seed {row['seed']:>2} threads {row['threads']}: held-out "
                  f"{v}  gain {100 * row['gain']:+.1f}  reward rises {row['reward_rises']}  "
                  f"({row['seconds']} s)", flush=True)
    print("\nsmallest gain per case (bar +5.0):")
    for name, *_ in todo:
        gains = [r["gain"] for r in rows if r["case"] == name and "gain" in r]
        if gains:
            print(f"  {name:<20} {100 * min(gains):+.1f} (of {len(gains)} runs; mean "
                  f"{100 * sum(gains) / len(gains):+.1f})")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0 if all("gain" in r and r["gain"] >= BAR and r["reward_rises"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
