"""Worker (2 gloo ranks) of tests/trainer/test_old_logprob_pass.py: the torch backend's
old-logprob pass at FSDP2 (rows split over DP) with R2 recording and sum_pi_squared on an MoE
policy, and under Ulysses (each rank holds half of each packed sequence) with sum_pi_squared on
a dense one. Rank 0 saves what every rank returned (they must agree) for the test to compare
with one process and transformers.

usage: torchrun --standalone --nproc_per_node=2 tests/dist/torch_r2_otb_worker.py IN.pt OUT.pt
"""

import sys

import torch
import torch.distributed as dist

from megarl.backends.torch import TorchBackend
from megarl.trainer.advantage import old_logprob_pass
from megarl.utils.dist import destroy, init_distributed


def main() -> None:
    torch.set_num_threads(1)
    init_distributed(torch.device("cpu"))
    given = torch.load(sys.argv[1], weights_only=False)
    seq, temperature = given["seq"], given["temperature"]
    out = {}
    moe = TorchBackend("actor", given["moe"], device="cpu", dtype="fp32", router_replay=True,
                       dp_shard=2, forward_micro_batch_size=2, optim={"lr": 1e-3})
    out["fsdp2"] = old_logprob_pass(moe, seq, temperature, sum_pi_squared=True,
                                    record_routing=True)
    dense = TorchBackend("actor", given["dense"], device="cpu", dtype="fp32", ulysses=2)
    out["ulysses2"] = old_logprob_pass(dense, seq, temperature, sum_pi_squared=True)
    for res in out.values():  # every rank returns the whole batch's tensors
        for v in res.values():
            other = v.double()  # gloo broadcasts no int16
            dist.broadcast(other, src=0)
            assert torch.equal(other, v.double())
    if dist.get_rank() == 0:
        torch.save(out, sys.argv[2])
    dist.barrier()
    destroy()


if __name__ == "__main__":
    main()
