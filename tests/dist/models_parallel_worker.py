"""torchrun worker for tests/models/test_parallel_compat.py: the module tree of
megarl.models.Transformer takes DTensor TP and FSDP2 from outside and keeps its numbers.

Run: torchrun --standalone --nproc_per_node=2 tests/dist/models_parallel_worker.py <hf folder>
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from megarl.models import load_model
from megarl.utils import dist as mdist

TP_PLAN = {
    "self_attn.q_proj": ColwiseParallel(),
    "self_attn.k_proj": ColwiseParallel(),
    "self_attn.v_proj": ColwiseParallel(),
    "self_attn.o_proj": RowwiseParallel(),
    "mlp.gate_proj": ColwiseParallel(),
    "mlp.up_proj": ColwiseParallel(),
    "mlp.down_proj": RowwiseParallel(),
}


def loss_of(model, ids, mask):
    out = model(ids, attention_mask=mask)
    return out, out.float().logsumexp(-1).mul(mask).sum()


def main(path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    ids = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0

    ref = load_model(path)
    expected, loss = loss_of(ref, ids, mask)
    loss.backward()

    tp = load_model(path)
    for layer in tp.model.layers.values():
        parallelize_module(layer, mesh, TP_PLAN)
    out, loss = loss_of(tp, ids, mask)
    loss.backward()
    assert (out - expected).abs().max() <= 1e-5, "TP forward differs"
    # Qwen3 q_norm/k_norm act on each rank's own heads, so their (plain, replicated) weights get
    # partial grads under head-sharded TP: the backend must SUM them over the TP group. Norms
    # outside the sharded region (input_layernorm, ...) already get the full grad on every rank.
    for layer in tp.model.layers.values():
        for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
            dist.all_reduce(norm.weight.grad)
    for name in (
        "self_attn.q_proj.weight",
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
        "mlp.down_proj.weight",
        "input_layernorm.weight",
    ):
        got = tp.model.layers["1"].get_parameter(name).grad
        got = got.full_tensor() if hasattr(got, "full_tensor") else got
        want = ref.model.layers["1"].get_parameter(name).grad
        assert (got - want).abs().max() <= 1e-5, f"TP grad of {name} differs"

    fsdp = load_model(path)
    for layer in fsdp.model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    out, loss = loss_of(fsdp, ids, mask)
    loss.backward()
    assert (out - expected).abs().max() <= 1e-5, "FSDP2 forward differs"
    assert fsdp.lm_head.weight is fsdp.model.embed_tokens.weight, "FSDP2 untied the embeddings"
    got = fsdp.model.embed_tokens.weight.grad.full_tensor()
    assert (got - ref.model.embed_tokens.weight.grad).abs().max() <= 1e-5, "tied grad differs"
    mdist.destroy()


if __name__ == "__main__":
    main(sys.argv[1])
