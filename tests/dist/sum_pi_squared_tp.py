"""torchrun worker: ``sum_v pi_v^2`` under vocabulary-parallel TP=2 (gloo) against a float64
softmax of the full logits.

Usage: torchrun --standalone --nproc_per_node=2 tests/dist/sum_pi_squared_tp.py [cpu|cuda]
Every rank builds the same full inputs and keeps its vocabulary shard of the weight. Checked:
``megarl_kernels.linear_logprob_stats`` (torch; triton under TRITON_INTERPRET=1 on the CPU, or
compiled on CUDA tensors with ``cuda``, gloo all-reducing them), the torch
backend's naive head path and the megatron backend's PyTorch fallback. One "OK" line per check;
exits 1 on a mismatch.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import megarl_kernels as mk
from megarl.backends.megatron.heads import torch_sum_pi_squared
from megarl.backends.torch.heads import naive_sum_pi_squared


def reference(hidden, weight, labels, temperature):
    logits = hidden.double() @ weight.double().t() / temperature
    logp = torch.log_softmax(logits, -1)
    return (logp.gather(-1, labels[:, None])[:, 0], -(logp.exp() * logp).sum(-1),
            logp.exp().square().sum(-1))


def close(name, got, want, tol):
    err = float((got.double() - want).abs().max())
    if not err <= tol:
        raise AssertionError(f"{name}: max error {err:.3e} > {tol:.1e}")


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(5)
    T, H, v_local = 23, 16, 97
    V = v_local * world
    hidden = torch.randn(T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.8
    weight[:, 0] += torch.linspace(0, 6, V)  # a peaked distribution at some tokens
    labels = torch.randint(0, V, (T,), generator=g)
    shard = weight[rank * v_local:(rank + 1) * v_local].clone()
    temperature = 0.6
    want_lp, want_ent, want_sq = reference(hidden, weight, labels, temperature)
    on_cuda = len(sys.argv) > 1 and sys.argv[1] == "cuda"
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    impls = ["torch"] + (["triton"] if interpreted or on_cuda else [])
    if interpreted:
        from megarl_kernels import triton_impl

        triton_impl.INTERP_MAX_BLOCKS = (16, 32, 16)  # several vocab tiles per shard
    for impl in impls:
        dev = torch.device("cuda", torch.cuda.current_device()) if impl == "triton" and on_cuda \
            else torch.device("cpu")
        lp, ent, sq = (x.cpu() for x in mk.linear_logprob_stats(
            hidden.to(dev), shard.to(dev), labels.to(dev), temperature, group, impl=impl,
            chunk_size=(8, 40)))
        close(f"{impl} logprob", lp, want_lp, 1e-4)
        close(f"{impl} entropy", ent, want_ent, 1e-4)
        close(f"{impl} sum_pi_squared", sq, want_sq, 1e-5)
        print(f"rank{rank} OK kernel {impl}", flush=True)
    close("torch naive", naive_sum_pi_squared(hidden, shard, temperature, group), want_sq, 1e-5)
    print(f"rank{rank} OK torch naive", flush=True)
    close("megatron fallback", torch_sum_pi_squared(hidden, shard, temperature, group), want_sq,
          1e-5)
    print(f"rank{rank} OK megatron fallback", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
