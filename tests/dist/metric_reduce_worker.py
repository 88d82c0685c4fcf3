"""Worker (2 gloo ranks) of tests/backends/test_metric_reduce.py: the ranks report metrics with
DIFFERENT keys, and each case records what every rank put in and what every rank got back.

    torchrun --standalone --nproc_per_node=2 tests/dist/metric_reduce_worker.py MODELS OUT

Cases (values are dyadic rationals, so every sum and halving is exact in float64):
- ``dp_same_count`` / ``dp_diff_count``: `reduce_metrics` over DP=2 of per-rank sums with the
  same number of keys under different names, and with different numbers of keys;
- ``pp``: `reduce_metrics` over a pipeline group of 2 (the last stage's sums win);
- ``torch`` / ``megatron``: one ``train_step`` of each backend (actor, DP=2, two micro-batches
  per rank) whose loss function reports rank- and micro-batch-dependent keys; the recorded
  inputs are the loss values and metrics each micro-batch returned.

Rank 0 writes {case: {"inputs": [per rank: list of dicts], "outputs": [per rank: dict]}} to
OUT/results.json after every case (a later case that hangs leaves the earlier ones readable).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megarl.backends.metrics import reduce_metrics  # noqa: E402
from megarl.backends.protocol import SequenceBatch  # noqa: E402
from megarl.utils.dist import destroy, init_distributed  # noqa: E402

# per-rank sums of the direct cases
DIRECT = {
    "dp_same_count": [{"loss": 1.5, "a": 0.25, "c": 3.0}, {"loss": 0.5, "b": 2.0, "c": -1.25}],
    "dp_diff_count": [{"loss": 1.5, "a": 0.25}, {"loss": 0.5, "b": 2.0, "c": -1.25, "d": 8.0}],
    "pp": [{"loss": 9.0, "first_stage_only": 1.0}, {"loss": 0.75, "z": -0.5}],
}


def loss_metrics(rank: int, mb: int) -> tuple[float, dict[str, float]]:
    """(loss value, metrics) a loss function reports on micro-batch ``mb`` of ``rank``: a
    shared key, a key of this rank only, and on rank 1's second micro-batch one more key."""
    metrics = {"shared": 0.25 * (rank + 1) + 0.5 * mb, f"rank{rank}_only": 1.0 + 2.0 * mb}
    if rank == 1 and mb == 1:
        metrics["late"] = -3.5
    return 0.125 * (2 * rank + mb + 1), metrics


def micro_batches(rank: int) -> list[SequenceBatch]:
    g = torch.Generator().manual_seed(rank)
    return [SequenceBatch(torch.randint(3, 100, (2, 7), generator=g),
                          torch.ones(2, 7, dtype=torch.long), 3) for _ in range(2)]


def train_case(backend, rank: int) -> tuple[list[dict], dict]:
    seen: list[dict] = []

    def loss_fn(outputs, mb):
        i = len(seen)
        value, metrics = loss_metrics(rank, i)
        seen.append({"loss": value, **metrics})
        return outputs.logprob.sum() * 0.0 + value, metrics

    out = backend.train_step(micro_batches(rank), loss_fn)
    return seen, out


def main() -> None:
    models, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
    torch.set_num_threads(1)
    init_distributed(torch.device("cpu"))
    rank = dist.get_rank()
    results: dict = {}

    def record(case: str, inputs, output) -> None:
        both: list = [None, None]
        dist.all_gather_object(both, {"inputs": inputs, "outputs": output})
        results[case] = {"inputs": [b["inputs"] for b in both],
                         "outputs": [b["outputs"] for b in both]}
        if rank == 0:
            tmp = out_dir / "results.json.tmp"
            tmp.write_text(json.dumps(results, indent=1))
            os.replace(tmp, out_dir / "results.json")

    for case in ("dp_same_count", "dp_diff_count"):
        sums = DIRECT[case][rank]
        record(case, [sums], reduce_metrics(sums, dist.group.WORLD))
    sums = DIRECT["pp"][rank]
    record("pp", [sums], reduce_metrics(sums, None, dist.group.WORLD))

    from megarl.backends.torch import TorchBackend

    backend = TorchBackend("actor", str(models / "llama"), optim={"lr": 1e-3}, device="cpu")
    assert backend.dp_size == 2
    record("torch", *train_case(backend, rank))

    from megarl.backends.megatron import MegatronBackend

    backend = MegatronBackend("actor", str(models / "llama"), dtype="fp32", spec="local",
                              optim={"lr": 1e-3})
    assert backend.dp_size == 2
    record("megatron", *train_case(backend, rank))
    dist.barrier()
    destroy()


if __name__ == "__main__":
    main()
