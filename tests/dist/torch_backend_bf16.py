"""TorchBackend in bf16 (bf16 compute, fp32 masters) against transformers run in bf16 on the
same weights: the padded batch of ``torch_backend_ref.make_batch`` under one layout per call.
Launched by tests/backends/test_torch_backend_bf16.py:

    torchrun --standalone --nproc_per_node=2 tests/dist/torch_backend_bf16.py MODEL OUT.json
    python tests/dist/torch_backend_bf16.py MODEL OUT.json          (a world of one)

Rank 0 writes {layout: {"lp_max", "lp_mean", "grad_rel", "planted": {...}}}: the backend's
logprobs minus the reference's (max / mean |diff|), the global relative L2 of the gradients,
and the same measures for planted bugs applied to the reference (temperature 1.05 T; a
normaliser over half the vocabulary, as a TP shard's own logsumexp would give).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch_backend_ref as R  # noqa: E402

from megarl.backends.torch import TorchBackend  # noqa: E402
from megarl.utils.dist import destroy, init_distributed  # noqa: E402

BATCH = R.make_batch()
TOTAL = float(BATCH.tensors["mask"].sum())
LAYOUTS = {1: {"single": {}}, 2: {"fsdp2": {"dp_shard": 2}, "tp2": {"tp": 2}, "pp2": {"pp": 2}}}


def hf_bf16(path: str):
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()


def hf_logprob(hf, temperature: float, half_vocab: bool = False) -> torch.Tensor:
    """[B, L] float64 logprobs of the response tokens from transformers' bf16 logits
    (positions cumsum(mask) - 1, as the backend), 0 outside the response; with grad."""
    ids, mask, L = BATCH.input_ids, BATCH.attention_mask, BATCH.response_length
    P = ids.shape[1] - L
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    z = hf(ids, attention_mask=mask, position_ids=pos).logits[:, P - 1:-1].double() / temperature
    if half_vocab:  # planted: normalise over the first half of the vocabulary only
        logp = z - torch.logsumexp(z[..., : z.shape[-1] // 2], -1, keepdim=True)
    else:
        logp = torch.log_softmax(z, -1)
    return logp.gather(-1, ids[:, P:, None])[..., 0] * mask[:, P:]


def hf_grads(hf, temperature: float) -> dict[str, torch.Tensor]:
    """Gradients of the policy loss (entropy term left out on both sides) in transformers'
    bf16 autograd, as float64."""
    hf.zero_grad(set_to_none=True)
    m = BATCH.tensors["mask"].double()
    lp = hf_logprob(hf, temperature)
    (-(lp * BATCH.tensors["adv"].double()) * m).sum().div(TOTAL).backward()
    return {n: p.grad.double() for n, p in hf.named_parameters()}


def loss_fn(dp: int):
    def fn(out, mb):
        m = mb.tensors["mask"]
        loss = (-(out.logprob * mb.tensors["adv"]) * m).sum() / TOTAL * dp
        return loss, {}

    return fn


def rel_l2(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    num = sum(float((got[k].double() - want[k]).pow(2).sum()) for k in want)
    den = sum(float(want[k].pow(2).sum()) for k in want)
    return math.sqrt(num / den)


def diff(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    m = BATCH.attention_mask[:, -BATCH.response_length:].bool()
    d = (a.double() - b.double()).abs()[m]
    return {"lp_max": float(d.max()), "lp_mean": float(d.mean())}


def check(path: str, layout: dict) -> dict:
    T = R.TEMPERATURE
    be = TorchBackend("actor", path, dtype="bf16", optim={"lr": 1e-3}, **layout)
    lp, _ = be.logprobs(BATCH, T)
    hf = hf_bf16(path)
    with torch.no_grad():
        ref = hf_logprob(hf, T)
        planted = {"temperature_1.05": diff(hf_logprob(hf, 1.05 * T), ref),
                   "half_vocab": diff(hf_logprob(hf, T, half_vocab=True), ref)}
    rows = range(BATCH.input_ids.shape[0])
    mine = [r for r in rows if r % be.dp_size == be.dp_rank]
    be.forward_backward([BATCH.select(mine)], loss_fn(be.dp_size), T)
    grads = dict(be.full_grads())
    want = hf_grads(hf, T)
    planted["temperature_1.05"]["grad_rel"] = rel_l2(hf_grads(hf, 1.05 * T), want)
    return {**diff(lp, ref), "grad_rel": rel_l2(grads, want), "planted": planted}


def main() -> None:
    model, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    init_distributed(torch.device("cpu"))
    results = {name: check(model, layout)
               for name, layout in LAYOUTS[dist.get_world_size()].items()}
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, results)
    if dist.get_rank() == 0:
        merged = {name: {k: max(p[name][k] for p in parts) for k in ("lp_max", "lp_mean",
                                                                     "grad_rel")}
                  | {"planted": parts[0][name]["planted"]} for name in results}
        out.write_text(json.dumps(merged, indent=1))
    dist.barrier()
    destroy()


if __name__ == "__main__":
    main()
