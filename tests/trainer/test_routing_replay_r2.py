"""R2 routing replay (``actor_rollout_ref.actor.router_replay.mode=R2``, verl's meaning) on the
torch backend: the trainer's own old-logprob pass records the experts its routers choose
(`megarl.backends.torch.moe.record_logprobs`), the batch carries them as ``routed_experts``, and
the update's forwards replay them, so the policy gradient goes through the routing of the
policy that computed the old logprobs even after the routers moved.

References: the recording against a brute-force loop, one row at a time, of the plain model with
`record_experts` (no packing, no backend); the update's experts against the recording; and, by
brute force, that the moved routers would choose other experts for some tokens (the planted
case: without replay the update's routing would differ). Planted bugs: the recorded rows
scattered to the wrong batch rows or token columns (row loop mismatch), ``replay_routing``
ignoring the batch's ``routed_experts`` in the update (experts differ from the recording),
the recording taken under replay of stale targets (the rows carry them, not the router's).
"""

from __future__ import annotations

import pytest
import torch

from megarl.backends.protocol import SequenceBatch
from megarl.backends.torch import TorchBackend
from megarl.backends.torch.moe import record_logprobs
from megarl.errors import UserInputError
from megarl.models.moe import moe_blocks, record_experts, stack_layers
from megarl.utils import dist as mdist

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def world():
    """The process group a TorchBackend needs: a world of one."""
    mdist.init_distributed(torch.device("cpu"))


@pytest.fixture(scope="module")
def model_path(tmp_path_factory, world):
    from megarl.models.testing import make_tiny_hf_model

    return make_tiny_hf_model(tmp_path_factory.mktemp("r2") / "m", "qwen3_moe")


def batch(B: int = 6, P: int = 7, L: int = 9, seed: int = 1) -> SequenceBatch:
    """Left-padded prompts, right-padded responses of different lengths."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 100, (B, P + L), generator=g)
    mask = torch.zeros(B, P + L, dtype=torch.long)
    for i in range(B):
        p = int(torch.randint(2, P + 1, (1,), generator=g))
        r = int(torch.randint(1, L + 1, (1,), generator=g))
        mask[i, P - p:P + r] = 1
    ids = ids * mask
    resp = mask[:, P:].float()
    return SequenceBatch(input_ids=ids, attention_mask=mask, response_length=L,
                         tensors={"response_mask": resp})


def row_by_row(backend: TorchBackend, seq: SequenceBatch) -> torch.Tensor:
    """[B, P + L, n_sparse, k] of the plain model's routers, one unpadded row at a time."""
    args = backend.model.args
    n, k = sum(args.is_moe_layer(i) for i in range(args.num_hidden_layers)), args.num_experts_per_tok
    out = torch.full((*seq.input_ids.shape, n, k), -1, dtype=torch.long)
    for i in range(seq.batch_size):
        cols = seq.attention_mask[i].bool()
        with torch.no_grad(), record_experts(backend.model) as chosen:
            backend.model(seq.input_ids[i, cols][None])
        out[i, cols] = stack_layers(chosen, args).long()
    return out


def move_routers(backend: TorchBackend, std: float = 0.3) -> None:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for block in moe_blocks(backend.model).values():
            w = block.gate.weight
            w.add_(std * w.abs().mean() * torch.randn(w.shape, generator=g, dtype=w.dtype))


def test_r2_records_the_old_logprob_pass_and_the_update_replays_it(model_path):
    be = TorchBackend("actor", str(model_path), device="cpu", dtype="fp32", router_replay=True,
                      optim={"lr": 1e-2, "grad_clip": None}, forward_micro_batch_size=2)
    be.router_replay_mode = "R2"
    seq = batch()
    # stale targets in the batch must not be replayed by the recording pass
    seq.tensors["routed_experts"] = torch.zeros((*seq.input_ids.shape, 2, 2), dtype=torch.int16)
    lp, ent, routed = record_logprobs(be, seq, temperature=0.8, with_entropy=True)
    want = row_by_row(be, seq)
    assert routed.dtype == torch.int16 and routed.shape == want.shape
    assert torch.equal(routed.long(), want)
    assert (routed[seq.attention_mask == 0] == -1).all()
    del seq.tensors["routed_experts"]
    plain, plain_ent = be.logprobs(seq, temperature=0.8, with_entropy=True)
    torch.testing.assert_close(lp, plain, rtol=0, atol=1e-6)
    torch.testing.assert_close(ent, plain_ent, rtol=0, atol=1e-6)

    # the weights move (as an earlier mini-batch's update would)
    move_routers(be)
    moved = row_by_row(be, seq)
    real = seq.attention_mask.bool()
    flipped = ((moved.sort(-1).values != want.sort(-1).values).any(-1) & real[..., None])
    assert int(flipped.sum()) > 0  # the planted case: the routers now choose other experts

    # the update's forward replays the recording
    train = SequenceBatch(input_ids=seq.input_ids, attention_mask=seq.attention_mask,
                          response_length=seq.response_length,
                          tensors={**seq.tensors, "routed_experts": routed})

    def loss_fn(heads, mb):
        return heads.logprob.sum(), {}

    with record_experts(be.model) as used:
        be.forward_backward([train], loss_fn, temperature=0.8)
        used_rows = stack_layers(used, be.model.args).long()
    assert torch.equal(used_rows[: int(real.sum())], want[real])
    assert not torch.equal(used_rows[: int(real.sum())], moved[real])
    # the router still gets a gradient (through the weights at the replayed experts)
    grads = [b.gate.weight.grad for b in moe_blocks(be.model).values()]
    assert all(g is not None and float(g.abs().sum()) > 0 for g in grads)

    # on-policy, no recording pass ran: the routers route, no warning state set
    with record_experts(be.model) as used:
        be.forward_backward([seq], loss_fn, temperature=0.8)
        own = stack_layers(used, be.model.args).long()
    assert torch.equal(own[: int(real.sum())], moved[real])
    assert not getattr(be, "_warned_no_routing", False)


def test_r2_refuses_dense_models(tmp_path, world):
    from megarl.backends.routing import check_r2_layout
    from megarl.models.testing import make_tiny_hf_model

    path = make_tiny_hf_model(tmp_path / "dense", "qwen2")
    be = TorchBackend("actor", str(path), device="cpu", dtype="fp32")
    with pytest.raises(UserInputError, match="router_replay.mode=R2 needs a mixture-of-experts"):
        record_logprobs(be, batch())
    moe_args = type("A", (), {"is_moe": True})()
    with pytest.raises(UserInputError, match="pipeline_model_parallel_size=1"):
        check_r2_layout(moe_args, pp=2, sp=1)


def test_replay_mode_of_the_backend_argument():
    from megarl.backends.routing import replay_mode

    assert [replay_mode(v) for v in (False, None, True, "disabled", "R2", "R3")] == [
        "disabled", "disabled", "R3", "disabled", "R2", "R3"]
    with pytest.raises(UserInputError, match=r"router_replay.mode='R1': expected one of"):
        replay_mode("R1")
