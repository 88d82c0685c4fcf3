"""TorchBackend on mixture-of-experts models under FSDP2 (2 gloo ranks), against the plain
single-process model of ``torch_backend_ref`` (itself checked against transformers in
tests/models/test_moe_vs_hf.py). Launched by tests/backends/test_torch_backend_moe_dist.py:

    torchrun --standalone --nproc_per_node=2 tests/dist/torch_backend_moe_worker.py \
        --models JSON --work DIR --out results.json

Per model: the actor checks of ``torch_backend_worker.check_actor`` (export exact, logprobs,
gradients of unequal micro-batches, train/no-grad bit identity, 3 AdamW steps), the backend's
routing metrics against the reference model's router logits on the padded batch, and the
refusal of TP=2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch_backend_ref as R  # noqa: E402
import torch_backend_worker as W  # noqa: E402

from megarl.backends.torch import TorchBackend  # noqa: E402
from megarl.backends.torch.moe import routing_metrics  # noqa: E402
from megarl.errors import UserInputError  # noqa: E402
from megarl.models.moe import capture_router_logits  # noqa: E402
from megarl.models.moe_metrics import routing_metrics as ref_routing_metrics  # noqa: E402
from megarl.utils.dist import init_distributed  # noqa: E402


def check_metrics(name: str, path: str, res: W.Results) -> None:
    be = TorchBackend("actor", path, dp_shard=2, optim=W.OPT)
    got = routing_metrics(be, W.BATCH)
    ref = R.reference_model(path)
    with torch.no_grad(), capture_router_logits(ref) as router:
        R.ref_logits(ref, W.BATCH)
    a = ref.args
    want = ref_routing_metrics(router, a.num_experts, a.num_experts_per_tok,
                               W.BATCH.attention_mask)
    res[f"{name}/metrics_keys"] = sorted(got) == sorted(want) and len(got) > 3
    res[f"{name}/metrics_err"] = max(abs(got[k] - want[k]) for k in want)
    res[f"{name}/load_sum_ok"] = got["moe/layer_0/load_mean"] * a.num_experts == (
        a.num_experts_per_tok * float(W.BATCH.attention_mask.sum())
    )


def check_tp_refused(name: str, path: str, res: W.Results) -> None:
    try:
        TorchBackend("actor", path, tp=2, optim=W.OPT)
        res[f"{name}/tp_error"] = "no error"
    except UserInputError as e:
        res[f"{name}/tp_error"] = str(e)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", required=True, help="JSON {name: HF folder}")
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    init_distributed(torch.device("cpu"))
    res = W.Results()
    for name, path in json.loads(a.models).items():
        W.check_actor(f"{name}_fsdp2", path, {"dp_shard": 2}, res, Path(a.work))
        check_metrics(name, path, res)
        check_tp_refused(name, path, res)
    res.write_and_destroy(a.out)


if __name__ == "__main__":
    main()
