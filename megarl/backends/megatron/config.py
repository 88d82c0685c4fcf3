"""Project config -> `MegatronBackend` keyword arguments, per role: the shared settings of
`megarl.backends.settings` plus the role's ``megatron`` block (critic: its own; actor, ref and
prm: the actor's), which only this backend reads:

    param_dtype             the dtype of actor / ref / critic (None = the model's dtype); the
                            PRM computes in reward_model.model.dtype
    recompute_granularity   full | selective (+ recompute_method, recompute_num_layers); unset:
                            full when the role's model.enable_gradient_checkpointing
    use_distributed_optimizer, expert_model_parallel_size, expert_tensor_parallel_size,
    moe_aux_loss_coeff      (trainable roles only)
    override_transformer_config  verl's TransformerConfig fields (`apply_transformer_overrides`;
                            actor, ref: the actor's block; critic: its own)
    use_dist_checkpointing, dist_checkpointing_path, dist_checkpointing_prefix  initial weights
                            from a megatron-core dist checkpoint (`dist_init`; not the PRM)

The role's ``model.override_config`` (verl's HF config overrides) goes to the backend as
``hf_overrides`` (`megarl.models.overrides`); ``optim.override_optimizer_config`` travels in the
optimizer settings (`megarl.backends.megatron.optim.optimizer_config`).

No-grad micro-batches: the role's micro size when its dynamic batching is off, else None (the
DP share in ``pp`` pieces: this backend has no token budget).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from megarl.backends.settings import RoleSettings
from megarl.errors import UserInputError

if TYPE_CHECKING:
    from megatron.core.transformer import TransformerConfig


def backend_kwargs(s: RoleSettings) -> tuple[str, dict[str, Any]]:
    """(model path, keyword arguments of `MegatronBackend`) for the role of ``s``."""
    role = s.role
    mega, par = s.megatron, s.parallel
    recompute: dict[str, Any] | str | None = None
    if mega.recompute_granularity:
        recompute = {"granularity": mega.recompute_granularity,
                     "method": mega.recompute_method, "num_layers": mega.recompute_num_layers}
    elif s.activation_checkpointing:
        recompute = "full"
    dtype = s.dtype if role == "prm" else (mega.param_dtype or s.dtype)
    kwargs = {
        "tp": par.tp, "pp": par.pp, "vpp": par.vpp, "sp": par.sp, "cp": par.cp,
        "ep": int(mega.expert_model_parallel_size or 1),
        "etp": mega.expert_tensor_parallel_size,
        "dtype": dtype,
        "optim": s.optim,
        "use_distributed_optimizer": mega.use_distributed_optimizer is not False,
        "recompute": recompute,
        "seed": s.seed,
        "use_fused_kernels": s.kernels.fused,
        "forward_micro_batch_size": None if s.micro.dynamic else s.micro.rows,
        "moe_aux_loss_coeff": float(mega.moe_aux_loss_coeff or 0.0) if s.trainable else 0.0,
        "router_replay": s.router_replay,
    }
    if role == "actor":
        kwargs["lora"] = s.lora
    # verl's overrides (the backend's constructor applies them: hf_overrides to config.json as
    # it is read, transformer_overrides onto the TransformerConfig it builds)
    if s.override_config:
        kwargs["hf_overrides"] = s.override_config
    if role != "prm" and getattr(mega, "use_dist_checkpointing", False):
        from megarl.backends.megatron.dist_init import dist_checkpoint_keys

        use_key, path_key = dist_checkpoint_keys(role)
        if not mega.dist_checkpointing_path:
            raise UserInputError(f"{use_key}=true needs {path_key}: the folder of a "
                                 "megatron-core dist checkpoint")
        kwargs["dist_checkpoint"] = str(mega.dist_checkpointing_path)
        kwargs["dist_checkpoint_prefix"] = mega.dist_checkpointing_prefix or ""
    tf = getattr(mega, "override_transformer_config", None) if role != "prm" else None
    if transformer_overrides(tf, role):  # names checked here, values by megatron-core
        kwargs["transformer_overrides"] = dict(tf)
    return s.model_path, kwargs


def recompute_settings(recompute: str | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """megatron's TransformerConfig recompute fields from None | "full" | "selective" |
    {granularity, method, num_layers, modules} (full recompute: uniform, one layer per chunk
    unless given)."""
    if recompute is None or recompute is False:
        return None
    if isinstance(recompute, str):
        if recompute == "full":
            return {"granularity": "full", "method": "uniform", "num_layers": 1}
        if recompute == "selective":
            return {"granularity": "selective"}
        raise ValueError(f"recompute must be None, 'full', 'selective' or a dict, got {recompute!r}")
    out = {k: v for k, v in dict(recompute).items() if v is not None}
    if out.get("granularity") == "full":
        out.setdefault("method", "uniform")
        out.setdefault("num_layers", 1)
    return out


# ------------------------------------------------------------------ override_transformer_config

_HF = "megarl derives it from the model's config.json (actor_rollout_ref.model.override_config " \
      "changes config.json fields that keep the weights' shapes)"
_PAR = "use {m}.parallel.{k}"
_DTYPE = "use actor_rollout_ref.model.dtype (critic.model.dtype) or {m}.megatron.param_dtype"
_SPLIT = ("megarl splits the layers evenly over the pipeline stages (its weight and checkpoint "
          "layout assume it); choose pipeline_model_parallel_size / "
          "virtual_pipeline_model_parallel_size that divide num_hidden_layers")
_WIRED = "megarl's backend sets it itself (its schedule and weight handling depend on it)"
_EXPERTS = ("megarl builds the routed experts as megatron-core's SequentialMLP (its HF weight "
            "mapping reads their names); grouped GEMM is not wired")

# TransformerConfig fields megarl sets itself: field -> the megarl key to use instead, or why
MEGARL_FIELDS: dict[str, str] = {
    **{k: _HF for k in (
        "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
        "kv_channels", "layernorm_epsilon", "normalization", "gated_linear_unit",
        "activation_func", "add_bias_linear", "add_qkv_bias", "qk_layernorm", "init_method_std",
        "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq",
        "moe_router_pre_softmax", "moe_router_score_function",
        "moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
        "moe_router_topk_scaling_factor", "multi_latent_attention", "mtp_num_layers")},
    "tensor_model_parallel_size": _PAR.format(m="{m}", k="tensor_model_parallel_size"),
    "pipeline_model_parallel_size": _PAR.format(m="{m}", k="pipeline_model_parallel_size"),
    "virtual_pipeline_model_parallel_size": _PAR.format(
        m="{m}", k="virtual_pipeline_model_parallel_size"),
    "sequence_parallel": _PAR.format(m="{m}", k="sequence_parallel"),
    "context_parallel_size": _PAR.format(m="{m}", k="context_parallel_size"),
    "expert_model_parallel_size": "use {m}.megatron.expert_model_parallel_size",
    "expert_tensor_parallel_size": "use {m}.megatron.expert_tensor_parallel_size",
    "params_dtype": _DTYPE, "pipeline_dtype": _DTYPE, "bf16": _DTYPE, "fp16": _DTYPE,
    "moe_aux_loss_coeff": "use {m}.megatron.moe_aux_loss_coeff",
    "moe_router_load_balancing_type": "use {m}.megatron.moe_aux_loss_coeff (> 0: aux_loss)",
    **{k: _SPLIT for k in (
        "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
        "pipeline_model_parallel_layout", "account_for_embedding_in_pipeline_split",
        "account_for_loss_in_pipeline_split")},
    "moe_grouped_gemm": _EXPERTS, "moe_use_legacy_grouped_gemm": _EXPERTS,
    **{k: _WIRED for k in (
        "variable_seq_lengths", "batch_p2p_comm", "use_cpu_initialization",
        "perform_initialization", "finalize_model_grads_func", "grad_scale_func",
        "no_sync_func", "grad_sync_func", "param_sync_func", "timers")},
}


def transformer_override_key(role: str) -> str:
    """The config key of ``role``'s TransformerConfig overrides."""
    m = "critic" if role == "critic" else "actor_rollout_ref.actor"
    return f"{m}.megatron.override_transformer_config"


def transformer_overrides(overrides: Mapping[str, Any] | None, role: str = "actor"
                          ) -> dict[str, Any]:
    """Check verl's ``megatron.override_transformer_config`` block of ``role`` against
    megatron-core's TransformerConfig fields and return {field: value} (``attention_backend``
    as megatron's ``AttnBackend``). Unknown names and fields megarl sets itself are refused
    (`UserInputError` naming the key and the fix)."""
    import dataclasses

    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not overrides:
        return {}
    key = transformer_override_key(role)
    if not isinstance(overrides, Mapping):
        raise UserInputError(f"{key}={overrides!r}: expected a mapping of megatron-core "
                             "TransformerConfig fields, e.g. {attention_dropout: 0.0}")
    names = {f.name for f in dataclasses.fields(TransformerConfig)
             if f.init and not f.name.startswith("_")}
    out: dict[str, Any] = {}
    for name, value in overrides.items():
        if name not in names:
            close = difflib.get_close_matches(name, sorted(names), n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise UserInputError(
                f"{key}.{name}: megatron-core {_mcore_version()}'s TransformerConfig has no "
                f"field {name!r}{hint}; its fields: {', '.join(sorted(names))}")
        if name == "attention_backend" and isinstance(value, str):
            try:
                value = AttnBackend[value]
            except KeyError:
                raise UserInputError(
                    f"{key}.attention_backend={value!r}: expected one of "
                    f"{', '.join(b.name for b in AttnBackend)}") from None
        out[name] = value
    return out


def apply_transformer_overrides(config: TransformerConfig, overrides: Mapping[str, Any] | None,
                                role: str = "actor") -> TransformerConfig:
    """megatron-core's TransformerConfig ``config`` (as megarl built it) with ``overrides`` (the
    role's ``megatron.override_transformer_config``, checked by `transformer_overrides`) set
    on it through ``dataclasses.replace``, which runs megatron-core's own validation
    (``__post_init__``); its refusals (a fusion that needs TransformerEngine or CUDA, an
    inconsistent combination) come back as `UserInputError` naming the key."""
    import dataclasses

    checked = transformer_overrides(overrides, role)
    if not checked:
        return config
    key = transformer_override_key(role)
    changes: dict[str, Any] = {}
    section = "critic" if role == "critic" else "actor_rollout_ref.actor"
    for name, value in checked.items():
        if name in MEGARL_FIELDS:
            if getattr(config, name) != value:
                use = MEGARL_FIELDS[name].format(m=section)
                raise UserInputError(
                    f"{key}.{name}={value!r}: megarl sets {name} itself "
                    f"({getattr(config, name)!r} here); {use}")
            continue
        changes[name] = value
    if not changes:
        return config
    if changes.get("gradient_accumulation_fusion") and not _grad_fusion_available():
        raise UserInputError(
            f"{key}.gradient_accumulation_fusion=True: megatron-core's linear layers need "
            "TransformerEngine (with CUDA) or APEX's fused_weight_gradient_mlp_cuda for it, "
            "and neither is available here; drop it (the gradients are the same without)")
    try:
        return dataclasses.replace(config, **changes)
    except (AssertionError, ValueError, TypeError, RuntimeError, ImportError) as e:
        said = ", ".join(f"{k}={v!r}" for k, v in changes.items())
        from megarl.backends.megatron.optim import te_note

        raise UserInputError(f"{key}: megatron-core refuses {said}: {e}{te_note()}") from e


def _grad_fusion_available() -> bool:
    """megatron-core's condition for gradient_accumulation_fusion: TransformerEngine's layers
    (the TE spec megarl uses with CUDA), else APEX's ``fused_weight_gradient_mlp_cuda``."""
    from megarl.backends.megatron.model import te_available

    if te_available():
        return True
    try:
        import fused_weight_gradient_mlp_cuda  # noqa: F401
    except ImportError:
        return False
    return True


def _mcore_version() -> str:
    try:
        from megatron.core import __version__
    except ImportError:
        return "(version unknown)"
    return __version__
