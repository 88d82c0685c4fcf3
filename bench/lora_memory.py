"""Host memory of the actor + reference, full fine-tuning vs LoRA (torch backend, fp32, CPU).

    python bench/lora_memory.py [--hidden 1024] [--layers 4] [--rank 8]

Each mode runs in a fresh process (a world of one): build the actor and the reference (full: a
second frozen backend of the same folder; LoRA: the actor with its adapters off), one
``train_step`` (gradients and AdamW state exist), one reference ``logprobs`` and one pass over
``export_weights`` (the stream an engine receives). Printed per mode: the resident memory
(RSS, MiB) above the process's before the first backend, after each of these phases and at
most; the trainable parameters, the optimizer-state bytes, and the bytes of the weight stream
(LoRA: merged weights, the same size as the full model's) and of the adapters. RSS counts the
weights read from the safetensors file only once they are touched (the file is mapped).
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


def measure(mode: str, model: str, rank: int) -> dict:
    import torch

    from megarl.backends.protocol import SequenceBatch
    from megarl.backends.torch import TorchBackend
    from megarl.backends.torch.lora_reference import AdapterOffReference
    from megarl.models.lora import LoraSettings
    from megarl.utils.dist import init_distributed

    init_distributed(torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 128, (2, 32), generator=g)  # few tokens: the weights dominate
    batch = SequenceBatch(ids, torch.ones_like(ids), 16, {"adv": torch.randn(2, 16, generator=g)})

    def loss_fn(out, mb):
        return -(out.logprob * mb.tensors["adv"]).mean(), {}

    before = _rss_mib()
    phases = {}
    lora = LoraSettings(rank=rank, alpha=2.0 * rank) if mode == "lora" else None
    actor = TorchBackend("actor", model, device="cpu", dtype="fp32", use_fused_kernels=False,
                         lora=lora)
    if lora is None:
        ref = TorchBackend("ref", model, device="cpu", dtype="fp32", use_fused_kernels=False)
    else:
        ref = AdapterOffReference(actor, forward_max_tokens=16384, forward_micro_batch_size=None)
    phases["built"] = _rss_mib() - before
    actor.train_step([batch], loss_fn)
    phases["train_step"] = _rss_mib() - before
    ref.logprobs(batch)
    phases["ref_logprobs"] = _rss_mib() - before
    sent = sum(t.numel() * t.element_size() for _, t in actor.export_weights())
    phases["export"] = _rss_mib() - before
    adapter = sum(t.numel() * t.element_size() for _, t in actor.export_adapter())
    state = sum(v.numel() * v.element_size() for s in actor.optimizer.state.values()
                for v in s.values() if isinstance(v, torch.Tensor))
    trainable = sum(p.numel() for p in actor.model.parameters() if p.requires_grad)
    return {"mode": mode, **{f"rss_{k}_mib": round(v, 1) for k, v in phases.items()},
            "rss_max_mib": round(max(phases.values()), 1),
            "trainable_params": trainable, "optimizer_state_bytes": state,
            "weights_sent_bytes": sent, "adapter_bytes": adapter}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--child", nargs=2, metavar=("MODE", "MODEL"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], args.child[1], args.rank)))
        return
    from megarl.models.testing import make_tiny_hf_model

    with tempfile.TemporaryDirectory() as d:
        model = make_tiny_hf_model(Path(d) / "m", "qwen2", tokenizer=False,
                                   hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                                   num_hidden_layers=args.layers, num_attention_heads=8,
                                   num_key_value_heads=2)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        rows = []
        for mode in ("full", "lora"):
            out = subprocess.run([sys.executable, __file__, "--rank", str(args.rank),
                                  "--child", mode, str(model)], env=env, capture_output=True,
                                 text=True, check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"qwen2, hidden {args.hidden}, {args.layers} layers, LoRA rank {args.rank} all-linear")
    print_table(rows)


if __name__ == "__main__":
    main()
