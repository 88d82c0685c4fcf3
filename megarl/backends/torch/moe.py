"""Mixture-of-experts support of the torch backend.

Experts are ordinary parameters (``mlp.experts.{j}.*``), so FSDP2 shards them like the rest of
a decoder block; tensor parallelism refuses MoE models (`parallelize.check_tp_supported`).

`routing_metrics` runs a no-grad forward of a batch through a backend's model, recording the
routers (`megarl.models.moe.capture_router_logits`), and returns the metrics of
`megarl.models.moe_metrics.routing_metrics` over the batch's real tokens (padding excluded):
per-layer expert load (max / mean tokens per expert), router entropy, the load imbalance and
the auxiliary load-balancing loss.

Routing replay (``router_replay`` of `TorchBackend`): `replay_routing` gives a packed
micro-batch's forward the ``routing`` argument of `Transformer.forward` from the batch's
``routed_experts`` tensor [B, P + L, n_sparse, k] (what the rollout engine recorded, carried by
`megarl.trainer.batch.RolloutBatch`), packed like the tokens. It is an argument of every layer's
call, so activation-checkpointing recomputes and pipeline stages (it travels with the
micro-batch through torch's schedule) replay the same experts; under Ulysses each rank replays
its sequence shard's rows.
`replay_metrics` measures what replay changes on a batch: the logprob gap to the engine had
the trainer routed by its own routers, and the fraction of recorded routing decisions its
routers would have flipped.

R2 (``router_replay.mode=R2``, verl's meaning): the trainer's own old-logprob pass records the
experts its routers choose (`record_logprobs`: the logprobs and, in the same forwards, the
routing [B, P + L, n_sparse, k] in the ``routed_experts`` layout); the step's batch carries
them to the update, whose forwards replay them (``router_replay`` on, as for R3). The policy
gradient is then taken through the routing of the policy that computed the old logprobs, even
after earlier mini-batches moved the routers. The reference routes by its own routers.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from megarl.backends.protocol import SequenceBatch
from megarl.backends.torch.packing import Packed, pack
from megarl.models.moe import capture_router_logits
from megarl.models.moe_metrics import routing_metrics as _routing_metrics

logger = logging.getLogger(__name__)


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
    with capture_router_logits(model) as router:
        p = _eval_forward(backend, batch)
    real = torch.zeros(p.seq_len, dtype=torch.bool, device=backend.device)
    real[: p.num_tokens] = True
    return _routing_metrics(router, args.num_experts, args.num_experts_per_tok, real,
                            prefix=prefix)


def _eval_forward(backend: Any, batch: SequenceBatch) -> Packed:
    """One eval-mode forward of ``batch`` packed into one row (the routers' own routing, no
    replay); returns the packing. For the recorders wrapped around it."""
    model = backend.model
    was_training = model.training
    model.eval()
    try:
        p = pack(batch, backend.device)
        model(p.input_ids, position_ids=p.position_ids, segment_ids=p.segment_ids,
              output="hidden")
    finally:
        model.train(was_training)
    return p


def packed_routing(batch: SequenceBatch, p: Packed, device: torch.device) -> torch.Tensor:
    """[T, n_sparse, k] routing of ``batch`` packed as ``p`` (`packing.pack`): the real tokens'
    rows in row order, -1 on the padding tail (routed by the router)."""
    routing = batch.tensors["routed_experts"]
    if routing.dim() != 4 or tuple(routing.shape[:2]) != tuple(batch.input_ids.shape):
        raise ValueError(
            f"routed_experts must be [B, P+L, n_sparse, k] like input_ids "
            f"{tuple(batch.input_ids.shape)}, got {tuple(routing.shape)}"
        )
    real = routing.to(device)[batch.attention_mask.to(device).bool()]
    out = torch.full((p.seq_len, *routing.shape[2:]), -1, dtype=routing.dtype, device=device)
    out[: p.num_tokens] = real
    return out


def replay_routing(backend: Any, batch: SequenceBatch, p: Packed) -> torch.Tensor | None:
    """The ``routing`` argument of the model's forward of ``batch`` packed as ``p``: [1, T,
    n_sparse, k] recorded experts when ``backend.router_replay`` is on and the batch carries
    ``routed_experts`` (under Ulysses this rank's sequence shard of them); None (the routers
    route) otherwise."""
    recorder = getattr(backend, "_r2_recorder", None)
    if recorder is not None:  # R2's recording pass (`record_logprobs`): the routers route
        recorder.next_forward(batch)
        return None
    if not backend.router_replay:
        return None
    if "routed_experts" not in batch.tensors:
        if getattr(backend, "router_replay_mode", "R3") == "R2":
            return None  # no recording pass ran: on-policy, the routers route as they would
        if batch.batch_size and not getattr(backend, "_warned_no_routing", False):
            logger.warning("%s: router_replay is on but a batch carries no routed_experts; its "
                           "forwards route with the current routers", backend.role)
            backend._warned_no_routing = True
        return None
    routing = packed_routing(batch, p, backend.device)
    if backend._shard is not None:  # Ulysses: this rank's sequence shard
        start, t = backend._shard.span(p)
        routing = routing[start:start + t]
    return routing[None]


def pipeline_routing(backend: Any, batches: list[SequenceBatch], packed: list[Packed]
                     ) -> list[torch.Tensor] | None:
    """`replay_routing` of each micro-batch of a pipeline step (None: nothing to replay); a
    micro-batch without ``routed_experts`` (the schedule's filler) gets -1 rows (the router
    routes), as torch's schedule splits one tensor over all of them."""
    routings = [replay_routing(backend, b, p) for b, p in zip(batches, packed)]
    if all(r is None for r in routings):
        return None
    like = next(r for r in routings if r is not None)
    return [r if r is not None else torch.full((1, p.seq_len, *like.shape[2:]), -1,
                                               dtype=like.dtype, device=like.device)
            for r, p in zip(routings, packed)]


@torch.no_grad()
def replay_metrics(backend: Any, batch: SequenceBatch, rollout_logprob: torch.Tensor,
                   temperature: float = 1.0) -> dict[str, float]:
    """What routing replay changes on ``batch`` (a rollout with ``routed_experts``), for a
    check step of a backend with ``router_replay`` on ({} otherwise):

    ``rollout/logprob_abs_diff_{mean,max}_no_replay``: the engine/trainer logprob gap
    (`megarl.algos.rollout_correction.logprob_diff_metrics`) had the trainer routed by its own
    routers; ``moe/replay_flipped_fraction``: the fraction of (token, sparse layer) routing
    decisions the engine recorded whose expert set the trainer's routers would not choose.
    Collective like ``logprobs``; without pipeline parallelism."""
    from megarl.algos.rollout_correction import logprob_diff_metrics
    from megarl.models.moe import record_experts, sparse_layers

    if not backend.router_replay or "routed_experts" not in batch.tensors:
        return {}
    backend.router_replay = False
    try:
        plain, _ = backend.logprobs(batch, temperature=temperature)
    finally:
        backend.router_replay = True
    out = {f"{k}_no_replay": v for k, v in logprob_diff_metrics(
        rollout_logprob, plain, batch.tensors.get("response_mask", batch.response_mask)).items()}
    with record_experts(backend.model) as chosen:
        p = _eval_forward(backend, batch)
    own = torch.stack([chosen[i] for i in sparse_layers(backend.model.args)],
                      dim=1)[: p.num_tokens]
    recorded = packed_routing(batch, p, backend.device)[: p.num_tokens].long()
    ran = (recorded >= 0).all(-1)
    flipped = (own.sort(-1).values != recorded.sort(-1).values).any(-1) & ran
    out["moe/replay_flipped_fraction"] = float(flipped.sum()) / max(int(ran.sum()), 1)
    return out


class _PassRecorder(dict):
    """`record_experts`' sink for a no-grad pass of several forwards: each forward's experts
    ({layer index: [T, k]}) go to the piece `next_forward` announced before it."""

    def __init__(self) -> None:
        super().__init__()
        self.pieces: list[tuple[SequenceBatch, dict[int, torch.Tensor]]] = []

    def next_forward(self, piece: SequenceBatch) -> None:
        self.pieces.append((piece, {}))

    def __setitem__(self, layer: int, experts: torch.Tensor) -> None:
        self.pieces[-1][1][layer] = experts


ROW_KEY = "_r2_row"  # the batch row of each row of a piece (`record_logprobs`)


def record_logprobs(backend: Any, batch: SequenceBatch, temperature: float = 1.0,
                    with_entropy: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """R2's old-logprob pass: ``backend.logprobs(batch, temperature, with_entropy)`` with the
    routers routing (whatever ``routed_experts`` the batch carries is ignored), plus the experts
    they chose in the same forwards: [B, P + L, n_sparse, k] int16 like ``routed_experts`` (-1
    on padding), the update's replay targets. Collective like ``logprobs`` (every rank returns
    the whole batch's routing); without pipeline parallelism or Ulysses."""
    with recording_routing(backend, batch) as (tagged, out):
        lp, ent = backend.logprobs(tagged, temperature=temperature, with_entropy=with_entropy)
    return lp, ent, out["routed_experts"]


@contextlib.contextmanager
def recording_routing(backend: Any, batch: SequenceBatch
                      ) -> Iterator[tuple[SequenceBatch, dict[str, torch.Tensor]]]:
    """Record the routing of a no-grad pass over ``batch``: yields (the batch to give the
    pass: ``batch`` without ``routed_experts``, its rows tagged, a dict); on exit the dict holds
    ``routed_experts`` [B, P + L, n_sparse, k] int16 of the routers' choices (`record_logprobs`).
    Collective on exit (DP ranks exchange their rows)."""
    from megarl.backends.routing import check_r2_layout
    from megarl.models.moe import moe_blocks, routing_dtype, sparse_layers, stack_layers

    args = backend.model.args
    check_r2_layout(args, pp=backend.layout.pp, sp=backend.layout.ulysses)
    B, S = batch.input_ids.shape
    tensors = {k: v for k, v in batch.tensors.items() if k != "routed_experts"}
    tensors[ROW_KEY] = torch.arange(B)
    tagged = SequenceBatch(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                           response_length=batch.response_length, tensors=tensors)
    recorder = _PassRecorder()
    blocks = list(moe_blocks(backend.model).values())
    backend._r2_recorder = recorder
    for block in blocks:  # each block writes {its layer: experts [T, k]} of every forward
        block.recorded = recorder
    result: dict[str, torch.Tensor] = {}
    try:
        yield tagged, result
    finally:
        backend._r2_recorder = None
        for block in blocks:
            block.recorded = None
    n, k = len(sparse_layers(args)), args.num_experts_per_tok
    out = torch.full((B, S, n, k), -1, dtype=torch.long, device=backend.device)
    for piece, chosen in recorder.pieces:
        if not piece.batch_size:
            continue
        mask = piece.attention_mask.to(backend.device).bool()
        real = stack_layers(chosen, args).long()[: int(mask.sum())]
        rows = piece.tensors[ROW_KEY].to(backend.device)
        sub = torch.full((piece.batch_size, S, n, k), -1, dtype=torch.long, device=backend.device)
        sub[mask] = real
        out[rows] = sub
    if backend.dp_size > 1:  # each row was computed on one DP rank; -1 elsewhere
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=backend.dp_group)
    result["routed_experts"] = out.to(routing_dtype(args.num_experts)).cpu()
