"""Tiny random HF model folders for tests (needs transformers; never imported by runtime code).

    from megarl.models.testing import make_tiny_hf_model
    path = make_tiny_hf_model(tmp_path, family="qwen2")                      # Qwen2ForCausalLM
    prm = make_tiny_hf_model(tmp_path / "prm", "qwen2", head="token_cls")    # 2 labels
    critic = make_tiny_hf_model(tmp_path / "v", "llama", head="token_cls", num_labels=1)
    orm = make_tiny_hf_model(tmp_path / "rm", "llama", head="seq_cls")      # outcome RM, 1 label

The folder is written by transformers' own ``save_pretrained`` (so it is an independent
reference for our loader) and by default holds a character-level tokenizer with a ChatML-style
chat template (``<|endoftext|>`` = 0 = pad, ``<|im_start|>`` = 1, ``<|im_end|>`` = 2 = eos).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

FAMILIES = ("llama", "llama3", "qwen2", "qwen3", "mistral")
# Mixture-of-experts families (kept apart: not every backend runs them)
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN_ID = 2
PAD_TOKEN_ID = 0
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_BASE = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": None,
    "eos_token_id": EOS_TOKEN_ID,
    "pad_token_id": None,  # keeps HF's Embedding(padding_idx) out of gradient comparisons
}
_FAMILY = {
    "llama": {},
    # llama3 scaling with a short original context so all three frequency bands occur at hd=16
    "llama3": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        "rope_theta": 500000.0,
    },
    "qwen2": {},
    "qwen3": {"head_dim": 24},  # != hidden / heads (16), as in real Qwen3 configs
    "mistral": {"sliding_window": None},
    # 4 experts, top-2; head_dim 32 (vLLM's CPU attention refuses 16)
    "qwen3_moe": {
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "intermediate_size": 96,
        "moe_intermediate_size": 48,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
    },
    "qwen2_moe": {
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "intermediate_size": 96,
        "moe_intermediate_size": 48,
        "shared_expert_intermediate_size": 80,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "norm_topk_prob": False,
    },
}


def tiny_hf_config(family: str = "qwen2", **overrides: Any):
    """A transformers config object of a tiny model of ``family`` (see FAMILIES)."""
    import transformers

    if family not in FAMILIES + MOE_FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES + MOE_FAMILIES}, got {family!r}")
    kwargs = {**_BASE, **_FAMILY[family], **overrides}
    cls = {
        "llama": transformers.LlamaConfig,
        "llama3": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "mistral": transformers.MistralConfig,
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "qwen2_moe": transformers.Qwen2MoeConfig,
    }[family]
    return cls(**kwargs)


def make_tiny_hf_model(
    path: str | os.PathLike,
    family: str = "qwen2",
    head: str = "lm",
    num_labels: int = 2,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_size: int | str | None = None,
    tokenizer: bool = True,
    randomize: bool = True,
    lm_head_scale: float = 1.0,
    **overrides: Any,
) -> Path:
    """Write a tiny random HF model folder with transformers and return its path.

    family:     llama | llama3 (llama3 rope scaling) | qwen2 (qkv bias) | qwen3 (q/k norm,
                head_dim 24) | mistral | qwen3_moe (4 experts, top-2, renormalised, head_dim 32)
                | qwen2_moe (4 experts, top-2 unnormalised, shared expert, head_dim 32). Defaults: hidden 64, 2 layers, 4 heads, 2 kv heads,
                vocab 128; any config field can be overridden (``num_key_value_heads=1``,
                ``tie_word_embeddings=True``, ``attention_bias=True``, ...).
    head:       "lm" (*ForCausalLM), "token_cls" (*ForTokenClassification, ``num_labels``) or
                "seq_cls" (*ForSequenceClassification, 1 label: an outcome reward model).
    randomize:  draw every parameter (norm weights and biases included) from N(0, 0.1) (norms
                1 + N(0, 0.2)) so that no code path is hidden behind a zero bias or unit norm.
    max_shard_size: forwarded to ``save_pretrained`` (e.g. "20KB" for a sharded folder).
    lm_head_scale: multiply the (untied) lm_head by this: the random models' logits are near
                uniform (std ~0.8), which hides temperature and normaliser errors in bf16
                checks; 3 gives a logit std ~2.5, as in real LLMs.
    tokenizer:  also save the character-level tokenizer (`make_tiny_tokenizer`).
    """
    import transformers

    path = Path(path)
    config = tiny_hf_config(family, **overrides)
    torch.manual_seed(seed)
    if head == "lm":
        model = transformers.AutoModelForCausalLM.from_config(config)
    elif head == "token_cls":
        config.num_labels = num_labels
        model = transformers.AutoModelForTokenClassification.from_config(config)
    elif head == "seq_cls":
        config.num_labels = 1
        model = transformers.AutoModelForSequenceClassification.from_config(config)
    else:
        raise ValueError(f"head must be 'lm', 'token_cls' or 'seq_cls', got {head!r}")
    if randomize:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
                is_norm = name.endswith("norm.weight")
                p.copy_(1.0 + 0.2 * noise if is_norm else 0.1 * noise)
    if lm_head_scale != 1.0:
        if head != "lm" or config.tie_word_embeddings:
            raise ValueError("lm_head_scale needs an untied lm head")
        with torch.no_grad():
            model.lm_head.weight.mul_(lm_head_scale)
    model = model.to(dtype)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    if tokenizer:
        make_tiny_tokenizer(config.vocab_size).save_pretrained(path)
    return path


def make_tiny_tokenizer(vocab_size: int = 128):
    """A character-level ``PreTrainedTokenizerFast``: the 3 special tokens, printable ASCII,
    newline and tab (100 ids); unknown characters map to ``<|endoftext|>``."""
    import transformers
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *chars])}
    if len(vocab) > vocab_size:
        raise ValueError(f"the tiny tokenizer needs vocab_size >= {len(vocab)}, got {vocab_size}")
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS[0]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def hf_grads_by_checkpoint_name(model) -> dict:
    """transformers' gradients under checkpoint (per-expert) names: its fused
    ``experts.gate_up_proj [E, 2I, H]`` / ``experts.down_proj [E, H, I]`` split by hand;
    parameters without a gradient count as zeros."""
    import torch

    out = {}
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        if name.endswith("mlp.experts.gate_up_proj"):
            base, inner = name.removesuffix("gate_up_proj"), g.shape[1] // 2
            for j in range(g.shape[0]):
                out[f"{base}{j}.gate_proj.weight"] = g[j, :inner]
                out[f"{base}{j}.up_proj.weight"] = g[j, inner:]
        elif name.endswith("mlp.experts.down_proj"):
            base = name.removesuffix("down_proj")
            for j in range(g.shape[0]):
                out[f"{base}{j}.down_proj.weight"] = g[j]
        else:
            out[name] = g
    return out


def save_random_peft_adapter(model_folder: str | os.PathLike, out: str | os.PathLike,
                             target_modules: list[str], r: int = 4, lora_alpha: float = 12,
                             seed: int = 3, scale: float = 0.3, **lora_kwargs: Any
                             ) -> tuple[Path, torch.Generator]:
    """A PEFT LoRA adapter of the HF model in ``model_folder``, saved by peft itself to ``out``,
    with every A and B drawn from N(0, scale^2) (float64; a fresh adapter's B is zero and would
    test nothing). Returns the folder and the generator, seeded ``seed``, after the draws."""
    import peft
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float64)
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=r, lora_alpha=lora_alpha, lora_dropout=0.0,
                                                 target_modules=list(target_modules),
                                                 **lora_kwargs))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if ".lora_" in n:
                p.copy_(scale * torch.randn(p.shape, generator=g, dtype=torch.float64))
    pm.save_pretrained(out)
    return Path(out), g
