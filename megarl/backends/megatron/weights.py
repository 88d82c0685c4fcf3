"""HF <-> megatron weight layout: the one place that knows how HF tensors map onto megatron's
sharded parameters.

megatron layout (per tensor-parallel rank r of T, verified against transformers in tests):

- ``linear_qkv.weight`` ``[G * (R + 2) * hd, h]`` with G = kv groups on this rank
  (num_key_value_heads / T, rank r holds groups ``[r*G, (r+1)*G)``), R = query heads per group;
  rows per group are ``[q_1 .. q_R, k, v]`` (each ``hd`` rows). The bias (Qwen2) likewise.
- ``linear_fc1.weight`` ``cat([gate_r, up_r])``: rank r's chunk of gate_proj, then of up_proj.
- ``linear_proj`` / ``linear_fc2``: input dim (dim 1) split; embedding / ``output_layer``: vocab
  rows split; norms, q/k norms and the ``score`` head: replicated.

Loading reads only this rank's slice of every tensor (safetensors ``get_slice``). Exporting
all-gathers one tensor at a time over TP and broadcasts it over PP from the stage holding it, so
no rank holds more than one full tensor beyond its own shards.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open

from megarl.backends.megatron import moe, parallel
from megarl.backends.megatron.model import (
    Layout,
    MegarlGPTModel,
    global_layer_numbers,
    layer_owner,
)
from megarl.backends.protocol import LM_ROLES
from megarl.models.args import ModelArgs
from megarl.models.hf_io import hf_weight_map
from megarl.models.state_dict_adapter import CheckpointMismatchError, hf_sort_key

logger = logging.getLogger(__name__)

_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
EMBED, NORM, LM_HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"
SCORE_W, SCORE_B = "score.weight", "score.bias"

# kinds: replicated | row (dim 0 split) | col (dim 1 split) | qkv | fc1
_LAYER_ENTRIES: list[tuple[str, tuple[str, ...], str, str]] = [
    # (megatron suffix, HF suffixes, kind, condition)
    ("input_layernorm.weight", ("input_layernorm.weight",), "replicated", ""),
    (
        "self_attention.linear_qkv.weight",
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        "qkv",
        "",
    ),
    (
        "self_attention.linear_qkv.bias",
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
        "qkv",
        "qkv_bias",
    ),
    ("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",), "replicated", "qk_norm"),
    ("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",), "replicated", "qk_norm"),
    ("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), "col", ""),
    ("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), "replicated", ""),
    ("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), "fc1", ""),
    ("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), "col", ""),
]
# TransformerEngine fuses the pre-norms into the following linear layer.
_TE_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


@dataclass(frozen=True)
class Entry:
    """One megatron parameter of one chunk and the HF tensors it is made of."""

    mcore: str  # parameter name inside MegarlGPTModel
    hf: tuple[str, ...]
    kind: str
    layer: int | None  # global layer index, None for embedding / final norm / heads
    inner: int = 0  # MLP width of fc1 / col kinds when not the dense intermediate_size
    expert: int | None = None  # global expert index (kinds efc1 / ecol)


def layer_entries(
    args: ModelArgs, layer: int, local: int, names: set[str], ep_rank: int | None = 0,
    ep_size: int = 1,
) -> list[Entry]:
    """Entries of global layer ``layer`` held as ``decoder.layers.{local}`` in a chunk whose
    parameter names are ``names`` (local or TE spec). A sparse (MoE) layer lists the experts of
    expert-parallel rank ``ep_rank`` of ``ep_size``, every expert when ``ep_rank`` is None."""
    out = []
    sparse = args.is_moe_layer(layer)
    for suffix, hf, kind, cond in _LAYER_ENTRIES:
        if cond and not getattr(args, cond):
            continue
        if sparse and suffix.startswith("mlp."):
            continue
        name = f"decoder.layers.{local}.{suffix}"
        if name not in names and suffix in _TE_NAMES:
            name = f"decoder.layers.{local}.{_TE_NAMES[suffix]}"
        out.append(Entry(name, tuple(f"model.layers.{layer}.{h}" for h in hf), kind, layer))
    if sparse:
        for name, hf, kind, inner, expert in moe.moe_layer_entries(
            args, layer, local, ep_rank, ep_size
        ):
            out.append(Entry(name, hf, kind, layer, inner, expert))
    return out


def chunk_entries(model: MegarlGPTModel, args: ModelArgs) -> list[Entry]:
    """Every parameter of one chunk as an Entry (tied output copies included)."""
    names = {n for n, _ in model.named_parameters()}
    out = []
    if model.pre_process:
        out.append(Entry("embedding.word_embeddings.weight", (EMBED,), "row", None))
    ep_rank, ep_size = (parallel.ep_rank(), parallel.ep_size()) if args.is_moe else (0, 1)
    for local, layer in enumerate(global_layer_numbers(model)):
        out.extend(layer_entries(args, layer, local, names, ep_rank, ep_size))
    if model.post_process:
        out.append(Entry("decoder.final_layernorm.weight", (NORM,), "replicated", None))
        if model.num_labels is not None:
            out.append(Entry("score.weight", (SCORE_W,), "replicated", None))
            if model.score.bias is not None:
                out.append(Entry("score.bias", (SCORE_B,), "replicated", None))
        elif not model.share_embeddings_and_output_weights:
            out.append(Entry("output_layer.weight", (LM_HEAD,), "row", None))
        elif not model.pre_process:  # tied, PP > 1: the last stage keeps a copy
            out.append(Entry("output_layer.weight", (EMBED,), "row", None))
    missing = sorted({e.mcore for e in out} - names)
    if missing:
        raise RuntimeError(f"weight map names parameters the model lacks: {missing}")
    return out


def expected_hf_names(args: ModelArgs, role: str) -> list[str]:
    """HF tensor names of the full model of ``role``, in HF state_dict order."""
    names = [EMBED, NORM]
    for layer in range(args.num_hidden_layers):
        for e in layer_entries(args, layer, 0, set(), ep_rank=None):
            names.extend(e.hf)
    if role in LM_ROLES:
        if not args.tie_word_embeddings:
            names.append(LM_HEAD)
    else:
        names += [SCORE_W, SCORE_B] if args.token_classification_bias else [SCORE_W]
    return sorted(names, key=hf_sort_key)


# ------------------------------------------------------------------- sharding (pure functions)


def pack_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """[q_g, k_g, v_g] per KV group along dim 0 (q: R*G*hd rows, k, v: G*hd rows each)."""
    qs = q.reshape(groups, -1, *q.shape[1:])
    ks = k.reshape(groups, -1, *k.shape[1:])
    vs = v.reshape(groups, -1, *v.shape[1:])
    return torch.cat([qs, ks, vs], dim=1).reshape(-1, *q.shape[1:])


def unpack_qkv(
    packed: torch.Tensor, groups: int, q_per_group: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `pack_qkv` on the full (all TP ranks) tensor."""
    per = packed.reshape(groups, (q_per_group + 2) * head_dim, *packed.shape[1:])
    q = per[:, : q_per_group * head_dim].reshape(-1, *packed.shape[1:])
    k = per[:, q_per_group * head_dim : (q_per_group + 1) * head_dim].reshape(-1, *packed.shape[1:])
    v = per[:, (q_per_group + 1) * head_dim :].reshape(-1, *packed.shape[1:])
    return q.contiguous(), k.contiguous(), v.contiguous()


def _chunk(n: int, rank: int, size: int) -> slice:
    step = n // size
    return slice(rank * step, (rank + 1) * step)


Reader = Callable[[str, slice | None, slice | None], torch.Tensor]
"""read(hf_name, rows, cols) -> that slice of the HF tensor."""


def shard_from_hf(entry: Entry, read: Reader, args: ModelArgs, rank: int, size: int):
    """This TP rank's shard of ``entry`` read from HF tensors."""
    if entry.kind == "replicated":
        return read(entry.hf[0], None, None)
    if entry.kind == "row":
        return read(entry.hf[0], _chunk(args.vocab_size, rank, size), None)
    if entry.kind in ("col", "ecol"):
        n = args.num_attention_heads * args.head_dim if "o_proj" in entry.hf[0] else (
            entry.inner or args.intermediate_size
        )
        return read(entry.hf[0], None, _chunk(n, rank, size))
    if entry.kind in ("fc1", "efc1"):
        rows = _chunk(entry.inner or args.intermediate_size, rank, size)
        return torch.cat([read(entry.hf[0], rows, None), read(entry.hf[1], rows, None)])
    if entry.kind == "qkv":
        groups = args.num_key_value_heads // size
        hd, rep = args.head_dim, args.n_rep
        g0 = rank * groups
        q = read(entry.hf[0], slice(g0 * rep * hd, (g0 + groups) * rep * hd), None)
        k = read(entry.hf[1], slice(g0 * hd, (g0 + groups) * hd), None)
        v = read(entry.hf[2], slice(g0 * hd, (g0 + groups) * hd), None)
        return pack_qkv(q, k, v, groups)
    raise ValueError(f"unknown entry kind {entry.kind}")


def hf_from_shards(entry: Entry, shards: list[torch.Tensor], args: ModelArgs):
    """[(HF name, full tensor)] of ``entry`` from the TP shards of every rank (rank order)."""
    if entry.kind == "replicated":
        return [(entry.hf[0], shards[0])]
    if entry.kind == "row":
        return [(entry.hf[0], torch.cat(shards, 0))]
    if entry.kind in ("col", "ecol"):
        return [(entry.hf[0], torch.cat(shards, 1))]
    if entry.kind in ("fc1", "efc1"):
        halves = [s.chunk(2, dim=0) for s in shards]
        gate = torch.cat([h[0] for h in halves])
        up = torch.cat([h[1] for h in halves])
        return [(entry.hf[0], gate), (entry.hf[1], up)]
    if entry.kind == "qkv":
        full = torch.cat(shards, 0)
        q, k, v = unpack_qkv(full, args.num_key_value_heads, args.n_rep, args.head_dim)
        return list(zip(entry.hf, (q, k, v)))
    raise ValueError(f"unknown entry kind {entry.kind}")


def hf_shapes(entry: Entry, args: ModelArgs, num_labels: int | None) -> list[tuple[int, ...]]:
    """Full shapes of the HF tensors of ``entry`` (known on every rank, for PP broadcasts)."""
    h, hd = args.hidden_size, args.head_dim
    shapes = {
        EMBED: (args.vocab_size, h),
        LM_HEAD: (args.vocab_size, h),
        NORM: (h,),
        SCORE_W: (num_labels or 0, h),
        SCORE_B: (num_labels or 0,),
    }
    out = []
    for name in entry.hf:
        if name in shapes:
            out.append(shapes[name])
            continue
        leaf = name.split(".", 3)[3]
        moe_shape = moe.moe_hf_shapes(args, leaf)
        if moe_shape is not None:
            out.append(moe_shape)
            continue
        q_rows, kv_rows = args.num_attention_heads * hd, args.num_key_value_heads * hd
        table = {
            "input_layernorm.weight": (h,),
            "post_attention_layernorm.weight": (h,),
            "self_attn.q_proj.weight": (q_rows, h),
            "self_attn.k_proj.weight": (kv_rows, h),
            "self_attn.v_proj.weight": (kv_rows, h),
            "self_attn.q_proj.bias": (q_rows,),
            "self_attn.k_proj.bias": (kv_rows,),
            "self_attn.v_proj.bias": (kv_rows,),
            "self_attn.q_norm.weight": (hd,),
            "self_attn.k_norm.weight": (hd,),
            "self_attn.o_proj.weight": (h, q_rows),
            "mlp.gate_proj.weight": (args.intermediate_size, h),
            "mlp.up_proj.weight": (args.intermediate_size, h),
            "mlp.down_proj.weight": (h, args.intermediate_size),
        }
        out.append(table[leaf])
    return out


# ------------------------------------------------------------------------------ HF reading


class HFReader:
    """Sliced reads of an HF safetensors folder (single file or sharded)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        weight_map = hf_weight_map(self.path)
        bare = weight_map and not any(k.startswith("model.") for k in weight_map)
        self._file = {}
        self._stored = {}
        for name, file in weight_map.items():
            if _IGNORED.search(name):
                continue
            ours = name
            if bare and not name.startswith(("lm_head.", "score.")):
                ours = f"model.{name}"  # a bare *Model checkpoint
            self._file[ours] = file
            self._stored[ours] = name
        self._handles: dict[str, object] = {}

    def names(self) -> set[str]:
        return set(self._file)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def _slice(self, name: str):
        file = self._file[name]
        if file not in self._handles:
            self._handles[file] = safe_open(self.path / file, framework="pt")
        return self._handles[file].get_slice(self._stored[name])

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None):
        s = self._slice(name)
        if rows is None and cols is None:
            return s[:]
        if cols is None:
            return s[rows]
        return s[rows if rows is not None else slice(None), cols]

    def close(self) -> None:
        self._handles.clear()


def check_checkpoint_names(reader: HFReader, args: ModelArgs, role: str, num_labels: int | None):
    """Raise CheckpointMismatchError listing missing / unexpected / mis-shaped tensors.
    Returns True when a value head must be freshly initialised (critic from an LM checkpoint)."""
    have = reader.names()
    want = set(expected_hf_names(args, role))
    optional = set()
    fresh_head = False
    if role in LM_ROLES:
        optional.add(LM_HEAD)  # tied checkpoints may still carry lm_head.weight
    else:
        optional.add(LM_HEAD)  # a value model may start from an LM checkpoint
        if role == "critic" and not ({SCORE_W, SCORE_B} & have):
            want -= {SCORE_W, SCORE_B}
            fresh_head = True
    missing = sorted(want - have, key=hf_sort_key)
    unexpected = sorted(have - want - optional, key=hf_sort_key)
    bad = []
    for name in sorted(want & have, key=hf_sort_key):
        entry = Entry("", (name,), "", None)
        expected = hf_shapes(entry, args, num_labels)[0]
        if reader.shape(name) != expected:
            bad.append(f"{name}: checkpoint {reader.shape(name)} vs model {expected}")
    if missing or unexpected or bad:
        lines = [f"checkpoint {reader.path} does not match the {args.model_type} {role} model:"]
        if missing:
            lines.append(f"  missing ({len(missing)}): {', '.join(missing)}")
        if unexpected:
            lines.append(f"  unexpected ({len(unexpected)}): {', '.join(unexpected)}")
        if bad:
            lines.append(f"  shape mismatch ({len(bad)}): {'; '.join(bad)}")
        raise CheckpointMismatchError("\n".join(lines))
    return fresh_head


@torch.no_grad()
def load_hf_into_chunks(
    chunks: list[MegarlGPTModel],
    path: str | os.PathLike,
    args: ModelArgs,
    role: str,
    num_labels: int | None,
    seed: int,
) -> None:
    """Copy this rank's shards of the HF folder ``path`` into the (unwrapped) chunks."""
    reader = HFReader(path)
    fresh_head = check_checkpoint_names(reader, args, role, num_labels)
    rank, size = parallel.tp_rank(), dist.get_world_size(parallel.tp_group())
    expert_rank, expert_size = parallel.etp_rank(), parallel.etp_size()
    try:
        for chunk in chunks:
            params = dict(chunk.named_parameters())
            entries = chunk_entries(chunk, args)
            uncovered = sorted(set(params) - {e.mcore for e in entries})
            if uncovered:
                raise RuntimeError(f"no HF tensor maps onto megatron parameters {uncovered}")
            for entry in entries:
                param = params[entry.mcore]
                if entry.hf[0] in (SCORE_W, SCORE_B) and fresh_head:
                    _init_fresh_head(chunk, args, seed)
                    continue
                if entry.kind in moe.EXPERT_KINDS:
                    shard = shard_from_hf(entry, reader.read, args, expert_rank, expert_size)
                else:
                    shard = shard_from_hf(entry, reader.read, args, rank, size)
                if tuple(shard.shape) != tuple(param.shape):
                    raise CheckpointMismatchError(
                        f"{entry.hf} -> {entry.mcore}: shard {tuple(shard.shape)} vs parameter "
                        f"{tuple(param.shape)}"
                    )
                param.copy_(shard.to(param.dtype))
    finally:
        reader.close()
    if fresh_head:
        logger.warning("%s has no score head: the critic starts with a fresh one", path)


def _init_fresh_head(chunk: MegarlGPTModel, args: ModelArgs, seed: int) -> None:
    """N(0, initializer_range) weight, zero bias: the same draw on every rank (replicated)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.empty(chunk.score.weight.shape, dtype=torch.float32)
    w.normal_(0.0, args.initializer_range, generator=gen)
    chunk.score.weight.copy_(w)
    if chunk.score.bias is not None:
        chunk.score.bias.zero_()


# ------------------------------------------------------------------------------- exporting


def export_hf(
    chunks: list[MegarlGPTModel],
    args: ModelArgs,
    layout: Layout,
    role: str,
    num_labels: int | None,
    grads: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) of the whole model on every rank, in HF state_dict order
    (``hf_sort_key``). Collective over the TP and PP groups (every rank must iterate to the
    end); at most one layer's full tensors are held at a time. ``grads``: the accumulated
    gradients (megatron's ``main_grad`` buffers, fp32) instead of the weights."""
    tp_group, tp_size = parallel.tp_group(), layout.tp
    my_pp = parallel.pp_rank()
    pp_ranks = parallel.pp_ranks()
    mine: dict[tuple, tuple[torch.nn.Parameter, Entry]] = {}
    for chunk in chunks:
        params = dict(chunk.named_parameters())
        for entry in chunk_entries(chunk, args):
            if entry.mcore == "output_layer.weight" and entry.hf == (EMBED,):
                continue  # tied copy on the last stage: the first stage exports the embedding
            mine[entry.hf] = (params[entry.mcore], entry)
    def value(param: torch.nn.Parameter) -> torch.Tensor:
        if not grads:
            return param.detach()
        grad = getattr(param, "main_grad", None)
        if grad is None:
            raise RuntimeError("no gradient buffer: export_grads needs a trainable backend")
        return grad.detach()

    dtype = value(next(iter(mine.values()))[0]).dtype if mine else torch.float32
    # One layer (or top-level tensor) at a time, its tensors yielded in HF state_dict order.
    for group in _entry_groups(args, role):
        ready: list[tuple[str, torch.Tensor]] = []
        for entry in group:
            owner = _owner_stage(entry, args, layout)
            outputs = None
            if owner == my_pp and entry.kind in moe.EXPERT_KINDS:
                outputs = _gather_expert(entry, mine, value, args, num_labels, dtype)
            elif owner == my_pp:
                param, local_entry = mine[entry.hf]
                shard = value(param)
                if tp_size > 1 and local_entry.kind != "replicated":
                    shards = [torch.empty_like(shard) for _ in range(tp_size)]
                    dist.all_gather(shards, shard.contiguous(), group=tp_group)
                else:
                    shards = [shard]
                outputs = hf_from_shards(local_entry, shards, args)
            if layout.pp > 1:
                shapes = hf_shapes(entry, args, num_labels)
                if outputs is None:
                    outputs = [
                        (name, torch.empty(shape, dtype=dtype, device=_device()))
                        for name, shape in zip(entry.hf, shapes)
                    ]
                for _, tensor in outputs:
                    dist.broadcast(tensor, src=pp_ranks[owner], group=parallel.pp_group())
            ready.extend(outputs)
        yield from sorted(ready, key=lambda item: hf_sort_key(item[0]))

def _gather_expert(entry: Entry, mine: dict, value, args: ModelArgs, num_labels, dtype):
    """[(HF name, full tensor)] of one expert's entry on every rank of this pipeline stage:
    all-gathered over the expert-tensor-parallel group on the expert-parallel rank holding the
    expert, then broadcast from it over the expert-parallel group."""
    ep_size = parallel.ep_size()
    owner = entry.expert // (args.num_experts // ep_size)
    if parallel.ep_rank() == owner:
        param, local_entry = mine[entry.hf]
        shard = value(param)
        if parallel.etp_size() > 1:
            shards = [torch.empty_like(shard) for _ in range(parallel.etp_size())]
            dist.all_gather(shards, shard.contiguous(), group=parallel.etp_group())
        else:
            shards = [shard]
        outputs = [(n, t.contiguous()) for n, t in hf_from_shards(local_entry, shards, args)]
    else:
        outputs = [
            (name, torch.empty(shape, dtype=dtype, device=_device()))
            for name, shape in zip(entry.hf, hf_shapes(entry, args, num_labels))
        ]
    if ep_size > 1:
        src = dist.get_process_group_ranks(parallel.ep_group())[owner]
        for _, tensor in outputs:
            dist.broadcast(tensor, src=src, group=parallel.ep_group())
    return outputs


def _entry_groups(args: ModelArgs, role: str) -> list[list[Entry]]:
    """Entries of the full model grouped by layer (top-level tensors alone), in HF order."""
    groups: list[list[Entry]] = []
    for entry in _all_entries(args, role):
        if entry.layer is not None and groups and groups[-1][0].layer == entry.layer:
            groups[-1].append(entry)
        else:
            groups.append([entry])
    return groups


def _all_entries(args: ModelArgs, role: str) -> list[Entry]:
    out = [Entry("", (EMBED,), "row", None)]
    for layer in range(args.num_hidden_layers):
        out.extend(layer_entries(args, layer, 0, set(), ep_rank=None))
    out.append(Entry("", (NORM,), "replicated", None))
    if role in LM_ROLES:
        if not args.tie_word_embeddings:
            out.append(Entry("", (LM_HEAD,), "row", None))
    else:
        out.append(Entry("", (SCORE_W,), "replicated", None))
        if args.token_classification_bias:
            out.append(Entry("", (SCORE_B,), "replicated", None))
    return out


def _owner_stage(entry: Entry, args: ModelArgs, layout: Layout) -> int:
    if entry.layer is not None:
        return layer_owner(args, layout, entry.layer)[0]
    return 0 if entry.hf[0] == EMBED else layout.pp - 1


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else (
        torch.device("cpu")
    )

