"""Steps per minute of the RL loop with async_training.staleness_threshold 0 and 1, measured in
the same run on the same model (the embedded demo, GRPO, one rank).

The trainer is pinned to one core (taskset), the engine process of the staleness-1 run to
another (async_training.engine_cpus); the synchronous run generates in the trainer's process
on the trainer's core. Each setting runs ``--repeats`` times in alternating order; the
reported step time is the median of steps 3..N (steps 1-2 warm up: the first has no
overlap). Prints steps/min for both, their ratio, and where a staleness-1 step's time goes
(timing_s/gen is the trainer waiting for the engine).

    OMP_NUM_THREADS=1 python bench/async_step.py --steps 12 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(staleness: int, steps: int, trainer_cpu: int, engine_cpu: int, extra: list[str]) -> list:
    out = Path(tempfile.mkdtemp(prefix=f"async{staleness}_"))
    cmd = ["taskset", "-c", str(trainer_cpu), sys.executable, "launch/train.py", "--config",
           "grpo", f"trainer.default_local_dir={out}", f"trainer.total_training_steps={steps}",
           "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.logger=[jsonl]",
           "trainer.export_hf=false", "trainer.save_freq=-1",
           f"async_training.staleness_threshold={staleness}",
           f"async_training.engine_cpus=[{engine_cpu}]", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True, text=True)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
            if line.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--trainer-cpu", type=int, default=0)
    ap.add_argument("--engine-cpu", type=int, default=1)
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides for both runs")
    args = ap.parse_args()
    times: dict[int, list[float]] = {0: [], 1: []}
    parts: dict[int, dict[str, list[float]]] = {0: {}, 1: {}}
    for rep in range(args.repeats):
        for s in ((0, 1) if rep % 2 == 0 else (1, 0)):
            rows = [r for r in run(s, args.steps, args.trainer_cpu, args.engine_cpu,
                                   args.overrides) if r["step"] >= 3]
            times[s].append(statistics.median(r["timing_s/step"] for r in rows))
            for r in rows:
                for k, v in r.items():
                    if k.startswith("timing_s/") and isinstance(v, (int, float)):
                        parts[s].setdefault(k, []).append(v)
    for s in (0, 1):
        med = statistics.median(times[s])
        print(f"staleness {s}: {60 / med:.1f} steps/min (median step {med:.3f} s; runs "
              f"{', '.join(f'{t:.3f}' for t in times[s])})")
        for k in sorted(parts[s]):
            print(f"    {k:32s} {statistics.median(parts[s][k]):.3f} s")
    print(f"staleness 1 / staleness 0 throughput: "
          f"{statistics.median(times[0]) / statistics.median(times[1]):.2f}x")


if __name__ == "__main__":
    main()
