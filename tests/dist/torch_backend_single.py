"""Single-process (world of one) TorchBackend checks, run by torch_backend_worker.py single:
transformers float64 references, padding invariance, micro-batch accumulation, step skipping,
the LR schedule inside train_step, loading the TP=2 checkpoint at TP=1, bf16, roles."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch_backend_ref as R
import torch_backend_worker as W

from megarl.backends.protocol import SequenceBatch
from megarl.backends.torch import TorchBackend


def hf_reference(path: str, head: str):
    """transformers' own model in float64 (independent of megarl.models)."""
    import transformers

    cls = (transformers.AutoModelForCausalLM if head == "lm"
           else transformers.AutoModelForTokenClassification)
    return cls.from_pretrained(path, dtype=torch.float64).eval()


def hf_logits(model, batch: SequenceBatch) -> torch.Tensor:
    pos = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                     position_ids=pos).logits


def repad(batch: SequenceBatch, left: int, right: int) -> SequenceBatch:
    """The same sequences with ``left`` more prompt columns and ``right`` more response
    columns of padding."""
    B, L = batch.batch_size, batch.response_length
    P = batch.input_ids.shape[1] - L

    def widen(t, fill=0):
        out = torch.full((B, P + left + L + right), fill, dtype=t.dtype)
        out[:, left : left + P + L] = t
        return out

    return SequenceBatch(widen(batch.input_ids, 7), widen(batch.attention_mask), L + right)


def hand_lr(k: int, lr: float, warmup: int, total: int, floor: float) -> float:
    if k < warmup:
        return lr * k / warmup
    p = (k - warmup) / (total - warmup)
    return lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p)))


def run_single(models: dict, work: Path, res) -> None:
    main, batch = models["main"], W.BATCH
    L = batch.response_length
    P = batch.input_ids.shape[1] - L
    resp = batch.attention_mask[:, P:].double()

    # --- logprobs / entropy vs transformers float64 --------------------------------------
    actor = TorchBackend("actor", main, optim=W.OPT)
    res["plain_unwrapped"] = type(actor.model).__name__ == "Transformer" and not any(
        "DTensor" in type(p).__name__ for p in actor.model.parameters()
    )
    lp, ent = actor.logprobs(batch, R.TEMPERATURE, with_entropy=True)
    logp = torch.log_softmax(hf_logits(hf_reference(main, "lm"), batch)[:, P - 1 : -1] / R.TEMPERATURE, -1)
    hlp = logp.gather(-1, batch.input_ids[:, P:, None])[..., 0] * resp
    hent = -(logp.exp() * logp).sum(-1) * resp
    res["hf64/logprob_err"] = float((lp.double() - hlp).abs().max())
    res["hf64/entropy_err"] = float((ent.double() - hent).abs().max())
    res["hf64/zero_outside_mask"] = bool((lp[resp == 0] == 0).all() and (ent[resp == 0] == 0).all())

    # --- padding and micro-batching do not change results --------------------------------
    wide = repad(batch, 3, 2)
    lp_wide, _ = actor.logprobs(wide, R.TEMPERATURE)
    res["padded/extra_padding_err"] = float((lp_wide[:, :L] - lp).abs().max())
    res["padded/extra_columns_zero"] = bool((lp_wide[:, L:] == 0).all())
    one_row = TorchBackend("ref", main, forward_micro_batch_size=1)
    lp_rows, _ = one_row.logprobs(batch, R.TEMPERATURE)
    res["padded/row_by_row_err"] = float((lp_rows - lp).abs().max())
    res["ref/equals_actor"] = torch.equal(one_row.logprobs(batch, R.TEMPERATURE,
                                                           micro_batches=[list(range(6))])[0],
                                          actor.logprobs(batch, R.TEMPERATURE,
                                                         micro_batches=[list(range(6))])[0])
    try:
        one_row.train_step([batch], W.policy(1))
        res["ref/frozen"] = False
    except TypeError:
        res["ref/frozen"] = not any(p.requires_grad for p in one_row.model.parameters())

    # --- accumulation over 3 unequal micro-batches == whole-batch autograd ---------------
    ref = R.reference_model(main)
    _, mbs = W.micro(actor)
    captured: list = []
    actor.forward_backward(mbs, W.policy(1, captured), R.TEMPERATURE)
    res["accum/grad_err"] = R.max_err(dict(actor.full_grads()), R.ref_grads(ref, batch))
    lp_same, _ = actor.logprobs(batch, R.TEMPERATURE, micro_batches=W.rank_split(1)[0])
    res["accum/bit_identical"] = all(
        torch.equal(lp_same[rows], c) for rows, c in zip(W.rank_split(1)[0], captured)
    )
    actor.optimizer.zero_grad(set_to_none=True)

    # --- naive log_softmax path == fused kernel path -------------------------------------
    naive = TorchBackend("actor", main, use_fused_kernels=False, optim=W.OPT)
    res["naive/logprob_err"] = float((naive.logprobs(batch, R.TEMPERATURE)[0] - lp).abs().max())
    naive.forward_backward(mbs, W.policy(1), R.TEMPERATURE)
    res["naive/grad_err"] = R.max_err(dict(naive.full_grads()), R.ref_grads(ref, batch))

    # --- activation checkpointing changes nothing ----------------------------------------
    ac = TorchBackend("actor", main, activation_checkpointing=True, optim=W.OPT)
    ac.forward_backward(mbs, W.policy(1), R.TEMPERATURE)
    res["ac/grad_err"] = R.max_err(dict(ac.full_grads()), R.ref_grads(ref, batch))

    # --- LR schedule inside train_step, with a skipped (non-finite) step -----------------
    sched = {"lr_scheduler_type": "cosine", "lr_warmup_steps": 2, "total_training_steps": 6,
             "min_lr_ratio": 0.1}
    be = TorchBackend("actor", main, optim={**W.OPT, **sched})

    def nan_loss(out, mb):
        loss, m = W.policy(1)(out, mb)
        return loss * float("nan"), m

    before = dict(be.export_weights())
    lrs, skipped = [], []
    for i, fn in enumerate((W.policy(1), W.policy(1), nan_loss, W.policy(1), W.policy(1))):
        m = be.train_step(mbs, fn, R.TEMPERATURE)
        lrs.append(m["lr"])
        skipped.append(m["skipped"])
        if i == 0:  # warmup step 0 has lr 0: AdamW (and its weight decay) changes nothing
            res["sched/lr0_step_unchanged"] = W.exact(before, dict(be.export_weights()))
    want = [hand_lr(k, 1e-3, 2, 6, 0.1) for k in (0, 1, 2, 2, 3)]
    res["sched/lr_err"] = max(abs(a - b) for a, b in zip(lrs, want))
    res["sched/skip_flags"] = skipped == [0.0, 0.0, 1.0, 0.0, 0.0]
    res["sched/step_counter"] = be.step == 4

    # --- trained weights -> HF folder -> transformers gives the same logprobs ------------
    from megarl.models import save_hf_checkpoint

    out_dir = save_hf_checkpoint(work / "hf_export", be.export_weights(), be.hf_export_config())
    logp = torch.log_softmax(hf_logits(hf_reference(str(out_dir), "lm"), batch)[:, P - 1 : -1] / R.TEMPERATURE, -1)
    hlp = logp.gather(-1, batch.input_ids[:, P:, None])[..., 0] * resp
    res["hf_export/logprob_err"] = float((be.logprobs(batch, R.TEMPERATURE)[0].double() - hlp).abs().max())

    # --- the TP=2 checkpoint at TP=1 -----------------------------------------------------
    W.check_dcp_load("tp2_to_tp1", main, {}, res, work)

    # --- bf16 --------------------------------------------------------------------------
    b16 = TorchBackend("actor", main, dtype="bf16", optim=W.OPT)
    lp16, _ = b16.logprobs(batch, R.TEMPERATURE)
    res["bf16/logprob_close"] = float((lp16 - lp).abs().max())
    m = b16.train_step(mbs, W.policy(1), R.TEMPERATURE)
    exported = dict(b16.export_weights())
    res["bf16/trains"] = m["skipped"] == 0.0 and math.isfinite(m["grad_norm"])
    res["bf16/fp32_masters"] = all(t.dtype == torch.float32 for t in exported.values())
    ref16 = TorchBackend("ref", main, dtype="bf16")
    res["bf16/ref_bf16_weights"] = all(t.dtype == torch.bfloat16 for _, t in ref16.export_weights())
    res["bf16/ref_logprob_close"] = float((ref16.logprobs(batch, R.TEMPERATURE)[0] - lp).abs().max())

    # --- critic and PRM heads vs transformers float64 ------------------------------------
    critic = TorchBackend("critic", models["critic"], optim=W.OPT)
    hv = hf_logits(hf_reference(models["critic"], "token_cls"), batch)[:, P - 1 : -1, 0] * resp
    res["critic/values_err"] = float((critic.values(batch).double() - hv).abs().max())
    prm = TorchBackend("prm", models["prm"])
    hs = hf_logits(hf_reference(models["prm"], "token_cls"), batch)[:, P:] * resp[..., None]
    res["prm/scores_err"] = float((prm.token_scores(batch).double() - hs).abs().max())
    fresh = [TorchBackend("critic", main, seed=3).values(batch) for _ in range(2)]
    res["critic/fresh_head_seeded"] = torch.equal(fresh[0], fresh[1]) and bool(fresh[0].abs().sum() > 0)
