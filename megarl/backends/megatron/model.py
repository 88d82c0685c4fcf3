"""megatron-core GPTModel built from an HF config.json (Llama, Mistral, Qwen2, Qwen3 dense).

`build_model_chunks` returns this rank's pipeline chunks (one, or ``vpp`` interleaved ones) of a
`MegarlGPTModel`: a GPTModel whose forward ends at the final norm and returns hidden states
``[s, b, h]`` (sequence-sharded under SP), so that the heads (`heads.py`) can compute logprobs
and entropies from the hidden states and the vocab-parallel LM-head weight without ever
materialising full logits. Value roles (critic, PRM) carry a token-classification head
``score = Linear(h, num_labels, bias=True)`` (HF ``*ForTokenClassification``) replicated over
TP instead of the LM head.

Layer spec: megatron's local spec with our own RMSNorm (torch's, plus the ``sequence_parallel``
tag megatron's ``finalize_model_grads`` needs to all-reduce norm grads under SP; megatron's
``WrappedTorchNorm`` refuses SP) and, under context parallelism, our
`context_parallel.ContextParallelAttention` (megatron's local attention refuses CP); or the
TransformerEngine spec when TE imports and CUDA is up.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

from megarl.backends.megatron import moe
from megarl.backends.megatron.context_parallel import ContextParallelAttention
from megarl.backends.protocol import LM_ROLES, VALUE_ROLES
from megarl.models.args import ModelArgs, UnsupportedModelError


@dataclass(frozen=True)
class Layout:
    """Parallel layout of one backend: tensor, pipeline, virtual-pipeline sizes, SP flag, the
    context-parallel size, and for MoE models the expert-parallel size and the
    expert-tensor-parallel size (None: tp)."""

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    sp: bool = False
    ep: int = 1
    etp: int | None = None
    cp: int = 1

    @property
    def num_chunks(self) -> int:
        return self.vpp or 1

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def seq_multiple(self) -> int:
        """What the padded sequence length must be a multiple of: 2 x CP (the load-balanced
        chunks), times TP under sequence parallelism (each chunk pair split over TP)."""
        return (2 * self.cp if self.cp > 1 else 1) * (self.tp if self.sp else 1)


def te_available() -> bool:
    """TransformerEngine importable (and CUDA present, which TE needs)."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
        from megatron.core.extensions import transformer_engine as _  # noqa: F401
    except Exception:  # ImportError, or RuntimeError from TE's empty meta package
        return False
    return True


def check_supported(args: ModelArgs, layout: Layout) -> None:
    """Refuse configs megatron's GPTModel would compute differently from transformers, and
    layouts that do not divide the model."""
    if args.o_bias or args.mlp_bias:
        raise UnsupportedModelError(
            "config.json asks for a bias on o_proj or the MLP (attention_bias/mlp_bias): the "
            "megatron backend supports q/k/v biases only (Qwen2); use the torch backend"
        )
    if args.num_attention_heads % layout.tp or args.num_key_value_heads % layout.tp:
        raise ValueError(
            f"tensor_model_parallel_size={layout.tp} must divide num_attention_heads "
            f"({args.num_attention_heads}) and num_key_value_heads ({args.num_key_value_heads})"
        )
    if args.vocab_size % layout.tp or args.intermediate_size % layout.tp:
        raise ValueError(
            f"tensor_model_parallel_size={layout.tp} must divide vocab_size ({args.vocab_size}) "
            f"and intermediate_size ({args.intermediate_size})"
        )
    stages = layout.pp * layout.num_chunks
    if args.num_hidden_layers % stages:
        raise ValueError(
            f"num_hidden_layers ({args.num_hidden_layers}) must be a multiple of "
            f"pipeline_model_parallel_size x virtual_pipeline_model_parallel_size ({stages})"
        )
    if layout.vpp is not None and (layout.pp < 2 or layout.vpp < 2):
        raise ValueError("virtual_pipeline_model_parallel_size needs pipeline size >= 2 and >= 2")
    if layout.sp and layout.tp < 2:
        raise ValueError("sequence_parallel needs tensor_model_parallel_size >= 2")
    if layout.cp < 1:
        raise ValueError(f"context_parallel_size must be >= 1, got {layout.cp}")
    moe.check_moe_supported(args, layout.tp, layout.ep, layout.expert_tp, layout.sp)


def transformer_config(
    args: ModelArgs,
    layout: Layout,
    *,
    dtype: torch.dtype,
    recompute: dict[str, Any] | None = None,
    moe_aux_loss_coeff: float = 0.0,
) -> TransformerConfig:
    """The TransformerConfig of ``args`` (an HF config) at ``layout``; all fusions off, no
    dropout (RL)."""
    recompute = dict(recompute or {})
    return TransformerConfig(
        num_layers=args.num_hidden_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.intermediate_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_key_value_heads,
        kv_channels=args.head_dim,
        layernorm_epsilon=args.rms_norm_eps,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=args.qkv_bias,
        qk_layernorm=args.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=args.initializer_range,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        sequence_parallel=layout.sp,
        context_parallel_size=layout.cp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        # Fixed p2p shapes: the backend pads the micro-batches of one schedule call to one
        # [s, b]. (Shape exchange, variable_seq_lengths=True, deadlocks the interleaved
        # schedule on gloo.)
        variable_seq_lengths=False,
        # Interleaving sends to the previous and the next stage in one call; at pp=2 both are
        # the same rank and batched p2p pairs the two messages in the wrong order (silently
        # swapping activations and gradients). megatron's unbatched path orders them by rank.
        batch_p2p_comm=layout.vpp is None,
        use_cpu_initialization=not torch.cuda.is_available(),
        # Kept on although every parameter is overwritten (HF weights or a checkpoint):
        # megatron sets the `tensor_model_parallel` attributes of TP-sharded weights only in
        # its init functions, and the grad norm and the optimizer rely on them.
        perform_initialization=True,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        persist_layer_norm=False,
        recompute_granularity=recompute.get("granularity"),
        recompute_method=recompute.get("method"),
        recompute_num_layers=recompute.get("num_layers"),
        recompute_modules=recompute.get("modules"),
        **moe.moe_config_kwargs(
            args, layout.ep, layout.expert_tp, aux_loss_coeff=moe_aux_loss_coeff
        ),
    )


class RMSNorm(torch.nn.RMSNorm):
    """torch RMSNorm with megatron's norm constructor signature; the weight carries the
    ``sequence_parallel`` tag so finalize_model_grads all-reduces its grad over TP under SP."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: Any):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = bool(config.sequence_parallel)


class QKRMSNorm(torch.nn.RMSNorm):
    """RMSNorm over head_dim on q / k (Qwen3); runs on the full sequence inside the TP region
    (megatron all-reduces its grads over TP by name: ``q_layernorm`` / ``k_layernorm``)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: Any):
        super().__init__(hidden_size, eps=eps)


def block_spec(config: TransformerConfig, *, use_te: bool, vp_stage: int | None, pp_rank: int):
    """Layer specs of one pipeline chunk plus its final norm."""
    if use_te and config.num_moe_experts:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        return get_gpt_decoder_block_spec(
            config, use_transformer_engine=True, normalization="RMSNorm", vp_stage=vp_stage,
            pp_rank=pp_rank,
        )
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=config.qk_layernorm)
    if config.context_parallel_size > 1:
        spec.submodules.self_attention.submodules.core_attention = ContextParallelAttention
    spec.submodules.input_layernorm = RMSNorm
    spec.submodules.pre_mlp_layernorm = RMSNorm
    if config.qk_layernorm:
        spec.submodules.self_attention.submodules.q_layernorm = QKRMSNorm
        spec.submodules.self_attention.submodules.k_layernorm = QKRMSNorm
    n = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    if not config.num_moe_experts:
        return TransformerBlockSubmodules(layer_specs=[spec] * n, layer_norm=RMSNorm)
    sparse_spec = copy.deepcopy(spec)
    sparse_spec.submodules.mlp = moe.moe_mlp_spec(config)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    pattern = config.moe_layer_freq
    specs = [sparse_spec if pattern[offset + i] else spec for i in range(n)]
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=RMSNorm)


class MegarlGPTModel(GPTModel):
    """GPTModel that returns final hidden states; with ``num_labels`` it carries a ``score``
    token-classification head (replicated over TP) instead of the LM output layer."""

    def __init__(self, *args: Any, num_labels: int | None = None, score_bias: bool = True,
                 **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.num_labels = num_labels
        if num_labels is not None and self.post_process:
            # Value heads have no LM output layer (the one GPTModel built is dropped at once).
            del self.output_layer
            self.output_layer = None
            device = "cpu" if self.config.use_cpu_initialization else torch.cuda.current_device()
            self.score = torch.nn.Linear(
                self.config.hidden_size,
                num_labels,
                bias=score_bias,
                dtype=self.config.params_dtype,
                device=device,
            )

    def _postprocess(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any):
        return hidden_states

    def lm_head_weight(self) -> torch.Tensor:
        """[V/tp, h] vocab-parallel LM-head weight (the embedding when tied)."""
        if self.share_embeddings_and_output_weights:
            return self.shared_embedding_or_output_weight()
        return self.output_layer.weight

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        if self.num_labels is None:
            return super().sharded_state_dict(prefix, sharded_offsets, metadata)
        # No output layer: skip LanguageModule's output-layer tying / padding bookkeeping.
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return MegatronModule.sharded_state_dict(self, prefix, sharded_offsets, metadata)


def llama3_inv_freq(args: ModelArgs) -> torch.Tensor:
    """HF's llama3 frequency-dependent RoPE scaling of the inverse frequencies [head_dim/2]."""
    s = args.rope_scaling
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def build_model_chunks(
    role: str,
    args: ModelArgs,
    config: TransformerConfig,
    layout: Layout,
    *,
    pp_rank: int,
    num_labels: int | None,
    use_te: bool,
) -> list[MegarlGPTModel]:
    """This rank's chunks (``layout.num_chunks`` of them) of the model, randomly initialised."""
    chunks = []
    for vp in range(layout.num_chunks):
        vp_stage = vp if layout.vpp else None
        first = pp_rank == 0 and vp == 0
        last = pp_rank == layout.pp - 1 and vp == layout.num_chunks - 1
        model = MegarlGPTModel(
            config=config,
            transformer_layer_spec=block_spec(config, use_te=use_te, vp_stage=vp_stage,
                                              pp_rank=pp_rank),
            vocab_size=args.vocab_size,
            max_sequence_length=args.max_position_embeddings,
            pre_process=first,
            post_process=last,
            share_embeddings_and_output_weights=args.tie_word_embeddings and role in LM_ROLES,
            position_embedding_type="rope",
            rotary_base=args.rope_theta,
            vp_stage=vp_stage,
            num_labels=num_labels if role in VALUE_ROLES else None,
            score_bias=args.token_classification_bias,
        )
        if args.rope_scaling is not None:
            model.rotary_pos_emb.inv_freq = llama3_inv_freq(args).to(
                model.rotary_pos_emb.inv_freq.device
            )
        if config.num_moe_experts:
            moe.mark_expert_params(model)
        if not config.use_cpu_initialization:
            # megatron creates its linear layers on the current CUDA device; the norms
            # (torch modules) and buffers are created on the CPU: move the rest, as megatron's
            # own get_model does.
            model.cuda(torch.cuda.current_device())
        chunks.append(model)
    return chunks


def global_layer_numbers(model: MegarlGPTModel) -> list[int]:
    """0-based global indices of the decoder layers held by this chunk, in local order."""
    return [layer.layer_number - 1 for layer in model.decoder.layers]


def layer_owner(args: ModelArgs, layout: Layout, layer: int) -> tuple[int, int]:
    """(pp_rank, vp_stage) holding global layer ``layer`` with megatron's even split: chunk
    ``vp * pp + pp_rank`` holds layers ``[c * n, (c + 1) * n)``, n = L / (pp * vpp)."""
    per_chunk = args.num_hidden_layers // (layout.pp * layout.num_chunks)
    chunk = layer // per_chunk
    return chunk % layout.pp, chunk // layout.pp
