"""Runs on the embedded demo resolve to the config pinned in ``snapshots/`` (written by
``embedded_cases.py`` before the recipes became real-scale): ``make demo``, the trainer tests and
every recipe loaded without a model path keep exactly the settings they were measured with.

Keys added to the schema since the snapshots were taken are listed in ``ADDED`` with the value
every pinned run must hold. A planted change (the demo lr in configs/demo/base.yaml 3e-4 ->
3e-5, or the demo overlay skipped) fails with the differing keys listed."""

from __future__ import annotations

import pytest
import yaml
from embedded_cases import SNAPSHOTS, cases, resolve

# schema keys added after the snapshots: dotted key -> the value every pinned run resolves to
ADDED: dict[str, object] = {
    "actor_rollout_ref.rollout.expert_parallel_size": 1,
    "algorithm.custom_algorithms.options": {},
    "data.apply_chat_template_kwargs": {},
    "actor_rollout_ref.actor.parallel.context_parallel_size": 1,
    "critic.parallel.context_parallel_size": 1,
    "reward_model.parallel.context_parallel_size": 1,
    "actor_rollout_ref.actor.megatron.dist_checkpointing_path": None,
    "actor_rollout_ref.actor.megatron.dist_checkpointing_prefix": "",
    "actor_rollout_ref.actor.megatron.override_transformer_config": {},
    "actor_rollout_ref.actor.megatron.use_dist_checkpointing": False,
    "actor_rollout_ref.actor.optim.override_optimizer_config": None,
    "actor_rollout_ref.model.override_config": {},
    "critic.megatron.dist_checkpointing_path": None,
    "critic.megatron.dist_checkpointing_prefix": "",
    "critic.megatron.override_transformer_config": {},
    "critic.megatron.use_dist_checkpointing": False,
    "critic.optim.override_optimizer_config": None,
    "reward_model.max_length": None,
    "reward_model.model.input_tokenizer": None,
    "reward_model.model.kind": "auto",
    "async_training.engine_cpus": [],
    "async_training.engine_timeout_s": 1800.0,
    "async_training.staleness_threshold": 0,
    "async_training.use_rollout_log_probs": True,
    "async_training.partial_rollout": False,
    "async_training.require_batches": 1,
    "async_training.trigger_parameter_sync_step": 1,
    "actor_rollout_ref.hybrid_engine": True,
    "rollout.nnodes": 0,
    "rollout.n_gpus_per_node": 0,
    "rollout.check_weight_digest": False,
    "rollout.total_rollout_steps": None,
    "data.gen_batch_size": None,
    "data.on_bad_row": "error",
    "algorithm.rollout_correction.rollout_is": None,
    "algorithm.rollout_correction.rollout_is_threshold": 2.0,
    "algorithm.rollout_correction.rollout_is_batch_normalize": False,
    "algorithm.rollout_correction.rollout_rs": None,
    "algorithm.rollout_correction.rollout_rs_threshold": None,
    "algorithm.rollout_correction.bypass_mode": False,
    "algorithm.rollout_correction.loss_type": "ppo_clip",
    "actor_rollout_ref.actor.tau_pos": 1.0,
    "actor_rollout_ref.actor.tau_neg": 1.05,
    "algorithm.custom_algorithms.path": None,
    "reward_model.overlong_buffer.log": False,
    "reward_model.overlong_buffer.max_resp_len": None,
    "reward_model.sandbox_fusion.url": None,
    "reward_model.sandbox_fusion.max_concurrent": 64,
    "reward_model.sandbox_fusion.memory_limit_mb": 1024,
    "actor_rollout_ref.actor.router_replay.mode": "disabled",
    **{f"actor_rollout_ref.rollout.multi_turn.{key}": value for key, value in (
        ("enable", False), ("max_assistant_turns", None), ("max_user_turns", None), ("tool_config_path", None),
        ("interaction_config_path", None),
        ("format", "hermes"), ("max_parallel_calls", 1), ("max_tool_response_length", 256),
        ("tool_response_truncate_side", "middle"), ("tokenization_sanity_check_mode", "strict"))},
    **{f"{role}.parallel.ulysses_sequence_parallel_size": 1
       for role in ("actor_rollout_ref.actor", "critic", "reward_model")},
    **{f"{role}.megatron.{key}": value for role in ("actor_rollout_ref.actor", "critic")
       for key, value in (("expert_model_parallel_size", 1), ("expert_tensor_parallel_size", None),
                          ("moe_aux_loss_coeff", 0.0))},
    **{f"actor_rollout_ref.model.{key}": value for key, value in (
        ("lora_rank", 0), ("lora_alpha", 16.0), ("target_modules", "all-linear"),
        ("exclude_modules", None), ("use_shm", False))},
    "actor_rollout_ref.rollout.layered_summon": False,
    "actor_rollout_ref.rollout.engine_kwargs.vllm": {},
    "actor_rollout_ref.rollout.engine_kwargs.sglang": {},
    "data.custom_cls.path": None,
    "data.custom_cls.name": None,
    "data.sampler.class_path": None,
    "data.sampler.class_name": None,
    "reward_model.use_reward_loop": False,
    "reward_model.rollout.name": None,
    "reward_model.rollout.dtype": 'bf16',
    "reward_model.rollout.gpu_memory_utilization": 0.5,
    "reward_model.rollout.enforce_eager": True,
    "reward_model.rollout.free_cache_engine": True,
    "reward_model.rollout.tensor_model_parallel_size": 1,
    "reward_model.rollout.max_num_batched_tokens": 8192,
    "reward_model.rollout.max_model_len": None,
    "reward_model.rollout.max_num_seqs": 1024,
    "reward_model.rollout.enable_chunked_prefill": True,
    "reward_model.rollout.enable_prefix_caching": True,
    "reward_model.rollout.engine_kwargs": {},
    "reward_model.rollout.cudagraph_capture_sizes": None,
    "reward_model.rollout.load_format": 'auto',
    "reward_model.rollout.disable_log_stats": True,
    "reward_model.rollout.data_parallel_size": 1,
    "reward_model.rollout.expert_parallel_size": 1,
    "reward_model.rollout.skip_tokenizer_init": False,
    "reward_model.rollout.limit_images": None,
    "reward_model.rollout.prompt_length": 2048,
    "reward_model.rollout.response_length": 2048,
    "reward_model.rollout.temperature": 0.0,
    "reward_model.rollout.do_sample": True,
    "reward_model.rollout.top_p": 1.0,
    "reward_model.rollout.top_k": -1,
    "reward_model.rollout.seed": None,
    "reward_model.rollout.template": None,
    "reward_model.rollout.apply_chat_template": True,
    "reward_model.rollout.score_parse": 'boxed',
    "reward_model.rollout.score_min": None,
    "reward_model.rollout.score_max": None,
    "reward_model.rollout.timeout_s": 600.0,
    "actor_rollout_ref.model.lora_A_init_method": 'kaiming',
    "actor_rollout_ref.model.lora_B_init_method": 'zero',
    "actor_rollout_ref.model.lora_adapter_path": None,
    "actor_rollout_ref.model.lora_dropout": 0.0,
    "actor_rollout_ref.model.lora_dropout_position": "pre",
    "actor_rollout_ref.actor.parallel.param_dtype": None,
    "critic.parallel.param_dtype": None,
    "reward_model.parallel.param_dtype": None,
}


def _flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in tree.items():
        key = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key))
        else:
            out[key] = v
    return out


@pytest.mark.parametrize("case", sorted(cases()))
def test_embedded_run_resolves_as_pinned(case):
    name, overrides = cases()[case]
    now = _flatten(resolve(name, overrides))
    pinned = _flatten(yaml.safe_load((SNAPSHOTS / f"{case}.yaml").read_text()))
    for key, value in ADDED.items():
        assert now.pop(key, value) == value, key
    diff = {k: (pinned.get(k, "<absent>"), now.get(k, "<absent>"))
            for k in sorted(set(now) | set(pinned)) if now.get(k, "<absent>") != pinned.get(k, "<absent>")}
    assert not diff, f"{case}: pinned -> now: {diff}"
