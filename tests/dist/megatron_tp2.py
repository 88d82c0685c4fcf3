"""Worker (2 ranks, TP=2): the megatron backend against transformers (float64) at tensor
parallelism 2, with and without sequence parallelism, for every model family and head; then
saves a trained TP=2 checkpoint for the resharding checks, and the HF weights after one more
step at TP=2 (the uninterrupted run) beside it (`mcore_testlib.next_step_path`).

usage: torchrun --standalone --nproc_per_node=2 tests/dist/megatron_tp2.py ROOT RESULTS CKPT
ROOT holds the zoo models (written by the test beforehand); RESULTS gets a JSON of measured
differences (rank 0); CKPT gets the checkpoint.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "megatron"))

import mcore_testlib as lib  # noqa: E402


def lm_checks(res, root, name, **layout):
    import torch

    from megarl.backends.megatron import MegatronBackend
    from megarl.models.hf_io import load_hf_state_dict

    path = lib.zoo_model(root, name)
    be = MegatronBackend(
        "actor", str(path), **layout, optim=lib.RESHARD_OPTIM
    )
    hf = lib.hf_model(path)
    batch = lib.make_batch(seed=1)
    ref_lp, ref_ent, ref_logits = lib.hf_logprobs(hf, batch, temperature=0.7)
    lp, ent = be.logprobs(batch, temperature=0.7, with_entropy=True)
    logits = be.logits(batch, temperature=0.7)
    res[f"{name}.logprob"] = lib.max_diff(lp, ref_lp)
    res[f"{name}.entropy"] = lib.max_diff(ent, ref_ent)
    res[f"{name}.logits"] = lib.max_diff(logits, ref_logits)
    res[f"{name}.tol"] = lib.fp32_tols(path, ref_logits, batch.response_mask, 0.7)
    res[f"{name}.no_entropy_is_none"] = be.logprobs(batch)[1] is None

    source = load_hf_state_dict(path)
    exported = dict(be.export_weights())
    res[f"{name}.export_names"] = sorted(exported) == sorted(source)
    res[f"{name}.export_exact"] = all(torch.equal(exported[k].cpu(), source[k]) for k in source)

    n = float(batch.response_mask.sum())
    mbs = [batch.select(slice(0, 2)), batch.select(slice(2, 4))]
    metrics = be.train_step(mbs, lambda o, mb: lib.pg_loss(o, mb, n), temperature=0.7)
    ref_loss = -(ref_lp.sum()) / n
    ref_loss.backward()
    ref_grads = {k: p.grad for k, p in hf.named_parameters() if p.grad is not None}
    grads = dict(be.export_grads())
    res[f"{name}.loss"] = abs(metrics["loss"] - float(ref_loss))
    res[f"{name}.metric_tokens"] = metrics["tokens"]
    res[f"{name}.tokens"] = n
    ref_norm = float(torch.sqrt(sum((g**2).sum() for g in ref_grads.values())))
    res[f"{name}.grad_norm"] = abs(metrics["grad_norm"] - ref_norm) / ref_norm
    res[f"{name}.grads"] = max(lib.rel_diff(grads[k], ref_grads[k]) for k in ref_grads)
    res[f"{name}.grad_names"] = sorted(grads) == sorted(ref_grads)
    return be, batch


def main():
    import torch.distributed as dist
    from safetensors.torch import save_file

    from megarl.utils import dist as mdist

    lib.worker_setup()
    root, results, ckpt = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    res = {}
    lm_checks(res, root, "llama_tied_gqa", tp=2)
    lm_checks(res, root, "qwen3_qknorm", tp=2, sp=True)
    be, batch = lm_checks(res, root, "qwen2_bias", tp=2, sp=True)

    # protocol methods on the trained TP=2 actor, then a checkpoint for resharding checks
    res["qwen2_bias.step"] = be.step
    res["qwen2_bias.trained_logprob"] = be.logprobs(batch)[0].tolist()
    be.save(str(ckpt))
    # the uninterrupted run: the next step at TP=2, for the loads at PP=2 and TP=1
    after = lib.reshard_next_step(be)
    if dist.get_rank() == 0:
        save_file(after, str(lib.next_step_path(ckpt, "tp2")))
    del be

    lib.critic_checks(res, root, batch, tp=2, sp=True)
    lib.prm_checks(res, root, batch, tp=2)

    if dist.get_rank() == 0:
        lib.write_results(results, res)
    dist.barrier()
    mdist.destroy()


if __name__ == "__main__":
    main()
