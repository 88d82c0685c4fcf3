"""The R2 routing replay checks of the megatron backend at one layout (single process:
tests/megatron/test_mcore_replay_r2.py; 2 ranks: tests/dist/megatron_r2.py): the recording
pass against megarl's plain model in float64 one row at a time, and the update's routing after
the routers moved."""

from __future__ import annotations

from pathlib import Path

import mcore_testlib as lib
import moe_testlib as ml
import torch


def row_by_row(model, batch) -> torch.Tensor:
    """[B, P + L, n_sparse, k] of ``model``'s routers, one unpadded row at a time."""
    from megarl.models.moe import record_experts, stack_layers

    args = model.args
    n = sum(args.is_moe_layer(i) for i in range(args.num_hidden_layers))
    out = torch.full((*batch.input_ids.shape, n, args.num_experts_per_tok), -1, dtype=torch.long)
    for i in range(batch.batch_size):
        cols = batch.attention_mask[i].bool()
        with torch.no_grad(), record_experts(model) as chosen:
            model(batch.input_ids[i, cols][None])
        out[i, cols] = stack_layers(chosen, args).long()
    return out


def move_routers(be, ref, std: float = 0.5) -> None:
    """The same noise (seeded per layer) on the backend's local routers and the reference's."""
    from megatron.core.transformer.moe.router import TopKRouter

    from megarl.models.moe import moe_blocks

    blocks = moe_blocks(ref)
    with torch.no_grad():
        for idx, block in blocks.items():
            gate = block.gate.weight
            g = torch.Generator().manual_seed(idx)
            gate.add_(std * gate.abs().mean() * torch.randn(gate.shape, generator=g,
                                                            dtype=gate.dtype))
        for chunk in be.chunks:
            for m in chunk.modules():
                if isinstance(m, TopKRouter):
                    m.weight.copy_(blocks[m.layer_number - 1].gate.weight.to(m.weight.dtype))


def r2_checks(path: Path, **layout) -> dict:
    """Run R2 on an actor at ``layout``; returns the results (all ranks the same):

    recorded_ok: the recording equals the float64 row loop at every real token, -1 elsewhere;
    logprob_gap: its logprobs against a plain ``logprobs`` call; sum_pi_squared_err: the old-
    logprob pass's sum_v pi_v^2 against transformers' float64 softmax; flips: real (token, layer)
    decisions the moved routers choose differently (the float64 loop); own_mismatch: the
    fraction where the backend's moved routers disagree with that loop; update_ok: the update
    routed by the recording at every real token; update_differs: not by the moved routers."""
    from megarl.backends.megatron import MegatronBackend, replay
    from megarl.backends.protocol import SequenceBatch
    from megarl.models import load_model
    from megarl.trainer.advantage import old_logprob_pass

    be = MegatronBackend("actor", str(path), optim=lib.RESHARD_OPTIM,
                         use_distributed_optimizer=False, router_replay=True, **layout)
    batch = lib.make_batch(B=4, P=8, L=7, seed=1)
    batch.tensors["routed_experts"] = ml.random_routing(batch, path)  # stale: must not replay
    lp, _, routed = replay.record_logprobs(be, batch, temperature=ml.TEMPERATURE)
    ref = load_model(path, dtype=torch.float64)
    want = row_by_row(ref, batch)
    real = batch.attention_mask.bool()
    res = {"recorded_ok": routed.dtype == torch.int16 and routed.shape == want.shape
           and torch.equal(routed.long()[real], want[real]) and bool((routed[~real] == -1).all())}
    plain = SequenceBatch(batch.input_ids, batch.attention_mask, batch.response_length)
    res["logprob_gap"] = float((lp - be.logprobs(plain, temperature=ml.TEMPERATURE)[0]).abs().max())
    # sum_v pi_v^2 of the same pass (vocab-parallel under TP) against transformers in float64
    stats = old_logprob_pass(be, plain, ml.TEMPERATURE, sum_pi_squared=True)
    _, _, logits = lib.hf_logprobs(ml.hf_moe_model(path), batch, temperature=ml.TEMPERATURE)
    want_sq = torch.softmax(logits.detach(), -1).square().sum(-1) * batch.response_mask
    res["sum_pi_squared_err"] = float((stats["sum_pi_squared"].double() - want_sq).abs().max())

    move_routers(be, ref)
    moved = row_by_row(ref, batch)
    res["flips"] = int(((moved.sort(-1).values != want.sort(-1).values).any(-1)
                        & real[..., None]).sum())
    free = SequenceBatch(batch.input_ids, batch.attention_mask, batch.response_length,
                         tensors=replay.tag_rows({"response_mask": batch.response_mask}, batch))
    with replay.recording(be) as sinks:
        be.logprobs(free, temperature=ml.TEMPERATURE)
    own = replay.assemble(be, sinks, tuple(batch.input_ids.shape))
    res["own_mismatch"] = float((own.long()[real] != moved[real]).any(-1).float().mean())

    train = SequenceBatch(batch.input_ids, batch.attention_mask, batch.response_length,
                          tensors=replay.tag_rows({"response_mask": batch.response_mask,
                                                   "routed_experts": routed}, batch))
    mbs, n = ml.dp_share(train, be)
    dp = be.dp_size
    with replay.recording(be) as sinks:
        be.train_step(mbs, lambda o, mb: lib.pg_loss(o, mb, n / dp),
                      temperature=ml.TEMPERATURE)
    used = replay.assemble(be, sinks, tuple(batch.input_ids.shape))
    res["update_ok"] = torch.equal(used.long()[real], want[real])
    res["update_differs"] = not torch.equal(used.long()[real], moved[real])
    del be
    return res


def r2_failures(res: dict) -> list[str]:
    out = [k for k in ("recorded_ok", "update_ok", "update_differs") if not res[k]]
    if not res["logprob_gap"] < 1e-5:
        out.append(f"logprob_gap {res['logprob_gap']}")
    if not res["flips"] > 0:
        out.append("no routing decision flipped: the planted case is void")
    if not res["sum_pi_squared_err"] < 2e-5:
        out.append(f"sum_pi_squared_err {res['sum_pi_squared_err']}")
    if not res["own_mismatch"] < 0.02:
        out.append(f"own_mismatch {res['own_mismatch']}")
    return out
