"""``make demo``: build the embedded default, train it with torchrun, report the accuracy gain.

    python -m megarl.demo.run [--config pure_prm_vr] [--nproc 2] [--out DIR] [key=value ...]

1. Runs ``torchrun --standalone --nproc_per_node=N launch/train.py --config CONFIG`` on the CPU
   into a fresh run folder (``runs/demo-<time>`` unless ``--out``), output streamed as it goes.
   The run makes the embedded assets it reads on first use, and only those (`embedded://`
   paths: the shipped SFT policy and PRM of pure_prm_vr, the tool-using policy of grpo_tools).
2. Reads the run's metrics.jsonl and prints the held-out greedy accuracy before and after
   training (``val/test_score/arith``: 500 three-operation problems kept out of every training set).

Exit status: torchrun's when training fails, else 0 (the gain is reported, not asserted).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from megarl.demo.assets import assets_root, repo_root

VAL_KEY = "val/test_score/arith"


def read_accuracy(metrics_path: Path, key: str = VAL_KEY) -> tuple[tuple[int, float] | None,
                                                                    tuple[int, float] | None]:
    """((step, value) of the first logged ``key``, (step, value) of the last) from a
    metrics.jsonl; (None, None) when it was never logged."""
    seen: list[tuple[int, float]] = []
    if metrics_path.is_file():
        for line in metrics_path.read_text().splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            if key in row:
                seen.append((int(row.get("step", row.get("training/global_step", 0))),
                             float(row[key])))
    return (seen[0], seen[-1]) if seen else (None, None)


def report(before: tuple[int, float] | None, after: tuple[int, float] | None,
           seconds: dict[str, float]) -> str:
    times = ", ".join(f"{k} {v / 60:.1f} min" for k, v in seconds.items())
    if before is None or after is None or after[0] == before[0]:
        return f"no before/after validation in the run's metrics ({times})"
    gain = 100 * (after[1] - before[1])
    return (f"held-out greedy accuracy (500 three-operation problems): "
            f"{100 * before[1]:.1f}% at step {before[0]} -> {100 * after[1]:.1f}% at step "
            f"{after[0]} ({gain:+.1f} points); {times}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megarl.demo.run", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="pure_prm_vr", help="recipe name or YAML path")
    ap.add_argument("--nproc", type=int, default=2, help="torchrun ranks (CPU processes)")
    ap.add_argument("--out", default=None, help="run folder (default runs/demo-<time>)")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides")
    a = ap.parse_args(argv)
    if a.nproc < 1:
        ap.error("--nproc must be >= 1")
    bad = [o for o in a.overrides if "=" not in o]
    if bad:
        ap.error(f"overrides must be key=value, got {bad}")

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    t0 = time.perf_counter()
    print(f"[demo] embedded assets under {assets_root()} (the shipped checkpoints, installed "
          "on first use)", flush=True)

    root = repo_root()
    out = Path(a.out) if a.out else root / "runs" / time.strftime("demo-%Y%m%d-%H%M%S")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={a.nproc}", str(root / "launch" / "train.py"), "--config", a.config,
           f"trainer.default_local_dir={out}", *a.overrides]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    print("[demo] " + " ".join(["torchrun"] + cmd[3:]), flush=True)
    t1 = time.perf_counter()
    rc = subprocess.run(cmd, cwd=root, env=env).returncode
    t_train = time.perf_counter() - t1
    if rc != 0:
        print(f"[demo] training failed (exit {rc}); logs under {out}", file=sys.stderr)
        return rc
    before, after = read_accuracy(out / "metrics.jsonl")
    print("[demo] " + report(before, after, {"training": t_train,
                                            "total": time.perf_counter() - t0}))
    print(f"[demo] run folder: {out} (metrics.jsonl, tensorboard/, curves.png, hf_actor/)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
