"""The torch backend with bf16 parameters (``param_dtype="bf16"``, bf16 compute) under FSDP2
over 2 ranks, each rank feeding its own rows. Launched by tests/backends/test_param_dtype.py:

    torchrun --standalone --nproc_per_node=2 tests/dist/param_dtype_worker.py MODEL OUT.pt

Rank 0 saves {"dtypes": the dtypes of the local shards, their gradients and AdamW state,
"before", "grads", "after": the full parameters before one train_step, the full gradients of
that step (from a twin backend's forward_backward) and the parameters after it, "lr"}.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megarl.backends.protocol import SequenceBatch  # noqa: E402
from megarl.backends.torch import TorchBackend  # noqa: E402
from megarl.utils.dist import destroy, init_distributed  # noqa: E402

LR = 1e-3


def make_batch(seed: int, B: int = 4, P: int = 5, L: int = 4) -> SequenceBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (B, P + L), generator=g)
    mask = torch.ones(B, P + L, dtype=torch.long)
    mask[0, :2] = 0
    return SequenceBatch(ids * mask, mask, L, {"adv": torch.randn(B, L, generator=g),
                                               "mask": mask[:, P:].float()})


def loss_fn(out, mb):
    m = mb.tensors["mask"]
    return -(out.logprob * mb.tensors["adv"] * m).sum() / m.sum(), {}


def main() -> None:
    model, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    init_distributed(torch.device("cpu"))

    def actor() -> TorchBackend:
        return TorchBackend("actor", model, device="cpu", dtype="bf16", param_dtype="bf16",
                            dp_shard=2, use_fused_kernels=False,
                            optim={"lr": LR, "betas": (0.9, 0.999), "eps": 1e-8,
                                   "weight_decay": 0.01, "grad_clip": None})

    batch = [make_batch(dist.get_rank())]
    twin = actor()
    twin.forward_backward(batch, loss_fn)
    grads = {n: t.clone() for n, t in twin.full_grads()}
    a = actor()
    before = {n: t.clone() for n, t in a.export_weights()}
    a.train_step(batch, loss_fn)
    after = {n: t.clone() for n, t in a.export_weights()}
    twin.forward_backward(batch, loss_fn)
    local = [p for p in twin.model.parameters()]
    dtypes = sorted({str(p.to_local().dtype) for p in local}
                    | {str(p.grad.to_local().dtype) for p in local}
                    | {str(s[k].to_local().dtype) for s in a.optimizer.state.values()
                       for k in ("exp_avg", "exp_avg_sq")})
    if dist.get_rank() == 0:
        torch.save({"dtypes": dtypes, "before": before, "grads": grads, "after": after,
                    "lr": LR, "n_state": len(a.optimizer.state)}, out)
    dist.barrier()
    destroy()


if __name__ == "__main__":
    main()
