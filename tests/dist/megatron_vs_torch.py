"""Worker (2 ranks): the megatron backend against the torch backend at the same parallel
layout, on the same HF weights, with the same loss and the same AdamW settings
(`mcore_testlib.VS_OPTIM`): TP=2 (qwen2 with biases), TP=2 + SP (llama, tied head, GQA), then
PP=2 (qwen3 with q/k norms, one layer per stage; the torch backend refuses a tied head under
PP).

Per case it records (rank 0, JSON): per-token logprobs and entropies, and the gradients of one
step (HF names, gathered in full), both backends against each other (and each against
transformers in float64, for scale); the weights after two AdamW steps, each against the
other's; the grad norms; and both optimizers' hyperparameters as they stand after the steps.

usage: torchrun --standalone --nproc_per_node=2 tests/dist/megatron_vs_torch.py ROOT RESULTS
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "megatron"))

import mcore_testlib as lib  # noqa: E402

CASES = (  # (key, zoo model, layout)
    ("tp2", "qwen2_bias", {"tp": 2}),
    ("tp2_sp", "llama_tied_gqa", {"tp": 2, "sp": True}),
    ("pp2", "qwen3_qknorm", {"pp": 2}),
)


def hyperparameters(optimizer) -> list[dict]:
    """(class, lr, betas, eps, weight_decay, amsgrad, maximize) of every torch param group
    under ``optimizer`` (megatron's wrappers unwrapped to the torch optimizer inside)."""
    subs = getattr(optimizer, "chained_optimizers", [optimizer])
    out = []
    for sub in subs:
        inner = getattr(sub, "optimizer", sub)
        for g in inner.param_groups:
            out.append({
                "class": type(inner).__name__, "lr": g["lr"], "betas": list(g["betas"]),
                "eps": g["eps"], "weight_decay": g["weight_decay"],
                "amsgrad": g.get("amsgrad", False), "maximize": g.get("maximize", False),
            })
    return out


def weights_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))
    return max(lib.max_diff(a[k], b[k]) for k in a)


def grads_diff(a: dict, b: dict) -> tuple[float, float]:
    """(max abs diff, max over tensors of abs diff / the reference tensor's largest entry)."""
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))
    return (max(lib.max_diff(a[k], b[k]) for k in a), max(lib.rel_diff(a[k], b[k]) for k in a))


def compare(res: dict, key: str, name: str, layout: dict) -> None:
    import torch

    from megarl.backends.megatron import MegatronBackend
    from megarl.backends.torch import TorchBackend

    path = lib.zoo_model(Path(sys.argv[1]), name)
    mega = MegatronBackend("actor", str(path), **layout, optim=lib.VS_OPTIM)
    tor = TorchBackend("actor", str(path), **layout, optim=lib.VS_OPTIM)
    hf = lib.hf_model(path)

    batch = lib.vs_batch(0)
    ref_lp, ref_ent, _ = lib.hf_logprobs(hf, batch, temperature=lib.VS_TEMPERATURE)
    m_lp, m_ent = mega.logprobs(batch, lib.VS_TEMPERATURE, with_entropy=True)
    t_lp, t_ent = tor.logprobs(batch, lib.VS_TEMPERATURE, with_entropy=True)
    res[f"{key}.logprob"] = lib.max_diff(m_lp, t_lp)
    res[f"{key}.entropy"] = lib.max_diff(m_ent, t_ent)
    res[f"{key}.logprob_hf"] = max(lib.max_diff(m_lp, ref_lp), lib.max_diff(t_lp, ref_lp))

    # step 1. megatron's export_grads reads its gradient buffers after the step, which the
    # clipping has scaled in place; torch's full_grads after forward_backward are unclipped,
    # so they (and the float64 reference) are clipped here by clip / (norm + 1e-6).
    mbs, loss = lib.vs_step_inputs(0)
    m_metrics = [mega.train_step(mbs, loss, lib.VS_TEMPERATURE)]
    m_grads = dict(mega.export_grads())
    tor.forward_backward(mbs, loss, lib.VS_TEMPERATURE)
    t_grads = dict(tor.full_grads())
    tor.optimizer.zero_grad(set_to_none=True)
    t_metrics = [tor.train_step(mbs, loss, lib.VS_TEMPERATURE)]
    t_grads = lib.clipped(t_grads, t_metrics[0]["grad_norm"])
    res[f"{key}.grads_abs"], res[f"{key}.grads_rel"] = grads_diff(m_grads, t_grads)
    lib.vs_reference_loss(ref_lp, ref_ent, batch).backward()
    hf_grads = {k: p.grad for k, p in hf.named_parameters() if p.grad is not None}
    ref_norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in hf_grads.values())))
    hf_grads = lib.clipped(hf_grads, ref_norm)
    res[f"{key}.grads_rel_hf"] = max(
        max(lib.rel_diff(m_grads[k], g), lib.rel_diff(t_grads[k], g)) for k, g in hf_grads.items()
    )
    res[f"{key}.grad_norm_hf_rel"] = abs(t_metrics[0]["grad_norm"] - ref_norm) / ref_norm
    res[f"{key}.grad_names"] = sorted(m_grads) == sorted(t_grads) == sorted(hf_grads)
    res[f"{key}.step1"] = weights_diff(dict(mega.export_weights()), dict(tor.export_weights()))

    # step 2: the Adam moments (betas) and the second LR of the schedule come in
    mbs, loss = lib.vs_step_inputs(1)
    m_metrics.append(mega.train_step(mbs, loss, lib.VS_TEMPERATURE))
    t_metrics.append(tor.train_step(mbs, loss, lib.VS_TEMPERATURE))
    m_after = dict(mega.export_weights())
    res[f"{key}.step2"] = weights_diff(m_after, dict(tor.export_weights()))
    res[f"{key}.moved"] = weights_diff(m_after, {k: v.cpu() for k, v in lib.hf_weights(path)})
    res[f"{key}.grad_norm_rel"] = max(
        abs(m["grad_norm"] - t["grad_norm"]) / t["grad_norm"] for m, t in zip(m_metrics, t_metrics)
    )
    res[f"{key}.grad_norms"] = [t["grad_norm"] for t in t_metrics]
    res[f"{key}.loss"] = max(abs(m["loss"] - t["loss"]) for m, t in zip(m_metrics, t_metrics))
    res[f"{key}.lrs"] = [[m["lr"], t["lr"]] for m, t in zip(m_metrics, t_metrics)]
    res[f"{key}.skipped"] = sum(m["skipped"] + t["skipped"] for m, t in zip(m_metrics, t_metrics))
    res[f"{key}.megatron_hparams"] = hyperparameters(mega.optimizer)
    res[f"{key}.torch_hparams"] = hyperparameters(tor.optimizer)
    del mega, tor
    torch.distributed.barrier()


def main():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megarl.utils import dist as mdist

    lib.worker_setup()
    res = {}
    for key, name, layout in CASES:
        if ps.model_parallel_is_initialized() and (
            ps.get_pipeline_model_parallel_world_size() != layout.get("pp", 1)
        ):
            ps.destroy_model_parallel()  # megatron keeps one layout per process
        compare(res, key, name, layout)
    if dist.get_rank() == 0:
        lib.write_results(Path(sys.argv[2]), res)
    dist.barrier()
    mdist.destroy()


if __name__ == "__main__":
    main()
