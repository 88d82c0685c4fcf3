"""ModelArgs: the architecture of one dense decoder, read from an HF ``config.json`` dict.

Supported families (``model_type``): ``llama`` (Llama 2/3.x, incl. llama3 RoPE scaling),
``qwen2`` (Qwen2 / Qwen2.5: bias on q/k/v), ``qwen3`` (RMSNorm on q and k per head, head_dim may
differ from hidden/heads), ``mistral`` (GQA, no bias) and the mixture-of-experts families
``qwen3_moe`` (Qwen3 attention, top-k routed experts) and ``qwen2_moe`` (Qwen2 attention, routed
experts plus a sigmoid-gated shared expert); see `megarl.models.moe`. Anything the model in ``model.py`` would
compute differently from transformers (sliding-window attention, other RoPE types, other
activations) is refused here with a clear error instead of silently giving other numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from megarl.errors import UserInputError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe")
MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe")
SUPPORTED_ROPE_TYPES = ("default", "llama3")


class UnsupportedModelError(UserInputError):
    """An HF config describes an architecture (or a feature of one) this model family lacks."""


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1 frequency-dependent RoPE scaling (``rope_type: llama3``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass
class ModelArgs:
    """Everything `Transformer` needs to build the module tree. Sizes are counts, not bytes.

    ``hf_config`` keeps the source config.json dict so a checkpoint can be written back with it.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Llama3RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # bias on q_proj, k_proj, v_proj
    o_bias: bool = False  # bias on o_proj
    mlp_bias: bool = False  # bias on gate_proj, up_proj, down_proj
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    initializer_range: float = 0.02
    pad_token_id: int | None = None
    # `score` bias: *ForTokenClassification has one, *ForSequenceClassification (outcome reward
    # models: Skywork-Reward, FsfairX-LLaMA3-RM) has none
    token_classification_bias: bool = True
    # Mixture of experts (num_experts == 0: every layer is the dense MLP above)
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int = 0  # width of one routed expert
    norm_topk_prob: bool = False  # renormalise the k chosen probabilities to sum to 1
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's sigmoid-gated shared expert (0: none)
    router_aux_loss_coef: float = 0.0  # weight of the load-balancing loss in HF's training loss
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelArgs.{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], got "
                    f"{self.num_experts_per_tok}"
                )
            if self.moe_intermediate_size <= 0:
                raise ValueError(
                    f"moe_intermediate_size must be > 0, got {self.moe_intermediate_size}"
                )
            if self.decoder_sparse_step < 1:
                raise ValueError(
                    f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}"
                )

    @property
    def is_moe(self) -> bool:
        """Whether any layer is a mixture-of-experts layer."""
        return any(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    def is_moe_layer(self, layer_idx: int) -> bool:
        """transformers' rule: sparse iff experts exist, ``layer_idx`` is not in
        ``mlp_only_layers`` and ``(layer_idx + 1) % decoder_sparse_step == 0``."""
        return (
            self.num_experts > 0
            and layer_idx not in self.mlp_only_layers
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    @property
    def n_rep(self) -> int:
        """Query heads per key/value head (GQA group size)."""
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelArgs:
        """Build ModelArgs from a parsed HF ``config.json`` (transformers 4.x or 5.x layout)."""
        if not isinstance(config, dict):
            raise TypeError(f"from_hf_config expects the config.json dict, got {type(config)}")
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"config.json model_type {model_type!r} is not supported by megarl.models; "
                f"supported model_type values: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )

        def need(key: str) -> Any:
            if config.get(key) is None:
                raise ValueError(f"config.json of a {model_type} model is missing {key!r}")
            return config[key]

        hidden_size = int(need("hidden_size"))
        num_heads = int(need("num_attention_heads"))
        num_kv_heads = int(config.get("num_key_value_heads") or num_heads)

        head_dim = config.get("head_dim")
        if head_dim is None:
            # transformers' Qwen3Config defaults head_dim to 128 rather than hidden/heads.
            head_dim = 128 if model_type == "qwen3" else hidden_size // num_heads

        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(
                f"config.json hidden_act {act!r} is not supported (only 'silu' SwiGLU MLPs)"
            )
        if float(config.get("partial_rotary_factor", 1.0) or 1.0) != 1.0:
            raise UnsupportedModelError("config.json partial_rotary_factor != 1.0 is not supported")
        _reject_sliding_window(config, model_type)
        rope_theta, rope_scaling = _parse_rope(config)

        if model_type == "qwen2":
            qkv_bias, o_bias, mlp_bias, qk_norm = True, False, False, False
        elif model_type == "qwen2_moe":
            qkv_bias, o_bias, mlp_bias, qk_norm = (
                bool(config.get("qkv_bias", True)), False, False, False
            )
        elif model_type in ("qwen3", "qwen3_moe"):
            bias = bool(config.get("attention_bias", False))
            qkv_bias, o_bias, mlp_bias, qk_norm = bias, bias, False, True
        elif model_type == "llama":
            bias = bool(config.get("attention_bias", False))
            qkv_bias, o_bias, mlp_bias, qk_norm = bias, bias, bool(config.get("mlp_bias")), False
        else:  # mistral
            qkv_bias, o_bias, mlp_bias, qk_norm = False, False, False, False

        return cls(
            model_type=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden_size,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            qk_norm=qk_norm,
            initializer_range=float(config.get("initializer_range", 0.02)),
            pad_token_id=config.get("pad_token_id"),
            token_classification_bias=bool(
                config.get("token_classification_bias", not is_sequence_classifier(config))
            ),
            hf_config=dict(config),
            **(_moe_fields(config) if model_type in MOE_MODEL_TYPES else {}),
        )


def is_sequence_classifier(config: dict[str, Any]) -> bool:
    """Whether config.json's ``architectures`` name an HF ``*ForSequenceClassification`` (an
    outcome reward model: one ``score`` row, no bias, read at the last token)."""
    return any(str(a).endswith("ForSequenceClassification")
               for a in config.get("architectures") or ())


def num_labels_from_hf_config(config: dict[str, Any]) -> int:
    """Label count of an HF ``*ForTokenClassification`` config (``num_labels``, else the size of
    ``id2label``, else transformers' default of 2)."""
    if config.get("num_labels") is not None:
        return int(config["num_labels"])
    if config.get("id2label"):
        return len(config["id2label"])
    return 2


def _moe_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The ModelArgs MoE fields of a qwen3_moe / qwen2_moe config.json (transformers 5 writes
    ``num_local_experts`` where the published checkpoints say ``num_experts``)."""
    num_experts = config.get("num_experts", config.get("num_local_experts"))
    if num_experts is None:
        raise ValueError(f"config.json of a {config['model_type']} model is missing 'num_experts'")
    for key in ("num_experts_per_tok", "moe_intermediate_size"):
        if config.get(key) is None:
            raise ValueError(f"config.json of a {config['model_type']} model is missing {key!r}")
    fields: dict[str, Any] = {
        "num_experts": int(num_experts),
        "num_experts_per_tok": int(config["num_experts_per_tok"]),
        "moe_intermediate_size": int(config["moe_intermediate_size"]),
        "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
        "decoder_sparse_step": int(config.get("decoder_sparse_step", 1) or 1),
        "mlp_only_layers": tuple(int(i) for i in (config.get("mlp_only_layers") or ())),
        "router_aux_loss_coef": float(config.get("router_aux_loss_coef", 0.001)),
    }
    if config["model_type"] == "qwen2_moe":
        if config.get("shared_expert_intermediate_size") is None:
            raise ValueError("config.json of a qwen2_moe model is missing "
                             "'shared_expert_intermediate_size'")
        fields["shared_expert_intermediate_size"] = int(config["shared_expert_intermediate_size"])
    return fields


def _reject_sliding_window(config: dict[str, Any], model_type: str) -> None:
    if config.get("use_sliding_window"):
        raise UnsupportedModelError(
            f"config.json of this {model_type} model sets use_sliding_window: true; sliding-window "
            "attention is not supported by megarl.models (it would silently differ from the "
            "reference beyond the window). Use a checkpoint with use_sliding_window: false."
        )
    layer_types = config.get("layer_types") or []
    odd = sorted({t for t in layer_types if t != "full_attention"})
    if odd:
        raise UnsupportedModelError(
            f"config.json layer_types contains {odd}; only 'full_attention' layers are supported"
        )
    if model_type == "mistral" and config.get("sliding_window") is not None:
        raise UnsupportedModelError(
            f"config.json of this mistral model sets sliding_window: {config['sliding_window']}; "
            "transformers applies sliding-window attention for Mistral whenever sliding_window is "
            "not null, and megarl.models does not support it. If every sequence you run is "
            "shorter than the window the result is identical to full attention: then set "
            '"sliding_window": null in config.json.'
        )


def _parse_rope(config: dict[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    """(rope_theta, llama3 scaling or None) from either ``rope_parameters`` (transformers 5) or
    ``rope_theta`` + ``rope_scaling`` (transformers 4 / original checkpoints)."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    if params and not isinstance(next(iter(params.values())), (int, float, str, type(None))):
        raise UnsupportedModelError("per-layer-type rope_parameters are not supported")
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"config.json RoPE type {rope_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    scaling = None
    if rope_type == "llama3":
        try:
            scaling = Llama3RopeScaling(
                factor=float(params["factor"]),
                low_freq_factor=float(params["low_freq_factor"]),
                high_freq_factor=float(params["high_freq_factor"]),
                original_max_position_embeddings=int(params["original_max_position_embeddings"]),
            )
        except KeyError as e:
            raise ValueError(f"llama3 rope scaling in config.json is missing {e.args[0]!r}") from e
        if not math.isfinite(scaling.factor) or scaling.factor <= 0:
            raise ValueError(f"llama3 rope scaling factor must be > 0, got {scaling.factor}")
    return float(theta), scaling
