"""The GPU check: megarl's CUDA paths measured on one GPU in one command (bench/gpu_check.sh).

    python bench/gpu_check.py run --out DIR [--dry-run] [--steps env,kernels,...] [--budget S]
    python bench/gpu_check.py step NAME --out DIR [--dry-run]     (one step; `run` calls this)

Each step runs in its own process (the numeric steps live in gpu_check_numerics.py, the
training steps in gpu_check_rl.py, what the steps share in gpu_check_lib.py) under its own timeout and writes ``DIR/NAME.json``
(``{"step", "ok", "seconds", "result" | "error"}``) and ``DIR/NAME.log``; ``run`` prints a
summary and writes ``DIR/summary.json``. Steps (``--dry-run``: tiny shapes on the CPU, fp32,
the Triton kernels under the interpreter, so that every step and key runs in ``make test``):

- ``env``: versions of Python, torch, CUDA, the GPU, Triton, transformers, megatron-core, megarl.
- ``kernels``: the compiled Triton kernels against float64 (logprob + entropy and their
  gradients, the fused PPO and PACS losses), fp32 and bf16, temperatures 1.0 and 0.6, a small
  and the Qwen-vocabulary shape (T=2048, H=896, V=151,936). Bound: the test suite's tolerance,
  or twice the torch implementation's own error on the same inputs where that is larger.
- ``kernel_bench``: ``bench/kernels.py`` in bf16: naive vs ours (Triton and torch paths) vs
  Liger's fused linear cross-entropy, T=4096 and 16,384: time and peak memory.
- ``pytest``: ``tests/kernels tests/models tests/algos`` (compiled Triton on CUDA tensors;
  started first and run beside the other steps, 4 workers).
- ``model``: a random Qwen2-shaped ~0.5B model (hidden 896, 24 layers, vocab 151,936, bf16),
  its tokenizer and 64 math prompts in verl's row format.
- ``megatron_vs_hf``: megatron's and the torch backend's bf16 logprobs against transformers in
  float64, next to transformers' own bf16 error.
- ``grpo_torch`` / ``grpo_megatron``: GRPO, 4 steps, our engine, bf16, 256-token responses
  (16 prompts x 4): s/step, generated tokens/s, peak memory, engine-vs-trainer logprob gap
  (bound: twice transformers' own bf16 error from ``megatron_vs_hf``).
- ``grpo_lora``: GRPO with LoRA (rank 8, all-linear), 2 steps, torch backend, our engine
  (merged weights at each sync), bf16: reference = actor with its adapters off, the engine
  follows the adapted policy, the exported actor = base + (alpha / r) B A with every other
  tensor the base's, PEFT's merge of the exported adapter folder equals it.
- ``grpo_megatron_lora``: the same on the megatron backend, verl's megatron module names as the
  targets (``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``).
- ``grpo_bf16_params``: grpo_torch with ``actor.parallel.param_dtype=bf16``, 2 steps at lr 1e-4
  (an update bf16 rounding keeps): finite gradient norms, KL 0 then > 0, the gap within the
  bound, peak memory below grpo_torch's.
- ``grpo_tools``: multi-turn GRPO with the calculator tool, 2 steps (every turn read as a
  call: the random policy writes none): turns, tool calls, appended tokens, logprob gap.
- ``generate``: our engine vs transformers' ``generate`` on the same model and prompts (tok/s).

At the end ``run`` packs ``DIR/summary.json`` and every ``DIR/STEP.json`` / ``DIR/STEP.log``
(with the pytest step's JUnit reports and the install log) into one small ``DIR/results.tgz``
and prints its path: the one file to copy back from the GPU machine (never the model or
``DIR/site``).
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

from gpu_check_lib import (
    CHAR_IDS,
    DRY,
    GPU,
    REPO,
    CheckFailed,  # noqa: F401 (raised by the steps; the driver records its result)
    Sizes,
    load_hf,
    model_dir,
    require,
    work_dir,
)
from gpu_check_numerics import step_kernels, step_megatron_vs_hf
from gpu_check_rl import (
    step_grpo_bf16_params,
    step_grpo_lora,
    step_grpo_megatron,
    step_grpo_megatron_lora,
    step_grpo_tools,
    step_grpo_torch,
)

# (step, timeout s on the GPU); the order they run in. pytest runs beside the others. The
# training steps come first (grpo_torch's gap bound reads megatron_vs_hf's record); the steps
# that already passed on a GPU close the list, where a short --budget leaves them unrun.
# grpo_bf16_params compares its peak memory with grpo_torch's record.
STEPS = {"env": 60, "pytest": 330, "model": 120, "megatron_vs_hf": 120, "grpo_torch": 200,
         "grpo_lora": 150, "grpo_tools": 150, "grpo_megatron": 200, "grpo_megatron_lora": 150,
         "grpo_bf16_params": 150, "kernels": 150, "generate": 120, "kernel_bench": 200}
# seconds for all steps (--budget): room for every step up to grpo_bf16_params at the times
# of the last GPU run (369 s through grpo_megatron) plus ~130 s for the two after it
BUDGET = 510.0
RESULTS = "results.tgz"  # summary.json and every step's STEP.json / STEP.log, nothing else
BACKGROUND = ("pytest",)
# The GRPO steps' reward: the share of digits in a response, so that responses to one prompt
# score differently and the update has a gradient (the random policy never solves a prompt).
REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)
"""
# megatron's single-process backend tests run its CUDA path against float64 transformers
PYTEST_GPU = [["tests/kernels", "tests/models", "tests/algos"],
              ["tests/megatron/test_mcore_backend.py"]]
PYTEST_DRY = [["tests/kernels/test_kernels_api.py"]]
PYTEST_ENV = "MEGARL_GPU_CHECK_PYTEST"  # "paths of run 1;paths of run 2" instead of the above


# ----------------------------------------------------------------------------- steps


def step_env(sizes: Sizes, out: Path) -> dict:
    import torch
    import transformers

    res = {"python": platform.python_version(), "torch": torch.__version__,
           "cuda_runtime": torch.version.cuda, "transformers": transformers.__version__,
           "megarl": importlib.metadata.version("megarl"),
           "cpu_count": os.cpu_count()}
    for dist in ("triton", "megatron-core", "omegaconf", "math-verify", "liger-kernel"):
        try:
            res[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:  # each later step says what it needs
            res[dist] = "missing"
    res["imported_from"] = {}
    for mod in ("megarl", "megatron.core", "omegaconf", "math_verify"):
        spec = importlib.util.find_spec(mod)
        res["imported_from"][mod] = spec.origin if spec else None
    if sizes.device == "cuda":
        require(torch.cuda.is_available(), "CUDA is not available to torch")
        props = torch.cuda.get_device_properties(0)
        res.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   sm_count=props.multi_processor_count,
                   capability=f"{props.major}.{props.minor}", driver=_driver_version())
    return res


def _driver_version() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"unknown ({err})"


def step_kernel_bench(sizes: Sizes, out: Path) -> dict:
    """bench/kernels.py per T: Triton path (with naive, PPO and Liger beside it), then torch."""
    H, V = sizes.bench_hv
    runs = {}
    for T in sizes.bench_tokens:
        for impl, methods in (("triton", "naive,ours,ppo_naive,ppo_fused,liger"),
                              ("torch", "ours,ppo_fused")):
            js = work_dir(out) / f"kernels_T{T}_{impl}.json"
            dtype = "bf16" if sizes.device == "cuda" else "fp32"
            cmd = [sys.executable, str(REPO / "bench" / "kernels.py"), "--T", str(T), "--H", str(H),
                   "--V", str(V), "--dtype", dtype, "--device", sizes.device, "--impl", impl,
                   "--methods", methods, "--repeats", "3", "--json", str(js)]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            print(proc.stdout, proc.stderr[-2000:], sep="\n", flush=True)
            require(proc.returncode == 0, f"bench/kernels.py T={T} impl={impl} failed")
            runs[f"T{T}_{impl}"] = json.loads(js.read_text())["results"]
    failed = [f"{k}: {r['method']}: {r['skipped']}" for k, rs in runs.items() for r in rs
              if "failed" in r.get("skipped", "") and r["method"] != "naive"]
    require(not failed, "; ".join(failed))  # naive may run out of memory at T=16384
    return {"runs": runs}


def step_pytest(sizes: Sizes, out: Path) -> dict:
    """The test files of PYTEST_GPU (the dry run: PYTEST_DRY), one pytest run per entry."""
    runs = PYTEST_GPU if sizes.device == "cuda" else PYTEST_DRY
    if os.environ.get(PYTEST_ENV):
        runs = [run.split() for run in os.environ[PYTEST_ENV].split(";") if run.strip()]
    workers = ["-n", "4"] if sizes.device == "cuda" else []
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if sizes.device == "cuda":
        env["TRITON_INTERPRET"] = "0"  # the compiled kernels on CUDA tensors
    res, failed = {}, []
    for i, paths in enumerate(runs):
        junit = work_dir(out) / f"pytest_{i}.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *workers,
               "--timeout=300", f"--junitxml={junit}", *paths]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        print(proc.stdout[-20000:], proc.stderr[-5000:], sep="\n", flush=True)
        tail = ([x for x in proc.stdout.splitlines() if x.strip()] or ["(no output)"])[-1]
        res[" ".join(paths)] = tail
        if proc.returncode != 0:
            failed.append(f"pytest {' '.join(paths)}: {tail}; {'; '.join(junit_failures(junit))}")
    require(not failed, "; ".join(failed))
    return res


def junit_failures(junit: Path, limit: int = 10) -> list[str]:
    """``test id: first line of its message`` for each failed or erroring test of a JUnit XML
    report, so that summary.json names them without the step's full log."""
    import xml.etree.ElementTree as ET

    if not junit.exists():
        return [f"(no report at {junit})"]
    out = []
    for case in ET.parse(junit).iter("testcase"):
        for bad in (*case.findall("failure"), *case.findall("error")):
            msg = (bad.get("message") or bad.text or "").strip().splitlines()
            out.append(f"{case.get('classname')}::{case.get('name')}: {(msg or [''])[0][:300]}")
    return out[:limit] + ([f"... {len(out) - limit} more"] if len(out) > limit else [])


def step_model(sizes: Sizes, out: Path) -> dict:
    """The random policy (bf16 on the GPU), its tokenizer and the prompt rows."""
    import torch

    from megarl.data.rows import write_rows
    from megarl.models.testing import make_tiny_hf_model

    path = model_dir(out)
    dtype = torch.bfloat16 if sizes.dtype == "bf16" else torch.float32
    t0 = time.perf_counter()
    make_tiny_hf_model(path, "qwen2", dtype=dtype, **sizes.model)
    _condition(path)
    params = sum(p.numel() for p in load_hf(path, torch.float32, "meta").parameters())
    rows = [{"data_source": "openai/gsm8k",
             "prompt": [{"role": "user", "content": f"What is {i}+{2 * i + 1}? Answer with the "
                                                    "number after ####."}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(3 * i + 1)},
             "extra_info": {"index": i}} for i in range(64)]
    write_rows(rows, str(work_dir(out) / "train.parquet"))
    (work_dir(out) / "reward.py").write_text(REWARD)
    return {"path": str(path), "params_m": round(params / 1e6, 1), "build_s":
            round(time.perf_counter() - t0, 1), **sizes.model}


def _condition(path: Path) -> None:
    """Rescale the random matrices (N(0, 0.1) from make_tiny_hf_model) to N(0, 1/fan_in), as a
    trained model's are: with 0.1 at width 896 every block multiplies its input's scale by
    ~3-7 and bf16 logprobs drift 0.4 nats from float64, far more than a real checkpoint's.
    The embedding (tied to the LM head) keeps 0.1, logits of std ~3, except the rows of the
    tokenizer's ``CHAR_IDS`` ids, scaled by 3 so that sampling picks text the reward can read."""
    from safetensors.torch import load_file, save_file

    for file in sorted(path.glob("*.safetensors")):
        state = load_file(str(file))
        for name, t in state.items():
            if t.dim() == 2 and "embed_tokens" not in name and "lm_head" not in name:
                state[name] = (t.float() / (0.1 * t.shape[1] ** 0.5)).to(t.dtype)
            elif "embed_tokens" in name:
                t = t.float()
                t[:CHAR_IDS] *= 3.0
                state[name] = t.to(state[name].dtype)
        save_file(state, str(file), metadata={"format": "pt"})


def step_generate(sizes: Sizes, out: Path) -> dict:
    """Tokens/s of our engine and of transformers' generate: the same prompts, exactly
    ``gen_len`` new tokens (ignore EOS / min_new_tokens), sampling at T=1, alternating calls."""
    import torch

    from megarl.rollout.protocol import SamplingParams
    from megarl.rollout.torch import TorchRolloutEngine

    device = torch.device(sizes.device)
    dtype = torch.bfloat16 if sizes.dtype == "bf16" else torch.float32
    path = model_dir(out)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 100, (int(torch.randint(16, 48, (1,), generator=g)),),
                             generator=g).tolist() for _ in range(sizes.gen_batch)]
    width = max(map(len, prompts))
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
    hf = load_hf(path, dtype, device)
    engine = TorchRolloutEngine.from_pretrained(path, dtype=dtype, device=device,
                                                max_num_seqs=sizes.gen_batch)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def run_hf() -> int:
        with torch.inference_mode():
            o = hf.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                            do_sample=True, temperature=1.0, top_k=None, top_p=1.0,
                            max_new_tokens=sizes.gen_len, min_new_tokens=sizes.gen_len,
                            pad_token_id=0, use_cache=True)
        return (o.shape[1] - width) * o.shape[0]

    def run_ours(seed: int) -> int:
        done = engine.generate(prompts, SamplingParams(temperature=1.0, ignore_eos=True, seed=seed,
                                                       max_new_tokens=sizes.gen_len))
        return sum(len(c.token_ids) for c in done)

    def timed(fn) -> float:
        sync()
        t0 = time.perf_counter()
        n = fn()
        sync()
        return n / (time.perf_counter() - t0)

    run_hf(), run_ours(0)  # warm-up
    hf_tps, ours_tps = [], []
    for r in range(sizes.gen_repeats):
        hf_tps.append(timed(run_hf))
        ours_tps.append(timed(functools.partial(run_ours, r + 1)))
    res = {"batch": sizes.gen_batch, "new_tokens": sizes.gen_len, "dtype": sizes.dtype,
           "hf_tok_s": statistics.median(hf_tps), "ours_tok_s": statistics.median(ours_tps)}
    res["ours_over_hf"] = res["ours_tok_s"] / res["hf_tok_s"]
    return res


STEP_FUNCS = {"env": step_env, "kernels": step_kernels, "kernel_bench": step_kernel_bench,
              "pytest": step_pytest, "model": step_model, "grpo_torch": step_grpo_torch,
              "grpo_megatron": step_grpo_megatron, "megatron_vs_hf": step_megatron_vs_hf,
              "grpo_lora": step_grpo_lora, "grpo_tools": step_grpo_tools, "generate": step_generate,
              "grpo_megatron_lora": step_grpo_megatron_lora,
              "grpo_bf16_params": step_grpo_bf16_params}
NEEDS_MODEL = ("grpo_torch", "grpo_megatron", "grpo_lora", "grpo_tools", "megatron_vs_hf",
               "generate", "grpo_megatron_lora", "grpo_bf16_params")


# ----------------------------------------------------------------------------- driver


def run_step(name: str, sizes: Sizes, out: Path) -> int:
    """One step in this process: its JSON record; exit status 0 when it passed."""
    t0 = time.perf_counter()
    rec: dict = {"step": name, "device": sizes.device, "dry_run": sizes is DRY}
    try:
        rec["result"] = STEP_FUNCS[name](sizes, out)
        rec["ok"] = True
    except Exception as err:  # the record says what failed; the driver goes on
        traceback.print_exc()
        rec["ok"], rec["error"] = False, f"{type(err).__name__}: {err}"[:4000]
        if getattr(err, "result", None) is not None:
            rec["result"] = err.result
    rec["seconds"] = round(time.perf_counter() - t0, 1)
    (out / f"{name}.json").write_text(json.dumps(rec, indent=1, default=str))
    return 0 if rec["ok"] else 1


def _launch(name: str, out: Path, dry_run: bool):
    cmd = [sys.executable, str(Path(__file__).resolve()), "step", name, "--out", str(out)]
    log = open(out / f"{name}.log", "w")  # noqa: SIM115 (closed by the caller via proc.log)
    proc = subprocess.Popen(cmd + ["--dry-run"] * dry_run, stdout=log, stderr=subprocess.STDOUT,
                            cwd=REPO, start_new_session=True)
    proc.log = log
    return proc


def _finish(name: str, proc, out: Path, timeout: float) -> dict:
    """Wait for a step's process up to ``timeout`` s; kill its whole group after that."""
    import signal

    try:
        proc.wait(timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rec = {"step": name, "ok": False, "error": f"timed out after {timeout:.0f} s"}
        (out / f"{name}.json").write_text(json.dumps(rec, indent=1))
    finally:
        proc.log.close()
    path = out / f"{name}.json"
    if not path.is_file():
        return {"step": name, "ok": False, "error": f"died (exit {proc.returncode}): see {name}.log"}
    return json.loads(path.read_text())


def run_all(steps: list[str], out: Path, dry_run: bool, budget: float) -> int:
    """Every step in order, each in its own process under min(its timeout, what is left of
    ``budget``); background steps start first and are collected last."""
    deadline = time.monotonic() + budget
    scale = 1.0 if not dry_run else 2.0  # the CPU is slower, the shapes much smaller
    records, background = {}, {}
    for name in steps:
        if name in BACKGROUND:
            background[name] = _launch(name, out, dry_run)
    for name in steps:
        if name in BACKGROUND:
            continue
        if name in NEEDS_MODEL and not records.get("model", {}).get("ok", False) \
                and not (model_dir(out) / "config.json").is_file():
            records[name] = {"step": name, "ok": False, "error": "no model (step model failed)"}
            continue
        left = deadline - time.monotonic() - 5
        if left < 20:
            records[name] = {"step": name, "ok": False, "error": "not run: out of time budget"}
            continue
        print(f"[gpu_check] {name} ...", flush=True)
        records[name] = _finish(name, _launch(name, out, dry_run), out,
                                min(STEPS[name] * scale, left))
        _print_record(records[name])
    for name, proc in background.items():
        records[name] = _finish(name, proc, out, deadline - time.monotonic())
        _print_record(records[name])
    summary = [records[n] for n in steps]
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print(f"[gpu_check] {sum(r['ok'] for r in summary)}/{len(summary)} steps passed", flush=True)
    path = write_results(out, steps)
    print(f"[gpu_check] results: {path} ({path.stat().st_size / 1024:.0f} KiB; bring it back "
          f"with: cp {path} $OUT/)", flush=True)
    return 0 if all(r["ok"] for r in summary) else 1


def write_results(out: Path, steps: list[str]) -> Path:
    """``out/results.tgz``: summary.json, each step's STEP.json and STEP.log, the pytest step's
    JUnit reports and the install log (those that exist); never the work or site folders."""
    import tarfile

    names = ["summary.json", "install_megarl.log",
             *(f"{n}.{ext}" for n in steps for ext in ("json", "log"))]
    files = [out / n for n in names] + sorted(work_dir(out).glob("pytest_*.xml"))
    path = out / RESULTS
    with tarfile.open(path, "w:gz") as tar:
        for f in files:
            if f.is_file():
                tar.add(f, arcname=str(f.relative_to(out)))
    return path


def _print_record(rec: dict) -> None:
    state = "PASS" if rec.get("ok") else "FAIL"
    body = rec.get("result") if rec.get("ok") else rec.get("error")
    text = json.dumps(body, default=str)
    print(f"[gpu_check] {state} {rec['step']} ({rec.get('seconds', '-')} s): {text[:3000]}",
          flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="every step (or --steps), each in its own process")
    r.add_argument("--steps", default=",".join(STEPS))
    r.add_argument("--budget", type=float, default=BUDGET, help="seconds for all steps")
    s = sub.add_parser("step", help="one step in this process")
    s.add_argument("name", choices=sorted(STEP_FUNCS))
    for p in (r, s):
        p.add_argument("--out", required=True, type=Path)
        p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.cmd == "step":
        return run_step(args.name, DRY if args.dry_run else GPU, args.out)
    steps = [x for x in args.steps.split(",") if x]
    unknown = sorted(set(steps) - set(STEP_FUNCS))
    if unknown:
        ap.error(f"unknown steps {unknown}; valid: {list(STEPS)}")
    return run_all(steps, args.out, args.dry_run, args.budget)


if __name__ == "__main__":
    sys.exit(main())
