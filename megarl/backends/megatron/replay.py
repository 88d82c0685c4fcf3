"""Routing replay (R3) on megatron-core's MoE routers.

The rollout engine records, for every token, the k experts each sparse layer routed it to
(``routed_experts`` [B, P + L, n_sparse, k] in the batch, -1 where it recorded none). With
replay on, the actor's forwards route each token to those experts instead of the router's own
top-k, so the trainer's logprobs are those of the computation that sampled the tokens.

megatron-core's ``TopKRouter`` asks ``router.router_replay.get_replay_topk(scores, topk, ...)``
for its top-k whenever that attribute is set. `RoutingReplay` answers it: the router's own
top-k where a token has no recorded row (-1), the recorded experts elsewhere, with the gate
weights taken at the recorded experts (for ``norm_topk_prob`` megatron then softmaxes the k
gathered logits: the probabilities at the replayed experts divided by their sum, as the torch
backend's replay). megatron's own ``RouterReplay`` replaces a layer's routing wholesale and is
driven by global switches; this one keeps the torch backend's -1 rule and serves several models
per process.

Token order: megatron's router sees a micro-batch as [s, b] flattened (s major), after
`batching.to_micro_batch` moved each row's real tokens to its first columns; under sequence
parallelism TP rank r routes the r-th of tp equal slices of s. `layout_routing` and
`router_targets` put the recorded experts in that order.

R2 (``router_replay.mode=R2``): `record_logprobs` is the old-logprob pass with each router
recording the top-k it chose (in the token order above, mapped back to the batch's
[B, P + L] layout and gathered over all ranks); the batch then carries that routing as
``routed_experts`` into the update, whose forwards replay it as R3's.

Activation recompute: a layer checkpointed by megatron runs its router first under no-grad
(inside the checkpoint's forward) and again during the backward pass. A forward under no-grad
while training queues its targets; the backward's run takes them in order (micro-batches are
recomputed in the order they ran, each layer has its own queue).
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from megarl.backends.protocol import SequenceBatch
from megarl.models.moe import sparse_layers


class RoutingReplay:
    """The ``router_replay`` of one megatron ``TopKRouter`` (sparse layer ``sparse_index``)."""

    def __init__(self, sparse_index: int) -> None:
        self.sparse_index = sparse_index
        self.target: torch.Tensor | None = None  # [tokens, k] for the next forwards
        self.training = False
        self.apply = True  # False: only count how the router's choice differs from target
        self.queued: deque[torch.Tensor] = deque()
        self.counting = False
        self.flipped = 0  # recorded rows whose expert set the router did not choose
        self.recorded = 0  # recorded rows counted
        self.current: Any = None  # the micro-batch of the next forwards (`arm`)
        self.sink: list[tuple[Any, torch.Tensor]] | None = None  # R2: (micro-batch, top-k)

    def arm(self, target: torch.Tensor | None, training: bool, *, counting: bool = False,
            apply: bool = True) -> None:
        self.target, self.training = target, training
        self.counting, self.apply = counting, apply

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        values, own = default_compute_topk(scores, topk, num_groups=num_groups,
                                           group_topk=group_topk)
        in_backward = torch._C._current_graph_task_id() != -1
        if in_backward:
            target = self.queued.popleft() if self.queued else None
        else:
            target = self.target
            if target is not None and self.training and not torch.is_grad_enabled():
                self.queued.append(target)  # a checkpointed layer: its backward routes again
        if target is None:
            return values, self._record(own, in_backward)
        if tuple(target.shape) != tuple(own.shape):
            raise ValueError(
                f"routed_experts give {tuple(target.shape)} routing rows for a router that "
                f"routes {tuple(own.shape)} (sparse layer {self.sparse_index})"
            )
        target = target.to(own.device)
        recorded = (target >= 0).all(-1, keepdim=True)
        if self.counting and not in_backward:
            differs = (own.sort(-1).values != target.sort(-1).values).any(-1)
            self.flipped += int((differs & recorded[:, 0]).sum())
            self.recorded += int(recorded.sum())
        if not self.apply:
            return values, self._record(own, in_backward)
        chosen = torch.where(recorded, target, own)
        return scores.gather(1, chosen), self._record(chosen, in_backward)

    def _record(self, experts: torch.Tensor, in_backward: bool) -> torch.Tensor:
        """With a ``sink`` (R2's `record_logprobs`, tests): keep the experts a forward routes
        its tokens to, with the micro-batch they belong to."""
        if self.sink is not None and not in_backward:
            self.sink.append((self.current, experts.detach().clone()))
        return experts


def install(chunks: Iterable[torch.nn.Module], args: Any) -> list[RoutingReplay]:
    """Give every MoE router in ``chunks`` a `RoutingReplay` (its sparse index from the
    router's 1-based global ``layer_number``); returns them."""
    from megatron.core.transformer.moe.router import TopKRouter

    index = {layer: j for j, layer in enumerate(sparse_layers(args))}
    out = []
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, TopKRouter):
                module.router_replay = RoutingReplay(index[module.layer_number - 1])
                out.append(module.router_replay)
    return out


def replays_of(model: torch.nn.Module) -> list[RoutingReplay]:
    """The `RoutingReplay` objects of the routers inside ``model`` (a model chunk, wrapped)."""
    return [m.router_replay for m in model.modules()
            if isinstance(getattr(m, "router_replay", None), RoutingReplay)]


def layout_routing(mb: Any, routed: torch.Tensor) -> torch.Tensor:
    """[rows, S, n_sparse, k] routing in ``mb``'s layout (`batching.MicroBatch`: row i's real
    tokens in its first ``lengths[i]`` columns; rows and columns past them -1) from the
    caller's ``routed`` [B, P + L, n_sparse, k] of ``mb.source`` (left/right padded)."""
    source = mb.source
    if routed.dim() != 4 or tuple(routed.shape[:2]) != tuple(source.input_ids.shape):
        raise ValueError(
            f"routed_experts must be [B, P+L, n_sparse, k] like input_ids "
            f"{tuple(source.input_ids.shape)}, got {tuple(routed.shape)}"
        )
    mask = source.attention_mask.to(routed.device).bool()
    rows, cols = mask.nonzero(as_tuple=True)
    shifted = mask.long().cumsum(1)[rows, cols] - 1
    out = torch.full((*mb.input_ids.shape, *routed.shape[2:]), -1, dtype=torch.long,
                     device=routed.device)
    out[rows, shifted] = routed[rows, cols].long()
    return out


def router_targets(layout: torch.Tensor, sparse_index: int, tp: int, tp_rank: int,
                   sequence_parallel: bool) -> torch.Tensor:
    """[tokens, k] targets of one router: sparse layer ``sparse_index`` of ``layout``
    ([rows, S, n_sparse, k]) in megatron's s-major order, this TP rank's slice of s under
    sequence parallelism."""
    t = layout[:, :, sparse_index].transpose(0, 1)  # [S, rows, k]
    if sequence_parallel and tp > 1:
        t = t.chunk(tp, dim=0)[tp_rank]
    return t.reshape(-1, t.shape[-1])


def arm(model: torch.nn.Module, mb: Any, *, tp: int, tp_rank: int, sequence_parallel: bool,
        counting: bool = False, apply: bool = True) -> bool:
    """Set the targets of ``model``'s routers for the forward of ``mb`` (its source's
    ``routed_experts``; none: the routers route). ``apply=False``: the routers route and, with
    ``counting``, count where they differ from the targets. Returns whether ``mb`` carries
    routing."""
    routed = mb.source.tensors.get("routed_experts")
    replays = replays_of(model)
    for r in replays:
        r.current = mb
    training = torch.is_grad_enabled()
    if routed is None:
        for r in replays:
            r.arm(None, training)
        return False
    layout = layout_routing(mb, routed.to(mb.input_ids.device))
    for r in replays:
        r.arm(router_targets(layout, r.sparse_index, tp, tp_rank, sequence_parallel), training,
              counting=counting, apply=apply)
    return True


@contextlib.contextmanager
def disarmed_after(replays: Iterable[RoutingReplay]) -> Iterator[None]:
    """Run a schedule; afterwards forwards route by the routers until armed again."""
    try:
        yield
    finally:
        for r in replays:
            r.arm(None, False)
            r.queued.clear()


def replay_metrics(backend: Any, batch: SequenceBatch, rollout_logprob: torch.Tensor,
                   temperature: float = 1.0) -> dict[str, float]:
    """What routing replay changes on ``batch`` (a rollout with ``routed_experts``), as the
    torch backend reports it (`megarl.backends.torch.moe.replay_metrics`), from one forward in
    which the routers route by themselves:

    ``rollout/logprob_abs_diff_{mean,max}_no_replay``: the engine/trainer logprob gap had the
    trainer routed by its own routers; ``moe/replay_flipped_fraction``: the fraction of (token,
    sparse layer) routing decisions the engine recorded whose expert set the trainer's routers
    choose differently. Collective over the backend's ranks (each routes distinct tokens: its
    DP rows, its sequence slice under SP, its stage's layers)."""
    from megarl.algos.rollout_correction import logprob_diff_metrics

    if "routed_experts" not in batch.tensors:
        return {}
    for r in backend._replays:
        r.flipped = r.recorded = 0
    backend._measure_replay = True
    try:
        plain, _ = backend.logprobs(batch, temperature=temperature)
    finally:
        backend._measure_replay = False
    mask = batch.tensors.get("response_mask", batch.response_mask)
    out = {f"{k}_no_replay": v
           for k, v in logprob_diff_metrics(rollout_logprob, plain, mask).items()}
    counts = torch.tensor([sum(r.flipped for r in backend._replays),
                           sum(r.recorded for r in backend._replays)], dtype=torch.float64,
                          device=plain.device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(counts)
    out["moe/replay_flipped_fraction"] = float(counts[0]) / max(float(counts[1]), 1.0)
    return out


ROW_KEY = "_r2_row"  # the batch row of each row of a micro-batch (`record_logprobs`)


def record_logprobs(backend: Any, batch: SequenceBatch, temperature: float = 1.0,
                    with_entropy: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """R2's old-logprob pass on a `MegatronBackend` with routing replay installed:
    ``backend.logprobs(batch, temperature, with_entropy)`` with the routers routing (any
    ``routed_experts`` of the batch ignored), plus the experts they chose in the same forwards,
    [B, P + L, n_sparse, k] int16 like ``routed_experts`` (-1 on padding): the update's replay
    targets. Collective over all ranks (`assemble`)."""
    with recording_routing(backend, batch) as (tagged, out):
        lp, ent = backend.logprobs(tagged, temperature=temperature, with_entropy=with_entropy)
    return lp, ent, out["routed_experts"]


@contextlib.contextmanager
def recording_routing(backend: Any, batch: SequenceBatch
                      ) -> Iterator[tuple[SequenceBatch, dict[str, torch.Tensor]]]:
    """Record the routing of a no-grad pass over ``batch``: yields (the batch to give the
    pass: ``batch`` without ``routed_experts``, its rows tagged, a dict); on exit the dict holds
    ``routed_experts`` [B, P + L, n_sparse, k] int16 (`assemble`; collective on exit)."""
    from megarl.backends.routing import REPLAY_KEY
    from megarl.errors import UserInputError

    if not backend._replays:
        raise UserInputError(f"{REPLAY_KEY}=R2 records through the routing replay hooks: build "
                             "the actor with router_replay on (a mixture-of-experts policy)")
    tensors = {k: v for k, v in batch.tensors.items() if k != "routed_experts"}
    tagged = SequenceBatch(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                           response_length=batch.response_length,
                           tensors=tag_rows(tensors, batch))
    result: dict[str, torch.Tensor] = {}
    with recording(backend) as sinks:
        yield tagged, result
    result["routed_experts"] = assemble(backend, sinks, tuple(batch.input_ids.shape))


def tag_rows(tensors: dict[str, torch.Tensor], batch: SequenceBatch) -> dict[str, torch.Tensor]:
    """``tensors`` plus each row's index in ``batch`` (``ROW_KEY``), so that the routing a
    micro-batch records can be put back at its rows."""
    return {**tensors, ROW_KEY: torch.arange(batch.batch_size)}


@contextlib.contextmanager
def recording(backend: Any) -> Iterator[dict[int, list[tuple[Any, torch.Tensor]]]]:
    """While open, every router of ``backend`` keeps the experts its forwards route to (the
    replayed ones where it replays), per micro-batch: {id(replay): [(micro-batch, [tokens,
    k])]}, for `assemble`."""
    sinks: dict[int, list[tuple[Any, torch.Tensor]]] = {id(r): [] for r in backend._replays}
    for r in backend._replays:
        r.sink = sinks[id(r)]
    try:
        yield sinks
    finally:
        for r in backend._replays:
            r.sink = None


def assemble(backend: Any, sinks: dict[int, list[tuple[Any, torch.Tensor]]],
             shape: tuple[int, int]) -> torch.Tensor:
    """[B, P + L, n_sparse, k] int16 (-1 where no forward routed a token) of what `recording`
    kept, at the rows ``ROW_KEY`` of each micro-batch's source (``shape`` = (B, P + L)).
    Collective over all ranks: each routes its DP rows, its sequence slice under SP, its
    stage's layers; a MAX all-reduce over the world assembles the whole."""
    from megarl.models.moe import routing_dtype

    args = backend.args
    n, k = len(sparse_layers(args)), args.num_experts_per_tok
    tp, sp = backend.layout.tp, backend.layout.sp
    tp_rank = dist.get_rank(backend.tp_group) if tp > 1 else 0
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    out = torch.full((*shape, n, k), -1, dtype=torch.long, device=dev)
    for r in backend._replays:
        for mb, experts in sinks[id(r)]:
            _scatter_recorded(out, mb, experts.to(dev).long(), r.sparse_index, tp, tp_rank, sp)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return out.to(routing_dtype(args.num_experts)).cpu()


def _scatter_recorded(out: torch.Tensor, mb: Any, own: torch.Tensor, sparse_index: int,
                      tp: int, tp_rank: int, sequence_parallel: bool) -> None:
    """Write one router's top-k ``own`` [tokens, k] of micro-batch ``mb`` (megatron's s-major
    order, this TP rank's slice of s under SP; `router_targets` inverted) into ``out``
    [B, P + L, n_sparse, k] at the batch rows of ``mb.source``."""
    rows_mb, s_mb = mb.input_ids.shape
    s_loc = own.shape[0] // rows_mb
    layout = torch.full((rows_mb, s_mb, own.shape[-1]), -1, dtype=torch.long, device=own.device)
    off = tp_rank * s_loc if sequence_parallel and tp > 1 else 0
    layout[:, off:off + s_loc] = own.view(s_loc, rows_mb, -1).transpose(0, 1)
    source = mb.source
    if ROW_KEY not in source.tensors:
        return
    mask = source.attention_mask.to(own.device).bool()
    rows, cols = mask.nonzero(as_tuple=True)
    shifted = mask.long().cumsum(1)[rows, cols] - 1
    batch_rows = source.tensors[ROW_KEY].to(own.device)[rows]
    out[batch_rows, cols, sparse_index] = layout[rows, shifted]
