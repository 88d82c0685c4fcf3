"""Parameter sharding of the torch backend on 4 gloo ranks: FSDP2 over data-parallel x Ulysses
sequence-parallel ranks, and hybrid sharding (``dp_shard`` below the data-parallel size:
parameters sharded inside a group, replicated over the groups). Every layout against the
single-process reference of ``torch_backend_ref`` (``check_actor`` of torch_backend_worker), the
hybrid layout's gradients against the fully sharded layout's, and the bytes each rank holds.
Launched by tests/backends/test_torch_backend_hsdp_dist.py:

    torchrun --standalone --nproc_per_node=4 tests/dist/torch_backend_hsdp_worker.py \
        --models JSON --work DIR --out results.json

Layouts (4 ranks):
  sp2        Ulysses 2, DP 2: parameters sharded over all 4 ranks (DP x SP);
  sp2_hsdp   Ulysses 2, DP 2, dp_shard 1: sharded over each SP pair, replicated over DP;
  hsdp2      DP 4, dp_shard 2: sharded over pairs of DP ranks, replicated over the 2 pairs
             (the batch split over DP 4 is not ``rank_split``'s: gradients and logprobs only);
  tp2_hsdp   TP 2, DP 2, dp_shard 1: TP shards replicated over DP through FSDP2's 2-D mesh.
Checkpoint: saved at ``sp2_hsdp`` after 3 steps, loaded at ``sp2``: same logprobs, and one
more step equals the uninterrupted run.
Planted: ``planted_sp_replicated``, the FSDP mesh without the SP ranks (parameters replicated
over the sequence-parallel group, gradients not summed over it); ``planted_no_replica_reduce``,
hybrid sharding without its replicate dimension (gradients not summed over the groups).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch_backend_ref as R  # noqa: E402
import torch_backend_worker as W  # noqa: E402

from megarl.backends.torch import TorchBackend  # noqa: E402
from megarl.backends.torch import backend as backend_mod  # noqa: E402
from megarl.utils.dist import init_distributed  # noqa: E402

LAYOUTS = {
    "sp2": {"ulysses": 2},
    "sp2_hsdp": {"ulysses": 2, "dp_shard": 1},
    "tp2_hsdp": {"tp": 2, "dp_shard": 1},
}


def local_bytes(be: TorchBackend) -> tuple[int, int]:
    """(parameter bytes, optimizer-state bytes) this rank holds (local shards)."""
    def size(t: torch.Tensor) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    params = sum(size(p) for p in be.model.parameters())
    state = sum(size(v) for s in be.optimizer.state.values() for v in s.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0)
    return params, state


def grads_and_bytes(path: str, layout: dict, steps: int = 1):
    """Full gradients of one forward/backward of the whole batch split over DP (one micro-batch
    per rank), then ``steps`` AdamW steps: (grads, weights, (param bytes, state bytes))."""
    be = TorchBackend("actor", path, **layout, optim=W.OPT)
    dp = be.dp_size
    rows = [list(range(i, R.make_batch().input_ids.shape[0], dp)) for i in range(dp)]
    mb = [W.BATCH.select(rows[be.dp_rank])]
    be.forward_backward(mb, W.policy(dp), R.TEMPERATURE)
    grads = {k: v.detach().clone() for k, v in be.full_grads()}
    be.optimizer.zero_grad(set_to_none=True)
    for _ in range(steps):
        be.train_step(mb, W.policy(dp), R.TEMPERATURE)
    weights = {k: v.detach().clone() for k, v in be.export_weights()}
    return grads, weights, local_bytes(be)


def max_gap(a: dict, b: dict) -> float:
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def _sp_replicated(mesh, layout):
    """BUG: FSDP over the data-parallel ranks only (the SP group holds whole copies and its
    partial gradients are never summed)."""
    return mesh["dp_shard"]


def _no_replica_reduce(mesh, layout):
    """BUG: hybrid sharding without the replicate dimension (each shard group keeps its own
    gradients: the other data-parallel ranks' parts are never added)."""
    return mesh["dp_shard_in", "ulysses"]._flatten("dp_shard_in_ulysses")


@contextlib.contextmanager
def planted(bad):
    good = backend_mod.fsdp_mesh
    backend_mod.fsdp_mesh = bad
    try:
        yield
    finally:
        backend_mod.fsdp_mesh = good


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", required=True, help="JSON {name: HF folder}")
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    init_distributed(torch.device("cpu"))
    models, work, res = json.loads(a.models), Path(a.work), W.Results()
    path = models["main"]
    for name, layout in LAYOUTS.items():
        W.check_actor(name, path, layout, res, work, dcp=name == "sp2_hsdp")
        if name == "sp2_hsdp":  # saved sharded over the SP pair, loaded sharded over all 4
            W.check_dcp_load("sp2_hsdp_to_sp2", path, LAYOUTS["sp2"], res, work)

    # hybrid vs fully sharded: same gradients and weights; bytes per rank
    ref_grads = R.ref_grads(R.reference_model(path), W.BATCH)
    full = grads_and_bytes(path, {"ulysses": 2}, steps=2)
    for name, layout in (("sp2_hsdp", {"ulysses": 2, "dp_shard": 1}),
                         ("hsdp2", {"dp_shard": 2})):
        g, w, (pb, sb) = grads_and_bytes(path, layout, steps=2)
        res[f"{name}/vs_sp2_grad_gap"] = max_gap(g, full[0])
        res[f"{name}/vs_sp2_weight_gap"] = max_gap(w, full[1])
        res[f"{name}/ref_grad_err"] = R.max_err(g, {k: ref_grads[k] for k in g})
        res[f"{name}/param_bytes"], res[f"{name}/state_bytes"] = pb, sb
    res["sp2/param_bytes"], res["sp2/state_bytes"] = full[2]
    with planted(_sp_replicated):
        g, w, (pb, sb) = grads_and_bytes(path, {"ulysses": 2})
    res["planted_sp_replicated/ref_grad_err"] = R.max_err(g, {k: ref_grads[k] for k in g})
    res["planted_sp_replicated/param_bytes"] = pb
    with planted(_no_replica_reduce):
        g, w, _ = grads_and_bytes(path, {"ulysses": 2, "dp_shard": 1})
    res["planted_no_replica_reduce/ref_grad_err"] = R.max_err(g, {k: ref_grads[k] for k in g})
    total = sum(t.numel() * t.element_size() for t in W.hf_tensors(path).values())
    res["model_bytes"] = total
    res.write_and_destroy(a.out)


if __name__ == "__main__":
    main()
