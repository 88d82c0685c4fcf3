"""verl's ``model.override_config``: a mapping merged into a model's HF config before the model
is built (actor, reference and rollout engine from ``actor_rollout_ref.model.override_config``,
the critic from ``critic.model.override_config``).

verl's rule (``verl.utils.model.update_model_config``, applied by its FSDP and megatron workers
and its ``HFModelConfig``): the mapping under ``model_config`` when the block has one (the
megatron workers' spelling), else the whole block; each key is set on the HF config, a mapping
value is merged into the config's mapping of that name (``rope_scaling: {factor: ...}``). Keys
the HF config does not have are added (passed through). megarl merges the same way into the
``config.json`` dict, with two rules of its own:

- a key that changes a weight's shape or the set of weights (``hidden_size``,
  ``num_hidden_layers``, ``vocab_size``, ``tie_word_embeddings``, the expert layout, biases, ...)
  is refused: the checkpoint's tensors would not fit the model (`OverrideError`, naming the key);
- ``rope_theta`` is also written into ``rope_parameters`` when the config has that mapping
  (transformers 5's layout, where the RoPE base is read from it), so the override reaches the
  model whichever layout the folder was saved in.

`override_notices` names the keys that change nothing megarl's model reads (``attn_implementation``,
``use_cache``, a field of another architecture): they are still passed through to the HF config
(and to vLLM as ``hf_overrides``).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from megarl.errors import UserInputError
from megarl.utils.plain import plain

# verl's megatron workers read only this sub-mapping of override_config
NESTED_KEY = "model_config"


def override_key(role: str) -> str:
    """The config key of ``role``'s override block (actor, ref and the rollout engine share the
    policy's)."""
    return {"critic": "critic.model.override_config",
            "prm": "reward_model.model.override_config"}.get(
        role, "actor_rollout_ref.model.override_config")


class OverrideError(UserInputError):
    """An ``override_config`` entry megarl cannot apply."""


def effective_overrides(override_config: Mapping[str, Any] | None,
                        key: str = "actor_rollout_ref.model.override_config") -> dict[str, Any]:
    """The mapping merged into the HF config: ``override_config["model_config"]`` when present
    (verl's megatron spelling), else the whole block (verl's FSDP spelling); ``key`` names the
    block in errors."""
    if not override_config:
        return {}
    if not isinstance(override_config, Mapping):
        raise OverrideError(f"{key}={override_config!r}: expected a mapping of HF config "
                            "fields, e.g. {max_position_embeddings: 32768}")
    block = override_config.get(NESTED_KEY, override_config)
    if not isinstance(block, Mapping):
        raise OverrideError(f"{key}.{NESTED_KEY}={block!r}: expected a mapping of HF config "
                            "fields")
    return plain(block)


def merge_overrides(hf_config: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``hf_config`` (a ``config.json`` dict) with ``overrides`` merged in (verl's
    ``update_model_config``: mappings merge key by key, other values replace)."""
    out = copy.deepcopy(dict(hf_config))
    _merge_into(out, plain(overrides))
    theta = overrides.get("rope_theta")
    params = out.get("rope_parameters")
    given = overrides.get("rope_parameters")
    if theta is not None and isinstance(params, dict) and not (
            isinstance(given, Mapping) and "rope_theta" in given):
        params["rope_theta"] = theta
    return out


def apply_hf_overrides(hf_config: Mapping[str, Any], override_config: Mapping[str, Any] | None,
                       key: str = "actor_rollout_ref.model.override_config") -> dict[str, Any]:
    """``hf_config`` with the overrides of ``override_config`` (the config block, see
    `effective_overrides`) merged in; refuses an override that changes the model's weights
    (their names or shapes), naming ``key`` and the field. ``hf_config`` is returned as a copy
    unchanged when there is nothing to override."""
    overrides = effective_overrides(override_config, key)
    if not overrides:
        return dict(hf_config)
    merged = merge_overrides(hf_config, overrides)
    before = _weight_shapes(hf_config, key, "the model's config.json")
    after = _weight_shapes(merged, key, f"{key} applied")
    if before != after:
        culprits = [k for k in overrides
                    if _weight_shapes(merge_overrides(hf_config, {k: overrides[k]}), key,
                                      f"{key}.{k}") != before] or sorted(overrides)
        changed = sorted(set(before) ^ set(after)) or sorted(
            n for n in before if before[n] != after.get(n))
        raise OverrideError(
            f"{key}: {', '.join(f'{k}={overrides[k]!r}' for k in culprits)} changes the "
            f"model's weights ({', '.join(changed[:4])}{', ...' if len(changed) > 4 else ''}), "
            "which the checkpoint's tensors would not fit; override only fields that keep "
            "the architecture (max_position_embeddings, rope_theta, rope_scaling, "
            "rms_norm_eps, ...), or convert the checkpoint to the other architecture")
    return merged


def override_notices(hf_config: Mapping[str, Any], override_config: Mapping[str, Any] | None,
                     key: str = "actor_rollout_ref.model.override_config") -> list[str]:
    """One line per override that changes nothing megarl's model reads from the HF config
    (the architecture megarl builds, `megarl.models.ModelArgs`, is the same with and without
    it). Call after `apply_hf_overrides` accepted the block."""
    from megarl.models.args import ModelArgs

    overrides = effective_overrides(override_config, key)
    if not overrides:
        return []
    base = replace(ModelArgs.from_hf_config(dict(hf_config)), hf_config={})
    idle = [k for k in overrides
            if replace(ModelArgs.from_hf_config(merge_overrides(hf_config, {k: overrides[k]})),
                       hf_config={}) == base]
    if not idle:
        return []
    return [f"{key}: {', '.join(f'{k}={overrides[k]!r}' for k in idle)} changes nothing megarl's "
            "model reads from the HF config; passed through to the HF config (and to vLLM as "
            "hf_overrides), as verl passes it"]


def changed_fields(hf_config: Mapping[str, Any], merged: Mapping[str, Any]) -> dict[str, Any]:
    """{top-level field: merged value} of the fields ``merged`` sets differently from
    ``hf_config`` (the form of vLLM's ``hf_overrides``: a mapping value merges into the
    config's attribute of that name)."""
    return {k: copy.deepcopy(v) for k, v in merged.items()
            if k not in hf_config or hf_config[k] != v}


# ---------------------------------------------------------------------------------------------



def _merge_into(target: dict[str, Any], overrides: Mapping[str, Any]) -> None:
    for k, v in overrides.items():
        if isinstance(v, Mapping) and isinstance(target.get(k), dict):
            _merge_into(target[k], v)
        else:
            target[k] = copy.deepcopy(v)


def _weight_shapes(config: Mapping[str, Any], key: str, what: str) -> dict[str, tuple[int, ...]]:
    """{parameter name: shape} of the LM model ``config`` describes (built on the meta
    device: no memory)."""
    import torch

    from megarl.models.args import ModelArgs
    from megarl.models.model import Transformer

    try:
        args = ModelArgs.from_hf_config(dict(config))
    except UserInputError as e:
        raise OverrideError(f"{key}: {what}: {e}") from e
    except (ValueError, TypeError) as e:
        raise OverrideError(f"{key}: {what} is not a valid model config: {e}") from e
    with torch.device("meta"):
        model = Transformer(args, head="lm")
    shapes = {n: tuple(p.shape) for n, p in model.state_dict().items()}
    if args.tie_word_embeddings:  # lm_head is then read from embed_tokens, not the checkpoint
        shapes["lm_head.weight (tied to the embedding)"] = shapes.pop("lm_head.weight", ())
    return shapes
