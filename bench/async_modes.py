"""Samples per second and each side's busy share, synchronous vs one-step-off vs fully async
(with and without partial rollout), on long-tailed response lengths, measured in one invocation on 2 cores: the trainer pinned to
core 0, the rollout engine (one-step-off's engine process, fully async's rollout worker) to core
1 (``async_training.engine_cpus=[1]``); the synchronous loop generates on core 0 itself.

The workload: GRPO on the demo's prompts with a randomly initialised demo-architecture policy
(near-uniform next-token distribution) and ``--stops`` extra stop tokens
(``actor_rollout_ref.rollout.stop_token_ids``), so a response ends at each token with
probability about (stops + 1) / vocab: geometric lengths, the longest of a step's responses
several times the median (printed), up to ``--max-len`` tokens. lr 1e-6, so the policy and the
lengths stay as they are over the run. The rewards are all zero (nothing is learned); every
phase still runs.

Per mode (median over ``--repeats`` runs, modes alternating):
- samples/s: kept steps x prompts x n / the sum of their ``timing_s/step`` (steps 1..warmup
  dropped); the ratio against the synchronous run;
- busy share of each side over the kept steps: CPU seconds of the trainer process / wall, and
  of the engine or worker process (psutil, sampled when the row of step ``warmup`` and of the
  last step appear in metrics.jsonl); the trainer's wait for samples (``timing_s/gen`` in the
  asynchronous modes) as a share of the step time.
- response lengths: median and max over the run's samples (``response_length/*``).

    OMP_NUM_THREADS=1 python bench/async_modes.py --steps 8 --repeats 2 [--json PATH] [k=v ...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.results import write_section  # noqa: E402

MODES = {
    "synchronous": [],
    "one-step-off": ["async_training.staleness_threshold=1", "async_training.engine_cpus=[1]"],
    "fully async": ["actor_rollout_ref.hybrid_engine=false", "rollout.nnodes=1",
                    "rollout.n_gpus_per_node=1", "async_training.engine_cpus=[1]"],
}
# fully async with partial rollout: new weights apply at the worker's next decode step
MODES["fully async + partial"] = [*MODES["fully async"], "async_training.partial_rollout=true"]


def random_assets(out: Path, seed: int = 0) -> Path:
    """A copy of the demo's assets whose policy has freshly initialised weights (a run reads it
    with MEGARL_ASSETS=out, the demo's data and settings unchanged)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from megarl.demo.assets import assets_root

    shutil.copytree(assets_root(), out, dirs_exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out / "policy"))
    model.save_pretrained(out / "policy", safe_serialization=True)
    return out


def run(mode: str, assets: Path, args: argparse.Namespace) -> dict[str, Any]:
    run_dir = Path(tempfile.mkdtemp(prefix="megarl_async_modes_"))
    stops = list(range(100, 100 + args.stops))
    cmd = ["taskset", "-c", "0", sys.executable, "launch/train.py", "--config", "grpo",
           f"trainer.default_local_dir={run_dir}",
           f"actor_rollout_ref.rollout.stop_token_ids={stops}",
           f"data.max_response_length={args.max_len}", f"data.train_batch_size={args.prompts}",
           f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
           f"actor_rollout_ref.rollout.n={args.n}", "actor_rollout_ref.actor.optim.lr=1e-6",
           f"trainer.total_training_steps={args.steps}", "trainer.test_freq=-1",
           "trainer.val_before_train=false", "trainer.save_freq=-1", "trainer.logger=[jsonl]",
           "trainer.export_hf=false", *args.overrides, *MODES[mode]]
    if mode.startswith("fully async"):
        cmd += [f"async_training.staleness_threshold={args.staleness}",
                f"async_training.trigger_parameter_sync_step={args.sync_every}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), MEGARL_ASSETS=str(assets))
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    metrics = run_dir / "metrics.jsonl"
    marks: dict[int, tuple[float, float, float]] = {}  # step -> (wall, trainer cpu, engine cpu)
    tree = psutil.Process(proc.pid)
    while proc.poll() is None:
        steps = _steps(metrics)
        for step in (args.warmup, args.steps):
            if step in steps and step not in marks:
                marks[step] = (time.monotonic(), *_cpu(tree))
        time.sleep(0.02)
    out = proc.stdout.read()
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{out[-4000:]}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    kept = [r for r in rows if args.warmup < r["step"] <= args.steps]
    step_s = sum(r["timing_s/step"] for r in kept)
    wait_s = sum(r.get("timing_s/gen", 0.0) for r in kept) if mode != "synchronous" else 0.0
    (w0, t0, e0), (w1, t1, e1) = marks[args.warmup], marks[args.steps]
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"samples_per_s": len(kept) * args.prompts * args.n / step_s,
            "step_s": [r["timing_s/step"] for r in kept],
            "gen_s": [r.get("timing_s/gen", 0.0) for r in kept],
            "tokens": [r["perf/total_num_tokens"] for r in kept],
            "response_tokens": [r["response_length/mean"] * args.prompts * args.n for r in kept],
            "partial_samples": statistics.mean(r.get("async/partial_samples", 0.0)
                                               for r in kept),
            "trainer_busy": (t1 - t0) / (w1 - w0), "engine_busy": (e1 - e0) / (w1 - w0),
            "trainer_wait": wait_s / step_s,
            "len_median": statistics.median(r["response_length/mean"] for r in kept),
            "len_max": max(r["response_length/max"] for r in kept),
            "len_min": min(r["response_length/min"] for r in kept)}


def _steps(path: Path) -> set[int]:
    if not path.exists():
        return set()
    out = set()
    for line in path.read_text().splitlines():
        try:
            out.add(int(json.loads(line)["step"]))
        except (ValueError, KeyError):
            pass  # a row being written
    return out


def _cpu(tree: psutil.Process) -> tuple[float, float]:
    """(CPU seconds of the trainer process, of its engine / worker processes)."""
    t = tree.cpu_times()
    engine = 0.0
    for child in tree.children(recursive=True):
        try:
            if "spawn_main" in " ".join(child.cmdline()):
                c = child.cpu_times()
                engine += c.user + c.system
        except psutil.NoSuchProcess:
            pass
    return t.user + t.system, engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--stops", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--staleness", type=float, default=1.0, help="fully async's threshold")
    ap.add_argument("--sync-every", type=int, default=1,
                    help="fully async's trigger_parameter_sync_step")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--json", type=Path)
    ap.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("async_modes needs 2 cores (the trainer on core 0, the engine on core 1)")
    model = random_assets(Path(tempfile.mkdtemp(prefix="megarl_async_assets_")))
    modes = args.modes.split(",")
    res: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for rep in range(args.repeats):
        order = modes if rep % 2 == 0 else list(reversed(modes))
        for mode in order:
            r = run(mode, model, args)
            res[mode].append(r)
            print(f"{mode}: {r}", flush=True)
    base = statistics.median(r["samples_per_s"] for r in res[modes[0]])
    lines = ["| mode | samples/s | vs synchronous | trainer core busy | engine core busy | "
             "trainer waits for samples | samples spanning a sync | response length: median "
             "of step means / longest |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for mode, runs in res.items():
        def med(key, runs=runs):
            return statistics.median(r[key] for r in runs)
        engine = "idle (the trainer generates)" if mode == "synchronous" else \
            f"{med('engine_busy'):.0%}"
        lines.append(f"| {mode} | {med('samples_per_s'):.2f} | **{med('samples_per_s') / base:.2f}x**"
                     f" | {med('trainer_busy'):.0%} | {engine} | {med('trainer_wait'):.0%} | "
                     f"{med('partial_samples'):.1%} | "
                     f"{med('len_median'):.0f} / {max(r['len_max'] for r in runs):.0f} |")
    cmd = ("OMP_NUM_THREADS=1 python bench/async_modes.py " +
           " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                    if k not in ("json", "no_write", "overrides", "modes")) +
           "".join(f" {o}" for o in args.overrides))
    body = (f"`{cmd}`, {time.strftime('%Y-%m-%d')}, {platform_line()}.\n"
            f"GRPO, {args.prompts} prompts x {args.n} responses per step, responses ended by "
            f"EOS or {args.stops} extra stop tokens under a random policy (geometric lengths, "
            f"at most {args.max_len}); fully async: 1 rollout worker, staleness_threshold="
            f"{args.staleness:g}, trigger_parameter_sync_step={args.sync_every}, "
            "partial_rollout=false, and with partial_rollout=true (\"partial\"). Medians over "
            f"{args.repeats} runs per mode, steps {args.warmup + 1}..{args.steps} kept.\n\n"
            + "\n".join(lines) + "\n")
    print(body)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: v for k, v in vars(args).items()
                                                  if k != "json"} | {"command": cmd},
                                         "modes": res}, indent=1, default=str))
    if not args.no_write:
        write_section("Disaggregated, fully asynchronous RL: the three schedules "
                      "(`bench/async_modes.py`)", body)


def platform_line() -> str:
    import platform

    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, Python {platform.python_version()}"


if __name__ == "__main__":
    main()
