"""Mixture-of-experts support of the torch backend.

Experts are ordinary parameters (``mlp.experts.{j}.*``), so FSDP2 shards them like the rest of
a decoder block; tensor parallelism refuses MoE models (`parallelize.check_tp_supported`).

`routing_metrics` runs a no-grad forward of a batch through a backend's model, recording the
routers (`megarl.models.moe.capture_router_logits`), and returns the metrics of
`megarl.models.moe_metrics.routing_metrics` over the batch's real tokens (padding excluded):
per-layer expert load (max / mean tokens per expert), router entropy, the load imbalance and
the auxiliary load-balancing loss.
"""

from __future__ import annotations

from typing import Any

import torch

from megarl.backends.protocol import SequenceBatch
from megarl.backends.torch.packing import pack
from megarl.models.moe import capture_router_logits
from megarl.models.moe_metrics import routing_metrics as _routing_metrics


@torch.no_grad()
def routing_metrics(backend: Any, batch: SequenceBatch, *, prefix: str = "moe/"
                    ) -> dict[str, float]:
    """Routing metrics of ``batch`` (all rows, packed into one row) under ``backend``'s model.

    Collective over the backend (every rank runs the same forward; FSDP gathers the experts);
    every rank returns the same dict. Without pipeline parallelism only (a stage sees only its
    own layers); ``{}`` for a dense model."""
    model = backend.model
    args = model.args
    if not args.is_moe:
        return {}
    if backend.layout.pp > 1:
        raise ValueError(
            "routing_metrics needs pipeline_model_parallel_size=1 (each stage holds only its "
            "own sparse layers)"
        )
    was_training = model.training
    model.eval()
    try:
        p = pack(batch, backend.device)
        with capture_router_logits(model) as router:
            model(p.input_ids, position_ids=p.position_ids, segment_ids=p.segment_ids,
                  output="hidden")
    finally:
        model.train(was_training)
    real = torch.zeros(p.seq_len, dtype=torch.bool, device=backend.device)
    real[: p.num_tokens] = True
    return _routing_metrics(router, args.num_experts, args.num_experts_per_tok, real,
                            prefix=prefix)
