"""PRM scoring: split responses into steps and read the PRM's score at each step end.

A step ends at every response token whose decoded text ends with the separator (default
"\\n\\n", so merged tokens such as ".\\n\\n" count) and at the last response token. The PRM
(a 2-label token classifier, label 1 = correct step) reads the prompt and the response with
every step-end token replaced by ``prm_step_token`` (PURE's "\\n"; with a tokenizer where the
separator is itself one token, pass the separator to keep the text unchanged), and its score
at step end k is r_k = p_k(correct) - p_k(incorrect) in [-1, 1].
"""

from __future__ import annotations

import torch

from megarl.backends.protocol import Backend
from megarl.trainer.advantage import last_token_mask
from megarl.trainer.batch import RolloutBatch


def step_end_token_table(tokenizer, separator: str) -> torch.Tensor:
    """[V] bool: token ids whose decoded text ends with ``separator``."""
    vocab_size = len(tokenizer)
    texts = tokenizer.batch_decode([[i] for i in range(vocab_size)],
                                   skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return torch.tensor([t.endswith(separator) for t in texts], dtype=torch.bool)


def single_token_id(tokenizer, text: str, field: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(
            f"{field}: {text!r} encodes to {len(ids)} tokens {ids} with this tokenizer; the PRM "
            "input needs a single-token step marker (set it to the step separator, or a "
            "one-token string)")
    return ids[0]


def step_end_mask(response_ids: torch.Tensor, response_mask: torch.Tensor,
                  table: torch.Tensor) -> torch.Tensor:
    """[B, L] float: 1 at separator tokens inside the response and at the last valid token."""
    table = table.to(response_ids.device)
    ids = response_ids.clamp(0, table.numel() - 1)
    is_sep = table[ids] & response_mask.bool()
    return torch.maximum(is_sep.to(torch.float32), last_token_mask(response_mask))


def score_steps(prm: Backend, batch: RolloutBatch, step_mask: torch.Tensor,
                prm_step_token_id: int | None) -> torch.Tensor:
    """[B, L] step rewards: p(correct) - p(incorrect) at step ends, 0 elsewhere."""
    seq = batch.sequence_batch()
    if prm_step_token_id is not None:
        # every step-end token (the final one included) is replaced by the marker, as PURE
        resp = seq.input_ids[:, -seq.response_length:]
        resp[step_mask.bool()] = prm_step_token_id
    logits = prm.token_scores(seq).to(torch.float32)  # [B, L, 2]
    probs = torch.softmax(logits, dim=-1)
    return (probs[..., 1] - probs[..., 0]) * step_mask
