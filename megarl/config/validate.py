"""Cross-field rules of a ``Config`` and the filling of "None = X" defaults.

``finalize(cfg, explicit)`` returns a new Config with every derived value filled in (so the
trainer reads concrete values) plus the list of problems found; each problem is one line that
starts with the dotted key it is about and says how to fix it.
"""

from __future__ import annotations

import copy
import logging

from megarl.config import algorithms as A
from megarl.config import disaggregated
from megarl.config.schema import Config, ParallelConfig
from megarl.config.schema_judge import judge_enabled
from megarl.config.schema_reward import sandbox_fusion_problems

log = logging.getLogger("megarl.config")


def critic_enabled(cfg: Config) -> bool:
    """critic.enable, with None (auto) meaning on iff the advantage estimator needs a critic's
    values (``megarl.algos`` NEEDS "values": gae)."""
    if cfg.critic.enable is not None:
        return cfg.critic.enable
    return "values" in A.estimator_needs(cfg.algorithm.adv_estimator)


# the parallel sizes every megatron role of one run shares (`_check_megatron_sizes_shared`)
SHARED_MEGATRON_SIZES = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                         "context_parallel_size")


def fill_derived(cfg: Config, explicit: set[str]) -> tuple[Config, list[tuple[tuple[str, ...], str]]]:
    """Copy of ``cfg`` with the documented "None = X" values filled. ``explicit`` holds the
    dotted keys the user wrote (files or overrides). Returns (config, problems)."""
    cfg = copy.deepcopy(cfg)
    problems: list[tuple[tuple[str, ...], str]] = []
    # the user's estimators and losses first: the critic's auto rule below reads their needs
    bad_file = A.custom_algorithms_problem(cfg.algorithm.custom_algorithms.path)
    if bad_file:
        problems.append(((A.PATH_KEY,), bad_file))
    if cfg.data.seed is None:
        cfg.data.seed = cfg.trainer.seed
    disaggregated.fill(cfg, explicit)
    arr = cfg.actor_rollout_ref
    model, actor, rollout, ref = arr.model, arr.actor, arr.rollout, arr.ref
    if model.tokenizer_path is None:
        model.tokenizer_path = model.path
    if actor.clip_ratio_low is None:
        actor.clip_ratio_low = actor.clip_ratio
    if actor.clip_ratio_high is None:
        actor.clip_ratio_high = actor.clip_ratio
    if actor.megatron.param_dtype is None:
        actor.megatron.param_dtype = model.dtype
    if actor.checkpoint.load_contents is None:
        actor.checkpoint.load_contents = list(actor.checkpoint.save_contents)
    if rollout.seed is None:
        rollout.seed = cfg.trainer.seed
    # use_dynamic_bsz None: dynamic unless the role's own micro-batch size is given (an explicit
    # true wins over a micro size, as in verl; megarl.config.notices announces it)
    if actor.use_dynamic_bsz is None:
        actor.use_dynamic_bsz = actor.ppo_micro_batch_size_per_gpu is None
    if rollout.log_prob_use_dynamic_bsz is None:
        rollout.log_prob_use_dynamic_bsz = rollout.log_prob_micro_batch_size_per_gpu is None
    if ref.log_prob_use_dynamic_bsz is None and ref.log_prob_micro_batch_size_per_gpu is not None:
        ref.log_prob_use_dynamic_bsz = False
    for name in ("log_prob_micro_batch_size_per_gpu", "log_prob_use_dynamic_bsz", "log_prob_max_token_len_per_gpu"):
        if getattr(ref, name) is None:
            setattr(ref, name, getattr(rollout, name))

    critic = cfg.critic
    critic.enable = critic_enabled(cfg)
    if critic.model.path is None:
        critic.model.path = model.path
    if critic.model.tokenizer_path is None:
        critic.model.tokenizer_path = model.tokenizer_path
    if critic.model.dtype is None:
        critic.model.dtype = model.dtype
    if critic.megatron.param_dtype is None:
        critic.megatron.param_dtype = critic.model.dtype
    for name in ("strategy", "ppo_mini_batch_size", "use_dynamic_bsz", "ppo_epochs", "shuffle", "loss_agg_mode"):
        if getattr(critic, name) is None:
            setattr(critic, name, getattr(actor, name))

    rm = cfg.reward_model
    if rm.model.dtype is None:
        rm.model.dtype = model.dtype
    if rm.strategy is None:
        rm.strategy = actor.strategy
    if rm.use_dynamic_bsz is None:
        rm.use_dynamic_bsz = actor.use_dynamic_bsz
    for name in ("num_workers", "timeout_s", "memory_mb"):
        if getattr(rm.ray, name) is None:
            setattr(rm.ray, name, getattr(rm, name))

    # megatron roles share one megatron-core parallel state per process: a critic's or reward
    # model's sizes the user did not write follow the actor's (verl runs each role in its own
    # workers, where its default 1 stands alone)
    if actor.strategy == "megatron":
        for prefix, role in (("critic", critic), ("reward_model", rm)):
            if not role.enable or role.strategy != "megatron":
                continue
            for name in SHARED_MEGATRON_SIZES:
                if f"{prefix}.parallel.{name}" not in explicit:
                    setattr(role.parallel, name, getattr(actor.parallel, name))

    # trainer.nnodes / n_gpus_per_node (verl) and launch.nnodes / nproc_per_node (torchrun)
    # describe the same thing; whichever was written wins, both written must agree.
    trainer, launch = cfg.trainer, cfg.launch
    for tkey, lkey in (("nnodes", "nnodes"), ("n_gpus_per_node", "nproc_per_node")):
        tval, lval = getattr(trainer, tkey), getattr(launch, lkey)
        t_set = f"trainer.{tkey}" in explicit and tval is not None
        l_set = f"launch.{lkey}" in explicit
        if t_set and l_set and tval != lval:
            problems.append(
                ((f"trainer.{tkey}", f"launch.{lkey}"),
                 f"{tval} but launch.{lkey} is {lval}; they are the same setting, keep one")
            )
        elif t_set and not l_set:
            setattr(launch, lkey, tval)
        else:
            setattr(trainer, tkey, lval)
    if launch.log_dir is None:
        launch.log_dir = f"{trainer.default_local_dir}/logs"
    return cfg, problems


class _Checker:
    """Collects problems; skips a rule when a key it reads already had a type error (its value
    was replaced by the default, so the rule would talk about a value the user never wrote)."""

    def __init__(self, bad_keys: set[str]):
        self.bad = bad_keys
        self.problems: list[str] = []

    def fail(self, keys: str | tuple[str, ...], text: str) -> None:
        keys = (keys,) if isinstance(keys, str) else keys
        for k in keys:
            for b in self.bad:
                if k == b or b.startswith(k + ".") or k.startswith(b + "."):
                    return
        self.problems.append(f"{keys[0]}: {text}")

    def positive(self, key: str, value: int | float | None, what: str = "") -> None:
        if value is not None and value <= 0:
            self.fail(key, f"must be > 0{what}, got {value!r}")

    def non_negative(self, key: str, value: int | float | None) -> None:
        if value is not None and value < 0:
            self.fail(key, f"must be >= 0, got {value!r}")

    def unit(self, key: str, value: float, low_open: bool = False) -> None:
        if not ((0 < value if low_open else 0 <= value) and value <= 1):
            self.fail(key, f"must be in {'(' if low_open else '['}0, 1], got {value!r}")


def check(cfg: Config, bad_keys: set[str]) -> list[str]:
    """All cross-field problems of a filled config (see module docstring)."""
    c = _Checker(bad_keys)
    _check_ranges(cfg, c)
    _check_algorithm(cfg, c)
    _check_batches(cfg, c)
    _check_layout(cfg, c)
    _check_router_replay(cfg, c)
    _check_multi_turn(cfg, c)
    _check_judge(cfg, c)
    disaggregated.check(cfg, c)
    return c.problems


def _check_judge(cfg: Config, c: _Checker) -> None:
    """The generative judge (reward_model.use_reward_loop + rollout.name) needs its model. Its
    engine keys and the algorithms it cannot feed are checked at start-up, once
    reward_model.model.path is known to be generative (a classifier there is verl's "disrm",
    scored with one forward, whose rollout keys are not read): megarl.trainer.parts."""
    rm = cfg.reward_model
    if judge_enabled(rm) and not rm.model.path:
        c.fail(("reward_model.model.path", "reward_model.rollout.name"),
               f"required: reward_model.use_reward_loop=true with reward_model.rollout.name="
               f"{rm.rollout.name} serves a generative judge on this model; set "
               "reward_model.model.path to the judge model (an HF folder or hub id), or unset "
               "reward_model.rollout.name")


def _check_multi_turn(cfg: Config, c: _Checker) -> None:
    """Multi-turn rollouts with tools: what the trainer runs them with, and what it refuses.
    A process reward model scores each model turn as one step (`megarl.trainer.prm`);
    asynchronous rollout runs the agent loop in the engine process (one weight version per
    trajectory, `megarl.rollout.agent.remote`); a tensor-parallel engine's first rank runs it
    and broadcasts each turn's prompts to the group (`megarl.rollout.agent.group`)."""
    arr = cfg.actor_rollout_ref
    mt, key = arr.rollout.multi_turn, "actor_rollout_ref.rollout.multi_turn.enable"
    if not mt.enable:
        return
    if not mt.tool_config_path and not mt.interaction_config_path:
        c.fail(("actor_rollout_ref.rollout.multi_turn.tool_config_path", key),
               "multi_turn.enable needs tools or an interaction: set tool_config_path (verl's "
               "tool YAML: tools: [{class_name, config, tool_schema}]) and/or "
               "actor_rollout_ref.rollout.multi_turn.interaction_config_path (interaction: "
               "[{name, class_name, config}])")
    if arr.actor.router_replay.mode != "disabled":
        c.fail((key, "actor_rollout_ref.actor.router_replay.mode"),
               "routing replay does not record the experts across turns yet; set "
               "actor_rollout_ref.actor.router_replay.mode=disabled")
    if not cfg.data.apply_chat_template or cfg.data.chat_template:
        c.fail((key, "data.apply_chat_template", "data.chat_template"),
               "the agent loop renders tool turns with the tokenizer's own chat template; the "
               "prompts must use it too (data.apply_chat_template=true, data.chat_template "
               "unset)")


def _check_router_replay(cfg: Config, c: _Checker) -> None:
    """R3 routing replay: the torch and megatron backends replay, the torch engine records (the
    policy being a mixture of experts, and the torch backend's layout, are checked when the
    model is built)."""
    arr = cfg.actor_rollout_ref
    key = "actor_rollout_ref.actor.router_replay.mode"
    if arr.actor.router_replay.mode != "R3":  # R2 records in the trainer's own pass
        return
    if arr.rollout.name != "torch":
        c.fail((key, "actor_rollout_ref.rollout.name"),
               f"{arr.actor.router_replay.mode} needs actor_rollout_ref.rollout.name=torch: only "
               "megarl's torch engine returns the experts it routed each token to (vLLM 0.32 "
               "can on GPUs, through enable_return_routed_experts with its Triton-only model "
               "runner V2, but megarl's vLLM adapter does not request them yet); use "
               f"rollout.name=torch or {key}=disabled")


def _check_ranges(cfg: Config, c: _Checker) -> None:
    d, arr = cfg.data, cfg.actor_rollout_ref
    actor, rollout = arr.actor, arr.rollout
    if not d.train_files:
        c.fail("data.train_files", "required; set data.train_files=path/to/train.parquet (or a list)")
    if not arr.model.path:
        c.fail("actor_rollout_ref.model.path", "required; set it to an HF folder, hub id or embedded://NAME")
    for key in ("train_batch_size", "val_batch_size", "max_prompt_length", "max_response_length"):
        c.positive(f"data.{key}", getattr(d, key))
    c.non_negative("data.dataloader_num_workers", d.dataloader_num_workers)
    c.positive("actor_rollout_ref.model.fused_kernel_options.chunk_size", arr.model.fused_kernel_options.chunk_size)

    a = "actor_rollout_ref.actor"
    for key in ("ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu", "ppo_max_token_len_per_gpu", "ppo_epochs"):
        c.positive(f"{a}.{key}", getattr(actor, key))
    for key in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
        c.positive(f"{a}.{key}", getattr(actor, key))
    if actor.clip_ratio_c <= 1:
        c.fail(f"{a}.clip_ratio_c", f"must be > 1 (the dual-clip bound), got {actor.clip_ratio_c!r}")
    for key in ("entropy_coeff", "kl_loss_coef", "grad_clip"):
        c.non_negative(f"{a}.{key}", getattr(actor, key))
    _check_optim(f"{a}.optim", actor.optim, c)

    r = "actor_rollout_ref.rollout"
    for key in ("n", "max_num_seqs", "tensor_model_parallel_size", "log_prob_micro_batch_size_per_gpu",
                "log_prob_max_token_len_per_gpu", "update_weights_bucket_megabytes"):
        c.positive(f"{r}.{key}", getattr(rollout, key))
    c.positive(f"{r}.max_num_batched_tokens", rollout.max_num_batched_tokens)
    c.unit(f"{r}.gpu_memory_utilization", rollout.gpu_memory_utilization, low_open=True)
    ep, tp = rollout.expert_parallel_size, rollout.tensor_model_parallel_size
    if ep not in (1, tp):
        fix = (f"set it to {tp} (experts split over the engine's ranks) or 1 (each expert split "
               "by tensor parallelism)" if tp > 1 else
               "set it to 1 (an engine of one rank holds every expert)")
        c.fail((f"{r}.expert_parallel_size", f"{r}.tensor_model_parallel_size"),
               f"{ep}, but the experts are split over one engine's ranks: as in verl, it must be "
               f"{r}.tensor_model_parallel_size ({tp}) x data_parallel_size, and megarl runs one "
               f"engine per tensor-parallel group (data_parallel_size 1); {fix}")
    if rollout.name == "torch" and rollout.tensor_model_parallel_size > 1:
        c.fail((f"{r}.tensor_model_parallel_size", f"{r}.name"),
               f"{rollout.tensor_model_parallel_size} > 1, but rollout.name=torch generates with "
               "the whole model on every rank; set it to 1, or use rollout.name=vllm (or sglang)")
    for prefix, s in ((r, rollout), (f"{r}.val_kwargs", rollout.val_kwargs)):
        c.non_negative(f"{prefix}.temperature", s.temperature)
        c.unit(f"{prefix}.top_p", s.top_p, low_open=True)
        if s.top_k == 0 or s.top_k < -1:
            c.fail(f"{prefix}.top_k", f"must be -1 (off) or >= 1, got {s.top_k!r}")
    c.positive(f"{r}.val_kwargs.n", rollout.val_kwargs.n)
    ref = arr.ref
    c.positive("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", ref.log_prob_micro_batch_size_per_gpu)
    c.positive("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", ref.log_prob_max_token_len_per_gpu)

    if cfg.critic.enable:
        cr = cfg.critic
        for key in ("ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu", "ppo_max_token_len_per_gpu",
                    "ppo_epochs", "cliprange_value"):
            c.positive(f"critic.{key}", getattr(cr, key))
        c.non_negative("critic.grad_clip", cr.grad_clip)
        _check_optim("critic.optim", cr.optim, c)

    rm = cfg.reward_model
    for key in ("micro_batch_size_per_gpu", "forward_max_token_len_per_gpu", "num_workers", "timeout_s", "memory_mb"):
        c.positive(f"reward_model.{key}", getattr(rm, key))
    for key in ("num_workers", "timeout_s", "memory_mb"):
        c.positive(f"reward_model.ray.{key}", getattr(rm.ray, key))
    sbx = rm.sandbox_fusion
    for problem in sandbox_fusion_problems(sbx.url, sbx.max_concurrent, sbx.memory_limit_mb):
        key, text = problem.split(": ", 1)
        c.fail(key, text)
    if not rm.step_separator:
        c.fail("reward_model.step_separator", "must not be empty")
    if rm.prm_step_token == "":
        c.fail("reward_model.prm_step_token", "must not be empty (null keeps step ends as is)")
    ob = rm.overlong_buffer
    c.positive("data.gen_batch_size", d.gen_batch_size)
    if ob.enable and not 0 < ob.len < d.max_response_length:
        c.fail(("reward_model.overlong_buffer.len", "data.max_response_length"),
               f"must be in (0, data.max_response_length={d.max_response_length}) when the overlong "
               f"buffer is enabled, got {ob.len!r}")
    c.non_negative("reward_model.overlong_buffer.penalty_factor", ob.penalty_factor)
    c.positive("reward_model.overlong_buffer.max_resp_len", ob.max_resp_len)
    if ob.max_resp_len is not None and ob.max_resp_len != d.max_response_length:
        c.fail(("reward_model.overlong_buffer.max_resp_len", "data.max_response_length"),
               f"{ob.max_resp_len} differs from data.max_response_length={d.max_response_length}; "
               f"the buffer counts back from the generation limit: drop it or make them equal")

    t = cfg.trainer
    c.positive("trainer.total_epochs", t.total_epochs)
    c.positive("trainer.total_training_steps", t.total_training_steps)
    c.positive("trainer.max_ckpt_to_keep", t.max_ckpt_to_keep)
    c.non_negative("trainer.critic_warmup", t.critic_warmup)
    c.non_negative("trainer.log_val_generations", t.log_val_generations)
    for key in ("save_freq", "test_freq"):
        v = getattr(t, key)
        if v == 0 or v < -1:
            c.fail(f"trainer.{key}", f"must be -1 (never) or >= 1 steps, got {v!r}")
    if not t.resume:
        c.fail("trainer.resume", "must be 'auto', 'force' (auto, accepting changed settings), "
                                 "'disable' or a checkpoint path, got ''")


def _check_optim(prefix: str, o, c: _Checker) -> None:
    c.non_negative(f"{prefix}.lr", o.lr)
    c.non_negative(f"{prefix}.weight_decay", o.weight_decay)
    c.positive(f"{prefix}.eps", o.eps)
    c.unit(f"{prefix}.min_lr_ratio", o.min_lr_ratio)
    c.unit(f"{prefix}.lr_warmup_steps_ratio", o.lr_warmup_steps_ratio)
    if o.lr_warmup_steps < -1:
        c.fail(f"{prefix}.lr_warmup_steps", f"must be -1 (use lr_warmup_steps_ratio) or >= 0, got {o.lr_warmup_steps}")
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        c.fail(f"{prefix}.betas", f"must be two numbers in [0, 1) (Adam beta1, beta2), got {o.betas!r}")


def _check_algorithm_names(cfg: Config, c: _Checker) -> None:
    """The estimator and the policy loss are registered names (megarl.config.algorithms); an
    unknown one is reported once and the rules reading it are skipped."""
    for key, problem in ((A.ESTIMATOR_KEY, A.unknown_estimator(cfg.algorithm.adv_estimator)),
                         (A.LOSS_KEY, A.unknown_policy_loss(
                             cfg.actor_rollout_ref.actor.policy_loss.loss_mode))):
        if problem:
            c.fail(key, problem)
            c.bad.add(key)


def _check_algorithm(cfg: Config, c: _Checker) -> None:
    alg, rm, pacs = cfg.algorithm, cfg.reward_model, cfg.pacs
    rollout = cfg.actor_rollout_ref.rollout
    _check_algorithm_names(cfg, c)
    est = alg.adv_estimator
    needs = A.estimator_needs(est)
    c.unit("algorithm.gamma", alg.gamma)
    c.unit("algorithm.lam", alg.lam)
    c.non_negative("algorithm.kl_ctrl.kl_coef", alg.kl_ctrl.kl_coef)
    c.positive("algorithm.kl_ctrl.horizon", alg.kl_ctrl.horizon)
    c.positive("algorithm.kl_ctrl.target_kl", alg.kl_ctrl.target_kl)
    c.positive("pacs.beta", pacs.beta)

    if rm.reward_manager == "blank" and not rm.enable and not judge_enabled(rm):
        c.fail(("reward_model.reward_manager", "reward_model.enable"),
               "'blank' gives no verifiable reward and reward_model.enable is false: nothing would "
               "produce a reward; set reward_model.enable=true (PRM only) or reward_manager=prime|naive")
    if rm.enable and not rm.model.path and not judge_enabled(rm):
        c.fail(("reward_model.model.path", "reward_model.enable"),
               "required when reward_model.enable is true (the PRM to load); set "
               "reward_model.model.path=... or reward_model.enable=false")
    ca = rm.credit_assignment
    if isinstance(ca, float) and ca <= 0:
        c.fail("reward_model.credit_assignment",
               f"temperature must be > 0, got {ca!r}; use a float T > 0 (PURE: 0.1), 'min' or 'sum'")

    if rollout.n < 2:
        # grpo's singleton group has mean 0 and std 1 (verl's rule): the advantage is the score
        # itself, said at start-up (notices.py)
        if ("groups" in needs and not pacs.enable
                and "singleton_groups" not in A.estimator_traits(est)):
            c.fail(("actor_rollout_ref.rollout.n", "algorithm.adv_estimator"),
                   f"{rollout.n} < 2 but algorithm.adv_estimator={est} compares the responses of one "
                   f"prompt; set actor_rollout_ref.rollout.n >= 2")
        if pacs.enable:
            c.fail(("actor_rollout_ref.rollout.n", "pacs.enable"),
                   f"{rollout.n} < 2 but PACS (pacs.enable) scores each response against its group; "
                   f"set actor_rollout_ref.rollout.n >= 2")
        if alg.filter_groups.enable:
            c.fail(("actor_rollout_ref.rollout.n", "algorithm.filter_groups.enable"),
                   f"{rollout.n} < 2 but algorithm.filter_groups drops groups whose responses all "
                   f"agree, which every group of one does; set rollout.n >= 2")
    if alg.filter_groups.enable and alg.filter_groups.metric != "score":
        c.fail("algorithm.filter_groups.metric",
               f"{alg.filter_groups.metric!r} is not implemented: dynamic sampling filters groups on "
               f"'score' (the verifiable reward, overlong penalty included; equal to DAPO's 'acc' "
               f"when the penalty is off); set algorithm.filter_groups.metric=score")
    if "values" in needs and not cfg.critic.enable:
        c.fail(("critic.enable", "algorithm.adv_estimator"),
               f"false but algorithm.adv_estimator={est} needs a critic's values; set "
               "critic.enable=true (or null = auto), or choose another algorithm.adv_estimator")
    if pacs.enable and cfg.critic.enable:
        why = (f"algorithm.adv_estimator={est} turns it on" if "values" in needs
               else "critic.enable is true")
        c.fail(("pacs.enable", "critic.enable"),
               f"PACS trains the actor with its BCE loss and uses no critic, but {why}; set "
               f"critic.enable=false and algorithm.adv_estimator to a critic-free one (PACS: grpo)")
    if (pacs.enable and pacs.reward_method == "1" and pacs.adv_estimator == "grpo"
            and pacs.norm_adv_by_std_in_grpo):
        c.fail(("pacs.adv_estimator", "pacs.reward_method"),
               "grpo divides each group's reward proxy by its std, but reward_method=1's proxy "
               "beta*sum(logp - old_logp) is 0 for every response on a mini-batch's first update "
               "(logp = old_logp): the std is 0 and the gradient is scaled by 1/1e-6; set "
               "pacs.adv_estimator=rloo (PACS's default), pacs.norm_adv_by_std_in_grpo=false or "
               "pacs.reward_method=2")
    rc = alg.rollout_correction
    if rc.rollout_is_threshold is None:
        if rc.rollout_is is not None:
            c.fail(("algorithm.rollout_correction.rollout_is_threshold",
                    "algorithm.rollout_correction.rollout_is"),
                   f"null, but rollout_is={rc.rollout_is!r} truncates its importance weights "
                   "at it; set a threshold > 0 (verl's default is 2.0)")
    else:
        c.positive("algorithm.rollout_correction.rollout_is_threshold", rc.rollout_is_threshold,
                   " (the upper truncation of the importance weights; verl's default is 2.0)")
    if rc.rollout_is is not None and pacs.enable:
        c.fail(("algorithm.rollout_correction.rollout_is", "pacs.enable"),
               f"{rc.rollout_is!r} weights the policy loss per token, but PACS (pacs.enable) "
               "trains with its BCE loss, which takes no importance weights; set "
               "algorithm.rollout_correction.rollout_is=null or pacs.enable=false")
    if rc.rollout_rs is not None:
        from megarl.algos import parse_rollout_rs
        try:
            parse_rollout_rs(rc.rollout_rs, rc.rollout_rs_threshold)
        except ValueError as e:
            c.fail(("algorithm.rollout_correction.rollout_rs",
                    "algorithm.rollout_correction.rollout_rs_threshold"), str(e))
    if rc.bypass_mode and cfg.async_training.staleness_threshold > 0 \
            and not cfg.async_training.use_rollout_log_probs:
        c.fail(("algorithm.rollout_correction.bypass_mode", "async_training.use_rollout_log_probs"),
               "bypass_mode takes the ratio against the engine's logprobs, but "
               "use_rollout_log_probs=false takes it against the trainer's recomputation; set "
               "one of them the other way")
    a_ = cfg.actor_rollout_ref.actor
    c.positive("actor_rollout_ref.actor.tau_pos", a_.tau_pos, " (SAPO's gate temperature)")
    c.positive("actor_rollout_ref.actor.tau_neg", a_.tau_neg, " (SAPO's gate temperature)")
    if "baselines" in needs and not rollout.do_sample:
        c.fail(("algorithm.adv_estimator", "actor_rollout_ref.rollout.do_sample"),
               f"{est} needs actor_rollout_ref.rollout.do_sample=true (its baseline is a greedy "
               "response compared against sampled ones)")
    if cfg.critic.enable and "values" not in needs:
        log.warning("critic.enable is true but algorithm.adv_estimator=%s does not use values", est)


def _check_batches(cfg: Config, c: _Checker) -> None:
    d, arr = cfg.data, cfg.actor_rollout_ref
    tbs = d.train_batch_size
    gbs = d.gen_batch_size
    if gbs is not None and gbs != tbs and not cfg.algorithm.filter_groups.enable:
        c.fail(("data.gen_batch_size", "algorithm.filter_groups.enable"),
               f"{gbs} prompts per generation round differs from data.train_batch_size {tbs}, but "
               f"only DAPO's dynamic sampling (algorithm.filter_groups.enable=true) generates in "
               f"rounds; enable it, or drop data.gen_batch_size")
    roles = [("actor_rollout_ref.actor", arr.actor)]
    if cfg.critic.enable:
        roles.append(("critic", cfg.critic))
    for prefix, role in roles:
        mbs = role.ppo_mini_batch_size
        if mbs is not None and tbs > 0 and mbs > 0:
            if mbs > tbs:
                c.fail((f"{prefix}.ppo_mini_batch_size", "data.train_batch_size"),
                       f"{mbs} prompts > data.train_batch_size {tbs} prompts; set it <= "
                       f"{tbs} (equal = one optimizer step per training step)")
            elif tbs % mbs:
                c.fail((f"{prefix}.ppo_mini_batch_size", "data.train_batch_size"),
                       f"{mbs} prompts does not divide data.train_batch_size {tbs} prompts; choose a "
                       f"divisor of {tbs}")
        if not role.use_dynamic_bsz and role.ppo_micro_batch_size_per_gpu is None:
            c.fail((f"{prefix}.ppo_micro_batch_size_per_gpu", f"{prefix}.use_dynamic_bsz"),
                   f"required when {prefix}.use_dynamic_bsz is false (responses per forward); set "
                   f"it or use_dynamic_bsz=true")
    pairs = [("actor_rollout_ref.rollout", arr.rollout), ("actor_rollout_ref.ref", arr.ref)]
    for prefix, role in pairs:
        if not role.log_prob_use_dynamic_bsz and role.log_prob_micro_batch_size_per_gpu is None:
            c.fail((f"{prefix}.log_prob_micro_batch_size_per_gpu", f"{prefix}.log_prob_use_dynamic_bsz"),
                   f"required when {prefix}.log_prob_use_dynamic_bsz is false; set it or "
                   f"log_prob_use_dynamic_bsz=true")
    # reward_model.micro_batch_size_per_gpu is optional (verl 0.9.1 scores through its reward
    # loop by default and skips the check): without it the reward model packs its forwards up
    # to reward_model.forward_max_token_len_per_gpu (megarl.trainer.settings.micro_batching)


def _role_strategy(cfg: Config, prefix: str) -> str:
    if prefix == "critic":
        return cfg.critic.strategy
    if prefix == "reward_model":
        return cfg.reward_model.strategy
    return cfg.actor_rollout_ref.actor.strategy


def _check_ulysses(cfg: Config, prefix: str, par: ParallelConfig, c: _Checker) -> bool:
    """Ulysses sequence parallelism > 1: torch backend, without TP / PP. False if refused."""
    p = f"{prefix}.parallel"
    key = f"{p}.ulysses_sequence_parallel_size"
    sp = par.ulysses_sequence_parallel_size
    if not _on_backend(cfg, prefix, c, key, sp, "Ulysses sequence parallelism", "torch",
                       f"{p}.context_parallel_size"):
        return False
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    if tp > 1 or pp > 1:
        c.fail((key, f"{p}.tensor_model_parallel_size", f"{p}.pipeline_model_parallel_size"),
               f"{sp} with TP {tp} x PP {pp}: the torch backend combines Ulysses sequence "
               "parallelism with FSDP only; set tensor_model_parallel_size and "
               "pipeline_model_parallel_size to 1, or this to 1")
        return False
    return True


def _check_context_parallel(cfg: Config, prefix: str, par: ParallelConfig, c: _Checker
                            ) -> bool:
    """Context parallelism > 1: megatron backend, the same size on every megatron role (they
    share megatron-core's process groups). False if refused."""
    p = f"{prefix}.parallel"
    return _on_backend(cfg, prefix, c, f"{p}.context_parallel_size", par.context_parallel_size,
                       "context parallelism", "megatron", f"{p}.ulysses_sequence_parallel_size")


def _on_backend(cfg: Config, prefix: str, c: _Checker, key: str, value: int, feature: str,
                backend: str, counterpart: str) -> bool:
    """``feature`` (set by ``key``) exists on ``backend`` only: refused, naming the other
    backend's ``counterpart`` key, when the role runs elsewhere. False if refused."""
    strategy = _role_strategy(cfg, prefix)
    if strategy == backend:
        return True
    other = "megatron" if backend == "torch" else "torch"
    c.fail((key, f"{prefix}.strategy"),
           f"{value}: {feature} is implemented by the {backend} backend only (this role's "
           f"strategy is {strategy}); the {other} backend's counterpart is {counterpart}: use "
           f"it, or strategy={backend}")
    return False


def _check_megatron_sizes_shared(cfg: Config, c: _Checker) -> None:
    """Every megatron role of the run uses one tensor-, pipeline- and context-parallel size
    (one megatron-core parallel state per process)."""
    roles = [("actor_rollout_ref.actor", cfg.actor_rollout_ref.actor.parallel)]
    if cfg.critic.enable:
        roles.append(("critic", cfg.critic.parallel))
    if cfg.reward_model.enable:
        roles.append(("reward_model", cfg.reward_model.parallel))
    megatron = [(prefix, par) for prefix, par in roles
                if _role_strategy(cfg, prefix) == "megatron"]
    what = {"tensor_model_parallel_size": "tensor-parallel",
            "pipeline_model_parallel_size": "pipeline-parallel",
            "context_parallel_size": "context-parallel"}
    for key in SHARED_MEGATRON_SIZES:
        sizes = {prefix: getattr(par, key) for prefix, par in megatron}
        if len(set(sizes.values())) > 1:
            said = ", ".join(f"{k}.parallel.{key}={v}" for k, v in sizes.items())
            c.fail(tuple(f"{k}.parallel.{key}" for k in sizes),
                   f"{said}: the megatron roles of one run share megatron-core's process "
                   f"groups, so they need one {what[key]} size; set them equal")


def _check_expert_layout(cfg: Config, prefix: str, tp: int, pp: int, world: int,
                         c: _Checker) -> None:
    """megatron's expert layout (actor, critic): expert-TP x EP x PP must divide the world, as
    megatron-core's parallel state requires. What needs the model (EP dividing the experts,
    TP with sequence parallelism on MoE) is checked when the backend is built."""
    if prefix == "actor_rollout_ref.actor":
        section, strategy = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.actor.strategy
    elif prefix == "critic":
        section = cfg.critic
        strategy = cfg.critic.strategy or cfg.actor_rollout_ref.actor.strategy
    else:
        return
    m = f"{prefix}.megatron"
    ep = section.megatron.expert_model_parallel_size
    etp = section.megatron.expert_tensor_parallel_size
    if strategy != "megatron":
        if ep != 1 or etp not in (None, 1):
            c.fail((f"{m}.expert_model_parallel_size", f"{m}.expert_tensor_parallel_size",
                    f"{prefix}.strategy"),
                   f"expert parallelism (EP {ep}, expert TP {etp}) is the megatron backend's; "
                   f"strategy={strategy} shards experts with FSDP2 like any other parameter. "
                   "Set strategy=megatron, or leave these at 1 / null")
        return
    if ep < 1 or (etp is not None and etp < 1):
        c.positive(f"{m}.expert_model_parallel_size", ep)
        if etp is not None:
            c.positive(f"{m}.expert_tensor_parallel_size", etp)
        return
    etp = tp if etp is None else etp
    if world % (etp * ep * pp):
        c.fail((f"{m}.expert_model_parallel_size", f"{m}.expert_tensor_parallel_size",
                f"{prefix}.parallel.pipeline_model_parallel_size", "launch.nnodes",
                "launch.nproc_per_node"),
               f"expert TP {etp} x EP {ep} x PP {pp} does not divide the {world} ranks "
               "(launch.nnodes x launch.nproc_per_node); megatron lays the experts out over "
               "expert-TP x EP x PP ranks (expert-TP defaults to tensor_model_parallel_size)")


def _check_layout(cfg: Config, c: _Checker) -> None:
    launch = cfg.launch
    c.positive("launch.nnodes", launch.nnodes)
    c.positive("launch.nproc_per_node", launch.nproc_per_node)
    if not 1 <= launch.master_port <= 65535:
        c.fail("launch.master_port", f"must be a TCP port in 1..65535, got {launch.master_port}")
    if launch.node_rank is not None and not 0 <= launch.node_rank < max(launch.nnodes, 1):
        c.fail(("launch.node_rank", "launch.nnodes"), f"must be in [0, launch.nnodes={launch.nnodes}), got {launch.node_rank}")
    if launch.hosts and len(launch.hosts) != launch.nnodes:
        c.fail(("launch.hosts", "launch.nnodes"), f"{len(launch.hosts)} hosts but launch.nnodes is {launch.nnodes}")
    world = launch.nnodes * launch.nproc_per_node
    if world <= 0:
        return
    arr, d = cfg.actor_rollout_ref, cfg.data
    n = arr.rollout.n
    roles: list[tuple[str, ParallelConfig, int | None]] = [
        ("actor_rollout_ref.actor", arr.actor.parallel, arr.actor.ppo_mini_batch_size)
    ]
    if cfg.critic.enable:
        roles.append(("critic", cfg.critic.parallel, cfg.critic.ppo_mini_batch_size))
    if cfg.reward_model.enable:
        roles.append(("reward_model", cfg.reward_model.parallel, None))
    world_keys = ("launch.nnodes", "launch.nproc_per_node")
    for prefix, par, mbs in roles:
        p = f"{prefix}.parallel"
        tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
        sp = par.ulysses_sequence_parallel_size
        cp = par.context_parallel_size
        if par.param_dtype is not None and _role_strategy(cfg, prefix) != "torch":
            c.fail((f"{p}.param_dtype", f"{prefix}.strategy"),
                   f"{par.param_dtype}: read by the torch backend only; with strategy megatron "
                   f"set {prefix}.megatron.param_dtype instead")
        if tp <= 0 or pp <= 0 or sp <= 0 or cp <= 0:
            c.positive(f"{p}.tensor_model_parallel_size", tp)
            c.positive(f"{p}.pipeline_model_parallel_size", pp)
            c.positive(f"{p}.ulysses_sequence_parallel_size", sp)
            c.positive(f"{p}.context_parallel_size", cp)
            continue
        if sp > 1 and not _check_ulysses(cfg, prefix, par, c):
            continue
        if cp > 1 and not _check_context_parallel(cfg, prefix, par, c):
            continue
        if world % (tp * pp * sp * cp):
            keys = (f"{p}.tensor_model_parallel_size", f"{p}.pipeline_model_parallel_size")
            if sp > 1:
                keys = (f"{p}.ulysses_sequence_parallel_size", *keys)
            if cp > 1:
                keys = (f"{p}.context_parallel_size", *keys)
            extra = (f" x Ulysses SP {sp}" if sp > 1 else "") + (f" x CP {cp}" if cp > 1 else "")
            c.fail((*keys, *world_keys),
                   f"TP {tp} x PP {pp}{extra} does not divide "
                   f"the {world} ranks (launch.nnodes x launch.nproc_per_node)")
            continue
        dp = world // (tp * pp * sp * cp)
        _check_expert_layout(cfg, prefix, tp, pp, world, c)
        vpp = par.virtual_pipeline_model_parallel_size
        if vpp is not None and (vpp < 1 or pp < 2):
            c.fail((f"{p}.virtual_pipeline_model_parallel_size", f"{p}.pipeline_model_parallel_size"),
                   f"needs pipeline_model_parallel_size > 1 and a value >= 1, got {vpp} with PP {pp}; "
                   f"set it to null")
        shard = par.data_parallel_shard
        if shard != -1 and (shard < 1 or dp % shard):
            c.fail((f"{p}.data_parallel_shard", *world_keys),
                   f"must be -1 (all {dp} data-parallel ranks) or a divisor of {dp}, got {shard}")
        if prefix == "actor_rollout_ref.actor" and d.train_batch_size > 0 and d.train_batch_size % dp:
            c.fail(("data.train_batch_size", *world_keys),
                   f"{d.train_batch_size} prompts cannot be split evenly over {dp} data-parallel ranks "
                   f"(whole groups stay on one rank); use a multiple of {dp}")
        if mbs is not None and mbs > 0 and n > 0 and (mbs * n) % dp:
            c.fail((f"{prefix}.ppo_mini_batch_size", "actor_rollout_ref.rollout.n", *world_keys),
                   f"{mbs} prompts x rollout.n {n} = {mbs * n} responses cannot be split evenly over "
                   f"{dp} data-parallel ranks")
    _check_megatron_sizes_shared(cfg, c)
    rtp = arr.rollout.tensor_model_parallel_size
    if rtp > 0 and world % rtp:
        c.fail(("actor_rollout_ref.rollout.tensor_model_parallel_size", *world_keys),
               f"{rtp} does not divide the {world} ranks")
