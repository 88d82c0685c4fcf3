"""Parallelism applied to a loaded `megarl.models.Transformer`, torchtitan style: one small
function per kind (pipeline split, tensor parallel, FSDP2). Order: split -> TP -> FSDP.

Tensor parallel plan (DTensor ``parallelize_module``; every parameter ends up a DTensor on the
TP mesh, so optimizers, clipping and checkpoints see one kind of tensor):

- q/k/v, gate/up: ``ColwiseParallel``; o/down: ``RowwiseParallel`` (output all-reduced, or
  reduce-scattered along the sequence under SP);
- embedding: ``RowwiseParallel`` (vocabulary-sharded, output replicated);
- LM head: ``ColwiseParallel`` (its weight is the vocabulary shard ``[V/tp, H]`` that the
  logprob kernel reads; the module itself is never called); tied heads re-tied to the embedding;
- norms and the ``score`` head: replicated parameters (`ReplicateParallel`); Qwen3's per-head
  q/k norms see their input as sharded over heads, so their weight gradient is summed over TP;
- sequence parallel (``sp``): the residual stream between the norms is sharded along the
  sequence; norms run ``SequenceParallel``; attention / MLP inputs are all-gathered. The model
  derives mask and RoPE from full-length tensors, so the first block of every stage splits its
  input and the last block of a non-last stage (or the final norm) gathers its output.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from megarl.errors import UserInputError
from megarl.models.model import Transformer

# ---------------------------------------------------------------------------------------------
# Pipeline split
# ---------------------------------------------------------------------------------------------


def stage_layers(num_layers: int, stage: int, num_stages: int) -> list[int]:
    """Layer indices of ``stage`` (contiguous, sizes differing by at most one, earlier stages
    get the extra layers)."""
    if num_layers < num_stages:
        raise ValueError(
            f"pipeline_model_parallel_size={num_stages} exceeds the model's {num_layers} layers"
        )
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return list(range(start, start + base + (1 if stage < extra else 0)))


def split_stage(model: Transformer, stage: int, num_stages: int) -> list[int]:
    """Drop what ``stage`` does not own (layers, embedding on non-first, norm/head on non-last
    stages) in place; names of what remains are unchanged. Returns the owned layer indices."""
    if num_stages == 1:
        return list(range(model.args.num_hidden_layers))
    if model.tied:
        raise ValueError(
            "tie_word_embeddings with pipeline parallelism is not supported by the torch backend "
            "(the embedding and the LM head live on different stages); use pp=1"
        )
    owned = stage_layers(model.args.num_hidden_layers, stage, num_stages)
    for key in list(model.model.layers.keys()):
        if int(key) not in owned:
            del model.model.layers[key]
    if stage != 0:
        model.model.embed_tokens = None
    if stage != num_stages - 1:
        model.model.norm = None
        model.lm_head = None
        model.score = None
    return owned


# ---------------------------------------------------------------------------------------------
# Tensor parallel
# ---------------------------------------------------------------------------------------------


class ReplicateParallel(ParallelStyle):
    """Parameters become replicated DTensors; the first input is annotated with
    ``input_layout`` (Replicate: identical on every rank; Shard(d): this rank's slice) and the
    output is returned as a local tensor. With a sharded input the parameter gradient is a sum
    over the TP group (DTensor inserts the reduction)."""

    def __init__(self, input_layout: Placement | None = None) -> None:
        super().__init__()
        self.input_layout = input_layout or Replicate()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for pname, p in list(mod.named_parameters(recurse=False)):
                dt = DTensor.from_local(p.detach(), mesh, [Replicate()], run_check=False)
                mod.register_parameter(pname, nn.Parameter(dt, requires_grad=p.requires_grad))

        def input_fn(mod, inputs, mesh):
            x = inputs[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, [self.input_layout], run_check=False)
            return (x, *inputs[1:])

        def output_fn(mod, outputs, mesh):
            return outputs.to_local() if isinstance(outputs, DTensor) else outputs

        return distribute_module(module, device_mesh, partition, input_fn, output_fn)


def _seq_split(mesh: DeviceMesh):
    """Forward pre-hook: the block's full-sequence input -> this rank's sequence slice."""

    def hook(module, args):
        x = DTensor.from_local(args[0], mesh, [Replicate()], run_check=False)
        return (x.redistribute(mesh, [Shard(1)]).to_local(), *args[1:])

    return hook


def _seq_gather(mesh: DeviceMesh):
    """Forward hook: a sequence-sharded output (local slice or DTensor) -> the full sequence."""

    def hook(module, args, out):
        if not isinstance(out, DTensor):
            out = DTensor.from_local(out, mesh, [Shard(1)], run_check=False)
        return out.redistribute(mesh, [Replicate()]).to_local()

    return hook


def _block_plan(model: Transformer, sp: bool) -> dict[str, ParallelStyle]:
    out_layout = Shard(1) if sp else Replicate()
    plan: dict[str, ParallelStyle] = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=out_layout),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=out_layout),
    }
    if sp:
        n_attn_args = 5  # x, cos, sin, mask, kv_cache (DecoderLayer always passes all five)
        plan["input_layernorm"] = SequenceParallel()
        plan["post_attention_layernorm"] = SequenceParallel()
        plan["self_attn"] = PrepareModuleInput(
            input_layouts=(Shard(1),) + (None,) * (n_attn_args - 1),
            desired_input_layouts=(Replicate(),) + (None,) * (n_attn_args - 1),
            use_local_output=True,
        )
        plan["mlp"] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        )
    else:
        plan["input_layernorm"] = ReplicateParallel()
        plan["post_attention_layernorm"] = ReplicateParallel()
    if model.args.qk_norm:  # [b, t, heads, hd]: this rank holds a slice of the heads
        plan["self_attn.q_norm"] = ReplicateParallel(Shard(2))
        plan["self_attn.k_norm"] = ReplicateParallel(Shard(2))
    return plan


def check_tp_divisible(model: Transformer, tp: int) -> None:
    a = model.args
    for name, v in (
        ("num_attention_heads", a.num_attention_heads),
        ("num_key_value_heads", a.num_key_value_heads),
        ("intermediate_size", a.intermediate_size),
        ("vocab_size", a.vocab_size),
    ):
        if v % tp:
            raise ValueError(
                f"tensor_model_parallel_size={tp} must divide the model's {name} ({v})"
            )


def check_tp_supported(model: Transformer, tp: int) -> None:
    """Refuse what the tensor-parallel plan does not cover (mixture-of-experts layers)."""
    if tp > 1 and model.args.is_moe:
        raise UserInputError(
            f"MoE with TP>1 on the torch backend is not supported (this {model.args.model_type} "
            f"model has {model.args.num_experts} experts per sparse layer, "
            f"tensor_model_parallel_size={tp}); use tensor_model_parallel_size=1: FSDP2 "
            "(data_parallel_shard) shards the experts like every other parameter"
        )


def apply_tp(model: Transformer, tp_mesh: DeviceMesh, sp: bool, *, is_last: bool) -> None:
    """Tensor (and sequence) parallelism over ``tp_mesh`` in place (see module docstring)."""
    check_tp_supported(model, tp_mesh.size())
    check_tp_divisible(model, tp_mesh.size())
    m = model.model
    top: dict[str, ParallelStyle] = {}
    if m.embed_tokens is not None:
        top["model.embed_tokens"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Replicate()
        )
    if model.lm_head is not None and not model.tied:
        top["lm_head"] = ColwiseParallel()
    if model.score is not None:
        top["score"] = ReplicateParallel()
    if m.norm is not None:
        top["model.norm"] = SequenceParallel() if sp else ReplicateParallel()
    parallelize_module(model, tp_mesh, top, src_data_rank=None)
    for layer in m.layers.values():
        parallelize_module(layer, tp_mesh, _block_plan(model, sp), src_data_rank=None)
    model.tie_weights()  # the head is the (vocabulary-sharded) embedding again

    if sp:
        layers = list(m.layers.values())
        layers[0].register_forward_pre_hook(_seq_split(tp_mesh))
        if not is_last:
            layers[-1].register_forward_hook(_seq_gather(tp_mesh))
        else:
            m.norm.register_forward_hook(_seq_gather(tp_mesh))


# ---------------------------------------------------------------------------------------------
# FSDP2
# ---------------------------------------------------------------------------------------------


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype | None,
    reshard_after_forward: bool,
    gradient_divide_factor: float | None = None,
) -> None:
    """``fully_shard`` every decoder block, then the root (embedding, final norm, head).
    ``param_dtype`` (bf16) turns on mixed precision: bf16 compute params, the sharded params
    in their own dtype (fp32 masters); gradients are reduced in fp32 in every case (and kept
    in the parameters' dtype). The root keeps its parameters unsharded after forward
    (the LM-head weight is read by the logprob kernel after the model's forward returns).
    ``gradient_divide_factor``: what the gradient sum over ``dp_mesh`` is divided by (default:
    its size, the mean)."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    modules = [*model.model.layers.values(), model]
    for m in modules:
        last = m is model
        fully_shard(m, mesh=dp_mesh, mp_policy=mp,
                    reshard_after_forward=False if last else reshard_after_forward)
        if gradient_divide_factor is not None:  # a sum, then a division (gloo has no PREMUL_SUM)
            m.set_gradient_divide_factor(float(gradient_divide_factor))
            m.set_force_sum_reduction_for_comms(True)
