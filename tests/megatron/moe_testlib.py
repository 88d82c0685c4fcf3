"""Helpers of the megatron mixture-of-experts tests (pytest files and tests/dist workers):
tiny Qwen3-MoE / Qwen2-MoE folders, transformers references in float64 (eager experts), the
per-expert names of transformers' fused expert gradients, and the checks one layout runs."""

from __future__ import annotations

from pathlib import Path

import mcore_testlib as lib
import torch

from megarl.models.testing import hf_grads_by_checkpoint_name

# name: (family, overrides). 4 experts, top-2, head_dim 32 (megarl.models.testing); the mixed
# model has a dense first layer (mlp_only_layers) and 8 experts (4 per rank at EP=2).
MOE_ZOO = {
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen2_moe": ("qwen2_moe", {}),
    "qwen3_moe_mixed": ("qwen3_moe", {"mlp_only_layers": [0], "num_experts": 8,
                                      "num_hidden_layers": 2}),
    # 2 KV heads for TP=2 (head_dim stays 32)
    "qwen3_moe_kv2": ("qwen3_moe", {"num_attention_heads": 4, "num_key_value_heads": 2}),
    "qwen2_moe_kv2": ("qwen2_moe", {"num_attention_heads": 4, "num_key_value_heads": 2,
                                    "hidden_size": 128}),
    # 4 layers (the second dense) for the interleaved pipeline (2 stages x 2 chunks)
    "qwen3_moe_4l": ("qwen3_moe", {"num_hidden_layers": 4, "mlp_only_layers": [1]}),
}
TEMPERATURE = 0.7
# fp32 megatron against float64: the checks record tolerances derived from the model and batch
# next to the errors (`lib.fp32_tols`: logprobs, entropies and the loss, absolute;
# `lib.fp32_grad_tol`: gradients per tensor relative to its largest entry; tests/fp32_bounds.py)
# as `<key>.tol` / `<key>.grads_tol`, and `failures` / `replay_failures` read them.


def moe_model(root: Path, name: str) -> Path:
    family, overrides = MOE_ZOO[name]
    return lib.make_model(Path(root) / name, family, "lm", **dict(overrides))


def hf_moe_model(path: Path, dtype=torch.float64):
    """transformers' model with its eager expert loop (its grouped_mm refuses float64)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, experts_implementation="eager"
    )


def hf_grads(model) -> dict[str, torch.Tensor]:
    """transformers' gradients under checkpoint (per-expert) names."""
    return hf_grads_by_checkpoint_name(model)


def dp_share(batch, be):
    """(this DP rank's rows of ``batch`` in micro-batches of 2, global response tokens)."""
    per = batch.batch_size // be.dp_size
    share = batch.select(slice(be.dp_rank * per, (be.dp_rank + 1) * per))
    mbs = [share.select(slice(i, i + 2)) for i in range(0, per, 2)]
    return mbs, float(batch.response_mask.sum())


def moe_checks(res: dict, path: Path, key: str, **layout) -> None:
    """Build an actor at ``layout`` from ``path`` and record, under ``key.*``: max |logprob| /
    |entropy| differences to transformers (float64), whether the export equals the HF files
    bit for bit, the loss difference and the largest per-tensor relative gradient difference
    after one train_step of -sum(logprob)/tokens split over DP ranks, and the grad names."""
    from megarl.backends.megatron import MegatronBackend
    from megarl.models.hf_io import load_hf_state_dict

    be = MegatronBackend("actor", str(path), optim=lib.RESHARD_OPTIM,
                         use_distributed_optimizer=False, **layout)
    hf = hf_moe_model(path)
    batch = lib.make_batch(B=4, seed=1)
    ref_lp, ref_ent, ref_logits = lib.hf_logprobs(hf, batch, temperature=TEMPERATURE)
    lp, ent = be.logprobs(batch, temperature=TEMPERATURE, with_entropy=True)
    res[f"{key}.logprob"] = lib.max_diff(lp, ref_lp.detach())
    res[f"{key}.entropy"] = lib.max_diff(ent, ref_ent.detach())
    res[f"{key}.tol"] = lib.fp32_tols(path, ref_logits, batch.response_mask, TEMPERATURE)
    res[f"{key}.grads_tol"] = lib.fp32_grad_tol(path, batch, TEMPERATURE)
    source = load_hf_state_dict(path)
    exported = {k: v.cpu() for k, v in be.export_weights()}
    res[f"{key}.export_names"] = sorted(exported) == sorted(source)
    res[f"{key}.export_exact"] = all(torch.equal(exported[k], source[k]) for k in source)

    mbs, n = dp_share(batch, be)
    dp = be.dp_size
    metrics = be.train_step(
        mbs, lambda o, mb: lib.pg_loss(o, mb, n / dp), temperature=TEMPERATURE
    )
    ref_loss = -ref_lp.sum() / n
    ref_loss.backward()
    ref = hf_grads(hf)
    grads = {k: v.cpu() for k, v in be.export_grads()}
    res[f"{key}.loss"] = abs(metrics["loss"] - float(ref_loss.detach()))
    res[f"{key}.grad_names"] = sorted(grads) == sorted(ref)
    res[f"{key}.grads"] = max(lib.rel_diff(grads[k], ref[k]) for k in ref)
    res[f"{key}.expert_grads_nonzero"] = sum(
        float(g.abs().max()) > 0 for k, g in grads.items() if ".mlp.experts." in k
    )
    del be


def failures(res: dict, key: str) -> list[str]:
    out = []
    tols = res[f"{key}.tol"]
    for name, tol in (("logprob", tols["logprob"]), ("entropy", tols["entropy"]),
                      ("loss", tols["logprob"]), ("grads", res[f"{key}.grads_tol"])):
        if not res[f"{key}.{name}"] < tol:
            out.append(f"{key}.{name} = {res[f'{key}.{name}']} (tolerance {tol})")
    for flag in ("export_names", "export_exact", "grad_names"):
        if not res[f"{key}.{flag}"]:
            out.append(f"{key}.{flag} is False")
    return out


def next_step(be) -> dict[str, torch.Tensor]:
    """One more train_step (batch seed 5, this DP rank's rows in micro-batches of 2, loss
    -sum(logprob) / global tokens x dp_size) on ``be``; returns the full HF-named weights
    afterwards (collective)."""
    batch = lib.make_batch(B=4, seed=5)
    mbs, n = dp_share(batch, be)
    be.train_step(mbs, lambda o, mb: lib.pg_loss(o, mb, n / be.dp_size))
    return {k: v.detach().cpu().contiguous() for k, v in be.export_weights()}


AUX_COEFF = 0.5  # large enough that the load-balancing gradient is far above the gradient tol


def hf_aux_loss(model, mb) -> torch.Tensor:
    """megatron's Switch load-balancing loss of one micro-batch written out on transformers'
    router logits (float64): per sparse layer ``E / (k T^2) * sum_e (sum_x p_xe) * count_e``
    over the T real tokens x (softmax probabilities p, count_e = tokens with e in their top
    k), summed over layers."""
    mask = mb.attention_mask
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    out = model(input_ids=mb.input_ids, attention_mask=mask, position_ids=pos,
                output_router_logits=True)
    m = mask.reshape(-1).double()
    E, k = model.config.num_experts, model.config.num_experts_per_tok
    total = torch.zeros((), dtype=torch.float64)
    T = m.sum()
    for logits in out.router_logits:
        p = torch.softmax(logits.double(), dim=-1) * m[:, None]
        chosen = torch.topk(logits.double(), k, dim=-1).indices
        counts = torch.zeros(E, dtype=torch.float64).index_add(
            0, chosen.reshape(-1), m.repeat_interleave(k)
        )
        total = total + E / (k * T * T) * (p.sum(0) * counts).sum()
    return total


def aux_checks(res: dict, path: Path, key: str, **layout) -> None:
    """One train_step with ``moe_aux_loss_coeff=AUX_COEFF`` against transformers (float64):
    loss -sum(logprob)/tokens + AUX_COEFF x (mean over this DP rank's micro-batches of
    `hf_aux_loss`, averaged over DP ranks). Records the largest relative gradient difference,
    the reported ``moe_aux_loss`` against the reference, and how far the reference gradient
    moves when the aux term is dropped (what ignoring the coefficient would cost)."""
    import torch.distributed as dist

    from megarl.backends.megatron import MegatronBackend

    be = MegatronBackend("actor", str(path), optim=lib.RESHARD_OPTIM,
                         use_distributed_optimizer=False, moe_aux_loss_coeff=AUX_COEFF, **layout)
    hf = hf_moe_model(path)
    batch = lib.make_batch(B=4, seed=1)
    mbs, n = dp_share(batch, be)
    dp = be.dp_size
    metrics = be.train_step(mbs, lambda o, mb: lib.pg_loss(o, mb, n / dp))
    grads = {k: v.cpu() for k, v in be.export_grads()}

    ref_lp, _, _ = lib.hf_logprobs(hf, batch)
    main = -ref_lp.sum() / n
    per = batch.batch_size // dp
    aux_per_rank = []
    for r in range(dp):
        share = batch.select(slice(r * per, (r + 1) * per))
        rank_mbs = [share.select(slice(i, i + 2)) for i in range(0, per, 2)]
        aux_per_rank.append(sum(hf_aux_loss(hf, mb) for mb in rank_mbs) / len(rank_mbs))
    aux = sum(aux_per_rank) / dp
    main.backward(retain_graph=True)
    main_only = {k: g.clone() for k, g in hf_grads(hf).items()}
    (AUX_COEFF * aux).backward()
    ref = hf_grads(hf)
    res[f"{key}.aux_grads"] = max(lib.rel_diff(grads[k], ref[k]) for k in ref)
    res[f"{key}.aux_metric"] = abs(metrics["moe_aux_loss"] - float(aux.detach()))
    res[f"{key}.aux_value"] = float(aux.detach())
    res[f"{key}.aux_effect"] = max(lib.rel_diff(main_only[k], ref[k]) for k in ref)
    del be
    if dist.is_initialized():
        dist.barrier()


def random_routing(batch, path: Path, seed: int = 3, unrecorded: float = 0.2) -> torch.Tensor:
    """[B, P+L, n_sparse, k] distinct random experts per (token, sparse layer), -1 rows (routed
    by the router) with probability ``unrecorded``: far from what the routers would choose."""
    from megarl.models.args import ModelArgs
    from megarl.models.hf_io import read_hf_config
    from megarl.models.moe import sparse_layers

    args = ModelArgs.from_hf_config(read_hf_config(path))
    g = torch.Generator().manual_seed(seed)
    B, T = batch.input_ids.shape
    n, k, E = len(sparse_layers(args)), args.num_experts_per_tok, args.num_experts
    routing = torch.rand(B, T, n, E, generator=g).argsort(-1)[..., :k]
    routing[torch.rand(B, T, n, generator=g) < unrecorded] = -1
    return routing


def replayed_reference(path: Path, batch, routing: torch.Tensor, temperature: float = 1.0):
    """(logprobs [B, L], loss -sum(logprob)/tokens, grads by HF name) of megarl's plain model in
    float64 routed by ``routing`` (the model's ``routing`` argument, itself checked against a
    float64 loop over tokens in tests/models/test_moe_replay.py)."""
    from megarl.models import load_model

    model = load_model(path, dtype=torch.float64)
    L = batch.response_length
    P = batch.input_ids.shape[1] - L
    logits = model(batch.input_ids, attention_mask=batch.attention_mask, routing=routing)
    logp = torch.log_softmax(logits[:, P - 1:-1].double() / temperature, -1)
    lp = logp.gather(-1, batch.input_ids[:, P:, None])[..., 0] * batch.attention_mask[:, P:]
    loss = -lp.sum() / float(batch.response_mask.sum())
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()
             if p.grad is not None}
    return lp.detach(), loss.detach(), grads


def replay_checks(res: dict, path: Path, key: str, recompute=None, **layout) -> None:
    """An actor with routing replay at ``layout`` on a batch whose ``routed_experts`` are
    random (`random_routing`), against `replayed_reference`: logprobs, loss and gradients
    (router and experts included) under ``key.replay_*``; the same forward without the
    routing, against transformers (the routers route: ``key.replay_off_logprob``); and the
    replay metrics (``key.replay_flipped``, ``key.replay_gap``: the logprob gap without replay,
    taking the reference's replayed logprobs as the engine's)."""
    from megarl.backends.megatron import MegatronBackend
    from megarl.backends.protocol import SequenceBatch

    be = MegatronBackend("actor", str(path), optim=lib.RESHARD_OPTIM,
                         use_distributed_optimizer=False, router_replay=True,
                         recompute=recompute, **layout)
    batch = lib.make_batch(B=4, seed=1)
    plain = SequenceBatch(batch.input_ids, batch.attention_mask, batch.response_length)
    batch.tensors["routed_experts"] = random_routing(batch, path)
    ref_lp, ref_loss, ref_grads = replayed_reference(path, batch, batch.tensors["routed_experts"],
                                                     TEMPERATURE)
    lp, _ = be.logprobs(batch, temperature=TEMPERATURE)
    res[f"{key}.replay_logprob"] = lib.max_diff(lp, ref_lp)
    from fp32_bounds import fp32_ref_gap_bound

    res[f"{key}.replay_tol"] = fp32_ref_gap_bound(path, int(batch.response_mask.sum()),
                                                  TEMPERATURE)
    res[f"{key}.replay_grads_tol"] = lib.fp32_grad_tol(path, batch, TEMPERATURE)
    hf_lp, _, _ = lib.hf_logprobs(hf_moe_model(path), plain, temperature=TEMPERATURE)
    res[f"{key}.replay_off_logprob"] = lib.max_diff(be.logprobs(plain, temperature=TEMPERATURE)[0],
                                                    hf_lp.detach())
    metrics = be.routing_metrics(batch, ref_lp.float(), TEMPERATURE)
    res[f"{key}.replay_flipped"] = metrics["moe/replay_flipped_fraction"]
    res[f"{key}.replay_gap"] = metrics["rollout/logprob_abs_diff_max_no_replay"]
    mbs, n = dp_share(batch, be)
    dp = be.dp_size
    out = be.train_step(mbs, lambda o, mb: lib.pg_loss(o, mb, n / dp), temperature=TEMPERATURE)
    grads = {k: v.cpu() for k, v in be.export_grads()}
    res[f"{key}.replay_loss"] = abs(out["loss"] - float(ref_loss))
    res[f"{key}.replay_grads"] = max(lib.rel_diff(grads[k], ref_grads[k]) for k in ref_grads)
    del be


def replay_failures(res: dict, key: str) -> list[str]:
    """What `replay_checks` recorded under ``key`` that is out of bounds."""
    tols = {"replay_logprob": res[f"{key}.replay_tol"], "replay_loss": res[f"{key}.replay_tol"],
            "replay_off_logprob": res[f"{key}.replay_tol"],
            "replay_grads": res[f"{key}.replay_grads_tol"]}
    out = [f"{key}.{m} = {res[f'{key}.{m}']} (tolerance {tol})" for m, tol in tols.items()
           if not res[f"{key}.{m}"] < tol]
    if not res[f"{key}.replay_flipped"] > 0.5:  # random routing: most recorded rows differ
        out.append(f"{key}.replay_flipped = {res[f'{key}.replay_flipped']} (expected > 0.5)")
    if not res[f"{key}.replay_gap"] > 0.1:  # without replay the logprobs move
        out.append(f"{key}.replay_gap = {res[f'{key}.replay_gap']} (expected > 0.1)")
    return out
