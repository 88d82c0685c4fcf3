"""Mixture-of-experts layers (Qwen3-MoE, Qwen2-MoE) on megatron-core's own MoE modules.

A sparse layer's MLP is megatron's ``MoELayer``: ``TopKRouter`` (``mlp.router.weight [E, h]``,
replicated), ``SequentialMLP`` holding this expert-parallel rank's ``E / ep`` experts
(``mlp.experts.local_experts.{i}``, global expert ``ep_rank * E / ep + i``, each a SwiGLU MLP
``linear_fc1 = cat([gate, up])`` / ``linear_fc2``, sharded over the expert-tensor-parallel
group like a dense MLP over TP) and for Qwen2-MoE ``SharedExpertMLP`` (``mlp.shared_experts``,
TP-sharded, with ``gate_weight [1, h]``: output x sigmoid(x @ gate_weight^T)).

Routing equals transformers' ``Qwen3MoeTopKRouter`` (softmax of the fp32 router logits, top-k,
renormalised when ``norm_topk_prob``):

- ``norm_topk_prob=True``: ``moe_router_pre_softmax=False``, megatron's top-k of the logits then
  a softmax over the k of them, which is softmax-then-top-k divided by the k probabilities' sum
  (the partition function cancels; the top-k indices are the same since softmax is monotone);
- ``norm_topk_prob=False``: ``moe_router_pre_softmax=True``, softmax over all experts then top-k.

No capacity limit, no token dropping (``moe_expert_capacity_factor=None``): a token's output
does not depend on the other tokens. Tokens move between expert-parallel ranks with megatron's
``alltoall`` dispatcher on CUDA and its ``allgather`` dispatcher on CPU (megatron's all-to-all
dispatcher creates CUDA streams and events unconditionally; the all-gather one only all-gathers
and reduce-scatters over the expert grid, which gloo runs). The router runs in fp32
(``moe_router_dtype="fp32"``) as transformers' softmax does.

With TP > 1 the MoE layers need sequence parallelism (megatron's rule): without it every TP
rank routes the same tokens and the experts see each token TP times.

Layer kinds follow transformers: layer i is sparse unless it is listed in ``mlp_only_layers`` or
``(i + 1) % decoder_sparse_step != 0``; dense layers keep the dense MLP of width
``intermediate_size``.
"""

from __future__ import annotations

from typing import Any

from megarl.models.args import ModelArgs, UnsupportedModelError

# (megatron suffix under ``mlp.experts.local_experts.{i}.``, HF suffixes under
# ``mlp.experts.{j}.``, kind)
EXPERT_ENTRIES = (
    ("linear_fc1.weight", ("gate_proj.weight", "up_proj.weight"), "efc1"),
    ("linear_fc2.weight", ("down_proj.weight",), "ecol"),
)
SHARED_ENTRIES = (
    ("mlp.shared_experts.linear_fc1.weight",
     ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"), "fc1"),
    ("mlp.shared_experts.linear_fc2.weight", ("mlp.shared_expert.down_proj.weight",), "col"),
    ("mlp.shared_experts.gate_weight", ("mlp.shared_expert_gate.weight",), "replicated"),
)
EXPERT_KINDS = ("efc1", "ecol")


def layer_pattern(args: ModelArgs) -> list[int]:
    """megatron's ``moe_layer_freq`` list: 1 where layer i is sparse (transformers' rule)."""
    return [int(args.is_moe_layer(i)) for i in range(args.num_hidden_layers)]


def check_moe_supported(args: ModelArgs, tp: int, ep: int, etp: int, sp: bool) -> None:
    """Refuse expert layouts that do not divide the model or that megatron would compute
    differently (each refusal names the key to change)."""
    if not args.is_moe:
        if ep > 1 or etp != tp:
            raise ValueError(
                f"expert_model_parallel_size={ep} / expert_tensor_parallel_size={etp} need a "
                f"mixture-of-experts model; {args.model_type} has no experts: leave both unset"
            )
        return
    if args.num_experts % ep:
        raise ValueError(
            f"expert_model_parallel_size={ep} must divide num_experts ({args.num_experts})"
        )
    if args.moe_intermediate_size % etp:
        raise ValueError(
            f"expert_tensor_parallel_size={etp} must divide moe_intermediate_size "
            f"({args.moe_intermediate_size})"
        )
    if args.shared_expert_intermediate_size % tp:
        raise ValueError(
            f"tensor_model_parallel_size={tp} must divide shared_expert_intermediate_size "
            f"({args.shared_expert_intermediate_size})"
        )
    if tp > 1 and not sp:
        raise ValueError(
            f"tensor_model_parallel_size={tp} on a mixture-of-experts model needs "
            "sequence_parallel=True (megatron's rule: each TP rank routes its own tokens; "
            "without it the experts see every token tp times)"
        )


def default_dispatcher() -> str:
    """``alltoall`` on CUDA, ``allgather`` on CPU (see module docstring)."""
    import torch

    return "alltoall" if torch.cuda.is_available() else "allgather"


def moe_config_kwargs(
    args: ModelArgs, ep: int, etp: int, dispatcher: str | None = None, aux_loss_coeff: float = 0.0
) -> dict[str, Any]:
    """TransformerConfig fields of the MoE layers (empty for a dense model); ``aux_loss_coeff``
    > 0 turns on megatron's load-balancing loss (see `aux_loss_metric`)."""
    if aux_loss_coeff < 0:
        raise ValueError(f"moe_aux_loss_coeff must be >= 0, got {aux_loss_coeff}")
    if not args.is_moe:
        return {}
    if args.mlp_bias:
        raise UnsupportedModelError("MoE experts with biases are not supported by megatron")
    shared = args.shared_expert_intermediate_size or None
    return {
        "num_moe_experts": args.num_experts,
        "moe_router_topk": args.num_experts_per_tok,
        "moe_ffn_hidden_size": args.moe_intermediate_size,
        "moe_layer_freq": layer_pattern(args),
        "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": not args.norm_topk_prob,
        "moe_router_topk_scaling_factor": None,
        "moe_router_dtype": "fp32",
        "moe_router_load_balancing_type": "aux_loss" if aux_loss_coeff > 0 else "none",
        "moe_aux_loss_coeff": float(aux_loss_coeff),
        "moe_expert_capacity_factor": None,
        "moe_token_dispatcher_type": dispatcher or default_dispatcher(),
        "moe_grouped_gemm": False,
        "moe_permute_fusion": False,
        "moe_router_fusion": False,
        "moe_shared_expert_intermediate_size": shared,
        "moe_shared_expert_gate": bool(shared),
        "moe_shared_expert_overlap": False,
        "expert_model_parallel_size": ep,
        "expert_tensor_parallel_size": etp,
    }


def fix_router_gemm() -> None:
    """megatron-core 0.16.1 bug: ``moe_utils`` imports TransformerEngine's ``general_gemm`` in a
    try block whose ``except`` leaves the name undefined, so without TE every router forward
    fails with ``NameError: te_general_gemm``. None selects its plain ``torch.mm`` path."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def moe_mlp_spec(config):
    """megatron's MoE module spec without grouped GEMM (SequentialMLP, local linears)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    fix_router_gemm()

    spec = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts, moe_grouped_gemm=False, normalization="RMSNorm",
        qk_layernorm=config.qk_layernorm,
    )
    return spec.submodules.mlp


def mark_expert_params(model) -> None:
    """Tag every routed-expert parameter ``allreduce=False`` (megatron's mark of an expert
    parameter) also at EP=1, where megatron leaves them untagged: DDP and the optimizer then keep
    experts in their own buffers and their own (chained) optimizer at every EP size, so a
    checkpoint's optimizer state has the same structure at EP=1 and EP=2 and reshards between
    them. At EP=1 the expert data-parallel group is the data-parallel group: same reductions."""
    for name, param in model.named_parameters():
        if ".mlp.experts." in name:
            param.allreduce = False


def moe_layer_entries(
    args: ModelArgs, layer: int, local: int, ep_rank: int | None, ep_size: int
) -> list[tuple[str, tuple[str, ...], str, int, int | None]]:
    """(megatron name, HF names, kind, inner width, global expert) of the MoE MLP of global
    layer ``layer`` held as ``decoder.layers.{local}``. ``ep_rank``: the experts this rank
    holds (local index i is global expert ``ep_rank * E / ep_size + i``); None: every expert
    of the model (megatron name left empty), for the full-model lists."""
    pre, hf = f"decoder.layers.{local}.", f"model.layers.{layer}."
    out = [(pre + "mlp.router.weight", (hf + "mlp.gate.weight",), "replicated", 0, None)]
    n_local = args.num_experts // ep_size
    experts = range(args.num_experts) if ep_rank is None else range(
        ep_rank * n_local, (ep_rank + 1) * n_local
    )
    for j in experts:
        for suffix, hf_suffixes, kind in EXPERT_ENTRIES:
            name = "" if ep_rank is None else f"{pre}mlp.experts.local_experts.{j % n_local}.{suffix}"
            hf_names = tuple(f"{hf}mlp.experts.{j}.{s}" for s in hf_suffixes)
            out.append((name, hf_names, kind, args.moe_intermediate_size, j))
    if args.shared_expert_intermediate_size:
        for suffix, hf_suffixes, kind in SHARED_ENTRIES:
            out.append((pre + suffix, tuple(hf + s for s in hf_suffixes), kind,
                        args.shared_expert_intermediate_size, None))
    return out


def moe_hf_shapes(args: ModelArgs, leaf: str) -> tuple[int, ...] | None:
    """Full HF shape of an MoE tensor named ``leaf`` (the name after ``model.layers.{l}.``),
    None when ``leaf`` is not an MoE tensor."""
    h, inner, shared = args.hidden_size, args.moe_intermediate_size, (
        args.shared_expert_intermediate_size
    )
    if leaf == "mlp.gate.weight":
        return (args.num_experts, h)
    if leaf.startswith("mlp.experts."):
        last = leaf.split(".", 3)[3]
        return {"gate_proj.weight": (inner, h), "up_proj.weight": (inner, h),
                "down_proj.weight": (h, inner)}[last]
    table = {
        "mlp.shared_expert.gate_proj.weight": (shared, h),
        "mlp.shared_expert.up_proj.weight": (shared, h),
        "mlp.shared_expert.down_proj.weight": (h, shared),
        "mlp.shared_expert_gate.weight": (1, h),
    }
    return table.get(leaf)


def aux_loss_metric(num_microbatches: int, tp_cp_group, pp_group) -> float:
    """The load-balancing loss of the last train_step (without its coefficient), as the
    gradient saw it: per sparse layer and micro-batch megatron's Switch loss
    ``E / (k T^2) * sum_e (sum_x p_xe) * (tokens routed to e)`` over the T real tokens of the
    micro-batch (padding excluded), summed over layers, averaged over micro-batches (the
    caller averages over DP). Reads and drops megatron's layer-wise tracker entry. Collective
    over TP x CP (each rank holds its sequence shard's share: SP, context parallelism) and PP
    (each stage its layers)."""
    import torch
    import torch.distributed as dist

    entry = reset_aux_tracker()
    total = torch.zeros((), dtype=torch.float64)
    if entry is not None:
        total = entry["values"].detach().double().sum().cpu()
    device = entry["values"].device if entry is not None else torch.device("cpu")
    total = total.to(device)
    if dist.get_world_size(tp_cp_group) > 1:
        dist.all_reduce(total, group=tp_cp_group)
    if dist.get_world_size(pp_group) > 1:
        dist.all_reduce(total, group=pp_group)
    return float(total) / num_microbatches


def reset_aux_tracker() -> dict | None:
    """Remove (and return) megatron's global tracker entry of the load-balancing loss: it is
    sized by the num_layers of the first model that wrote it, so another model in the same
    process (more layers) would index past it."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    return get_moe_layer_wise_logging_tracker().pop("load_balancing_loss", None)


def padding_mask(lengths, rows: int, seq_len: int, columns=None):
    """[rows, seq_len] bool, True at padding: row i's real tokens are its first ``lengths[i]``
    columns, rows past ``len(lengths)`` are padding; ``columns`` [seq_len]: the global column
    of each (context parallelism), default 0..seq_len-1. megatron 0.16.1's router reads True
    as padding (``compute_routing_scores_for_aux_loss`` keeps ``~padding_mask``), whatever its
    docstrings say; the load-balancing loss then counts real tokens only."""
    import torch

    cols = torch.arange(seq_len, device=lengths.device) if columns is None else columns
    full = torch.zeros(rows, dtype=lengths.dtype, device=lengths.device)
    full[: lengths.shape[0]] = lengths
    return cols[None] >= full[:, None]


def align_over_dp(mbs: list, seq_len: int, rows: int, forward_only: bool, dp_group, dp_rank: int):
    """(micro-batches, seq_len, rows) agreed over the data-parallel group, for MoE layouts whose
    token exchange spans DP ranks (EP > 1, or an expert-TP size other than TP): megatron's
    all-gather dispatcher needs the same token count on all of them, and every exchange the same
    number of forwards. Sizes: the largest; for forwards also the largest count (extra
    micro-batches repeat the last one, their outputs fall after this rank's rows and are
    dropped); a train_step needs the same count on every DP rank (ValueError otherwise)."""
    import torch
    import torch.distributed as dist

    device = mbs[0].input_ids.device
    sizes = torch.tensor([len(mbs), seq_len, rows], dtype=torch.long, device=device)
    low = -sizes.clone()
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=dp_group)
    dist.all_reduce(low, op=dist.ReduceOp.MAX, group=dp_group)
    count, seq_len, rows = sizes.tolist()
    if count != -int(low[0]):
        if not forward_only:
            raise ValueError(
                f"train_step got {len(mbs)} micro-batches on data-parallel rank {dp_rank}, and "
                f"the DP ranks disagree ({-int(low[0])} to {count}): with expert parallelism "
                "every DP rank must run the same number"
            )
        mbs = mbs + [mbs[-1]] * (count - len(mbs))
    return mbs, seq_len, rows
