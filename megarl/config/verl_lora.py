"""verl's LoRA keys: the FSDP keys (``model.lora_rank``, ...) and verl's megatron LoRA block
(``actor_rollout_ref.model.lora.*``, Megatron-Bridge's LoRA), read as megarl's LoRA keys.

verl 0.9.1 reads the block on its megatron workers (``verl.workers.config.megatron_peft``);
megarl reads it on both backends:

- ``lora.rank`` / ``lora.alpha`` -> ``model.lora_rank`` / ``model.lora_alpha``;
- ``lora.target_modules`` / ``lora.exclude_modules``: megatron's module names become the HF
  projections they hold (``linear_qkv`` -> q/k/v_proj, ``linear_proj`` -> o_proj,
  ``linear_fc1`` -> gate/up_proj, ``linear_fc2`` -> down_proj, ``linear_q`` -> q_proj, ...);
  other entries pass unchanged;
- ``lora.lora_A_init_method`` / ``lora_B_init_method`` -> the keys of the same name;
- ``lora.dropout`` / ``lora.dropout_position`` -> ``model.lora_dropout`` /
  ``model.lora_dropout_position``;
- a block with ``rank`` set also brings the block's own defaults where the layer sets neither
  spelling: alpha 32 (the FSDP key's is 16), A drawn ``xavier``, the four megatron modules
  (every projection of a dense layer);
- ``lora.type``: ``lora`` and ``canonical_lora`` are read as megarl's adapters, one A and B per
  HF projection (Megatron-Bridge's ``canonical_lora`` layout; its ``lora`` shares one A over the
  fused ``linear_qkv`` and ``linear_fc1`` outputs); ``dora`` and ``vlm_lora`` are refused.

Both spellings of one setting in one layer with different values is an error naming both.
"""

from __future__ import annotations

from typing import Any

from megarl.config.errors import ConfigError

_M = "actor_rollout_ref.model"
BLOCK = f"{_M}.lora"
# megatron-core linear (Megatron-Bridge's target name) -> the HF projections it holds
MEGATRON_MODULES: dict[str, tuple[str, ...]] = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_q": ("q_proj",),
    "linear_k": ("k_proj",),
    "linear_v": ("v_proj",),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc1_gate": ("gate_proj",),
    "linear_fc1_up": ("up_proj",),
    "linear_fc2": ("down_proj",),
}
# verl's block defaults that differ from megarl's keys (verl_keys.yaml, megatron_peft.py)
BLOCK_DEFAULTS: dict[str, Any] = {
    "alpha": 32,
    "lora_A_init_method": "xavier",
    "target_modules": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
}
_READ_AS = {"rank": "lora_rank", "alpha": "lora_alpha", "target_modules": "target_modules",
            "exclude_modules": "exclude_modules", "lora_A_init_method": "lora_A_init_method",
            "lora_B_init_method": "lora_B_init_method", "dropout": "lora_dropout",
            "dropout_position": "lora_dropout_position"}
TYPES_READ = ("lora", "canonical_lora")

_ONLY_WHEN = "only read by {what}, which is rejected unless off"
_LORA_CRITIC = ("LoRA trains the actor only (actor_rollout_ref.model.lora_rank, lora_alpha, "
                "target_modules, exclude_modules, or verl's model.lora.* block); the critic "
                "trains all parameters")
_NAMES = "megatron module names become the HF projections they hold (linear_qkv -> q/k/v_proj, " \
         "linear_proj -> o_proj, linear_fc1 -> gate/up_proj, linear_fc2 -> down_proj)"

# (pattern, status, note) of verl_compat's rules table, in order
LORA_RULES: tuple[tuple[str, str, str], ...] = (
    ("critic.model.lora_rank", "rejected", _LORA_CRITIC),
    ("critic.model.lora.rank", "rejected", _LORA_CRITIC),
    ("critic.model.lora*", "inert", _ONLY_WHEN.format(what="critic LoRA (lora_rank)")),
    *[(f"critic.model.{k}", "inert", _ONLY_WHEN.format(what="LoRA (the actor's)"))
      for k in ("exclude_modules", "target_modules")],
    (f"{BLOCK}.rank", "converted", f"{_M}.lora_rank; a block with rank set also gives the "
     "block's defaults where unset: lora_alpha 32, lora_A_init_method xavier, the four megatron "
     "modules"),
    (f"{BLOCK}.alpha", "mapped", f"{_M}.lora_alpha"),
    (f"{BLOCK}.target_modules", "converted", f"{_M}.target_modules; {_NAMES}"),
    (f"{BLOCK}.exclude_modules", "converted", f"{_M}.exclude_modules; {_NAMES}"),
    (f"{BLOCK}.lora_A_init_method", "mapped", f"{_M}.lora_A_init_method"),
    (f"{BLOCK}.lora_B_init_method", "mapped", f"{_M}.lora_B_init_method"),
    (f"{BLOCK}.type", "rejected", "lora and canonical_lora are read as megarl's adapters (one "
     "A and B per HF projection, canonical_lora's layout; verl's lora shares one A over the "
     "fused linear_qkv and linear_fc1); DoRA and vlm_lora are not implemented"),
    (f"{BLOCK}.dropout", "mapped", f"{_M}.lora_dropout"),
    (f"{BLOCK}.dropout_position", "mapped", f"{_M}.lora_dropout_position"),
    (f"{BLOCK}.adapter_path", "rejected", "Megatron-Bridge adapter checkpoints are not read; "
     f"start from a PEFT adapter folder with {_M}.lora_adapter_path"),
    (f"{BLOCK}.merge", "inert", "how verl's megatron workers hand the adapters to vLLM (merged "
     "or as a LoRA); the engine computes with the same weights either way"),
    (f"{BLOCK}.dtype", "inert", "the adapters' parameter dtype; megarl's adapters are trained "
     "like its other parameters (fp32 optimizer copies, computed in model.dtype)"),
    (f"{BLOCK}.a2a_experimental", "inert", "an all-to-all variant for expert adapters of MoE "
     "models; megarl's LoRA is for dense models"),
    (f"{BLOCK}.freeze_*", "inert", "vlm_lora's vision/language freezing; megarl trains "
     "text-only models"),
)


def hf_module_names(entries: Any) -> Any:
    """A target / exclude list with megatron module names replaced by the HF projections they
    hold (order kept, duplicates dropped); a string (a regular expression) or None as given."""
    if entries is None or isinstance(entries, str):
        return entries
    out: list[Any] = []
    for e in entries:
        for name in MEGATRON_MODULES.get(e, (e,)):
            if name not in out:
                out.append(name)
    return out


def read_lora_block(layer: dict, source: str) -> None:
    """Read verl's megatron LoRA block of one config ``layer`` (nested, in place) into megarl's
    keys of ``actor_rollout_ref.model``: the keys it reads leave the block; the others stay for
    the rules table (inert / rejected). ConfigError when a block key and its megarl spelling
    are both set to different values while the block's rank is set (without it verl does not
    read the block, and the megarl key wins)."""
    model = layer.get("actor_rollout_ref", {}).get("model")
    if not isinstance(model, dict) or not isinstance(model.get("lora"), dict):
        return
    block = model["lora"]
    given = {k: block[k] for k in _READ_AS if k in block}
    in_use = bool(block.get("rank"))
    if in_use:
        given.update({k: v for k, v in BLOCK_DEFAULTS.items()
                      if k not in given and _READ_AS[k] not in model})
    for key in ("target_modules", "exclude_modules"):
        if key in given:
            given[key] = hf_module_names(given[key])
    for key, value in given.items():
        target = _READ_AS[key]
        if target in model and model[target] is not None and model[target] != value:
            if not in_use:  # verl reads the block only with its rank set
                block.pop(key, None)
                continue
            raise ConfigError(
                f"{BLOCK}.{key}={block.get(key, value)!r} and {_M}.{target}={model[target]!r} "
                f"(from {source}): both set the actor's LoRA {target}; set one of them")
        model[target] = value
        block.pop(key, None)
    if block.get("type") in TYPES_READ:
        block.pop("type")
    if not block:
        del model["lora"]
