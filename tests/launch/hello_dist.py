"""A stand-in for ``launch/train.py`` in the launcher and SLURM tests: same command line, same
outputs, no model.

    torchrun ... tests/launch/hello_dist.py --config NAME_OR_PATH [key=value ...]

Reads the overrides ``trainer.total_training_steps`` (default 2), ``trainer.default_local_dir``
(default runs/hello) and ``trainer.resume`` (auto | disable); the config file itself is not read.
``$HELLO_STEP_SECONDS`` sleeps that long after each step (the requeue test needs a job that is
still running when it is signalled). Each step all-reduces ``rank + 1`` over the whole world (gloo),
so every rank sees ``sum_ranks = W (W + 1) / 2``, and gathers the SLURM node name of every rank.

Every rank prints ``hello step=N sum_ranks=S world_size=W`` (so each node's log shows the same
metrics); rank 0 appends ``{"step": N, "hello/sum_ranks": S, ...}`` to
``<default_local_dir>/metrics.jsonl`` and then records N in ``<default_local_dir>/ckpt.json``.
With ``trainer.resume=auto`` a restarted job continues after the step in ``ckpt.json`` and drops
any metrics line past it, as the trainer does.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.utils import dist as mdist


def _overrides(pairs: list[str]) -> dict[str, str]:
    out = {}
    for text in pairs:
        key, sep, value = text.partition("=")
        if not sep:
            raise SystemExit(f"hello_dist: override {text!r} is not key=value")
        out[key.lstrip("+")] = value
    return out


def _resume_step(run_dir: Path, mode: str) -> int:
    ckpt = run_dir / "ckpt.json"
    if mode != "auto" or not ckpt.exists():
        return 0
    return int(json.loads(ckpt.read_text())["step"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    kv = _overrides(args.overrides)
    total = int(kv.get("trainer.total_training_steps", 2))
    run_dir = Path(kv.get("trainer.default_local_dir", "runs/hello"))
    pause = float(os.environ.get("HELLO_STEP_SECONDS", "0"))
    torch.set_num_threads(1)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    node = os.environ.get("SLURMD_NODENAME", socket.gethostname())
    nodes: list[str | None] = [None] * world
    dist.all_gather_object(nodes, node)

    start = torch.tensor([_resume_step(run_dir, kv.get("trainer.resume", "auto")) if rank == 0 else 0])
    dist.broadcast(start, src=0)
    start_step = int(start.item())
    metrics_path = run_dir / "metrics.jsonl"
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        kept = []
        if start_step and metrics_path.exists():
            kept = [line for line in metrics_path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= start_step]
        metrics_path.write_text("".join(line + "\n" for line in kept))
        print(f"hello start_step={start_step} restart={os.environ.get('SLURM_RESTART_COUNT', '0')}",
              flush=True)
        print(f"hello cwd={os.getcwd()} overrides={json.dumps(args.overrides)}", flush=True)

    for step in range(start_step + 1, total + 1):
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        print(f"hello step={step} sum_ranks={t.item():g} world_size={world}", flush=True)
        if rank == 0:
            row = {
                "step": step,
                "hello/sum_ranks": t.item(),
                "hello/world_size": world,
                "hello/nodes": sorted(set(nodes)),
                "hello/restart": int(os.environ.get("SLURM_RESTART_COUNT", "0")),
            }
            with open(metrics_path, "a") as f:
                f.write(json.dumps(row, sort_keys=True) + "\n")
            tmp = run_dir / "ckpt.json.tmp"
            tmp.write_text(json.dumps({"step": step}))
            os.replace(tmp, run_dir / "ckpt.json")
        dist.barrier()
        time.sleep(pause)
    mdist.destroy()


if __name__ == "__main__":
    main()
