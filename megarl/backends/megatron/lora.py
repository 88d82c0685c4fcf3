"""LoRA adapters on the megatron-core actor, tensor- and pipeline-parallel, with PEFT's names.

Every adapted HF linear (``model.layers.{i}.self_attn.{q,k,v,o}_proj``,
``model.layers.{i}.mlp.{gate,up,down}_proj``) gets its own pair A [r, in], B [out, r] (PEFT's
layout, `megarl.models.lora`), added to the output of the megatron linear that holds it:

    y = W x + b + (alpha / r) B A dropout(x)        (the base W, b frozen)

- a column-parallel linear (``linear_qkv``: q, k, v; ``linear_fc1``: gate, up) keeps A
  replicated over TP and splits B along its output rows like the layer; the fused outputs are
  laid out as the layer's (q/k/v per KV group, `weights.pack_qkv`; ``[gate, up]``);
- a row-parallel linear (``linear_proj``: o; ``linear_fc2``: down) splits A along its input
  columns and keeps B replicated; the partial A x is summed over TP (or reduce-scattered over
  the sequence under sequence parallelism) before B;
- under sequence parallelism the replicated factor's gradient is a partial sum over the
  sequence shards: it carries megatron's ``sequence_parallel`` tag, so ``finalize_model_grads``
  all-reduces it over TP, as it does for the norms.

The pairs of one pipeline chunk live in ``chunk.lora`` (`ChunkAdapters`, parameters
``lora.pairs.<layer>_<module>.lora_{A,B}``); forward hooks on the megatron linears add their
updates, so the base parameters keep their names and the weight map (`weights.py`) is unchanged.
Checkpoint keys are ``lora.<HF module>.lora_{A,B}`` with full shapes (any layout resumes any
other). A is drawn as PEFT draws it (``kaiming_uniform_(a=sqrt(5))`` on the full [r, in],
one generator per module seeded from ``seed``, so every TP/PP layout starts from the same
adapters), B starts at zero; verl's ``lora_A_init_method`` / ``lora_B_init_method`` choose
other draws (`megarl.models.lora.init_factor_`), and ``lora_adapter_path`` starts the adapters
from a PEFT folder's tensors instead.

Module selection follows `megarl.models.lora` (``target_modules`` / ``exclude_modules``: verl's
keys, PEFT's rules) over the HF module names; a list entry may also name megatron's modules as
verl's megatron LoRA block does (``linear_qkv``, ``linear_proj``, ``linear_fc1``,
``linear_fc2``, ``linear_q`` / ``linear_k`` / ``linear_v``, ``linear_fc1_gate`` /
``linear_fc1_up``; shell wildcards like ``*.layers.0.*.linear_qkv`` match megatron's full
names). The layers are megatron's local spec (TransformerEngine fuses the pre-norm into the
linear, whose input the hook would then not see); mixture-of-experts models are refused.

Adapter dropout (``lora_dropout``, in train mode only) on the input (``pre``) or on B A x
(``post``): every TP rank draws the mask of the whole [batch, sequence, features] tensor, in
transformers' batch-first order, from torch's default generator (the same state on every TP
rank, as megatron seeds it; restored by activation recompute) and keeps its own part. So every
TP and sequence-parallel layout drops what one process drops from a batch of the same padded
length (sequence parallelism pads it to a multiple of TP), and on the CPU what PEFT's
``lora_dropout`` drops with the same generator state; each rank pays for the whole draw.
Pipeline stages draw from their own generators; under context parallelism each rank draws
over its own tokens.
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.tensor_parallel import mappings
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.utils import (
    make_sharded_tensor_for_checkpoint,
    make_tp_sharded_tensor_for_checkpoint,
)
from torch import nn

from megarl.backends import lora_reference
from megarl.backends.megatron import parallel
from megarl.backends.megatron.model import Layout, MegarlGPTModel, global_layer_numbers, layer_owner
from megarl.backends.settings import RoleSettings
from megarl.errors import UserInputError
from megarl.models.args import ModelArgs
from megarl.models.lora import (
    ALL_LINEAR,
    LoraSettings,
    _excluded,
    _matches_list,
    check_adapter_names,
    init_factor_,
    read_adapter_tensors,
    settings_meta,
)
from megarl.models.state_dict_adapter import hf_sort_key
from megarl.utils.dist import all_gather_objects

# (HF module under model.layers.{i}., megatron linear under decoder.layers.{j}., parallel kind,
#  verl's megatron names that select it)
_MODULES: list[tuple[str, str, str, tuple[str, ...]]] = [
    ("self_attn.q_proj", "self_attention.linear_qkv", "column", ("linear_qkv", "linear_q")),
    ("self_attn.k_proj", "self_attention.linear_qkv", "column", ("linear_qkv", "linear_k")),
    ("self_attn.v_proj", "self_attention.linear_qkv", "column", ("linear_qkv", "linear_v")),
    ("self_attn.o_proj", "self_attention.linear_proj", "row", ("linear_proj",)),
    ("mlp.gate_proj", "mlp.linear_fc1", "column", ("linear_fc1", "linear_fc1_gate")),
    ("mlp.up_proj", "mlp.linear_fc1", "column", ("linear_fc1", "linear_fc1_up")),
    ("mlp.down_proj", "mlp.linear_fc2", "row", ("linear_fc2",)),
]
_PARTS = {"self_attention.linear_qkv": ("q_proj", "k_proj", "v_proj"),
          "mlp.linear_fc1": ("gate_proj", "up_proj")}


@dataclass(frozen=True)
class AdapterSpec:
    """One adapted HF linear of the full model."""

    module: str  # HF module name, model.layers.{layer}.self_attn.q_proj
    layer: int
    linear: str  # megatron linear under decoder.layers.{local}.
    parallel: str  # column | row
    in_features: int
    out_features: int

    @property
    def part(self) -> str:
        return self.module.rsplit(".", 1)[-1]

    @property
    def key(self) -> str:
        """Submodule name in `ChunkAdapters.pairs` (no dots)."""
        return f"{self.layer}_{self.part}"


def check_lora_supported(args: ModelArgs, settings: LoraSettings) -> None:
    """Refuse what the megatron adapters do not implement, naming the config key."""
    if args.is_moe:
        raise UserInputError(
            "actor_rollout_ref.model.lora_rank > 0 on a mixture-of-experts policy with "
            "actor_rollout_ref.actor.strategy=megatron: LoRA on expert layers is not implemented; "
            "set lora_rank=0 (full training) or use a dense policy")


def _shapes(args: ModelArgs, hf_leaf: str) -> tuple[int, int]:
    h, q, kv = args.hidden_size, args.num_attention_heads * args.head_dim, (
        args.num_key_value_heads * args.head_dim)
    ffn = args.intermediate_size
    return {"self_attn.q_proj": (h, q), "self_attn.k_proj": (h, kv), "self_attn.v_proj": (h, kv),
            "self_attn.o_proj": (q, h), "mlp.gate_proj": (h, ffn), "mlp.up_proj": (h, ffn),
            "mlp.down_proj": (ffn, h)}[hf_leaf]


def _selected(hf_name: str, mcore_name: str, aliases: Sequence[str], target: Any) -> bool:
    if isinstance(target, str):
        if target.lower() == ALL_LINEAR:
            return True
        import re

        return re.fullmatch(target, hf_name) is not None
    for entry in target:
        if _matches_list(hf_name, [entry]) or entry in aliases:
            return True
        if any(ch in entry for ch in "*?[") and (
                fnmatch.fnmatchcase(mcore_name, entry) or fnmatch.fnmatchcase(hf_name, entry)):
            return True
    return False


def adapter_specs(args: ModelArgs, settings: LoraSettings) -> list[AdapterSpec]:
    """The adapted modules of the full model (HF order); UserInputError when none is selected."""
    out = []
    for layer in range(args.num_hidden_layers):
        for leaf, linear, kind, aliases in _MODULES:
            name = f"model.layers.{layer}.{leaf}"
            mcore = f"decoder.layers.{layer}.{linear}"
            if _excluded(name, settings.exclude_modules):
                continue
            if settings.exclude_modules and not isinstance(settings.exclude_modules, str) and (
                    set(settings.exclude_modules) & set(aliases)):
                continue
            if _selected(name, mcore, aliases, settings.target_modules):
                fan_in, fan_out = _shapes(args, leaf)
                out.append(AdapterSpec(name, layer, linear, kind, fan_in, fan_out))
    if not out:
        raise UserInputError(
            f"actor_rollout_ref.model.target_modules={settings.target_modules!r} (exclude_modules="
            f"{settings.exclude_modules!r}) selects no linear layer of the model; use all-linear, "
            "HF names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj) or "
            "megatron names (linear_qkv, linear_proj, linear_fc1, linear_fc2)")
    return sorted(out, key=lambda s: hf_sort_key(s.module + ".weight"))


def _tp_slice(n: int, rank: int, size: int) -> slice:
    step = n // size
    return slice(rank * step, (rank + 1) * step)


def initial_factors(spec: AdapterSpec, index: int, settings: LoraSettings,
                    seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The full A [r, in] and B [out, r] of the ``index``-th adapted module (float32), drawn
    by ``settings.init_a`` / ``init_b`` (`megarl.models.lora.init_factor_`; default PEFT's:
    ``kaiming_uniform_(a=sqrt(5))`` and zeros), A then B, from a generator of its own."""
    g = torch.Generator().manual_seed(int(seed) * 1_000_003 + index)
    a = torch.empty(settings.rank, spec.in_features, dtype=torch.float32)
    b = torch.empty(spec.out_features, settings.rank, dtype=torch.float32)
    init_factor_(a, settings.init_a, g)
    init_factor_(b, settings.init_b, g)
    return a, b


class LoraPair(nn.Module):
    """This TP rank's A [r, in or in/tp] and B [out/tp or out, r] of one HF module."""

    def __init__(self, spec: AdapterSpec, a_full: torch.Tensor, b_full: torch.Tensor,
                 tp_rank: int, tp_size: int, *, dtype: torch.dtype, device: torch.device,
                 sp: bool) -> None:
        super().__init__()
        self.spec = spec
        if spec.parallel == "column":
            a = a_full
            b = b_full[_tp_slice(spec.out_features, tp_rank, tp_size)]
        else:
            a = a_full[:, _tp_slice(spec.in_features, tp_rank, tp_size)]
            b = b_full
        self.lora_A = nn.Parameter(a.to(device=device, dtype=dtype).contiguous())
        self.lora_B = nn.Parameter(b.to(device=device, dtype=dtype))
        split, replicated = ((self.lora_B, self.lora_A) if spec.parallel == "column"
                             else (self.lora_A, self.lora_B))
        set_tensor_model_parallel_attributes(split, True, 0 if split is self.lora_B else 1, 1)
        # Under SP the replicated factor sees one sequence shard per rank: summed over TP by
        # megatron's finalize_model_grads.
        replicated.sequence_parallel = sp

    def split_axis(self, which: str) -> int | None:
        """The TP-split dim of ``lora_A`` / ``lora_B`` (None: replicated)."""
        if self.spec.parallel == "column":
            return 0 if which == "lora_B" else None
        return 1 if which == "lora_A" else None


class ChunkAdapters(nn.Module):
    """The adapters of one pipeline chunk (``chunk.lora``), their scaling and their dropout
    (applied in train mode)."""

    def __init__(self, pairs: dict[str, LoraPair], scaling: float, *, dropout: float = 0.0,
                 dropout_position: str = "pre", tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.pairs = nn.ModuleDict(pairs)
        self.scaling = scaling
        self.enabled = True
        self.dropout, self.dropout_post = dropout, dropout_position == "post"
        self.tp_rank, self.tp_size = tp_rank, tp_size

    def keep(self, t: torch.Tensor, features: int, *, seq_shard: bool,
             feature_shard: bool) -> torch.Tensor:
        """The dropout multiplier (0 or 1 / (1 - p)) of ``t`` [s, b, f]: this rank's part of
        the mask of the whole [b, S, features] tensor (S = s x TP when ``seq_shard``: ``t`` is
        this rank's sequence shard; f = features / TP when ``feature_shard``), drawn whole, in
        batch-first order, from megatron's data-parallel RNG state, as F.dropout draws on the
        CPU."""
        s, b = t.shape[0], t.shape[1]
        p = self.dropout
        with parallel.data_parallel_rng():
            whole = torch.empty(b, s * self.tp_size if seq_shard else s, features,
                                dtype=t.dtype, device=t.device).bernoulli_(1 - p)
        whole = whole.div_(1 - p).transpose(0, 1)
        if seq_shard:
            whole = whole[self.tp_rank * s:(self.tp_rank + 1) * s]
        if feature_shard:
            whole = whole[..., _tp_slice(features, self.tp_rank, self.tp_size)]
        return whole

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict:
        """megatron dist-checkpoint entries keyed ``lora.<HF module>.lora_{A,B}`` (full
        shapes; the TP-split factor sharded along its split dim)."""
        out = {}
        for key, pair in self.pairs.items():
            for which in ("lora_A", "lora_B"):
                tensor = getattr(pair, which)
                global_key = f"lora.{pair.spec.module}.{which}"
                axis = pair.split_axis(which)
                if axis is None:
                    st = make_sharded_tensor_for_checkpoint(tensor, global_key)
                else:
                    st = make_tp_sharded_tensor_for_checkpoint(tensor, global_key, tp_axis=axis)
                out[f"{prefix}pairs.{key}.{which}"] = st
        return out


class _LinearHook:
    """Forward hook of one megatron linear: adds the updates of its adapted HF modules."""

    def __init__(self, adapters: ChunkAdapters, keys: list[str | None], widths: list[int],
                 kv_groups: int, sp: bool) -> None:
        self.adapters = adapters
        self.keys = keys  # pair key per fused part (None: that part is not adapted)
        self.widths = widths  # this rank's output width of each part
        self.kv_groups = kv_groups  # this rank's KV groups (linear_qkv)
        self.sp = sp

    def _delta(self, pair: LoraPair, x: torch.Tensor) -> torch.Tensor:
        adapters, spec = self.adapters, pair.spec
        column = spec.parallel == "column"
        dropout = adapters.dropout if adapters.training else 0.0
        if dropout and not adapters.dropout_post:
            # column: x [s (s / TP under SP), b, in]; row: [s, b, in / TP]
            x = x * adapters.keep(x, spec.in_features, seq_shard=column and self.sp,
                                  feature_shard=not column)
        z = F.linear(x, pair.lora_A)
        if column:
            z = (mappings.gather_from_sequence_parallel_region(z) if self.sp
                 else mappings.copy_to_tensor_model_parallel_region(z))
        else:
            z = (mappings.reduce_scatter_to_sequence_parallel_region(z) if self.sp
                 else mappings.reduce_from_tensor_model_parallel_region(z))
        delta = F.linear(z, pair.lora_B)
        if dropout and adapters.dropout_post:
            # column: delta [s, b, out / TP]; row: [s (s / TP under SP), b, out]
            delta = delta * adapters.keep(delta, spec.out_features,
                                          seq_shard=not column and self.sp, feature_shard=column)
        return delta * adapters.scaling

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if not self.adapters.enabled:
            return output
        x = args[0] if args else kwargs["input_"]
        y, bias = output
        pairs = self.adapters.pairs
        if len(self.keys) == 1:
            return y + self._delta(pairs[self.keys[0]], x).to(y.dtype), bias
        deltas = [self._delta(pairs[k], x) if k is not None else
                  y.new_zeros((*y.shape[:-1], w)) for k, w in zip(self.keys, self.widths)]
        if len(self.keys) == 3:  # q, k, v: [q_g, k_g, v_g] per KV group
            g = self.kv_groups
            delta = torch.cat([d.reshape(*d.shape[:-1], g, -1) for d in deltas], dim=-1)
            delta = delta.reshape(*y.shape)
        else:
            delta = torch.cat(deltas, dim=-1)
        return y + delta.to(y.dtype), bias


def _output_requires_grad(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
    """The frozen embedding's output marked as needing a gradient: megatron's activation
    recompute runs each block under a reentrant checkpoint, which passes gradients only to
    blocks whose input needs one (transformers' ``enable_input_require_grads``)."""
    if torch.is_grad_enabled() and not output.requires_grad:
        output.requires_grad_(True)


def install(chunks: list[MegarlGPTModel], args: ModelArgs, layout: Layout,
            settings: LoraSettings, seed: int) -> list[AdapterSpec]:
    """Add the adapters of ``settings`` to this rank's chunks (`ChunkAdapters` as
    ``chunk.lora``, forward hooks on the linears) and freeze every other parameter. Call on the
    unwrapped chunks after their weights are loaded, before DDP / Float16Module wrapping.
    Returns the adapted modules of the full model (HF order)."""
    check_lora_supported(args, settings)
    specs = adapter_specs(args, settings)
    index = {s.module: i for i, s in enumerate(specs)}
    by_layer: dict[int, list[AdapterSpec]] = {}
    for s in specs:
        by_layer.setdefault(s.layer, []).append(s)
    tp_rank, tp_size = parallel.tp_rank(), layout.tp
    hd = args.head_dim
    for chunk in chunks:
        ref = next(chunk.parameters())
        pairs: dict[str, LoraPair] = {}
        hooks = []
        for local, layer in enumerate(global_layer_numbers(chunk)):
            mine = by_layer.get(layer, [])
            for s in mine:
                a, b = initial_factors(s, index[s.module], settings, seed)
                pairs[s.key] = LoraPair(s, a, b, tp_rank, tp_size, dtype=ref.dtype,
                                        device=ref.device, sp=layout.sp)
            for linear in dict.fromkeys(s.linear for s in mine):
                parts = _PARTS.get(linear, (None,))
                keys = [next((s.key for s in mine if s.linear == linear and
                              (p is None or s.part == p)), None) for p in parts]
                module = chunk.decoder.layers[local].get_submodule(linear)
                groups = args.num_key_value_heads // tp_size
                if linear == "self_attention.linear_qkv":
                    widths = [args.n_rep * groups * hd, groups * hd, groups * hd]
                elif linear == "mlp.linear_fc1":
                    widths = [args.intermediate_size // tp_size] * 2
                else:
                    widths = [0]
                hooks.append((module, keys, widths, groups))
        adapters = ChunkAdapters(pairs, settings.scaling, dropout=settings.dropout,
                                 dropout_position=settings.dropout_position,
                                 tp_rank=tp_rank, tp_size=tp_size)
        for module, keys, widths, groups in hooks:
            module.register_forward_hook(_LinearHook(adapters, keys, widths, groups, layout.sp),
                                         with_kwargs=True)
        chunk.lora = adapters
        for name, p in chunk.named_parameters():
            p.requires_grad_(name.startswith("lora."))
        if getattr(chunk, "embedding", None) is not None:
            chunk.embedding.register_forward_hook(_output_requires_grad)
    if settings.adapter_path:
        tensors = read_adapter_tensors(settings.adapter_path)
        want = [f"{sp.module}.lora_{ab}.weight" for sp in specs for ab in "AB"]
        check_adapter_names(settings.adapter_path, list(tensors), want)
        set_adapters(chunks, tensors, tp_rank, tp_size)
    return specs


def chunk_adapters(chunks: Iterable[nn.Module]) -> list[ChunkAdapters]:
    return [c.lora for c in chunks if isinstance(getattr(c, "lora", None), ChunkAdapters)]


@contextlib.contextmanager
def adapters_disabled(chunks: Iterable[nn.Module]) -> Iterator[None]:
    """Inside: the chunks compute with their base weights only."""
    mods = chunk_adapters(chunks)
    before = [m.enabled for m in mods]
    for m in mods:
        m.enabled = False
    try:
        yield
    finally:
        for m, b in zip(mods, before):
            m.enabled = b


@torch.no_grad()
def gather_adapters(chunks: list[MegarlGPTModel], specs: list[AdapterSpec], args: ModelArgs,
                    layout: Layout, rank: int, *, grads: bool = False
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """(``<HF module>.lora_{A,B}.weight``, full tensor) of every adapter on every rank (A
    [rank, in], B [out, rank]; with ``grads`` the accumulated fp32 gradients), all-gathered over TP
    and broadcast from the owning pipeline stage. Collective over TP and PP."""
    mine = {}
    for adapters in chunk_adapters(chunks):
        for pair in adapters.pairs.values():
            mine[pair.spec.module] = pair
    my_pp, pp_ranks = parallel.pp_rank(), parallel.pp_ranks()
    dtype = None
    for pair in mine.values():
        dtype = _value(pair.lora_A, grads).dtype
        break
    if layout.pp > 1:  # stages without adapters learn the dtype from the others
        names = all_gather_objects(None if dtype is None else str(dtype).removeprefix("torch."),
                                   group=parallel.pp_group())
        dtype = getattr(torch, next(n for n in names if n is not None))
    dtypes = [torch.float32 if dtype is None else dtype]
    for s in specs:
        owner = layer_owner(args, layout, s.layer)[0]
        for which in ("lora_A", "lora_B"):
            out = None
            if owner == my_pp:
                pair = mine[s.module]
                t = _value(getattr(pair, which), grads)
                axis = pair.split_axis(which)
                if axis is not None and layout.tp > 1:
                    parts = [torch.empty_like(t) for _ in range(layout.tp)]
                    dist.all_gather(parts, t.contiguous(), group=parallel.tp_group())
                    t = torch.cat(parts, dim=axis)
                out = t.detach().clone()
            if layout.pp > 1:
                if out is None:
                    shape = (rank, s.in_features) if which == "lora_A" else (s.out_features,
                                                                             rank)
                    out = torch.empty(shape, dtype=dtypes[0], device=_device())
                dist.broadcast(out, src=pp_ranks[owner], group=parallel.pp_group())
            yield f"{s.module}.{which}.weight", out



def _value(p: torch.Tensor, grads: bool) -> torch.Tensor:
    if not grads:
        return p.detach()
    g = getattr(p, "main_grad", None)
    if g is None:
        g = p.grad
    if g is None:
        raise RuntimeError("no adapter gradient: run train_step on a trainable backend first")
    return g.detach()


@torch.no_grad()
def set_adapters(chunks: list[MegarlGPTModel], adapter: dict[str, torch.Tensor],
                 tp_rank: int, tp_size: int) -> int:
    """Copy full adapter tensors (``<HF module>.lora_{A,B}.weight``: A [r, in], B [out, r],
    e.g. a PEFT file's, `gather_adapters`' names) into this rank's shards of the pairs they
    name. Returns how many tensors were copied; KeyError for a name no chunk of the model
    (any stage) adapts is the caller's check. The optimizer's main params must be reloaded."""
    copied = 0
    for adapters in chunk_adapters(chunks):
        for pair in adapters.pairs.values():
            for which in ("lora_A", "lora_B"):
                full = adapter.get(f"{pair.spec.module}.{which}.weight")
                if full is None:
                    continue
                axis = pair.split_axis(which)
                if axis is not None:
                    n = full.shape[axis] // tp_size
                    full = full.narrow(axis, tp_rank * n, n)
                param = getattr(pair, which)
                if tuple(full.shape) != tuple(param.shape):
                    raise ValueError(f"{pair.spec.module}.{which}: shard {tuple(full.shape)} vs "
                                     f"parameter {tuple(param.shape)}")
                param.copy_(full.to(param.dtype))
                copied += 1
    return copied


def merge_stream(stream: Iterable[tuple[str, torch.Tensor]], adapter: dict[str, torch.Tensor],
                 scaling: float) -> Iterator[tuple[str, torch.Tensor]]:
    """``stream`` (HF name, full tensor) with ``W + scaling * B A`` folded into every adapted
    weight (computed in the weight's dtype, as PEFT's merge)."""
    for name, t in stream:
        module = name.removesuffix(".weight")
        a = adapter.get(f"{module}.lora_A.weight")
        if a is not None and name.endswith(".weight"):
            b = adapter[f"{module}.lora_B.weight"]
            t = t + (b.to(t.dtype) @ a.to(t.dtype)) * scaling
        yield name, t


def settings_json(settings: LoraSettings | None) -> Any:
    """``settings`` as it reads back from a checkpoint's JSON meta (lists, not tuples; how the
    adapters started left out: `megarl.models.lora.settings_meta`)."""
    return settings_meta(settings)


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else (
        torch.device("cpu"))


class AdapterOffReference(lora_reference.AdapterOffReference):
    """A `megarl.backends.protocol.Backend` of role ``ref`` over a megatron LoRA actor: the
    actor's chunks with their adapters off (the frozen base is the initial policy), with the
    reference's own no-grad micro size. Logprobs only (the shared part is
    `megarl.backends.lora_reference.AdapterOffReference`)."""

    micro_settings = ("forward_micro_batch_size",)

    def __init__(self, actor: Any, *, forward_micro_batch_size: int | None = None) -> None:
        if getattr(actor, "lora", None) is None:
            raise ValueError("AdapterOffReference needs a megatron actor with LoRA adapters")
        super().__init__(actor)
        self.forward_micro_batch_size = forward_micro_batch_size

    @classmethod
    def from_settings(cls, actor: Any, ref: RoleSettings) -> AdapterOffReference:
        """The reference of ``actor`` with the no-grad micro-batching of ``ref`` (the
        reference role's settings)."""
        from megarl.backends.megatron.config import backend_kwargs

        _, kw = backend_kwargs(ref)
        return cls(actor, forward_micro_batch_size=kw["forward_micro_batch_size"])

    def logprobs(self, batch: Any, temperature: float = 1.0, with_entropy: bool = False,
                 micro_batches: Any = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The base model's no-grad (logprob [B, L], entropy [B, L] or None), float32."""
        with self._as_reference() as a:
            return a.logprobs(batch, temperature, with_entropy)
