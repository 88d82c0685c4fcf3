"""verl's configuration surface, key by key: how megarl reads each key of a pinned verl release.

Every key of verl's trainer configs (``_generated_ppo_trainer.yaml`` and
``_generated_ppo_megatron_trainer.yaml`` of the wheel) has one of five statuses:

- ``implemented``: a megarl key of the same name and meaning;
- ``mapped``: read as another megarl key (``note`` names it);
- ``converted``: read into another megarl key with its value converted (``note`` says how: verl's
  deprecated global micro-batch sizes, ``megarl.config.global_micro``; ``fsdp_size``,
  ``megarl.config.fsdp_size``);
- ``inert``: accepted without effect, because it has no meaning for megarl's results (a Ray,
  profiler or memory option, a key only read by a feature that is off); set to anything but
  verl's default, the run prints one notice line saying so;
- ``rejected``: a feature megarl does not have; accepted at verl's default, an error naming the
  reason and what to use instead otherwise.

The keys and their verl defaults live in ``verl_keys.yaml``; ``megarl.config.verl_docs`` writes
it from the wheel and ``docs/verl_compat.md`` from this table
(``python -m megarl.config.verl_docs --wheel verl-X-py3-none-any.whl``);
``tests/config/test_verl_contract.py`` checks both against the wheel.
"""

from __future__ import annotations

import copy
import fnmatch
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Literal

import yaml

from megarl.config.errors import ConfigError
from megarl.config.fsdp_size import FSDP_SIZE
from megarl.config.global_micro import GLOBAL_MICRO
from megarl.config.keys import canonical_path, schema_problem
from megarl.config.verl_async import RECIPE_KEYS
from megarl.config.verl_async import RULES as ASYNC_RULES
from megarl.config.verl_judge import JUDGE_RULES, read_judge_loop
from megarl.config.verl_lora import LORA_RULES, read_lora_block
from megarl.config.verl_model_engine import read_model_engine

VERL_RELEASE = "0.9.1"
KEYS_FILE = Path(__file__).with_name("verl_keys.yaml")

# Keys verl's example scripts still set that the pinned release's configs no longer list (older
# spellings), with the default verl gave them.
OLDER_KEYS: dict[str, Any] = {
    "critic.model.fsdp_config.param_offload": False,
    "critic.model.fsdp_config.optimizer_offload": False,
    "critic.model.fsdp_config.fsdp_size": -1,
    "actor_rollout_ref.actor.megatron.grad_offload": False,
    "actor_rollout_ref.ref.megatron.grad_offload": False,
    "critic.megatron.grad_offload": False,
    "actor_rollout_ref.actor.router_replay.mode": "disabled",
    "trainer.use_legacy_worker_impl": "auto",
    "reward_model.use_reward_loop": True,
    "reward_model.model.use_remove_padding": False,
    "reward_model.model.fsdp_config.param_offload": False,
    "reward_model.micro_batch_size": None,
    "reward_model.sandbox_fusion.url": None,
    "reward_model.sandbox_fusion.max_concurrent": 64,
    "reward_model.sandbox_fusion.memory_limit_mb": 1024,
    "actor_rollout_ref.rollout.sglang_rollout_mode": None,
    "actor_rollout_ref.rollout.server.timeout": 60.0,
    "actor_rollout_ref.rollout.server.max_attempts": 3,
    "actor_rollout_ref.rollout.server.retry_delay": 2.0,
    "actor_rollout_ref.rollout.server.max_connections": 1000,
    "actor_rollout_ref.rollout.server.max_start_wait_time": 300.0,
    "actor_rollout_ref.rollout.enable_sleep_mode": True,
}

# verl sections whose keys are free-form (passed on to megatron-core's TransformerConfig)
OPEN_SECTIONS = ("*.megatron.override_transformer_config",)

Status = Literal["implemented", "mapped", "converted", "inert", "rejected"]
STATUSES: tuple[Status, ...] = ("implemented", "mapped", "converted", "inert", "rejected")


@dataclass(frozen=True)
class Rule:
    """``pattern`` (fnmatch over the dotted key; ``*`` crosses dots) -> status and note.
    ``mapped``: note = the megarl key; ``inert`` / ``rejected``: note = why (and what instead)."""

    pattern: str
    status: Status
    note: str


def _each(prefixes: tuple[str, ...], suffix: str, status: Status, note: str) -> list[Rule]:
    return [Rule(f"{p}.{suffix}", status, note.replace("{p}", p)) for p in prefixes]


_ARR = "actor_rollout_ref"
_ACTOR, _REF, _ROLLOUT = f"{_ARR}.actor", f"{_ARR}.ref", f"{_ARR}.rollout"
_TRAINED = (_ACTOR, "critic")
_ROLES = (_ACTOR, _REF, "critic")
_FSDP = (f"{_ACTOR}.fsdp_config", f"{_REF}.fsdp_config", "critic.fsdp", "critic.model.fsdp_config")
_MEGATRON = (f"{_ACTOR}.megatron", f"{_REF}.megatron", "critic.megatron")
_MODELS = (f"{_ARR}.model", "critic.model")

_NO_RAY = "megarl runs as one torchrun job, without Ray (reward workers on Ray: reward_model.pool=ray)"
_MEMORY = "a memory/speed option of verl's workers; megarl's results do not depend on it"
_TEXT = "megarl trains text-only language models"
_OFFLOAD = ("offload is not implemented: parameters, gradients and optimizer states stay on the "
            "device (memory differs, results do not)")
_ASYNC = ("verl 0.9's v1 trainers: sync is megarl's loop; colocate_async and separate_async "
          "(a replay buffer bounding staleness in versions, rollout replicas lent by the "
          "trainer) are not mapped; megarl's asynchronous modes take verl's recipe keys: "
          "async_training.staleness_threshold (one-step-off, colocated) or "
          "actor_rollout_ref.hybrid_engine=false with rollout.nnodes / n_gpus_per_node and "
          "async_training.* (fully async, partial rollout)")
_ONLY_WHEN = "only read by {what}, which is rejected unless off"
_ULYSSES_ACTOR = f"{_ACTOR}.parallel.ulysses_sequence_parallel_size"
_ULYSSES_CRITIC = "critic.parallel.ulysses_sequence_parallel_size"
_REF_LAYOUT = (f"the reference model runs with the actor's layout ({_ULYSSES_ACTOR}); memory "
               "differs, results do not")

RULES: tuple[Rule, ...] = (
    # verl's structured-config plumbing and tooling with no megarl counterpart
    Rule("*._target_", "inert", "verl's dataclass target; megarl's schema is typed itself"),
    Rule("*profiler*", "inert", "verl's profiler hooks; profile megarl with torch.profiler"),
    Rule("ray_kwargs.*", "inert", _NO_RAY),
    Rule("trainer.ray_wait_register_center_timeout", "inert", _NO_RAY),
    Rule("*.nccl_timeout", "inert", "megarl sets its process-group timeout itself"),
    Rule("transfer_queue.enable", "rejected", "TransferQueue is not implemented: batches move "
         "between roles inside each rank's process"),
    Rule("transfer_queue.*", "inert", _ONLY_WHEN.format(what="transfer_queue.enable")),
    Rule("skip.*.enable", "rejected", "rollout skipping/replay from dumps is not implemented; "
         "trainer.rollout_data_dir dumps generations"),
    Rule("skip.*", "inert", _ONLY_WHEN.format(what="skip.*.enable")),
    Rule("distillation.enabled", "rejected", "on-policy distillation is not implemented"),
    Rule("distillation.*", "inert", _ONLY_WHEN.format(what="distillation.enabled")),
    Rule("trainer.v1.trainer_mode", "rejected", _ASYNC),
    Rule("trainer.v1.*", "inert", _ONLY_WHEN.format(what="trainer.v1.trainer_mode (async modes)")),
    Rule("trainer.use_v1", "inert", "megarl has one trainer implementation"),
    Rule("trainer.use_legacy_worker_impl", "inert", "megarl has one worker implementation"),
    # verl's asynchronous recipes' own keys (megarl.config.verl_async)
    *[Rule(pattern, status, note) for pattern, status, note in ASYNC_RULES],
    # trainer
    Rule("trainer.resume_mode", "mapped", "trainer.resume"),
    Rule("trainer.default_hdfs_dir", "rejected", "HDFS upload is not implemented; copy "
         "trainer.default_local_dir"),
    Rule("trainer.del_local_ckpt_after_load", "inert", "megarl keeps the checkpoints it resumed "
         "from; trainer.max_ckpt_to_keep bounds how many stay"),
    Rule("trainer.esi_redundant_time", "inert", "cloud ESI checkpoint timing; save with "
         "trainer.save_freq"),
    Rule("trainer.checkpoint_callback_class", "rejected", "checkpoint callbacks are not "
         "implemented"),
    # data
    *[Rule(f"data.{k}", "inert", _TEXT) for k in (
        "audio_key", "image_key", "video_key", "image_patch_size", "mm_processor_kwargs",
        "return_multi_modal_inputs")],
    Rule("data.filter_overlong_prompts_workers", "inert", "prompts are tokenized once at load"),
    Rule("data.function_tool_path", "inert", "tools from a Python file of functions are not "
         "implemented"),
    Rule("data.tool_config_path", "inert", "the tools are read from "
         f"{_ROLLOUT}.multi_turn.tool_config_path"),
    Rule("data.return_raw_chat", "inert", "megarl's engines always receive the chat messages"),
    Rule("data.return_full_prompt", "inert", "the rollout dump always holds the full prompt text"),
    Rule("data.return_raw_input_ids", "inert", "megarl's batch always carries the prompt ids"),
    Rule("data.tokenizer", "mapped", f"{_ARR}.model.tokenizer_path"),
    Rule("data.trust_remote_code", "mapped", f"{_ARR}.model.trust_remote_code"),
    Rule("data.use_shm", "inert", _MEMORY),
    Rule("data.validation_shuffle", "inert", "validation runs over the whole set; its order "
         "does not change the metrics"),
    Rule("data.train_max_samples", "rejected", "subsample the parquet file instead"),
    Rule("data.val_max_samples", "rejected", "subsample the parquet file instead"),
    Rule("data.reward_fn_key", "rejected", "rewards are chosen by each row's data_source"),
    # models of the actor/ref and the critic
    *_each(_MODELS, "custom_chat_template", "mapped", "data.chat_template"),
    *_each(_MODELS, "enable_activation_offload", "inert", _OFFLOAD),
    *_each(_MODELS, "external_lib", "rejected", "megarl builds its own model from the HF "
           "config; external model libraries are not imported"),
    *_each(_MODELS, "hf_config_path", "rejected", "the HF config is read from model.path"),
    Rule("critic.model.override_config*", "rejected", "HF config overrides of the critic are "
         "not applied; edit config.json of a copy of the model"),
    *[Rule(pattern, status, note) for pattern, status, note in LORA_RULES],  # verl_lora
    *_each(_MODELS, "mtp.enable*", "rejected", "multi-token prediction is not implemented"),
    *_each(_MODELS, "mtp*", "inert", _ONLY_WHEN.format(what="mtp.enable")),
    *_each(_MODELS, "tiled_mlp.*", "inert", _MEMORY),
    *_each(_MODELS, "use_liger", "inert", "megarl's fused kernels compute logprobs and entropy "
           "without the full logits (model.use_fused_kernels)"),
    Rule("critic.model.use_shm", "inert", _MEMORY),
    Rule("critic.model.fused_kernel_options.impl_backend", "inert", "the critic's value head "
         "reads hidden states; no vocabulary projection to fuse"),
    Rule("critic.model.trust_remote_code", "mapped", f"{_ARR}.model.trust_remote_code"),
    Rule("critic.model.use_fused_kernels", "inert", "the critic's value head reads hidden "
         "states; no vocabulary projection to fuse"),
    Rule("critic.model.use_remove_padding", "mapped", f"{_ARR}.model.use_remove_padding"),
    # FSDP options (megarl's torch backend shards with FSDP2)
    *_each(_FSDP, "param_offload", "inert", _OFFLOAD),
    *_each(_FSDP, "optimizer_offload", "inert", _OFFLOAD),
    *_each(_FSDP, "offload_policy", "inert", _OFFLOAD),
    # verl's mesh rule (megarl.config.fsdp_size)
    *[Rule(k, "converted", f"{shard} = -1 (all ranks) when {k} is -1 or at least the world "
           f"size (verl's rule), else {k} / the role's ulysses_sequence_parallel_size (verl "
           "counts world ranks; a value splitting a sequence-parallel group is refused)")
      for k, shard in FSDP_SIZE.items()],
    Rule(f"{_REF}.fsdp_config.fsdp_size", "inert", "the reference model is sharded like the "
         "actor"),
    Rule(f"{_ACTOR}.fsdp_config.dtype", "mapped", f"{_ARR}.model.dtype"),
    Rule("critic.fsdp.dtype", "mapped", "critic.model.dtype"),
    Rule("critic.model.fsdp_config.dtype", "mapped", "critic.model.dtype"),
    Rule(f"{_REF}.fsdp_config.dtype", "inert", "the reference model computes in "
         "actor_rollout_ref.model.dtype"),
    Rule(f"{_ACTOR}.fsdp_config.model_dtype", "mapped", f"{_ACTOR}.parallel.param_dtype"),
    *_each(("critic.fsdp", "critic.model.fsdp_config"), "model_dtype", "mapped",
           "critic.parallel.param_dtype"),
    Rule(f"{_REF}.fsdp_config.model_dtype", "inert", "the reference holds the actor's "
         "parameter dtype (actor_rollout_ref.actor.parallel.param_dtype; unset: model.dtype)"),
    Rule(f"{_ACTOR}.fsdp_config.ulysses_sequence_parallel_size", "mapped", _ULYSSES_ACTOR),
    Rule(f"{_REF}.fsdp_config.ulysses_sequence_parallel_size", "inert", _REF_LAYOUT),
    *_each(("critic.fsdp", "critic.model.fsdp_config"), "ulysses_sequence_parallel_size",
           "mapped", _ULYSSES_CRITIC),
    *_each(_FSDP, "qat.enable", "rejected", "quantization-aware training is not implemented"),
    *_each(_FSDP, "qat.*", "inert", _ONLY_WHEN.format(what="qat.enable")),
    *_each(_FSDP, "turbo_config.*", "inert", "verl's FSDP-turbo plan; megarl's torch backend "
           "lays out FSDP2 / TP / PP from each role's parallel.* keys"),
    *_each(_FSDP[:3], "*", "inert", "FSDP1 / wrapping detail; megarl's torch backend shards each "
           "decoder layer with FSDP2"),
    # megatron options
    *[Rule(f"{m}.override_transformer_config.moe_aux_loss_coeff", "mapped",
           f"{m}.moe_aux_loss_coeff") for m in (f"{_ACTOR}.megatron", "critic.megatron")],
    Rule(f"{_REF}.megatron.override_transformer_config*", "inert", "the reference is built "
         "with the actor's override_transformer_config"),
    Rule(f"{_ACTOR}.megatron.router_replay.mode", "mapped", f"{_ACTOR}.router_replay.mode"),
    *_each(_MEGATRON[1:], "router_replay.mode", "rejected", "routing replay applies to the "
           "actor (actor_rollout_ref.actor.router_replay.mode); {p} routes with its own router"),
    *_each(_MEGATRON, "router_replay.*", "inert", "record / replay dump files of verl's "
           "routing replay; megarl's R2 records in the old-logprob pass and R3 in the rollout "
           "engine, both in memory"),
    *_each(_MEGATRON, "param_offload", "inert", _OFFLOAD),
    *_each(_MEGATRON, "grad_offload", "inert", _OFFLOAD),
    *_each(_MEGATRON, "optimizer_offload", "inert", _OFFLOAD),
    *[Rule(f"{_REF}.megatron.{k}", "mapped", f"{_ACTOR}.megatron.{k}") for k in (
        "use_dist_checkpointing", "dist_checkpointing_path", "dist_checkpointing_prefix")],
    *_each(_MEGATRON, "use_megatron_fsdp", "rejected", "megatron FSDP is not wired; use "
           "strategy=torch for FSDP2"),
    *_each(_MEGATRON, "qat.enable", "rejected", "quantization-aware training is not implemented"),
    *_each(_MEGATRON, "qat.*", "inert", _ONLY_WHEN.format(what="qat.enable")),
    Rule(f"{_ACTOR}.megatron.dtype", "mapped", f"{_ARR}.model.dtype"),
    Rule("critic.megatron.dtype", "mapped", "critic.model.dtype"),
    Rule(f"{_REF}.megatron.dtype", "inert", "the reference model computes in "
         "actor_rollout_ref.model.dtype"),
    Rule(f"{_REF}.megatron.*_parallel_size", "inert", "the reference model runs with the "
         "actor's layout (memory differs, results do not)"),
    Rule(f"{_REF}.megatron.sequence_parallel", "inert", "the reference model runs with the "
         "actor's layout"),
    Rule(f"{_REF}.megatron.use_distributed_optimizer", "inert", "the reference model has no "
         "optimizer"),
    *_each(_MEGATRON, "*", "inert", "verl's mbridge / padding / checkpoint detail; megarl maps "
           "HF weights to megatron-core itself"),
    # optimizers
    *_each(_TRAINED, "optim.clip_grad", "mapped", "{p}.grad_clip"),
    *_each(_TRAINED, "optim.lr_decay_style", "mapped", "{p}.optim.lr_scheduler_type"),
    *_each(_TRAINED, "optim.optimizer", "rejected", "megarl trains with AdamW"),
    *_each(_TRAINED, "optim.optimizer_impl", "rejected", "megarl uses torch.optim.AdamW (torch) "
           "or megatron-core's distributed Adam"),
    *_each(_TRAINED, "optim.muon_*", "inert", _ONLY_WHEN.format(what="optim.optimizer=Muon")),
    *_each(_TRAINED, "optim.min_lr", "rejected", "use optim.min_lr_ratio (a fraction of lr)"),
    *_each(_TRAINED, "optim.num_cycles", "rejected", "the cosine schedule decays over half a "
           "cycle (verl's default 0.5)"),
    *_each(_TRAINED, "optim.lr_warmup_init", "rejected", "warm-up starts from 0"),
    *_each(_TRAINED, "optim.lr_decay_steps", "rejected", "decay runs over optim."
           "total_training_steps"),
    *_each(_TRAINED, "optim.lr_wsd_*", "inert", _ONLY_WHEN.format(what="lr_decay_style=WSD")),
    *_each(_TRAINED, "optim.weight_decay_incr_style", "rejected", "weight decay is constant"),
    *_each(_TRAINED, "optim.zero_indexed_step", "rejected", "the scheduler counts from step 0"),
    *_each(_TRAINED, "optim.*_dtype", "rejected", "optimizer states and main grads are fp32"),
    *_each(_TRAINED, "optim.use_precision_aware_optimizer", "rejected", "optimizer states are "
           "fp32"),
    *_each(_TRAINED, "optim.use_layer_wise_distributed_optimizer", "inert", _MEMORY),
    *_each(_TRAINED, "optim.use_checkpoint_opt_param_scheduler", "inert", "the LR schedule "
           "always resumes from the checkpoint"),
    # actor / ref / critic workers
    Rule(f"{_ACTOR}.ulysses_sequence_parallel_size", "mapped", _ULYSSES_ACTOR),
    Rule(f"{_REF}.ulysses_sequence_parallel_size", "inert", _REF_LAYOUT),
    Rule("critic.ulysses_sequence_parallel_size", "mapped", _ULYSSES_CRITIC),
    *_each(_ROLES, "rollout_n", "inert", "read from actor_rollout_ref.rollout.n"),
    *_each(_ROLES, "use_torch_compile", "inert", "training forwards run eagerly"),
    *_each(_ROLES, "entropy_*", "inert", "megarl's fused kernels chunk the vocabulary "
           "themselves (model.fused_kernel_options.chunk_size)"),
    *_each(_ROLES, "pad_to_length*", "inert", "sequences are packed (model.use_remove_padding)"),
    Rule(f"{_REF}.strategy", "inert", "the reference model uses the actor's strategy"),
    *_each(_ROLES, "checkpoint.async_save", "inert", "checkpoints are written synchronously "
           "(atomically); only the wall time differs"),
    *_each(_ROLES, "checkpoint.strict", "inert", "checkpoints always load strictly"),
    *_each(_ROLES, "checkpoint.mbridge_config", "inert", "megarl maps HF weights itself"),
    *_each(_ROLES, "data_loader_seed", "inert", "mini-batch shuffling is seeded by trainer.seed"),
    *_each(_ROLES, "loss_scale_factor", "rejected", "loss scaling follows loss_agg_mode"),
    # verl's deprecated global micro sizes: divided over the data-parallel ranks, as verl's
    # workers do (megarl.config.global_micro)
    *[Rule(k, "converted", f"{per} = {k} // the data-parallel size (verl's rule)")
      for k, (per, _) in GLOBAL_MICRO.items()],
    Rule("critic.forward_micro_batch_size_per_gpu", "mapped", "critic.ppo_micro_batch_size_per_gpu"),
    Rule("critic.forward_max_token_len_per_gpu", "mapped", "critic.ppo_max_token_len_per_gpu"),
    Rule("critic.checkpoint.*", "inert", "the critic saves what the actor's checkpoint.* says"),
    Rule(f"{_ACTOR}.calculate_entropy", "inert", "the entropy is always computed (fused, no "
         "extra memory)"),
    Rule(f"{_ACTOR}.calculate_sum_pi_squared", "inert", "the old-logprob pass computes "
         "sum(pi^2) whenever the estimator needs it (adv_estimator=optimal_token_baseline)"),
    Rule(f"{_ACTOR}.freeze_vision_tower", "inert", _TEXT),
    Rule(f"{_ACTOR}.policy_loss.clip_cov_*", "inert", _ONLY_WHEN.format(what="loss_mode=clip_cov")),
    Rule(f"{_ACTOR}.policy_loss.kl_cov_ratio", "inert", _ONLY_WHEN.format(what="loss_mode=kl_cov")),
    Rule(f"{_ACTOR}.policy_loss.ppo_kl_coef", "inert", _ONLY_WHEN.format(what="loss_mode=kl_cov")),
    Rule(f"{_ACTOR}.policy_loss.dro_beta", "inert", _ONLY_WHEN.format(what="loss_mode=dro")),
    Rule(f"{_ACTOR}.use_fused_kernels", "mapped", f"{_ARR}.model.use_fused_kernels"),
    Rule(f"{_ACTOR}.use_remove_padding", "mapped", f"{_ARR}.model.use_remove_padding"),
    Rule(f"{_ACTOR}.use_prefix_grouper", "inert", "verl's shared-prefix forward (each prompt "
         "computed once for its n responses) is a speed / memory option with the same results; "
         "megarl computes each response with its own copy of the prompt"),
    Rule(f"{_ACTOR}.qat.enable", "rejected", "quantization-aware training is not implemented"),
    Rule(f"{_ACTOR}.qat.*", "inert", _ONLY_WHEN.format(what="qat.enable")),
    # rollout
    Rule(f"{_ROLLOUT}.checkpoint_engine.update_weights_bucket_megabytes", "mapped",
         f"{_ROLLOUT}.update_weights_bucket_megabytes"),
    Rule(f"{_ROLLOUT}.checkpoint_engine.*", "inert", "weights reach the engine through megarl's "
         "resharding stream"),
    Rule(f"{_ROLLOUT}.multi_turn.function_tool_path", "rejected", "tools from a Python file "
         "of functions are not implemented; list them in multi_turn.tool_config_path"),
    Rule(f"{_ROLLOUT}.multi_turn.use_inference_chat_template", "rejected", "the agent loop "
         "renders every turn with the training chat template"),
    Rule(f"{_ROLLOUT}.multi_turn.*", "inert", "not read by megarl's agent loop"),
    Rule(f"{_ROLLOUT}.agent.*", "inert", "megarl's agent loop (multi_turn.*) runs inside the "
         "trainer; verl's agent-loop workers have no counterpart"),
    Rule(f"{_ROLLOUT}.mode", "inert", "megarl's engines generate inside the synchronous step"),
    Rule(f"{_ROLLOUT}.calculate_log_probs", "inert", "the engines always return the sampled "
         "tokens' logprobs"),
    Rule(f"{_ROLLOUT}.logprobs_mode", "rejected", "the engines return processed logprobs (of "
         "the distribution sampled from)"),
    *[Rule(f"{_ROLLOUT}.{k}", "rejected", f"rollout {k} > 1 is not implemented; one engine "
           "per tensor_model_parallel_size ranks") for k in (
        "data_parallel_size", "pipeline_model_parallel_size")],
    Rule(f"{_ROLLOUT}.disaggregation.enabled", "rejected", "prefill/decode disaggregation is "
         "not implemented"),
    Rule(f"{_ROLLOUT}.disaggregation.*", "inert", _ONLY_WHEN.format(what="disaggregation.enabled")),
    Rule(f"{_ROLLOUT}.dtype", "inert", "the engine runs in actor_rollout_ref.model.dtype"),
    Rule(f"{_ROLLOUT}.enable_sleep_mode", "inert", "a colocated engine sleeps between "
         f"generations whenever {_ROLLOUT}.free_cache_engine is on (vLLM: where its build has "
         "a sleep mode); rollout workers of their own never sleep"),
    Rule(f"{_ROLLOUT}.enable_rollout_routing_replay", "inert", "the torch engine records "
         f"routing whenever {_ACTOR}.router_replay.mode=R3"),
    Rule(f"{_ROLLOUT}.moe_load_balance_metrics_interval", "inert",
         "an MoE actor's expert load, router entropy and load-balancing loss are logged on "
         "every check step (moe/*: the first step and with rollout.check_logprobs)"),
    Rule(f"{_ROLLOUT}.engine_kwargs.trtllm", "rejected", "the TensorRT-LLM engine is not "
         "supported (rollout.name: torch, vllm, sglang)"),
    Rule(f"{_ROLLOUT}.ignore_eos", "rejected", "responses end at EOS"),
    Rule(f"{_ROLLOUT}.over_sample_rate", "inert", "verl 0.9.1 reads it nowhere (its only "
         "reader, the SGLang engine-mode rollout, was removed): rollouts run to completion in "
         "verl too"),
    Rule(f"{_ROLLOUT}.sglang_rollout_mode", "inert", "verl 0.9.1 reads it nowhere: its SGLang "
         "rollout always runs as HTTP servers; megarl's SGLang engine is rollout.name=sglang"),
    Rule(f"{_ROLLOUT}.server.*", "inert", "HTTP-client timeouts and retries of verl's rollout "
         "servers (read only by its TensorRT-LLM rollout in 0.9.1); megarl's engines have no "
         "such client"),
    Rule(f"{_ROLLOUT}.nnodes", "rejected", "rollouts share the training ranks; separate "
         "rollout nodes are not implemented"),
    Rule(f"{_ROLLOUT}.n_gpus_per_node", "inert", "rollouts share the training ranks "
         "(trainer.n_gpus_per_node)"),
    Rule(f"{_ROLLOUT}.quantization*", "rejected", "quantized rollouts are not implemented"),
    Rule(f"{_ROLLOUT}.qat", "inert", _ONLY_WHEN.format(what="qat.enable")),
    Rule(f"{_ROLLOUT}.mtp", "inert", _ONLY_WHEN.format(what="mtp.enable")),
    Rule(f"{_ROLLOUT}.prompt_length", "inert", "read from data.max_prompt_length"),
    Rule(f"{_ROLLOUT}.response_length", "inert", "read from data.max_response_length"),
    Rule(f"{_ROLLOUT}.max_model_len", "inert", "the engine's context is data.max_prompt_length "
         "+ data.max_response_length"),
    *[Rule(f"{_ROLLOUT}.{k}", "inert", "a serving detail of verl's engine servers; megarl "
           "drives the engine in process") for k in (
        "cudagraph_capture_sizes", "disable_log_stats", "enable_prefix_caching",
        "full_determinism", "load_format", "multi_stage_wake_up",
        "router_config_path", "scheduling_policy", "skip_tokenizer_init", "prometheus.*",
        "trace.*")],
    # algorithm
    Rule("algorithm.filter_groups.max_inflight_gen_batches", "inert", "generation rounds run "
         "one at a time"),
    Rule("algorithm.use_pf_ppo", "rejected", "PF-PPO reweighting is not implemented"),
    Rule("algorithm.pf_ppo.*", "inert", _ONLY_WHEN.format(what="algorithm.use_pf_ppo")),
    # reward (verl's `reward.*` section and its older `reward_model.*` spellings)
    Rule("reward.custom_reward_function.*", "mapped", "custom_reward_function.*"),
    Rule("reward.reward_manager.name", "mapped", "reward_model.reward_manager"),
    Rule("reward.reward_manager.*", "rejected", "reward managers are chosen by name "
         "(reward_model.reward_manager); custom manager modules are not loaded"),
    Rule("reward.reward_model.enable", "mapped", "reward_model.enable"),
    Rule("reward.reward_model.model_path", "mapped", "reward_model.model.path"),
    Rule("reward.num_workers", "mapped", "reward_model.num_workers"),
    *[Rule(f"{s}.enable_resource_pool", "inert", "the reward model shares the training ranks")
      for s in ("reward.reward_model", "reward_model")],
    *[Rule(f"{s}.{k}", "inert", "the reward model shares the training ranks")
      for s in ("reward.reward_model", "reward_model") for k in ("n_gpus_per_node", "nnodes")],
    # verl 0.9.1's spelling of the judge's engine (megarl.config.verl_judge)
    *[Rule(pattern, status, note) for pattern, status, note in JUDGE_RULES],
    Rule("reward_model.model.external_lib", "rejected", "megarl builds its reward model from "
         "the HF config; external model libraries are not imported"),
    Rule("reward_model.model.use_remove_padding", "inert", "the PRM packs sequences like the "
         "actor (actor_rollout_ref.model.use_remove_padding)"),
    Rule("reward_model.model.fsdp_config.*", "inert", _OFFLOAD),
    Rule("reward_model.model.trust_remote_code", "mapped", f"{_ARR}.model.trust_remote_code"),
    Rule("reward_model.reward_loop_*", "rejected", "custom reward loops are not loaded; use "
         "custom_reward_function"),
    *[Rule(f"{s}sandbox_fusion.*", "mapped", "reward_model.sandbox_fusion.*")
      for s in ("reward.", "")],
)


@dataclass(frozen=True)
class Verdict:
    status: Status
    note: str  # mapped: the megarl key; inert / rejected: the reason; implemented: ""


def _schema_key(dotted: str) -> str | None:
    """The megarl key ``dotted`` is read as (itself, or through an alias), or None."""
    canon = canonical_path(dotted)
    return None if schema_problem(canon) else canon


@cache
def classify(key: str) -> Verdict | None:
    """How megarl reads verl's dotted ``key``; None if no rule covers it."""
    canon = _schema_key(key)
    if canon is not None:
        return Verdict("implemented", "") if canon == key else Verdict("mapped", canon)
    for rule in RULES:
        if fnmatch.fnmatchcase(key, rule.pattern):
            if rule.status == "mapped" and rule.note.endswith(".*"):
                prefix = rule.pattern[:-1]
                return Verdict("mapped", rule.note[:-1] + key[len(prefix):])
            return Verdict(rule.status, rule.note)
    return None


_ABSENT = object()


@cache
def _accepted_keys() -> dict[str, Any]:
    return {**verl_keys(), **OLDER_KEYS, **RECIPE_KEYS}


def verl_key_of(dotted: str) -> str | None:
    """The verl key (of the pinned release, or an older spelling) that ``dotted`` is or lies
    under (``...override_transformer_config.X`` lies under a mapping-valued verl key)."""
    keys = _accepted_keys()
    key = dotted
    while key:
        if key in keys or any(fnmatch.fnmatchcase(key, p) for p in OPEN_SECTIONS):
            return key
        key = key.rpartition(".")[0]
    return None


def _pop_leaf(tree: dict, dotted: str) -> None:
    """Remove ``dotted`` and the mappings it leaves empty."""
    *parents, last = dotted.split(".")
    chain = [tree]
    for part in parents:
        chain.append(chain[-1][part])
    del chain[-1][last]
    for node, part in zip(reversed(chain[:-1]), reversed(parents)):
        if node[part]:
            break
        del node[part]


@cache
def _rule_mappings() -> tuple[tuple[str, str], ...]:
    """(verl key or prefix, megarl key or prefix) of the ``mapped`` rules."""
    # trainer.resume_mode is read together with resume_from_path by megarl.config.aliases
    return tuple((r.pattern.removesuffix(".*"), r.note.removesuffix(".*"))
                 for r in RULES if r.status == "mapped" and r.pattern != "trainer.resume_mode")


def apply_verl_mappings(layer: dict, source: str) -> dict:
    """A copy of ``layer`` with every key of a ``mapped`` rule moved to its megarl key. The
    verl key and its megarl key both set to different values in one layer is an error.
    verl 0.9's ``model_engine`` group first (`megarl.config.verl_model_engine`), then verl's
    megatron LoRA block (`megarl.config.verl_lora`); verl 0.9.1's
    ``reward.reward_model.rollout.name`` also sets ``reward_model.use_reward_loop`` (that
    release always serves its reward model through the reward loop)."""
    layer = copy.deepcopy(layer)
    read_model_engine(layer, source)
    read_lora_block(layer, source)
    read_judge_loop(layer)
    for dotted, value in list(flatten(layer).items()):
        if (verdict := classify(dotted)) is not None and verdict.status in ("inert", "rejected"):
            continue  # a rule for this key comes before the section's mapping
        for verl, megarl in _rule_mappings():
            if dotted == verl or dotted.startswith(verl + "."):
                target = megarl + dotted[len(verl):]
                break
        else:
            continue
        node = layer
        for part in target.split(".")[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{target}: set as a value and as a section (from {source})")
        last = target.rsplit(".", 1)[-1]
        if value is None and last in node:  # unset (verl's legacy sections default to null)
            _pop_leaf(layer, dotted)
            continue
        if last in node and node[last] is not None and node[last] != value:
            raise ConfigError(f"{dotted}={value!r} and {target}={node[last]!r} (from {source}): "
                              f"{dotted} is verl's spelling of {target}; set one of them")
        node[last] = value
        _pop_leaf(layer, dotted)
    return layer


def take_verl_only(layer: dict) -> dict[str, Any]:
    """Pop from ``layer`` (a nested config layer, aliases already applied) every value of a
    verl key that megarl has no key for (inert or rejected); returns them as {dotted: value}.
    What remains holds megarl keys and unknown keys (which the schema check reports)."""
    taken: dict[str, Any] = {}
    for dotted, value in flatten(layer).items():
        if _schema_key(dotted) is not None or verl_key_of(dotted) is None:
            continue
        if (classify(dotted) or classify(verl_key_of(dotted))).status in (
                "converted", "inert", "rejected"):
            taken[dotted] = value
            _pop_leaf(layer, dotted)
    return taken


_SELECT = re.compile(r"^\$\{oc\.select:([^,}]+)(?:,(.*))?\}$")
_REFERENCE = re.compile(r"^\$\{([^}:]+)\}$")


def verl_defaults(dotted: str, config: dict[str, Any], depth: int = 0) -> list[Any]:
    """The values verl's default for ``dotted`` can stand for. A default that is an
    interpolation (``${oc.select:KEY,FALLBACK}``, ``${KEY}``, ``${.sibling}``) stands for the
    value KEY has in ``config`` (dotted -> value), KEY's own verl default, and FALLBACK."""
    default = _accepted_keys().get(dotted, _ABSENT)
    out = [default]
    if not isinstance(default, str) or depth > 8:
        return out
    if m := _SELECT.match(default):
        ref, fallback = m.group(1).strip(), m.group(2)
        if fallback is not None:
            out.append(yaml.safe_load(fallback.strip() or "null"))
    elif m := _REFERENCE.match(default):
        ref = m.group(1).strip()
    else:
        return out
    if ref.startswith("."):
        ref = dotted.rpartition(".")[0] + ref
    for key in (ref, _megarl_key_of(ref)):
        if key in config:
            out.append(config[key])
    return out + verl_defaults(ref, config, depth + 1)


def _megarl_key_of(dotted: str) -> str | None:
    """The megarl key a verl key is read as (an alias or a ``mapped`` rule), or None."""
    canon = _schema_key(dotted)
    if canon is not None:
        return canon
    for verl, megarl in _rule_mappings():
        if dotted == verl or dotted.startswith(verl + "."):
            return megarl + dotted[len(verl):]
    return None


def verl_only_findings(values: dict[str, tuple[Any, str]],
                       config: dict[str, Any] | None = None) -> tuple[list[str], list[str]]:
    """(notices, errors) for the verl-only values a config set: {dotted: (value, source)};
    ``config``: dotted -> value of the rest of the config (for interpolated verl defaults).
    A value equal to verl's default says nothing; otherwise an inert key gives a notice (no
    effect, and why) and a rejected key an error (why, and what to use instead)."""
    notices: list[str] = []
    errors: list[str] = []
    known = {**(config or {}), **{k: v for k, (v, _) in values.items()}}
    for dotted, (value, source) in sorted(values.items()):
        if any(value == d for d in verl_defaults(dotted, known) if d is not _ABSENT):
            continue
        verdict = classify(dotted) or classify(verl_key_of(dotted) or dotted)
        said = f"{dotted}={value!r} (from {source})"
        if verdict.status == "inert":
            notices.append(f"{said}: accepted without effect: {verdict.note}")
        else:
            errors.append(f"{said}: not supported by megarl: {verdict.note}")
    return notices, errors


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """Nested mapping -> {dotted key: leaf}; an empty mapping is a leaf."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and v:
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out


def verl_keys() -> dict[str, Any]:
    """The pinned release's keys and defaults (``verl_keys.yaml``)."""
    return yaml.safe_load(KEYS_FILE.read_text())["keys"]
