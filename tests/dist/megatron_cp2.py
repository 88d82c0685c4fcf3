"""Worker (context parallelism 2): the megatron backend against transformers (float64) with
each sequence split over two ranks (megatron's load-balanced chunks, our all-gather attention),
for the LM families, a critic and a PRM: logprobs, entropies, logits, values, scores, the loss
and every gradient. LAYOUT ``cp2`` (2 ranks) or ``cp2_tp2_sp`` (4 ranks: TP 2 with sequence
parallelism inside each context-parallel share).

usage: torchrun --standalone --nproc_per_node=N tests/dist/megatron_cp2.py ROOT RESULTS LAYOUT [CKPT]
ROOT holds the zoo models (written by the test beforehand); RESULTS gets a JSON of measured
differences (rank 0); CKPT, if given, a checkpoint of the trained qwen2_bias actor.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "megatron"))

import mcore_testlib as lib  # noqa: E402
from megatron_tp2 import lm_checks  # noqa: E402


def main():
    import torch
    import torch.distributed as dist

    from megarl.backends.megatron import MegatronBackend
    from megarl.utils import dist as mdist

    lib.worker_setup()
    root, results, layout = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    res = {}
    # the non-distributed optimizer: every rank holds the whole reduced gradient (export_grads)
    whole = {"cp": 2, "use_distributed_optimizer": False}
    whole.update({"cp2": {}, "cp2_tp2_sp": {"tp": 2, "sp": True}, "cp2_pp2": {"pp": 2},
                  "cp2_dp2": {}}[layout])
    be, batch = lm_checks(res, root, "llama_tied_gqa", **whole)
    res["cp_size"] = be.layout.cp
    res["dp_size"] = be.dp_size
    del be
    lm_checks(res, root, "qwen3_qknorm", **whole)
    be, _ = lm_checks(res, root, "qwen2_bias", **whole)
    if len(sys.argv) > 4:  # a checkpoint of the trained actor, loaded at CP 1 by the test
        res["qwen2_bias.trained_logprob"] = be.logprobs(batch)[0].tolist()
        res["qwen2_bias.step"] = be.step
        be.save(sys.argv[4])
    del be

    path = lib.zoo_model(root, "qwen2_critic")
    critic = MegatronBackend("critic", str(path), **whole, optim_config={"grad_clip": 0})
    hf = lib.hf_model(path, head="token_cls")
    ref_v = lib.hf_values(hf, batch)
    res["critic.values"] = lib.max_diff(critic.values(batch), ref_v)
    res["critic.values_tol"] = lib.fp32_value_tol(path, batch.response_mask)
    n = float(batch.response_mask.sum())
    batch.tensors["returns"] = torch.randn(batch.response_mask.shape, generator=torch.Generator()
                                           .manual_seed(3))
    critic.train_step([batch], lambda o, mb: lib.value_loss(o, mb, n))
    ((ref_v - batch.tensors["returns"].double()) ** 2 * batch.response_mask).sum().div(n).backward()
    grads = dict(critic.export_grads())
    res["critic.grads"] = max(
        lib.rel_diff(grads[k], p.grad) for k, p in hf.named_parameters() if p.grad is not None
    )
    del critic

    path = lib.zoo_model(root, "qwen3_prm")
    prm = MegatronBackend("prm", str(path), cp=2, tp=whole.get("tp", 1), pp=whole.get("pp", 1))
    scores = prm.token_scores(batch)
    res["prm.shape"] = list(scores.shape)
    res["prm.scores"] = lib.max_diff(scores, lib.hf_scores(lib.hf_model(path, "token_cls"), batch))
    res["prm.scores_tol"] = lib.fp32_value_tol(path, batch.response_mask)

    if dist.get_rank() == 0:
        lib.write_results(results, res)
    dist.barrier()
    mdist.destroy()


if __name__ == "__main__":
    main()
