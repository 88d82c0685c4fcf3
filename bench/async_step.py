"""Speed and host memory of the GRPO demo on 2 ranks with asynchronous rollout, measured in the
same invocation: the synchronous loop (``async_training.staleness_threshold=0``, the baseline)
against staleness 1 and 2 (each rank's engine in a spawned process, weights in a shared ring).

Each variant is one ``torchrun --standalone --nproc_per_node=N launch/train.py --config grpo``
run (demo policy, 4 prompts x 4 responses of <= 48 tokens, no validation, no checkpoints).
Measured, per variant (median over ``--repeats`` runs, alternating order):

- steps/min: 60 x kept steps / sum of their ``timing_s/step`` (metrics.jsonl), steps 1..warmup
  dropped; "wall" steps/min: kept steps / wall seconds between the rows of step ``warmup`` and
  step N appearing in metrics.jsonl (polled every 20 ms).
- memory, sampled every 0.2 s over the run's whole process tree (psutil), MiB = 2**20 bytes:
  peak RSS of each training rank (by LOCAL_RANK) and of each engine process (cmdline
  ``spawn_main``, by its rank), and the node's peak total PSS (``Pss:`` of
  /proc/<pid>/smaps_rollup summed over the agent and every descendant: shared pages are split
  between the processes that map them, so the weight ring counts once).
- the weight ring: formula (staleness + 1) x W, W = tensor bytes of the actor's safetensors (the
  run's ``actor_rollout_ref.model.path``), one ring per node; measured: the size of the
  ``megarl-ring-*`` mapping, its PSS summed over the processes (median of the smaps scans,
  every 1 s; processes are read one after another, so a scan is not an atomic snapshot) and
  the number of distinct ring files.
Ratios: steps/min and peak PSS against the synchronous run of the same invocation; then the
median of each ``timing_s/*`` phase per variant (seconds; ``gen`` = the trainer waiting for
its rollout).

    OMP_NUM_THREADS=1 python bench/async_step.py --steps 20 --repeats 3 [--json PATH] [k=v ...]

Labels (engine, backend, dtype, staleness) are read from each run's config.yaml.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.results import check_ran  # noqa: E402

MIB = 2**20
SAMPLE_S, RING_EVERY = 0.2, 5
RING = re.compile(r"megarl-ring-")


def ring_maps(pid: int, names: set[str]) -> tuple[int, int]:
    """(size, PSS) in bytes of the weight ring's mappings in process ``pid`` (0, 0: none);
    adds the rings' file names to ``names``."""
    size = pss = 0
    inside = False
    for ln in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", ln):
            inside = bool(RING.search(ln))
            if inside:
                names.add(ln.split()[5])
        elif inside and ln.startswith(("Size:", "Pss:")):
            val = int(ln.split()[1]) * 1024
            size, pss = (val, pss) if ln.startswith("Size:") else (size, pss + val)
    return size, pss


class Sampler(threading.Thread):
    """Peak RSS per rank / engine, peak node PSS and ring size / PSS of the tree under ``root``."""

    def __init__(self, root: int) -> None:
        super().__init__(daemon=True)
        self.root, self.stop = root, threading.Event()
        self.rss: dict[str, int] = {}  # "rank0", "engine1", ...
        self.names: dict[int, str] = {}
        self.pss = self.ring_size = 0
        self.ring_pss: list[int] = []  # per smaps scan: the ring's PSS summed over processes
        self.rings: set[str] = set()  # ring files seen (one per node expected)

    def name(self, p: psutil.Process) -> str:
        if p.pid not in self.names:
            cmd = " ".join(p.cmdline())
            if "launch/train.py" in cmd and p.pid != self.root:
                self.names[p.pid] = f"rank{p.environ().get('LOCAL_RANK', p.pid)}"
            elif "spawn_main" in cmd:
                self.names[p.pid] = self.name(p.parent()).replace("rank", "engine")
            else:
                self.names[p.pid] = "other"
        return self.names[p.pid]

    def run(self) -> None:
        n = 0
        while not self.stop.is_set():
            try:
                root = psutil.Process(self.root)
                procs = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                break
            total = rsize = rpss = 0
            for p in procs:
                try:
                    rollup = Path(f"/proc/{p.pid}/smaps_rollup").read_text()
                    total += int(re.search(r"^Pss:\s+(\d+) kB", rollup, re.M)[1]) * 1024
                    key = self.name(p)
                    if key != "other":
                        self.rss[key] = max(self.rss.get(key, 0), p.memory_info().rss)
                    if n % RING_EVERY == 0:
                        s, q = ring_maps(p.pid, self.rings)
                        rsize, rpss = max(rsize, s), rpss + q
                except (OSError, psutil.Error, TypeError):
                    continue  # the process ended between the listing and the read
            self.pss, self.ring_size = max(self.pss, total), max(self.ring_size, rsize)
            self.ring_pss += [rpss] if rpss else []
            n += 1
            self.stop.wait(SAMPLE_S)


def weights_bytes(model_path: str) -> int:
    """W: tensor bytes of the safetensors in the model folder (file size - 8 - header)."""
    from megarl.data.locations import resolve_path

    total = 0
    for f in Path(resolve_path(model_path)).glob("*.safetensors"):
        with open(f, "rb") as fh:
            total += f.stat().st_size - 8 - int.from_bytes(fh.read(8), "little")
    return total


def run(staleness: int, args: argparse.Namespace) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp(prefix=f"async_step_s{staleness}_"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={args.nproc}", "launch/train.py", "--config", "grpo",
           f"trainer.default_local_dir={out}", "data.train_batch_size=4",
           "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.rollout.n=4",
           "data.max_response_length=48", "trainer.test_freq=-1",
           "trainer.val_before_train=false", "trainer.logger=[jsonl]", "trainer.export_hf=false",
           "trainer.save_freq=-1", f"trainer.total_training_steps={args.steps}",
           f"async_training.staleness_threshold={staleness}", *args.overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    metrics, log = out / "metrics.jsonl", out / "run.log"
    load0 = os.getloadavg()[0]
    with open(log, "w") as lf:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=lf, stderr=subprocess.STDOUT,
                                start_new_session=True)
        sampler = Sampler(proc.pid)
        sampler.start()
        seen, rows_at, t0 = 0, [], time.monotonic()
        while proc.poll() is None:
            if metrics.exists() and metrics.stat().st_size > seen:
                seen = metrics.stat().st_size
                n = metrics.read_text().count("\n")
                rows_at += [time.monotonic()] * (n - len(rows_at))
            if time.monotonic() - t0 > args.timeout:
                os.killpg(proc.pid, 9)  # this run's own session: the agent, ranks, engines
                proc.wait()
                break
            time.sleep(0.02)
        sampler.stop.set()
        sampler.join()
    if metrics.exists():  # rows written in the run's last poll interval
        rows_at += [time.monotonic()] * (metrics.read_text().count("\n") - len(rows_at))
    tail = log.read_text()[-3000:]
    if proc.returncode:
        sys.exit(f"staleness {staleness}: the run exited {proc.returncode} "
                 f"({'timed out' if time.monotonic() - t0 > args.timeout else 'failed'}) "
                 f"in {out}:\n{tail}")
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    ran = {**check_ran(out, engine="torch", backend="torch"),
           "staleness": cfg["async_training"]["staleness_threshold"]}
    if ran["staleness"] != staleness:
        sys.exit(f"{out}: asked staleness {staleness}, config.yaml says {ran['staleness']}")
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    kept_rows = [r for r in rows if r["step"] > args.warmup]
    kept = [r["timing_s/step"] for r in kept_rows]
    phases = {k: statistics.median(r.get(k, 0.0) for r in kept_rows)
              for k in kept_rows[0] if k.startswith("timing_s/") and k != "timing_s/step"}
    wall = rows_at[len(rows) - 1] - rows_at[args.warmup - 1]
    return {"dir": str(out), "ran": ran, "steps": len(rows), "kept": len(kept),
            "steps_per_min": 60 * len(kept) / sum(kept), "wall_steps_per_min": 60 * len(kept) / wall,
            "step_s": kept, "phases": phases, "rss": dict(sorted(sampler.rss.items())), "pss": sampler.pss,
            "ring_size": sampler.ring_size, "rings": len(sampler.rings),
            "ring_pss": statistics.median(sampler.ring_pss) if sampler.ring_pss else 0,
            "W": weights_bytes(cfg["actor_rollout_ref"]["model"]["path"]),
            "load_avg": (load0, os.getloadavg()[0])}


def med(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def table(res: dict[int, list[dict[str, Any]]]) -> str:
    base = res[0] if 0 in res else None
    hdr = ["staleness", "steps/min", "wall steps/min", "vs sync", "peak RSS ranks MiB",
           "peak RSS engines MiB", "node peak PSS MiB", "PSS vs sync", "PSS - sync MiB",
           "ring (s+1) x W MiB", "ring measured: size / PSS MiB, rings", "load avg"]
    lines = ["| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
    for s, runs in res.items():
        def mem(prefix: str, runs: list[dict[str, Any]] = runs) -> str:
            keys = sorted({k for r in runs for k in r["rss"] if k.startswith(prefix)})
            return " / ".join(f"{statistics.median(r['rss'].get(k, 0) for r in runs) / MIB:.0f}"
                              for k in keys) or "-"
        spm, pss, W = med(runs, "steps_per_min"), med(runs, "pss"), runs[0]["W"]
        ring = med(runs, "ring_size"), med(runs, "ring_pss")
        cells = [f"{runs[0]['ran']['staleness']}", f"{spm:.1f}",
                 f"{med(runs, 'wall_steps_per_min'):.1f}",
                 f"**{spm / med(base, 'steps_per_min'):.2f}x**" if base else "-",
                 mem("rank"), mem("engine"), f"{pss / MIB:.0f}",
                 f"{pss / med(base, 'pss'):.2f}x" if base else "-",
                 f"{(pss - med(base, 'pss')) / MIB:+.0f}" if base else "-",
                 f"{(s + 1) * W / MIB:.2f}" if s else "- (no ring)",
                 f"{ring[0] / MIB:.2f} / {ring[1] / MIB:.2f}, {runs[0]['rings']}"
                 if ring[0] else "-",
                 ", ".join(f"{r['load_avg'][0]:.1f}-{r['load_avg'][1]:.1f}" for r in runs)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2, help="first steps dropped from steps/min")
    ap.add_argument("--variants", default="0,1,2", help="staleness values; 0 is the baseline")
    ap.add_argument("--nproc", type=int, default=2, help="ranks (torchrun --nproc_per_node)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per variant, order alternating")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    ap.add_argument("--json", type=Path, default=None, help="also write every run's data here")
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = ap.parse_args()
    if args.steps <= args.warmup:
        ap.error("--steps must exceed --warmup")
    from megarl.data.locations import resolve_path

    resolve_path("embedded://policy")  # builds the demo assets when missing
    variants = [int(v) for v in args.variants.split(",")]
    res: dict[int, list[dict[str, Any]]] = {s: [] for s in sorted(variants)}
    for rep in range(args.repeats):
        for s in (variants if rep % 2 == 0 else variants[::-1]):
            r = run(s, args)
            res[s].append(r)
            print(f"staleness {s}: {r['steps_per_min']:.1f} steps/min, peak PSS "
                  f"{r['pss'] / MIB:.0f} MiB ({r['dir']})", flush=True)
    print(f"\n{args.nproc} ranks, steps {args.warmup + 1}..{args.steps} kept; W = "
          f"{res[variants[0]][0]['W'] / MIB:.2f} MiB; ran: {res[variants[0]][0]['ran']}\n")
    print(table(res))
    for s, runs in res.items():  # median step phases, s (median over the runs)
        print(f"\nstaleness {s} phases (s): " + ", ".join(
            f"{k[9:]} {statistics.median(r['phases'][k] for r in runs):.3f}"
            for k in sorted(runs[0]["phases"]) if runs[0]["phases"][k] >= 0.001))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "runs": res}, indent=1))


if __name__ == "__main__":
    main()
