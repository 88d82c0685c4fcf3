"""The metrics of every recipe's first 2 steps on the demo, timings stripped: a fingerprint that
a refactoring must leave bit for bit the same.

Runs each recipe in configs/ for 2 steps (4 prompts x 4 responses, tests/trainer's fast
settings) on both backends, with our engine, with vLLM (fp32) and with asynchronous rollout
(staleness 1): the full product, not test_trainer_recipes.py's pairwise cover. Writes one JSON
(case -> the steps' metric rows); ``--compare`` leaves out the keys that measure the machine
(timings, memory, throughput).

    python bench/recipe_fingerprint.py --out before.json           # on the old commit
    python bench/recipe_fingerprint.py --out after.json            # on the new one
    python bench/recipe_fingerprint.py --compare before.json after.json

``--compare`` prints each case whose rows differ, the first differing keys with both values,
and exits 1 when any does (0: every case is bitwise the same).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FAST = ["data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "critic.ppo_mini_batch_size=4", "actor_rollout_ref.rollout.n=4",
        "data.max_response_length=48", "trainer.test_freq=-1", "trainer.val_before_train=false",
        "trainer.logger=[jsonl]", "trainer.export_hf=false", "trainer.save_freq=-1",
        "trainer.total_training_steps=2"]
# the engines and backends a recipe runs with (tests/trainer/test_trainer_recipes.py takes these)
ENGINES = {
    "torch": [],
    "vllm": ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.enforce_eager=true",
             "actor_rollout_ref.model.dtype=fp32"],
    "async1": ["async_training.staleness_threshold=1"],
}
BACKENDS = ("torch", "megatron")
MULTI_TURN = {"grpo_tools": ["data.max_response_length=128"]}  # our engine only
# keys that measure the machine, not the run (prefixes, and wall times anywhere in a name)
VOLATILE = ("timing_s/", "timing_per_token_ms/", "perf/", "reward/time_s", "memory/", "time/")
VOLATILE_PARTS = ("time_s",)


def _kept(key: str) -> bool:
    return not key.startswith(VOLATILE) and not any(p in key for p in VOLATILE_PARTS)


def cases() -> dict[str, list[str]]:
    """case name -> (recipe, then its overrides)."""
    recipes = sorted(p.stem for p in (REPO / "configs").glob("*.yaml") if p.stem != "base")
    out = {}
    for recipe in recipes:
        engines = {"torch": []} if recipe in MULTI_TURN else ENGINES
        for backend in BACKENDS:
            for engine, extra in engines.items():
                args = [f"actor_rollout_ref.actor.strategy={backend}", *extra,
                        *MULTI_TURN.get(recipe, [])]
                if recipe == "ppo":
                    args.append(f"critic.strategy={backend}")
                out[f"{recipe}-{backend}-{engine}"] = [recipe, *args]
    return out


def run_case(name: str, spec: list[str], root: Path) -> tuple[str, list[dict] | str]:
    run = root / name
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO))
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "launch/train.py", "--config", spec[0],
           f"trainer.default_local_dir={run}", *FAST, *spec[1:]]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        return name, f"exit {proc.returncode}: {proc.stderr[-2000:]}"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return name, rows


def _stripped(fingerprint: dict) -> dict:
    """A fingerprint (every metric of every row, as written) without the volatile keys."""
    return {n: [{k: v for k, v in r.items() if _kept(k)} for r in rows]
            if isinstance(rows, list) else rows for n, rows in fingerprint.items()}


def compare(before: dict, after: dict) -> int:
    differing = 0
    for name in sorted(set(before) | set(after)):
        a, b = before.get(name), after.get(name)
        if a == b:
            continue
        differing += 1
        if not isinstance(a, list) or not isinstance(b, list) or len(a) != len(b):
            print(f"{name}: {str(a)[:200]!r} != {str(b)[:200]!r}")
            continue
        for ra, rb in zip(a, b):
            keys = sorted(k for k in set(ra) | set(rb) if ra.get(k) != rb.get(k))
            if keys:
                shown = ", ".join(f"{k}: {ra.get(k)!r} -> {rb.get(k)!r}" for k in keys[:4])
                print(f"{name} step {ra.get('step')}: {len(keys)} keys differ ({shown})")
    print(f"{len(set(before) | set(after)) - differing} cases bitwise the same, {differing} "
          "differ")
    return 1 if differing else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write the fingerprint here")
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    ap.add_argument("--only", default="", help="comma-separated case-name substrings")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    if args.compare:
        return compare(*(_stripped(json.loads(p.read_text())) for p in args.compare))
    if args.out is None:
        ap.error("--out or --compare")
    todo = {n: s for n, s in cases().items()
            if not args.only or any(o in n for o in args.only.split(","))}
    with tempfile.TemporaryDirectory(prefix="megarl_fingerprint_") as tmp, \
            ThreadPoolExecutor(args.jobs) as pool:
        results = dict(pool.map(lambda item: run_case(*item, Path(tmp)), todo.items()))
    failed = {n: r for n, r in results.items() if isinstance(r, str)}
    for name, err in failed.items():
        print(f"{name}: {err}", file=sys.stderr)
    args.out.write_text(json.dumps(results, indent=1, sort_keys=True))
    print(f"{len(results) - len(failed)} of {len(results)} cases ran; wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
