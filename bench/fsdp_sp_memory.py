"""Bytes per rank of the torch backend's actor under Ulysses sequence parallelism, parameters
sharded over the data-parallel x sequence-parallel ranks vs over the data-parallel ranks only.

    python bench/fsdp_sp_memory.py [--hidden 512] [--layers 4] [--vocab 16384] [--nproc 4]

Each layout runs in a fresh ``torchrun --nproc_per_node=4`` gloo world (fp32, CPU): Ulysses 2 x
DP 2. Per layout: the parameter and AdamW-state bytes each rank holds after one ``train_step``
(local shards; maximum over ranks) and the resident memory (RSS, MiB) at its peak and after the
step (maximum over ranks). Layouts:

- ``dp_x_sp``: ``parallel.ulysses_sequence_parallel_size=2``, ``data_parallel_shard=-1``:
  sharded over all 4 ranks (verl's FSDP mesh spans the SP group the same way);
- ``sp_only``: ``data_parallel_shard=1``: sharded over each SP pair, replicated over DP (hybrid
  sharding; verl's ``fsdp_size=2`` on 4 ranks with Ulysses 2);
- ``dp_only``: the FSDP mesh without the SP ranks (parameters replicated over the SP group):
  what sharding over data-parallel ranks alone would hold. Its gradients are wrong (the SP
  group's partial gradients are not summed); it is measured for the bytes only.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {"dp_x_sp": {"ulysses": 2}, "sp_only": {"ulysses": 2, "dp_shard": 1},
           "dp_only": {"ulysses": 2}}


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def worker(name: str, model: str, out: str) -> None:
    """One rank of ``name``'s layout: build, one train_step, record the bytes."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from megarl.backends.protocol import SequenceBatch
    from megarl.backends.torch import TorchBackend
    from megarl.backends.torch import backend as backend_mod
    from megarl.utils.dist import init_distributed

    torch.set_num_threads(1)
    init_distributed(torch.device("cpu"))
    if name == "dp_only":
        backend_mod.fsdp_mesh = lambda mesh, layout: mesh["dp_shard"]
    be = TorchBackend("actor", model, **LAYOUTS[name], optim={"lr": 1e-5})
    g = torch.Generator().manual_seed(dist.get_rank())
    ids = torch.randint(3, 1000, (2, 64), generator=g)
    batch = SequenceBatch(ids, torch.ones_like(ids), 32, {})

    def loss(out, mb):
        return -out.logprob.mean(), {}

    be.train_step([batch], loss, 1.0)

    def size(t: torch.Tensor) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    row = {
        "param_bytes": sum(size(p) for p in be.model.parameters()),
        "state_bytes": sum(size(v) for s in be.optimizer.state.values() for v in s.values()
                           if isinstance(v, torch.Tensor) and v.dim() > 0),
        "rss_after_mib": _rss_mib(),
        "rss_peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({k: max(r[k] for r in rows) for k in row}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--worker", nargs=3, metavar=("LAYOUT", "MODEL", "OUT"))
    a = ap.parse_args()
    if a.worker:
        worker(*a.worker)
        return
    from megarl.models.testing import make_tiny_hf_model

    with tempfile.TemporaryDirectory() as d:
        model = make_tiny_hf_model(
            Path(d) / "m", "qwen2", tokenizer=False, hidden_size=a.hidden,
            intermediate_size=a.hidden * 11 // 4, num_hidden_layers=a.layers,
            num_attention_heads=8, num_key_value_heads=2, vocab_size=a.vocab)
        total = sum(p.stat().st_size for p in Path(model).glob("*.safetensors"))
        print(f"model: hidden {a.hidden}, {a.layers} layers, vocab {a.vocab}, "
              f"{total / 2**20:.1f} MiB fp32 (safetensors)")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        for name in LAYOUTS:
            out = Path(d) / f"{name}.json"
            subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc_per_node=4", __file__, "--worker", name, str(model), str(out)],
                cwd=ROOT, env=env, check=True, capture_output=True)
            r = json.loads(out.read_text())
            print(f"{name:8s} params {r['param_bytes'] / 2**20:7.2f} MiB  AdamW state "
                  f"{r['state_bytes'] / 2**20:7.2f} MiB  RSS peak {r['rss_peak_mib']:7.1f} MiB  "
                  f"after step {r['rss_after_mib']:7.1f} MiB")


if __name__ == "__main__":
    main()
