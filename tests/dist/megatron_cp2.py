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
    import torch.distributed as dist

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

    lib.critic_checks(res, root, batch, **whole)
    lib.prm_checks(res, root, batch, cp=2, tp=whole.get("tp", 1), pp=whole.get("pp", 1))

    if dist.get_rank() == 0:
        lib.write_results(results, res)
    dist.barrier()
    mdist.destroy()


if __name__ == "__main__":
    main()
