"""Worker (2 ranks, PP=2): the megatron backend against transformers (float64) with a 1F1B and
an interleaved (virtual, vpp=2) pipeline, tied embeddings split across stages, a critic on the
pipeline, and a TP=2 checkpoint loaded at PP=2 (its logprobs, and the HF weights after the next
step beside the checkpoint: `mcore_testlib.next_step_path`).

usage: torchrun --standalone --nproc_per_node=2 tests/dist/megatron_pp2.py ROOT RESULTS CKPT
CKPT: the checkpoint written by megatron_tp2.py (its logprobs after training are in
RESULTS_TP2 = CKPT/../tp2.json when present).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "megatron"))

import mcore_testlib as lib  # noqa: E402


def pipeline_checks(res, root, key, **layout):
    import torch

    from megarl.backends.megatron import MegatronBackend
    from megarl.models.hf_io import load_hf_state_dict

    path = lib.zoo_model(root, "llama4_tied")
    be = MegatronBackend("actor", str(path), **layout, optim={"grad_clip": 0.0})
    hf = lib.hf_model(path)
    batch = lib.make_batch(B=5, seed=2)
    ref_lp, ref_ent, ref_logits = lib.hf_logprobs(hf, batch, temperature=1.3)
    lp, ent = be.logprobs(batch, temperature=1.3, with_entropy=True)
    res[f"{key}.logprob"] = lib.max_diff(lp, ref_lp)
    res[f"{key}.entropy"] = lib.max_diff(ent, ref_ent)
    res[f"{key}.logits"] = lib.max_diff(be.logits(batch, temperature=1.3), ref_logits)
    res[f"{key}.tol"] = lib.fp32_tols(path, ref_logits, batch.response_mask, 1.3)
    source = load_hf_state_dict(path)
    exported = dict(be.export_weights())
    res[f"{key}.export_exact"] = sorted(exported) == sorted(source) and all(
        torch.equal(exported[k].cpu(), source[k]) for k in source
    )
    n = float(batch.response_mask.sum())
    mbs = [batch.select(slice(0, 2)), batch.select(slice(2, 3)), batch.select(slice(3, 4)),
           batch.select(slice(4, 5))]
    metrics = be.train_step(mbs, lambda o, mb: lib.pg_loss(o, mb, n), temperature=1.3)
    ref_loss = -(ref_lp.sum()) / n
    ref_loss.backward()
    grads = dict(be.export_grads())
    res[f"{key}.loss"] = abs(metrics["loss"] - float(ref_loss))
    res[f"{key}.grads"] = max(
        lib.rel_diff(grads[k], p.grad) for k, p in hf.named_parameters() if p.grad is not None
    )


def main():
    import torch.distributed as dist
    from safetensors.torch import save_file

    from megarl.backends.megatron import MegatronBackend
    from megarl.utils import dist as mdist

    lib.worker_setup()
    root, results, ckpt = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    res = {}
    pipeline_checks(res, root, "pp2", pp=2)
    pipeline_checks(res, root, "vpp2", pp=2, vpp=2)

    batch = lib.make_batch(seed=1)
    path = lib.zoo_model(root, "qwen2_critic")
    critic = MegatronBackend("critic", str(path), pp=2)
    ref_v = lib.hf_values(lib.hf_model(path, head="token_cls"), batch)
    res["critic.values"] = lib.max_diff(critic.values(batch), ref_v)
    res["critic.values_tol"] = lib.fp32_value_tol(path, batch.response_mask)
    del critic

    # the TP=2 checkpoint (after one Adam step) loaded at PP=2
    actor = MegatronBackend("actor", str(lib.zoo_model(root, "qwen2_bias")), pp=2,
                            optim=lib.RESHARD_OPTIM)
    actor.load(str(ckpt))
    res["ckpt.step"] = actor.step
    res["ckpt.logprob"] = actor.logprobs(batch)[0].tolist()
    # training goes on from the loaded optimizer state: the weights after the next step
    after = lib.reshard_next_step(actor)
    res["ckpt.step_after"] = actor.step
    if dist.get_rank() == 0:
        save_file(after, str(lib.next_step_path(ckpt, "pp2")))

    if dist.get_rank() == 0:
        lib.write_results(results, res)
    dist.barrier()
    mdist.destroy()


if __name__ == "__main__":
    main()
