"""Host memory of an actor with fp32 vs bf16 parameters (torch backend, bf16 compute, CPU), and
the share of weights that one AdamW step at a small learning rate changes in bf16.

    python bench/param_dtype_memory.py [--hidden 1024] [--layers 4] [--policy assets/policy]

Each mode runs in a fresh process (a world of one): build the actor
(``param_dtype`` null: fp32 parameters under FSDP2 mixed precision; ``bf16``: bf16 parameters),
one ``forward_backward`` (gradients exist) and one ``train_step`` (AdamW state exists).
Printed per mode: the resident memory (RSS, MiB) above the process's before the backend after
each phase and at most, and the bytes of this rank's parameters, gradients and AdamW state.

Then, for the random model and for ``--policy`` (the trained demo policy, if present): the
share of weights one ``train_step`` at lr 1e-6 changes with bf16 parameters (the rest of the
updates round away; with fp32 parameters every weight with a gradient changes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.results import print_table  # noqa: E402


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _batch(vocab: int):
    import torch

    from megarl.backends.protocol import SequenceBatch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (2, 32), generator=g)  # few tokens: the weights dominate
    return SequenceBatch(ids, torch.ones_like(ids), 16, {"adv": torch.randn(2, 16, generator=g)})


def _loss_fn(out, mb):
    return -(out.logprob * mb.tensors["adv"]).mean(), {}


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _bytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def _actor(model: str, param_dtype: str | None, lr: float):
    from megarl.backends.torch import TorchBackend

    return TorchBackend("actor", model, device="cpu", dtype="bf16", param_dtype=param_dtype,
                        optim={"lr": lr}, use_fused_kernels=False)


def measure(mode: str, model: str) -> dict:
    import torch

    from megarl.utils.dist import init_distributed

    init_distributed(torch.device("cpu"))
    batch = _batch(128)
    before = _rss_mib()
    phases = {}
    actor = _actor(model, None if mode == "fp32" else mode, 1e-6)
    phases["built"] = _rss_mib() - before
    actor.forward_backward([batch], _loss_fn)
    phases["backward"] = _rss_mib() - before
    params = list(actor.model.parameters())
    grads = _bytes(p.grad for p in params if p.grad is not None)
    actor.model.zero_grad(set_to_none=True)
    actor.train_step([batch], _loss_fn)
    phases["train_step"] = _rss_mib() - before
    state = _bytes(v for s in actor.optimizer.state.values() for v in s.values()
                   if isinstance(v, torch.Tensor) and v.dim() > 0)
    return {"mode": mode, **{f"rss_{k}_mib": round(v, 1) for k, v in phases.items()},
            "rss_max_mib": round(max(phases.values()), 1), "param_bytes": _bytes(params),
            "grad_bytes": grads, "optimizer_state_bytes": state}


def changed_share(model: str, lr: float) -> dict:
    """The share of weights (and of those with a gradient) one bf16 train_step changes."""
    import torch

    from megarl.models import read_hf_config
    from megarl.utils.dist import init_distributed

    init_distributed(torch.device("cpu"))
    batch = _batch(int(read_hf_config(model)["vocab_size"]))
    actor = _actor(model, "bf16", lr)
    before = [p.detach().clone() for p in actor.model.parameters()]
    actor.forward_backward([batch], _loss_fn)
    fed = [p.grad != 0 for p in actor.model.parameters()]
    actor.model.zero_grad(set_to_none=True)
    actor.train_step([batch], _loss_fn)
    moved = [p.detach() != b for p, b in zip(actor.model.parameters(), before)]
    total = sum(m.numel() for m in moved)
    return {"model": model, "lr": lr, "weights": total,
            "changed_share": sum(int(m.sum()) for m in moved) / total,
            "changed_share_of_fed": (sum(int((m & f).sum()) for m, f in zip(moved, fed))
                                     / sum(int(f.sum()) for f in fed))}


def _child(env: dict, *args: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", *args], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--policy", default=str(ROOT / "assets" / "policy"))
    ap.add_argument("--child", nargs=2, metavar=("MODE", "MODEL"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        mode, model = args.child
        res = changed_share(model, 1e-6) if mode == "share" else measure(mode, model)
        print(json.dumps(res))
        return
    from megarl.models.testing import make_tiny_hf_model

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    with tempfile.TemporaryDirectory() as d:
        model = str(make_tiny_hf_model(
            Path(d) / "m", "qwen2", tokenizer=False, hidden_size=args.hidden,
            intermediate_size=args.hidden * 3, num_hidden_layers=args.layers,
            num_attention_heads=8, num_key_value_heads=2, randomize=False))
        rows = [_child(env, mode, model) for mode in ("fp32", "bf16")]
        shares = [_child(env, "share", model)]
    if Path(args.policy, "config.json").is_file():
        shares.append(_child(env, "share", args.policy))
    print(f"qwen2, hidden {args.hidden}, {args.layers} layers, bf16 compute")
    for table in (rows, shares):
        print_table(table)


if __name__ == "__main__":
    main()
