"""HF folder <-> `Transformer`: build from config.json, load weights, save back."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import torch

from megarl.models.args import ModelArgs, is_sequence_classifier, num_labels_from_hf_config
from megarl.models.hf_io import (
    DEFAULT_MAX_SHARD_SIZE,
    iter_hf_tensors,
    read_hf_config,
    save_hf_checkpoint,
)
from megarl.models.model import Head, Transformer
from megarl.models.state_dict_adapter import from_hf, model_state_for_export

_ARCH_SUFFIX = {"lm": "ForCausalLM", "token_cls": "ForTokenClassification"}
_ARCH_PREFIX = {
    "llama": "Llama",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "qwen3_moe": "Qwen3Moe",
    "qwen2_moe": "Qwen2Moe",
}


def load_model(
    path: str | os.PathLike,
    head: Head = "lm",
    num_labels: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    *,
    allow_new_head: bool = False,
    activation_checkpointing: bool = False,
    seed: int = 0,
    hf_config: dict[str, Any] | None = None,
) -> Transformer:
    """Build a `Transformer` from an HF folder and load its safetensors weights.

    head:       "lm" (``lm_head``) or "token_cls" (``score``; PRM: 2 labels, critic: 1).
    num_labels: token_cls label count; None reads it from config.json (``num_labels`` /
                ``id2label``, default 2).
    dtype:      parameter dtype (floating checkpoint tensors are cast to it).
    allow_new_head: start a freshly initialised head (N(0, initializer_range), zero bias, drawn
                from ``seed``) when the checkpoint has the other head, e.g. a critic built from an
                LM checkpoint. Off by default: any missing tensor is an error.
    hf_config:  the config to build (default: the folder's config.json; e.g. with
                ``model.override_config`` merged in by ``read_hf_config``).
    """
    path = Path(path)
    config = read_hf_config(path) if hf_config is None else hf_config
    args = ModelArgs.from_hf_config(config)
    if head == "token_cls" and num_labels is None:
        num_labels = num_labels_from_hf_config(config)
    with torch.device("meta"):
        model = Transformer(
            args,
            head=head,
            num_labels=num_labels or 2,
            dtype=dtype,
            activation_checkpointing=activation_checkpointing,
        )
    state = from_hf(
        iter_hf_tensors(path, dtype=dtype, device=device), model, allow_new_head=allow_new_head
    )
    fresh = set(model.state_dict()) - set(state)
    model.load_state_dict(state, strict=not fresh, assign=True)
    if fresh:  # only the head, and only with allow_new_head (from_hf enforces it)
        layer = model.lm_head if head == "lm" else model.score
        layer.to_empty(device=device)
        gen = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            layer.weight.normal_(0.0, args.initializer_range, generator=gen)
            if getattr(layer, "bias", None) is not None:
                layer.bias.zero_()
    model.tie_weights()
    return model


def hf_config_for(model: Transformer) -> dict[str, Any]:
    """config.json dict for ``model``: its source config with ``architectures``, label fields
    and ``tie_word_embeddings`` set to match its head."""
    args = model.args
    config = copy.deepcopy(args.hf_config) if args.hf_config else _minimal_config(args)
    suffix = _ARCH_SUFFIX[model.head]
    if model.head == "token_cls" and is_sequence_classifier(config):
        suffix = "ForSequenceClassification"  # an outcome reward model stays one
    config["architectures"] = [_ARCH_PREFIX[args.model_type] + suffix]
    if model.head == "token_cls":
        config["id2label"] = {str(i): f"LABEL_{i}" for i in range(model.num_labels)}
        config["label2id"] = {f"LABEL_{i}": i for i in range(model.num_labels)}
        config.pop("num_labels", None)
    config["tie_word_embeddings"] = args.tie_word_embeddings
    return config


def save_model(
    model: Transformer,
    directory: str | os.PathLike,
    *,
    source_dir: str | os.PathLike | None = None,
    max_shard_size_bytes: int | str = DEFAULT_MAX_SHARD_SIZE,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> Path:
    """Save a (non-distributed) `Transformer` as an HF folder transformers can load."""
    config = hf_config_for(model)
    return save_hf_checkpoint(
        directory,
        model_state_for_export(model),
        config,
        max_shard_size_bytes=max_shard_size_bytes,
        dtype=dtype,
        source_dir=source_dir,
        overwrite=overwrite,
    )


def _minimal_config(args: ModelArgs) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_scaling is not None:
        rs = args.rope_scaling
        rope.update(
            rope_type="llama3",
            factor=rs.factor,
            low_freq_factor=rs.low_freq_factor,
            high_freq_factor=rs.high_freq_factor,
            original_max_position_embeddings=rs.original_max_position_embeddings,
        )
    config: dict[str, Any] = {
        "model_type": args.model_type,
        "vocab_size": args.vocab_size,
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "num_hidden_layers": args.num_hidden_layers,
        "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": args.num_key_value_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": args.rms_norm_eps,
        "max_position_embeddings": args.max_position_embeddings,
        "initializer_range": args.initializer_range,
        "rope_theta": args.rope_theta,
        "rope_scaling": None if rope["rope_type"] == "default" else rope,
    }
    if args.model_type in ("llama", "qwen3", "qwen3_moe"):
        config["attention_bias"] = args.qkv_bias
    if args.model_type == "qwen2_moe":
        config["qkv_bias"] = args.qkv_bias
    if args.num_experts:
        config.update(
            num_experts=args.num_experts,
            num_experts_per_tok=args.num_experts_per_tok,
            moe_intermediate_size=args.moe_intermediate_size,
            norm_topk_prob=args.norm_topk_prob,
            decoder_sparse_step=args.decoder_sparse_step,
            mlp_only_layers=list(args.mlp_only_layers),
            router_aux_loss_coef=args.router_aux_loss_coef,
        )
        if args.shared_expert_intermediate_size:
            config["shared_expert_intermediate_size"] = args.shared_expert_intermediate_size
    if args.model_type == "llama":
        config["mlp_bias"] = args.mlp_bias
    if args.model_type == "mistral":
        config["sliding_window"] = None
    return config
