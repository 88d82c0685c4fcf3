"""Step time of the mixture-of-experts demo policy on the megatron backend at expert parallel 1
vs 2, 2 ranks, measured in the same run.

The policy is ``embedded://policy_moe`` (the SFT demo policy upcycled to a Qwen2-MoE with 4
experts, top-2 and a shared expert). EP=1 is plain data parallel (every rank holds every
expert); EP=2 gives each rank 2 of the 4 experts, its tokens dispatched to the rank holding
their experts and back (megatron's allgather dispatcher on CPU / gloo, alltoall on CUDA).
Each setting runs ``--repeats`` times in alternating order; the reported step time is the
median of steps 2..N (step 1 warms up). Prints both, their ratio, and the median of each timed
phase (``timing_s/*``).

    OMP_NUM_THREADS=1 python bench/moe_ep_step.py --steps 6 --repeats 2
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


def run(ep: int, steps: int, extra: list[str]) -> list[dict]:
    out = Path(tempfile.mkdtemp(prefix=f"moe_ep{ep}_"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "launch/train.py", "--config", "grpo",
           "actor_rollout_ref.model.path=embedded://policy_moe",
           "actor_rollout_ref.actor.strategy=megatron",
           f"actor_rollout_ref.actor.megatron.expert_model_parallel_size={ep}",
           f"trainer.default_local_dir={out}", f"trainer.total_training_steps={steps}",
           "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.logger=[jsonl]",
           "trainer.export_hf=false", "trainer.save_freq=-1", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"EP={ep} run failed:\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
            if line.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides for both runs")
    args = ap.parse_args()
    times: dict[int, list[float]] = {1: [], 2: []}
    parts: dict[int, dict[str, list[float]]] = {1: {}, 2: {}}
    for rep in range(args.repeats):
        for ep in ((1, 2) if rep % 2 == 0 else (2, 1)):
            rows = [r for r in run(ep, args.steps, args.overrides) if r["step"] >= 2]
            times[ep].append(statistics.median(r["timing_s/step"] for r in rows))
            for r in rows:
                for k, v in r.items():
                    if k.startswith("timing_s/") and isinstance(v, (int, float)):
                        parts[ep].setdefault(k, []).append(v)
    for ep in (1, 2):
        med = statistics.median(times[ep])
        print(f"EP={ep}: median step {med:.3f} s (runs {', '.join(f'{t:.3f}' for t in times[ep])})")
        for k in sorted(parts[ep]):
            print(f"    {k:32s} {statistics.median(parts[ep][k]):.3f} s")
    print(f"EP=2 / EP=1 step time: {statistics.median(times[2]) / statistics.median(times[1]):.2f}x")


if __name__ == "__main__":
    main()
