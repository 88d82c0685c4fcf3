"""verl 0.9.1's spelling of the generative judge's engine, ``reward.reward_model.rollout.*``,
read as megarl's ``reward_model.rollout.*``. That release always serves its reward model
through the reward loop, so a ``rollout.name`` there also sets ``reward_model.use_reward_loop``
(`read_judge_loop`). Engine scheduling details are inert; settings the judge's engine lacks are
refused by name."""

from __future__ import annotations

_SECTION = "reward.reward_model.rollout"
_INERT = ("an engine scheduling / weight-loading detail of verl's reward loop; the judge's "
          "verdicts do not depend on it")
_NOT_BUILT = {
    "pipeline_model_parallel_size": "pipeline parallelism",
    "quantization": "quantization",
    "quantization_config_file": "quantization",
    "ignore_eos": "ignoring the end-of-sequence token",
    "disaggregation.enabled": "prefill / decode disaggregation",
}

# (pattern, status, note) rows for megarl.config.verl_compat.RULES, the section's mapping last
JUDGE_RULES: tuple[tuple[str, str, str], ...] = (
    *((f"{_SECTION}.{k}", "inert", _INERT) for k in (
        "scheduling_policy", "layered_summon", "multi_stage_wake_up", "full_determinism", "mtp",
        "disaggregation.bootstrap_port", "disaggregation.decode_replicas",
        "disaggregation.decode_tensor_model_parallel_size", "disaggregation.ib_device",
        "disaggregation.prefill_replicas", "disaggregation.transfer_backend")),
    (f"{_SECTION}.n", "rejected", "the judge gives one verdict per response"),
    *((f"{_SECTION}.{k}", "rejected", f"{what} is not implemented for the judge's engine")
      for k, what in _NOT_BUILT.items()),
    (f"{_SECTION}.*", "mapped", "reward_model.rollout.*"),
)


def read_judge_loop(layer: dict) -> None:
    """In place: a ``reward.reward_model.rollout.name`` in this config ``layer`` (nested) turns
    ``reward_model.use_reward_loop`` on unless the layer sets it."""
    node: object = layer
    for part in (*_SECTION.split("."), "name"):
        node = node.get(part) if isinstance(node, dict) else None
    if node is not None:
        layer.setdefault("reward_model", {}).setdefault("use_reward_loop", True)
