"""TorchBackend with Ulysses sequence parallelism (2 gloo ranks, one sequence-parallel group)
against the plain single-process model of ``torch_backend_ref`` (padded batch, autograd on the
whole batch: SP=1 on one rank) and transformers in float64. Launched by
tests/backends/test_torch_backend_ulysses_dist.py:

    torchrun --standalone --nproc_per_node=2 tests/dist/torch_backend_ulysses_worker.py \
        --models JSON --work DIR --out results.json

Sections (rank 0 writes {check: value}; errors are maxima over ranks):
  actor layouts   ``check_actor`` of torch_backend_worker (export, logprobs, entropy, gradients
                  of 3 unequal micro-batches, train/no-grad bit identity, 3 AdamW steps) for
                  qwen2 (4 heads, 2 KV heads), qwen2 with 1 KV head (< SP: repeated), qwen3 with
                  q/k norms and attention bias, and qwen2 with activation checkpointing;
  hf64            SP=2 logprobs / entropy against transformers' AutoModelForCausalLM (float64);
  dcp             saved at SP=2 after 3 steps, loaded at FSDP=2: same logprobs, and one more
                  step equals the uninterrupted SP=2 run;
  roles           critic values + gradients, PRM scores, frozen reference logprobs;
  refusals        heads not divisible by SP; SP with TP=2;
  planted/*       the same checks with one bug planted each (see `PLANTS`): the test asserts
                  they fail by a wide margin.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch_backend_ref as R  # noqa: E402
import torch_backend_worker as W  # noqa: E402
from torch_backend_single import hf_logits, hf_reference  # noqa: E402

from megarl.backends.torch import TorchBackend  # noqa: E402
from megarl.backends.torch import backend as backend_mod  # noqa: E402
from megarl.backends.torch import ulysses as U  # noqa: E402
from megarl.errors import UserInputError  # noqa: E402
from megarl.models.model import default_position_ids  # noqa: E402
from megarl.utils import dist as group_ops  # noqa: E402
from megarl.utils.dist import init_distributed  # noqa: E402

SP2 = {"ulysses": 2}


def check_hf64(name: str, path: str, res: W.Results) -> None:
    """SP=2 logprobs / entropy against transformers' own model in float64."""
    be = TorchBackend("actor", path, **SP2, optim=W.OPT)
    lp, ent = be.logprobs(W.BATCH, R.TEMPERATURE, with_entropy=True)
    L = W.BATCH.response_length
    P = W.BATCH.input_ids.shape[1] - L
    resp = W.BATCH.attention_mask[:, P:].double()
    logits = hf_logits(hf_reference(path, "lm"), W.BATCH)[:, P - 1 : -1] / R.TEMPERATURE
    logp = torch.log_softmax(logits, -1)
    hlp = logp.gather(-1, W.BATCH.input_ids[:, P:, None])[..., 0] * resp
    hent = -(logp.exp() * logp).sum(-1) * resp
    res[f"{name}/logprob_err"] = float((lp.double() - hlp).abs().max())
    res[f"{name}/entropy_err"] = float((ent.double() - hent).abs().max())


def check_refusals(models: dict, res: W.Results) -> None:
    for key, path, kw in (("heads3", models["heads3"], SP2),
                          ("tp2", models["qwen2"], {"ulysses": 2, "tp": 2})):
        try:
            TorchBackend("actor", path, **kw, optim=W.OPT)
            res[f"refuse/{key}"] = "no error"
        except UserInputError as e:
            res[f"refuse/{key}"] = str(e)


# --------------------------------------------------------------------------------------------
# Planted bugs: each swaps one piece of the implementation for a wrong one.
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _patched(obj, name: str, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def _local_positions(self, p):
    """BUG: positions recomputed from the shard's own segments (a sequence cut by the shard
    boundary restarts at 0 on the second rank) instead of the packed row's."""
    kw = _GOOD_INPUTS(self, p)
    start, t = self.span(p)
    seg = p.segment_ids[:, start : start + t]
    kw["position_ids"] = default_position_ids(tuple(seg.shape), seg.device, None, seg)
    return kw


def _fsdp_mean_over_sp(model, mesh, *, gradient_divide_factor=None, **kw):
    """BUG: FSDP averages the gradients over DP x SP (the group's parts are halved)."""
    return _GOOD_FSDP(model, mesh, **kw)


class _ReduceInBackward(torch.autograd.Function):
    """BUG: the heads' sum also all-reduces the gradient (each part counted U times)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


_GOOD_INPUTS = U.SeqShard.model_inputs
_GOOD_FSDP = backend_mod.par.apply_fsdp
PLANTS = {
    "local_positions": (U.SeqShard, "model_inputs", _local_positions),
    "mean_over_sp": (backend_mod.par, "apply_fsdp", _fsdp_mean_over_sp),
    "grad_allreduce": (group_ops, "_SumOverGroup", _ReduceInBackward),
}


def check_planted(path: str, res: W.Results, work: Path) -> None:
    for plant, (obj, name, value) in PLANTS.items():
        with _patched(obj, name, value):
            W.check_actor(f"planted_{plant}", path, SP2, res, work)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", required=True, help="JSON {name: HF folder}")
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    init_distributed(torch.device("cpu"))
    models, work, res = json.loads(a.models), Path(a.work), W.Results()
    for name in ("qwen2", "kv1", "qwen3"):
        W.check_actor(f"{name}_sp2", models[name], SP2, res, work, dcp=name == "qwen2")
    W.check_dcp_load("sp2_to_fsdp2", models["qwen2"], {"dp_shard": 2}, res, work)
    W.check_actor("qwen2_sp2_ac", models["qwen2"], {**SP2, "activation_checkpointing": True},
                  res, work)
    check_hf64("hf64_sp2", models["qwen2"], res)
    W.check_critic("critic_sp2", models["critic"], SP2, res)
    W.check_prm("prm_sp2", models["prm"], SP2, res)
    W.check_ref("ref_sp2", models["qwen2"], SP2, res)
    check_refusals(models, res)
    check_planted(models["qwen2"], res, work)
    res.write_and_destroy(a.out)


if __name__ == "__main__":
    main()
