"""Worker (2 ranks, DP=2): three AdamW steps with megatron's distributed optimizer (ZeRO-1),
grad clipping, weight decay and a warmup + cosine LR schedule; the weights after each step are
written for comparison with the same run at DP=1 (the test does that in-process). Also checks
that no-grad logprobs of an odd-sized batch split over DP equal transformers'.

usage: torchrun --standalone --nproc_per_node=2 tests/dist/megatron_dp2.py ROOT OUT_DIR
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "megatron"))

import mcore_testlib as lib  # noqa: E402


def main():
    import torch.distributed as dist
    from safetensors.torch import save_file

    from megarl.backends.megatron import MegatronBackend
    from megarl.utils import dist as mdist

    lib.worker_setup()
    root, out = Path(sys.argv[1]), Path(sys.argv[2])
    path = lib.zoo_model(root, "qwen3_qknorm")
    be = MegatronBackend(
        "actor", str(path), optim=lib.DP_OPTIM, use_distributed_optimizer=True
    )
    res = {"dp_size": be.dp_size, "dp_rank": be.dp_rank}
    batch = lib.make_batch(B=5, seed=4)
    ref_lp, _, ref_logits = lib.hf_logprobs(lib.hf_model(path), batch)
    res["logprob"] = lib.max_diff(be.logprobs(batch)[0], ref_lp)
    res["logprob_tol"] = lib.fp32_tols(path, ref_logits, batch.response_mask)["logprob"]

    metrics = []
    for step in range(lib.DP_STEPS):
        mbs, n = lib.dp_micro_batches(step, be.dp_rank, be.dp_size)
        metrics.append(be.train_step(mbs, lambda o, mb, n=n: lib.pg_loss(o, mb, n / be.dp_size)))
        weights = {k: v.contiguous() for k, v in be.export_weights()}
        if dist.get_rank() == 0:  # after each step: the test bounds each step's gap
            save_file(weights, str(out / f"dp2_weights_step{step}.safetensors"))
    res["metrics"] = metrics
    if dist.get_rank() == 0:
        save_file(weights, str(out / "dp2_weights.safetensors"))
        lib.write_results(out / "dp2.json", res)
    dist.barrier()
    mdist.destroy()


if __name__ == "__main__":
    main()
