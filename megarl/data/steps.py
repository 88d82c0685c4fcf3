"""Reasoning steps in token space, and the PRM's input (shared by PRM training and inference).

A step ends at every response token whose decoded text ends with the separator (default
"\\n\\n") and at the last valid response token (EOS, or the last token of a truncated
response). The PRM scores each step at its step-end token.

PRM input. PURE's PRM was trained with "\\n" after each step, so its verl branch rebuilds the
input with the step-end token replaced; when the separator is one token this is a one-for-one
substitution at the step-end positions, which is what ``replace_step_end_with`` does (every
other position, and the alignment of the response columns, is unchanged). The embedded demo
PRM is trained on the unchanged sequence (its tokenizer has "\\n\\n" as a single token, and the
final step ends at ``<|im_end|>``), i.e. ``replace_step_end_with=None``: the PRM sees exactly
the actor's prompt + response.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def step_end_token_ids(tokenizer, separator: str = "\n\n") -> list[int]:
    """Every vocabulary id whose decoded text ends with ``separator`` (sorted)."""
    if not separator:
        raise ValueError("the step separator must be a non-empty string")
    ids = []
    for i in range(len(tokenizer)):
        text = tokenizer.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if text.endswith(separator):
            ids.append(i)
    if not ids:
        raise ValueError(
            f"no token of this tokenizer decodes to text ending with {separator!r}; "
            f"choose another step separator"
        )
    return ids


def step_end_mask(
    response_ids: torch.Tensor, response_mask: torch.Tensor, step_end_ids: list[int] | torch.Tensor
) -> torch.Tensor:
    """Step ends of right-padded responses.

    response_ids, response_mask: [B, L] (mask 1 on real tokens, right-padded)
    Returns bool [B, L]: True at separator tokens inside the mask and at the last valid token
    of every non-empty response.
    """
    valid = response_mask.bool()
    ends = torch.isin(response_ids, torch.as_tensor(step_end_ids, dtype=response_ids.dtype,
                                                    device=response_ids.device)) & valid
    lengths = valid.sum(-1)
    rows = torch.nonzero(lengths > 0).squeeze(-1)
    ends[rows, lengths[rows] - 1] = True
    return ends


@dataclass
class PRMInputs:
    """input_ids, attention_mask: [B, P+L] in the SequenceBatch layout; step_mask: bool [B, L]
    marking the response columns whose PRM output scores a step (label 1 = correct step)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    step_mask: torch.Tensor


def build_prm_inputs(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_length: int,
    step_end_ids: list[int] | torch.Tensor,
    replace_step_end_with: int | None = None,
) -> PRMInputs:
    """The PRM's input for a batch of prompt (left-padded) + response (right-padded) rows.

    input_ids, attention_mask: [B, P+L]; response_length: L.
    replace_step_end_with: None keeps the sequence as is (the embedded demo PRM); a token id
    substitutes every step-end token (PURE-style PRMs trained with "\\n" after each step).
    """
    L = response_length
    if L <= 0 or L > input_ids.shape[1]:
        raise ValueError(f"response_length={L} does not fit input_ids of width {input_ids.shape[1]}")
    mask = step_end_mask(input_ids[:, -L:], attention_mask[:, -L:], step_end_ids)
    ids = input_ids
    if replace_step_end_with is not None:
        ids = input_ids.clone()
        ids[:, -L:][mask] = int(replace_step_end_with)
    return PRMInputs(input_ids=ids, attention_mask=attention_mask, step_mask=mask)
