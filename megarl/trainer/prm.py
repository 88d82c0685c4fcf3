"""PRM scoring of one step batch: step ends -> PRM input -> r_k = p(correct) - p(incorrect).

Steps and the PRM input are defined once, in ``megarl.data.steps`` (shared with PRM training):
a step ends at every response token whose decoded text ends with the separator and at the last
response token; with ``prm_step_token`` set, every step-end token is replaced by it in the PRM
input (PURE's "\\n"), else the PRM reads the response unchanged.

Multi-turn trajectories (`megarl.rollout.agent`: the batch's ``response_mask`` has holes where
tool responses and template glue were appended) are split by model turn instead: each maximal
run of model tokens is one step, ending at its last token (`turn_end_mask`); tool responses and
glue are never scored, and the separator plays no part. ``prm_step_token`` then replaces each
turn's last token in the PRM input, as it replaces a single-turn response's step ends.
"""

from __future__ import annotations

import torch

from megarl.backends.protocol import Backend, SequenceBatch
from megarl.data.steps import build_prm_inputs, step_end_token_ids
from megarl.trainer.batch import RolloutBatch


def single_token_id(tokenizer, text: str, field: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(
            f"{field}: {text!r} encodes to {len(ids)} tokens {ids} with this tokenizer; the PRM "
            "input needs a single-token step marker (a one-token string, or null to keep the "
            "step-end tokens unchanged)")
    return ids[0]


def prm_step_settings(rm_cfg, tokenizer) -> tuple[list[int], int | None]:
    """(step-end token ids, PRM-input marker id or None) from ``reward_model``: steps end at
    tokens whose text ends with ``step_separator`` (PURE: ``split_step_char``); the marker is
    ``prm_step_token`` (PURE: ``step_separator``), one token."""
    ends = step_end_token_ids(tokenizer, rm_cfg.step_separator)
    marker = rm_cfg.prm_step_token
    marker_id = (single_token_id(tokenizer, marker, "reward_model.prm_step_token")
                 if marker else None)
    return ends, marker_id


def turn_end_mask(response_mask: torch.Tensor) -> torch.Tensor:
    """bool [B, L]: True at the last token of every maximal run of model tokens.

    response_mask: [B, L], 1 on the tokens the model generated (a multi-turn batch's: 0 on
    tool responses, template glue and padding). Each run is one model turn, so each row has
    one True per turn, at that turn's last generated token."""
    model = response_mask.bool()
    following = torch.cat([model[:, 1:], torch.zeros_like(model[:, :1])], dim=-1)
    return model & ~following


def is_multi_turn(batch: RolloutBatch) -> bool:
    """Whether the batch holds agent-loop trajectories (samples that carried their own
    response mask: `RolloutBatch.from_samples` then keeps the padding mask apart)."""
    return "response_padding_mask" in batch.tensors


def score_steps(prm: Backend, batch: RolloutBatch, step_end_ids: list[int],
                marker_id: int | None,
                by_turn: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(step_rewards [B, L] float: r_k at step ends, 0 elsewhere; step_mask [B, L] float).

    by_turn: steps are the model's turns (`turn_end_mask`) instead of the separator's steps;
    None: so for multi-turn batches (`is_multi_turn`)."""
    seq = batch.sequence_batch()
    L = seq.response_length
    if by_turn is None:
        by_turn = is_multi_turn(batch)
    if by_turn:
        steps = turn_end_mask(batch.response_mask)
        ids = seq.input_ids
        if marker_id is not None:
            ids = ids.clone()
            ids[:, -L:][steps] = int(marker_id)
        prm_batch = SequenceBatch(ids, seq.attention_mask, L)
    else:
        inputs = build_prm_inputs(seq.input_ids, seq.attention_mask, L, step_end_ids,
                                  replace_step_end_with=marker_id)
        prm_batch = SequenceBatch(inputs.input_ids, inputs.attention_mask, L)
        steps = inputs.step_mask
    probs = torch.softmax(prm.token_scores(prm_batch).to(torch.float32), dim=-1)  # [B, L, 2]
    step_mask = steps.to(torch.float32)
    return (probs[..., 1] - probs[..., 0]) * step_mask, step_mask
