"""Benchmark: megarl_kernels.linear_logprob_entropy vs the naive full-logits computation.

    python bench/kernels.py [--T 4096 --H 896 --V 151936 --dtype fp32 --threads 1
                             --impl auto --device cpu --repeats 3 --methods naive,ours]

Each method runs in its own subprocess (so peak memory is per process), one after another:
inputs are allocated in place, then the baseline is taken (CPU: ``ru_maxrss``; GPU:
``memory_allocated``), then ``warmup + repeats`` forward+backward iterations of
``loss = sum(a * logprob) + sum(b * entropy)``. Reported: wall time per iteration (median and
min over the repeats), CPU seconds (``process_time``; on a shared box less sensitive to other
load than wall time), peak extra memory over the baseline (CPU: ``ru_maxrss``; GPU:
``max_memory_allocated``), and ratios to ``naive`` measured in the same run.

Methods:
- ``naive``: ``log_softmax(hidden @ W.T / temperature)`` (division in place, skipped at 1.0),
  gather, ``-(p * logp).sum(-1)`` with ``p = logp.exp()``.
- ``ours``: ``linear_logprob_entropy(..., impl=--impl)``.
- ``ours_compiled``: same with ``set_torch_compile(True)`` (torch implementation only).
- ``ppo_naive`` / ``ppo_fused``: the PPO loss (token-mean, entropy_coeff 0.01) from the naive
  log-probs vs ``fused_ppo_loss`` (ratios for these two are to ``naive``; compare them to each
  other).
- ``liger``: Liger's ``LigerFusedLinearCrossEntropyLoss`` (cross-entropy only: no entropy, no
  temperature), CUDA only. Its Triton kernel runs on CPU only under the interpreter, which would
  measure the interpreter, so it is skipped on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--T", type=int, default=4096, help="tokens")
    p.add_argument("--H", type=int, default=896, help="hidden size")
    p.add_argument("--V", type=int, default=151936, help="vocabulary size")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--threads", type=int, default=1, help="torch / OpenMP threads per process")
    p.add_argument("--impl", choices=["auto", "torch", "triton"], default="auto")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--chunk-size", type=int, nargs=2, default=None, metavar=("TOKENS", "VOCAB"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--methods", default="naive,ours", help="comma list: naive,ours,ours_compiled,ppo_naive,ppo_fused,liger")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- worker side


def _device_name(torch, device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    from megarl.utils.host import cpu_model

    return f"{cpu_model()}, {os.cpu_count()} cores"


def _step_fn(method: str, args, torch, hidden, weight, labels, a, b):
    """A closure running forward+backward once; returns (t_forward_end)."""
    temperature = args.temperature
    if method == "naive":
        def step():
            logits = (hidden @ weight.t()).float()
            if temperature != 1.0:
                logits = logits.div_(temperature)
            logp = torch.log_softmax(logits, dim=-1)
            lp = logp.gather(1, labels[:, None]).squeeze(1)
            ent = -(logp.exp() * logp).sum(dim=-1)
            loss = (lp * a).sum() + (ent * b).sum()
            t_fwd = time.perf_counter()
            loss.backward()
            return t_fwd
        return step
    if method in ("ours", "ours_compiled"):
        import megarl_kernels as mk

        mk.set_torch_compile(method == "ours_compiled")
        chunk = tuple(args.chunk_size) if args.chunk_size else None

        def step():
            lp, ent = mk.linear_logprob_entropy(hidden, weight, labels, temperature,
                                                impl=args.impl, chunk_size=chunk)
            loss = (lp * a).sum() + (ent * b).sum()
            t_fwd = time.perf_counter()
            loss.backward()
            return t_fwd
        return step
    if method in ("ppo_naive", "ppo_fused"):
        import megarl_kernels as mk

        old = -5.0 * torch.rand(labels.shape, device=labels.device)  # arbitrary behaviour logprobs
        scale = 1.0 / labels.numel()
        chunk = tuple(args.chunk_size) if args.chunk_size else None

        def ppo(lp, ent):
            ratio = torch.exp(torch.clamp(lp - old, -20.0, 20.0))
            clipped = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 0.8, 1.2))
            per_token = torch.where(a < 0, torch.minimum(-a * 3.0, clipped), clipped)
            return (per_token * scale).sum() - 0.01 * (ent * scale).sum()

        def step():
            if method == "ppo_fused":
                loss, _ = mk.fused_ppo_loss(hidden, weight, labels, old, a, loss_scale=scale,
                                            entropy_coeff=0.01, temperature=temperature,
                                            impl=args.impl, chunk_size=chunk)
            else:
                logits = (hidden @ weight.t()).float()
                if temperature != 1.0:
                    logits = logits.div_(temperature)
                logp = torch.log_softmax(logits, dim=-1)
                lp = logp.gather(1, labels[:, None]).squeeze(1)
                loss = ppo(lp, -(logp.exp() * logp).sum(dim=-1))
            t_fwd = time.perf_counter()
            loss.backward()
            return t_fwd
        return step
    if method == "liger":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        flce = LigerFusedLinearCrossEntropyLoss(reduction="sum")

        def step():
            loss = flce(weight, hidden, labels)  # = -sum(logprob); gradients computed here
            t_fwd = time.perf_counter()
            loss.backward()
            return t_fwd
        return step
    raise ValueError(f"unknown method {method!r}")


def worker(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, DTYPES[args.dtype])
    gen = torch.Generator(device=device).manual_seed(0)
    # allocated in place: no temporaries inflate the baseline peak
    hidden = torch.empty(args.T, args.H, dtype=dtype, device=device).normal_(0.0, 1.0, generator=gen)
    weight = torch.empty(args.V, args.H, dtype=dtype, device=device).normal_(
        0.0, 2.0 / args.H**0.5, generator=gen)
    labels = torch.randint(0, args.V, (args.T,), device=device, generator=gen)
    a = torch.randn(args.T, device=device, generator=gen)
    b = torch.randn(args.T, device=device, generator=gen)
    hidden.requires_grad_()
    weight.requires_grad_()
    cuda = device.type == "cuda"
    step = _step_fn(args.worker, args, torch, hidden, weight, labels, a, b)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    walls, fwds, cpus, loads = [], [], [], []
    for i in range(args.warmup + args.repeats):
        hidden.grad = weight.grad = None
        t0, c0 = time.perf_counter(), time.process_time()
        t_fwd = step()
        if cuda:
            torch.cuda.synchronize()
        t1, c1 = time.perf_counter(), time.process_time()
        if i >= args.warmup:
            walls.append(t1 - t0)
            fwds.append(t_fwd - t0)
            cpus.append(c1 - c0)
            loads.append(os.getloadavg()[0])
    if cuda:
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {
        "method": args.worker, "device": _device_name(torch, device),
        "wall_median_s": statistics.median(walls), "wall_min_s": min(walls),
        "fwd_median_s": statistics.median(fwds), "cpu_median_s": statistics.median(cpus),
        "walls_s": walls, "peak_extra_mb": peak / 2**20, "load_avg": loads,
        "torch": torch.__version__,
    }


# ----------------------------------------------------------------------------- driver side


def run_method(method: str, args) -> dict:
    if method == "liger" and args.device == "cpu":
        return {"method": method, "skipped": "Liger's Triton kernel needs a GPU (CPU: interpreter only)"}
    if method == "liger":
        try:
            import liger_kernel  # noqa: F401
        except ImportError:
            return {"method": method, "skipped": "liger-kernel not installed"}
    argv = [a for a in sys.argv[1:]]
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--worker", method]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"method": method, "skipped": f"failed (rc={proc.returncode}): {proc.stderr[-600:]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def table(results: list[dict], args) -> str:
    naive = next((r for r in results if r["method"] == "naive" and "skipped" not in r), None)
    lines = [
        f"T={args.T} H={args.H} V={args.V} {args.dtype} device={args.device} threads={args.threads} "
        f"impl={args.impl} temperature={args.temperature} repeats={args.repeats} (+{args.warmup} warmup)",
        "",
        "| method | fwd+bwd wall median (min) s | fwd s | CPU s | peak extra MB | time / naive | "
        "naive mem / mem | load avg |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "skipped" in r:
            lines.append(f"| {r['method']} | skipped: {r['skipped']} | | | | | | |")
            continue
        ratio_t = ratio_m = "-"
        if naive is not None:
            ratio_t = f"{r['wall_median_s'] / naive['wall_median_s']:.2f} (CPU {r['cpu_median_s'] / naive['cpu_median_s']:.2f})"
            ratio_m = f"{naive['peak_extra_mb'] / max(r['peak_extra_mb'], 1e-9):.1f}x"
        lines.append(
            f"| {r['method']} | {r['wall_median_s']:.2f} ({r['wall_min_s']:.2f}) | {r['fwd_median_s']:.2f} | "
            f"{r['cpu_median_s']:.2f} | {r['peak_extra_mb']:.0f} | {ratio_t} | {ratio_m} | "
            f"{min(r['load_avg']):.1f}-{max(r['load_avg']):.1f} |"
        )
    dev = next((r["device"] for r in results if "device" in r), args.device)
    lines += ["", f"device: {dev}; date: {time.strftime('%Y-%m-%d')}"]
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    results = []
    for m in methods:
        print(f"running {m} ...", file=sys.stderr, flush=True)
        results.append(run_method(m, args))
    print(table(results, args))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
