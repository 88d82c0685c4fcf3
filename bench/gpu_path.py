"""The GPU path of the demo recipe: CUDA runs of both backends checked against the CPU run.

    python bench/gpu_path.py [--config pure_prm_vr] [--steps 3] [--backends torch,megatron]

For each backend it runs the recipe on the CPU (fp32) and on CUDA (bf16, the torch engine),
compares the first step's metrics (identical prompts and seeds; the rollouts agree as long as
bf16 sampling does not diverge, the losses to bf16 tolerance), and prints / records step time,
tokens/s and peak memory into bench/RESULTS.md ("## GPU path"). Needs a CUDA machine; on a CPU
it says so and exits 0 without recording anything.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

COMPARE = ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/entropy",
           "actor/grad_norm")


def run(config: str, backend: str, device: str, steps: int, out: Path) -> list[dict]:
    dtype = "bf16" if device == "cuda" else "fp32"
    cmd = [sys.executable, "launch/train.py", "--config", config,
           f"actor_rollout_ref.actor.strategy={backend}", f"critic.strategy={backend}",
           f"trainer.device={device}", f"actor_rollout_ref.model.dtype={dtype}",
           f"trainer.total_training_steps={steps}", "trainer.test_freq=-1",
           "trainer.val_before_train=false", "trainer.save_freq=-1", "trainer.export_hf=false",
           f"trainer.default_local_dir={out}", "trainer.logger=[jsonl]"]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "4"))
    subprocess.run(cmd, cwd=REPO, env=env, check=True)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    return [r for r in rows if r["step"] > 0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--config", default="pure_prm_vr")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--backends", default="torch,megatron")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device here: the GPU path needs one (nothing measured, nothing recorded)")
        return 0
    device_name = torch.cuda.get_device_name(0)
    lines = [f"### {datetime.date.today()} — {device_name}, recipe `{args.config}`, "
             f"{args.steps} steps, torch engine", "",
             "| backend | device | s/step (steady) | tokens/s | peak GPU mem (GB) | "
             "first-step max rel. diff vs CPU |", "|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for backend in args.backends.split(","):
            cpu = run(args.config, backend, "cpu", 1, Path(tmp) / f"{backend}_cpu")
            gpu = run(args.config, backend, "cuda", args.steps, Path(tmp) / f"{backend}_gpu")
            diffs = {k: abs(gpu[0][k] - cpu[0][k]) / max(abs(cpu[0][k]), 1e-6)
                     for k in COMPARE if k in cpu[0] and k in gpu[0]}
            steady = gpu[1:] or gpu
            step_s = sum(r["timing_s/step"] for r in steady) / len(steady)
            tok_s = sum(r["perf/total_num_tokens"] for r in steady) / sum(
                r["timing_s/step"] for r in steady)
            mem = max(r.get("perf/max_memory_allocated_gb", float("nan")) for r in gpu)
            worst = max(diffs.items(), key=lambda kv: kv[1]) if diffs else ("-", float("nan"))
            lines.append(f"| {backend} | cuda bf16 | {step_s:.3f} | {tok_s:.0f} | {mem:.2f} | "
                         f"{worst[0]}: {worst[1]:.2e} |")
            print(json.dumps({"backend": backend, "diffs": diffs}, indent=1))
    print("\n".join(lines))
    if not args.no_record:
        from bench.results import write_section

        write_section("GPU path", "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
