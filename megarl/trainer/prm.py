"""PRM scoring of one step batch: step ends -> PRM input -> r_k = p(correct) - p(incorrect).

Steps and the PRM input are defined once, in ``megarl.data.steps`` (shared with PRM training):
a step ends at every response token whose decoded text ends with the separator and at the last
response token; with ``prm_step_token`` set, every step-end token is replaced by it in the PRM
input (PURE's "\\n"), else the PRM reads the response unchanged.
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


def score_steps(prm: Backend, batch: RolloutBatch, step_end_ids: list[int],
                marker_id: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(step_rewards [B, L] float: r_k at step ends, 0 elsewhere; step_mask [B, L] float)."""
    seq = batch.sequence_batch()
    inputs = build_prm_inputs(seq.input_ids, seq.attention_mask, seq.response_length,
                              step_end_ids, replace_step_end_with=marker_id)
    prm_batch = SequenceBatch(inputs.input_ids, inputs.attention_mask, seq.response_length)
    probs = torch.softmax(prm.token_scores(prm_batch).to(torch.float32), dim=-1)  # [B, L, 2]
    step_mask = inputs.step_mask.to(torch.float32)
    return (probs[..., 1] - probs[..., 0]) * step_mask, step_mask
