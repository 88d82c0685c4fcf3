"""Checks of megarl.backends.torch.TorchBackend under one parallel layout per section, against
the plain single-process references of ``torch_backend_ref``. Launched by
tests/backends/test_torch_backend_dist.py:

    torchrun --standalone --nproc_per_node=N tests/dist/torch_backend_worker.py SCENARIO \
        --models DIR --work DIR --out results.json
    python tests/dist/torch_backend_worker.py single ...      (a world of one)

Rank 0 writes {check name: value} (errors as floats, max over ranks; flags as bools, all over
ranks); the pytest side asserts on them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch_backend_ref as R  # noqa: E402
from fp32_bounds import bound_ratio  # noqa: E402  (tests/ is on the path through R)

from megarl.backends.torch import TorchBackend, interleave_rank_splits  # noqa: E402
from megarl.utils.dist import destroy, init_distributed  # noqa: E402

# eps 1e-6: with 1e-8 Adam amplifies fp32 reduction-order noise of ~1e-7 gradients past 1e-5
OPT = {"lr": 1e-3, "eps": 1e-6, "grad_clip": 1.0, "weight_decay": 0.01}
BATCH = R.make_batch()
TOTAL = float(BATCH.tensors["mask"].sum())


class Results:
    def __init__(self) -> None:
        self.values: dict[str, object] = {}

    def __setitem__(self, key: str, value) -> None:
        self.values[key] = value

    def merged(self) -> dict[str, object]:
        parts: list = [None] * dist.get_world_size()
        dist.all_gather_object(parts, self.values)
        out: dict[str, object] = {}
        for part in parts:
            for k, v in part.items():
                if isinstance(v, bool):
                    out[k] = bool(out.get(k, True)) and v
                elif isinstance(v, (int, float)):
                    v = float(v) if math.isfinite(v) else str(v)
                    out[k] = v if k not in out or isinstance(v, str) else max(out[k], v)
                else:
                    out[k] = v
        return out

    def write_and_destroy(self, out: str) -> None:
        """Every rank's results merged into ``out`` (JSON, written by rank 0), then the
        process group torn down."""
        merged = self.merged()
        if dist.get_rank() == 0:
            with open(out, "w", encoding="utf-8") as f:
                json.dump(merged, f, indent=1, sort_keys=True)
        dist.barrier()
        destroy()


def rank_split(dp: int) -> list[list[list[int]]]:
    """Rows of each DP rank's micro-batches (3 unequal micro-batches on one rank)."""
    if dp == 1:
        return [[[0, 1], [2], [3, 4, 5]]]
    if dp == 2:
        return [[[0], [1, 2]], [[3, 4], [5]]]
    raise ValueError(dp)


def micro(be: TorchBackend):
    split = rank_split(be.dp_size)
    return split, [BATCH.select(rows) for rows in split[be.dp_rank]]


def hf_tensors(path: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(path, "model.safetensors"))


def exact(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def policy(dp: int, captured: list | None = None):
    def fn(out, mb):
        if captured is not None:
            captured.append(out.logprob.detach().clone())
        return R.policy_loss(out, mb, TOTAL, dp)

    return fn


def check_actor(name: str, path: str, layout: dict, res: Results, work: Path,
                dcp: bool = False) -> None:
    be = TorchBackend("actor", path, **layout, optim=OPT)
    hf = hf_tensors(path)
    exported = dict(be.export_weights())
    res[f"{name}/export_exact"] = exact(exported, hf)

    ref = R.reference_model(path)
    lp, ent = be.logprobs(BATCH, R.TEMPERATURE, with_entropy=True)
    rlp, rent = R.ref_logprob_entropy(ref, BATCH)
    res[f"{name}/logprob_err"] = float((lp.double() - rlp).abs().max())
    res[f"{name}/entropy_err"] = float((ent.double() - rent).abs().max())

    split, mbs = micro(be)
    captured: list = []
    metrics = be.forward_backward(mbs, policy(be.dp_size, captured), R.TEMPERATURE)
    grads = dict(be.full_grads())
    res[f"{name}/grad_err"] = R.max_err(grads, {k: v for k, v in R.ref_grads(ref, BATCH).items()
                                                if k in grads})
    res[f"{name}/tokens_metric_err"] = abs(metrics["tokens"] - 1.0)
    lp2, _ = be.logprobs(BATCH, R.TEMPERATURE, micro_batches=interleave_rank_splits(split))
    if captured:  # last pipeline stage: train forward == no-grad forward, bit for bit
        res[f"{name}/bit_identical"] = all(
            torch.equal(lp2[rows], c) for rows, c in zip(split[be.dp_rank], captured)
        )
    be.optimizer.zero_grad(set_to_none=True)

    norms, steps = [], []
    for _ in range(3):
        norms.append(be.train_step(mbs, policy(be.dp_size), R.TEMPERATURE)["grad_norm"])
        steps.append({k: v.detach().clone() for k, v in be.export_weights()})
    after = steps[-1]
    ref_state, ref_norms, norm_bounds, bound = R.ref_adamw_bound(path, BATCH, steps, **OPT)
    res[f"{name}/adamw3_err"] = R.max_err(after, {k: ref_state[k] for k in after})
    res[f"{name}/adamw3_ratio"] = bound_ratio(after, {k: ref_state[k] for k in after},
                                              {k: bound[k] for k in after})
    gaps = [abs(a - b) for a, b in zip(norms, ref_norms)]
    res[f"{name}/grad_norm_err"] = max(gaps)
    res[f"{name}/grad_norm_ratio"] = max(g / b for g, b in zip(gaps, norm_bounds))
    res[f"{name}/step"] = be.step
    if dcp:
        check_dcp_save(be, mbs, work)


def check_dcp_save(be: TorchBackend, mbs, work: Path) -> None:
    """Save at this layout, then record the state's logprobs and the weights after one more
    step (the uninterrupted run) for the loading side."""
    lp, _ = be.logprobs(BATCH, R.TEMPERATURE)
    be.save(str(work / "ckpt"))
    be.train_step(mbs, policy(be.dp_size), R.TEMPERATURE)
    after = dict(be.export_weights())
    if dist.get_rank() == 0:
        torch.save({"lp": lp, "weights": after, "step": be.step}, work / "uninterrupted.pt")
    dist.barrier()


def check_dcp_load(name: str, path: str, layout: dict, res: Results, work: Path) -> None:
    saved = torch.load(work / "uninterrupted.pt", weights_only=True)
    be = TorchBackend("actor", path, **layout, optim=OPT)
    be.load(str(work / "ckpt"))
    lp, _ = be.logprobs(BATCH, R.TEMPERATURE)
    res[f"{name}/dcp_logprob_err"] = float((lp - saved["lp"]).abs().max())
    _, mbs = micro(be)
    be.train_step(mbs, policy(be.dp_size), R.TEMPERATURE)
    res[f"{name}/dcp_next_step_err"] = R.max_err(dict(be.export_weights()), saved["weights"])
    res[f"{name}/dcp_step_ok"] = be.step == saved["step"]


def check_critic(name: str, path: str, layout: dict, res: Results) -> None:
    be = TorchBackend("critic", path, **layout, optim=OPT)
    ref = R.reference_model(path, head="token_cls", num_labels=1)
    res[f"{name}/values_err"] = float((be.values(BATCH) - R.ref_values(ref, BATCH)).abs().max())
    _, mbs = micro(be)
    be.forward_backward(mbs, lambda o, mb: R.value_loss(o, mb, TOTAL, be.dp_size))
    grads = dict(be.full_grads())
    res[f"{name}/grad_err"] = R.max_err(grads, R.ref_grads(ref, BATCH, kind="value"))


def check_prm(name: str, path: str, layout: dict, res: Results) -> None:
    be = TorchBackend("prm", path, **layout)
    ref = R.reference_model(path, head="token_cls")
    err = (be.token_scores(BATCH) - R.ref_scores(ref, BATCH)).abs().max()
    res[f"{name}/scores_err"] = float(err)


def check_ref(name: str, path: str, layout: dict, res: Results) -> None:
    """The frozen LM role (no optimizer, no gradients) under ``layout``."""
    be = TorchBackend("ref", path, **layout)
    lp, _ = be.logprobs(BATCH, R.TEMPERATURE)
    rlp, _ = R.ref_logprob_entropy(R.reference_model(path), BATCH)
    res[f"{name}/logprob_err"] = float((lp.double() - rlp).abs().max())
    res[f"{name}/frozen"] = be.optimizer is None and not any(
        p.requires_grad for p in be.model.parameters()
    )


def check_bf16(name: str, path: str, layout: dict, res: Results) -> None:
    """bf16 mixed precision (bf16 compute, fp32 masters): close to the fp32 reference."""
    be = TorchBackend("actor", path, dtype="bf16", **layout, optim=OPT)
    ref = R.reference_model(path)
    lp, _ = be.logprobs(BATCH, R.TEMPERATURE)
    rlp, _ = R.ref_logprob_entropy(ref, BATCH)
    res[f"{name}/bf16_logprob_diff"] = float((lp.double() - rlp).abs().max())
    _, mbs = micro(be)
    be.forward_backward(mbs, policy(be.dp_size), R.TEMPERATURE)
    grads = dict(be.full_grads())
    rg = R.ref_grads(ref, BATCH)
    num = sum(float((grads[k].double() - rg[k].double()).pow(2).sum()) for k in grads)
    den = sum(float(rg[k].double().pow(2).sum()) for k in grads)
    res[f"{name}/bf16_grad_rel_diff"] = math.sqrt(num / den)
    be.optimizer.zero_grad(set_to_none=True)
    m = be.train_step(mbs, policy(be.dp_size), R.TEMPERATURE)
    exported = dict(be.export_weights())
    res[f"{name}/bf16_trains"] = m["skipped"] == 0.0 and all(
        t.dtype == torch.float32 for t in exported.values()
    )


def check_skip(name: str, path: str, layout: dict, res: Results) -> None:
    be = TorchBackend("actor", path, **layout, optim=OPT)
    before = dict(be.export_weights())
    _, mbs = micro(be)

    def nan_loss(out, mb):
        loss, m = R.policy_loss(out, mb, TOTAL, be.dp_size)
        return loss * float("nan"), m

    m = be.train_step(mbs, nan_loss, R.TEMPERATURE)
    res[f"{name}/skipped"] = m["skipped"] == 1.0 and be.step == 0
    res[f"{name}/unchanged"] = exact(dict(be.export_weights()), before)
    m = be.train_step(mbs, policy(be.dp_size), R.TEMPERATURE)
    res[f"{name}/recovers"] = m["skipped"] == 0.0 and be.step == 1


def scenario_two(models: dict, work: Path, res: Results) -> None:
    main = models["main"]
    check_actor("tp2", main, {"tp": 2}, res, work, dcp=True)
    check_dcp_load("tp2_to_fsdp2", main, {"dp_shard": 2}, res, work)
    check_dcp_load("tp2_to_pp2", main, {"pp": 2}, res, work)
    check_actor("tp2_sp", main, {"tp": 2, "sp": True}, res, work)
    check_actor("tp2_naive", main, {"tp": 2, "use_fused_kernels": False}, res, work)
    check_actor("fsdp2_ac", main, {"dp_shard": 2, "activation_checkpointing": True}, res, work)
    check_actor("pp2", main, {"pp": 2}, res, work)
    check_actor("tp2_tied", models["tied"], {"tp": 2}, res, work)
    check_critic("critic_tp2_sp", models["critic"], {"tp": 2, "sp": True}, res)
    check_critic("critic_fsdp2", models["critic"], {"dp_shard": 2}, res)
    check_critic("critic_pp2", models["critic"], {"pp": 2}, res)
    check_prm("prm_pp2", models["prm"], {"pp": 2}, res)
    check_prm("prm_tp2", models["prm"], {"tp": 2}, res)
    check_prm("prm_fsdp2", models["prm"], {"dp_shard": 2}, res)
    check_ref("ref_fsdp2", main, {"dp_shard": 2}, res)
    check_bf16("fsdp2", main, {"dp_shard": 2}, res)
    check_bf16("tp2", main, {"tp": 2}, res)
    check_bf16("pp2", main, {"pp": 2}, res)
    check_skip("skip_fsdp2", main, {"dp_shard": 2}, res)


def scenario_four(models: dict, work: Path, res: Results) -> None:
    main = models["main"]
    check_actor("tp2_fsdp2", main, {"tp": 2, "dp_shard": 2}, res, work)
    check_actor("pp2_fsdp2", main, {"pp": 2, "dp_shard": 2}, res, work)
    check_actor("tp2_sp_pp2", main, {"tp": 2, "sp": True, "pp": 2}, res, work)


def scenario_single(models: dict, work: Path, res: Results) -> None:
    from torch_backend_single import run_single

    run_single(models, work, res)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", choices=["two", "four", "single"])
    ap.add_argument("--models", required=True, help="JSON {name: HF folder}")
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    init_distributed(torch.device("cpu"))
    res = Results()
    {"two": scenario_two, "four": scenario_four, "single": scenario_single}[a.scenario](
        json.loads(a.models), Path(a.work), res
    )
    res.write_and_destroy(a.out)


if __name__ == "__main__":
    main()
