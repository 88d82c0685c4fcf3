"""torchrun worker: megarl_kernels under vocabulary-parallel TP=2 (gloo) equals TP=1.

Usage: torchrun --standalone --nproc_per_node=2 tests/dist/kernels_tp.py {torch|triton} [cpu|cuda]
(cuda: the Triton calls run compiled on CUDA copies of the inputs, tests/kernels/kernels_device.py)
Every rank builds the same full inputs, keeps its vocabulary shard of the weight, and compares
logprob / entropy / dh / its dW shard (and the fused PPO and PACS losses and grads) with the
single-process result on the full weight. Prints one "OK" line per check; exits 1 on a mismatch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

import megarl_kernels as mk
from megarl.utils import dist as mdist


def close(name, got, want, rel):
    got, want = got.detach().double(), want.detach().double()
    err = float((got - want).abs().max()) if got.numel() else 0.0
    bound = rel * float(want.abs().max()) + 1e-7
    if not err <= bound:
        raise AssertionError(f"{name}: max error {err:.3e} > {bound:.3e}")


def inputs(dtype, T=29, H=24, v_local=203, world=2):
    g = torch.Generator().manual_seed(11)
    V = v_local * world
    hidden = torch.randn(T, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * 0.6).to(dtype)
    labels = torch.randint(0, V, (T,), generator=g)
    labels[:4] = torch.tensor([0, V - 1, v_local - 1, v_local])  # edges of both shards
    a, b = torch.randn(T, generator=g), torch.randn(T, generator=g)
    return hidden, weight, labels, a, b


def run_linear(hidden, weight, labels, temperature, group, kw, a, b):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = mk.linear_logprob_entropy(h, w, labels, temperature, group, **kw)
    loss = (lp * a).sum() + (0.0 if b is None else (ent * b).sum())
    loss.backward()
    return lp, ent, h.grad, w.grad


def main() -> None:
    impl = sys.argv[1]
    if len(sys.argv) > 2 and sys.argv[2] == "cuda":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
        from kernels_device import triton_calls_on_cuda

        triton_calls_on_cuda(mk)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    if impl == "triton":
        from megarl_kernels import triton_impl

        triton_impl.INTERP_MAX_BLOCKS = (32, 128, 32)  # still 2 vocab tiles per shard
    for dtype, temperature, use_b in ((torch.float32, 0.7, True), (torch.bfloat16, 1.0, False)):
        hidden, weight, labels, a, b = inputs(dtype, world=world)
        b = b if use_b else None
        v_local = weight.shape[0] // world
        rows = slice(rank * v_local, (rank + 1) * v_local)
        shard = weight[rows].clone()
        kw = dict(impl=impl, chunk_size=(8, 64))
        tp = run_linear(hidden, shard, labels, temperature, group, kw, a, b)
        one = run_linear(hidden, weight, labels, temperature, None, kw, a, b)
        rel = 1e-5 if dtype == torch.float32 else 1e-2
        close("logprob", tp[0], one[0], 1e-5)
        close("entropy", tp[1], one[1], 1e-5)
        close("dh", tp[2], one[2], rel)
        close("dW shard", tp[3], one[3][rows], rel)
        print(f"rank{rank} OK linear {dtype} T={temperature} entropy_grad={use_b}", flush=True)

    hidden, weight, labels, a, b = inputs(torch.float32, world=world)
    v_local = weight.shape[0] // world
    rows = slice(rank * v_local, (rank + 1) * v_local)
    with torch.no_grad():
        lp, _ = mk.linear_logprob_entropy(hidden, weight, labels, impl=impl)
    old = lp + 0.5 * a
    seq = torch.arange(hidden.shape[0]) % 6
    groups, scores = torch.tensor([0, 1, 0, 1, 0, 1]), torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    losses = {
        "ppo": lambda h, w, g: mk.fused_ppo_loss(h, w, labels, old, b, loss_scale=0.05,
                                                 entropy_coeff=0.01, tp_group=g, impl=impl),
        "pacs": lambda h, w, g: mk.fused_pacs_loss(h, w, labels, old, seq, groups, scores,
                                                   tp_group=g, impl=impl),
    }
    for name, fn in losses.items():
        outs = []
        for w_in, g in ((weight[rows].clone(), group), (weight.clone(), None)):
            h, w = hidden.clone().requires_grad_(), w_in.requires_grad_()
            loss, metrics = fn(h, w, g)
            loss.backward()
            outs.append((loss.detach(), metrics, h.grad, w.grad))
        (l_tp, m_tp, dh_tp, dw_tp), (l_one, m_one, dh_one, dw_one) = outs
        close(f"{name} loss", l_tp, l_one, 1e-5)
        for k in m_one:
            close(f"{name} {k}", torch.tensor(m_tp[k]), torch.tensor(m_one[k]), 1e-5)
        close(f"{name} dh", dh_tp, dh_one, 1e-5)
        close(f"{name} dW shard", dw_tp, dw_one[rows], 1e-5)
        print(f"rank{rank} OK fused {name}", flush=True)
    mdist.destroy()


if __name__ == "__main__":
    main()
