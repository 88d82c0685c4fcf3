"""The pure-PyTorch decoder family (Llama 3.x, Qwen2/2.5, Qwen3, Mistral; mixture of experts:
Qwen3-MoE, Qwen2-MoE) and HF checkpoint I/O without transformers. See docs/design.md, "Model
family and HF layout"."""

from megarl.models.args import (
    SUPPORTED_MODEL_TYPES,
    ModelArgs,
    UnsupportedModelError,
    num_labels_from_hf_config,
)
from megarl.models.hf_io import (
    iter_hf_tensors,
    load_hf_state_dict,
    read_hf_config,
    save_hf_checkpoint,
)
from megarl.models.loading import hf_config_for, load_model, save_model
from megarl.models.lora import (
    LoRALinear,
    LoraSettings,
    adapter_state_dict,
    adapters_disabled,
    apply_lora,
    merged_state_dict,
    save_peft_adapter,
)
from megarl.models.model import KVCache, Transformer, value_model
from megarl.models.state_dict_adapter import CheckpointMismatchError, from_hf, to_hf

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "CheckpointMismatchError",
    "KVCache",
    "LoRALinear",
    "LoraSettings",
    "ModelArgs",
    "Transformer",
    "UnsupportedModelError",
    "adapter_state_dict",
    "adapters_disabled",
    "apply_lora",
    "from_hf",
    "hf_config_for",
    "iter_hf_tensors",
    "load_hf_state_dict",
    "load_model",
    "merged_state_dict",
    "num_labels_from_hf_config",
    "read_hf_config",
    "save_hf_checkpoint",
    "save_model",
    "save_peft_adapter",
    "to_hf",
    "value_model",
]
