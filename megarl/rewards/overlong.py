"""DAPO's soft overlong punishment, added to the verifiable reward by the trainer."""

from __future__ import annotations


def overlong_penalty(response_lengths, max_response_length: int, buffer_length: int, penalty_factor: float = 1.0):
    """Penalty per response, float32 tensor [B] in [-penalty_factor, 0].

    0 while length <= max_response_length - buffer_length, then falling linearly to
    -penalty_factor at length == max_response_length (and staying there beyond).
    response_lengths: [B] valid response tokens (tensor or sequence of ints).
    """
    import torch

    if not 0 < buffer_length <= max_response_length:
        raise ValueError(
            f"overlong buffer_length={buffer_length} must be in (0, max_response_length={max_response_length}]"
        )
    if penalty_factor < 0:
        raise ValueError(f"overlong penalty_factor={penalty_factor} must be >= 0")
    lengths = torch.as_tensor(response_lengths, dtype=torch.float32)
    exceed = (lengths - (max_response_length - buffer_length)).clamp(min=0)
    return (-exceed / buffer_length * penalty_factor).clamp(min=-penalty_factor)
