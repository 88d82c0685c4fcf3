"""Worker (2 ranks): a megatron-core dist checkpoint written at TP=1 (by the calling test)
loaded into a freshly initialised TP=2 model (`megarl.backends.megatron.dist_init`:
megatron-core reshards on load); its logits against transformers in float64.

usage: torchrun --standalone --nproc_per_node=2 tests/dist/megatron_dist_init.py MODEL CKPT RESULTS
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "megatron"))

import mcore_testlib as lib  # noqa: E402


def main():
    import torch.distributed as dist

    from megarl.backends.megatron import MegatronBackend
    from megarl.backends.megatron.dist_init import load_dist_checkpoint
    from megarl.models import read_hf_config
    from megarl.utils import dist as mdist

    lib.worker_setup()
    path, ckpt, results = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    batch = lib.make_batch(seed=4)
    be = MegatronBackend("ref", None, hf_config=read_hf_config(path), tp=2, seed=11)
    _, _, ref_logits = lib.hf_logprobs(lib.hf_model(path), batch)
    before = lib.max_diff(be.logits(batch), ref_logits)
    load_dist_checkpoint(be.chunks, ckpt)
    after = lib.max_diff(be.logits(batch), ref_logits)
    if dist.get_rank() == 0:
        lib.write_results(results, {"before": before, "after": after, "tol": lib.fp32_tols(
            path, ref_logits, batch.response_mask)["logits"]})
    dist.barrier()
    mdist.destroy()


if __name__ == "__main__":
    main()
