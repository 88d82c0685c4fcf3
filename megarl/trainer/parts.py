"""Assemble a run from its config: tokenizer, data, backends per role, engine, reward scoring,
run directory and logger. Everything the loop needs, built once, in one place: the only place
that maps a strategy to a backend class or picks the engine's process, so the loop itself never
branches on them."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megarl.backends.protocol import Backend
from megarl.config import disaggregated
from megarl.config.schema import Config
from megarl.config.schema_judge import judge_enabled
from megarl.data import PromptSampler, RLDataset, load_tokenizer, resolve_path
from megarl.data.extern import ExternSampler, prompt_dataset, prompt_sampler
from megarl.errors import UserInputError
from megarl.logging import MetricLogger
from megarl.rollout.build import EngineSpec, build_engine, check_engine_installed, engine_spec
from megarl.rollout.protocol import RolloutEngine
from megarl.trainer.generation import AgentRollout, Scorer, sampling_params
from megarl.trainer.outcome_rm import OutcomeRewardModel
from megarl.trainer.run_lock import RunDirLock
from megarl.trainer.settings import lora_settings, role_settings, rollout_settings
from megarl.utils import dist as mdist

log = logging.getLogger(__name__)


# actor_rollout_ref.actor.strategy / critic.strategy -> the Backend class, and the class of
# a LoRA actor's reference (its own model with the adapters off), as "module:name": the one
# place a strategy name picks a training backend
_BACKENDS = {
    "torch": ("megarl.backends.torch:TorchBackend",
              "megarl.backends.torch.lora_reference:AdapterOffReference"),
    "megatron": ("megarl.backends.megatron:MegatronBackend",
                 "megarl.backends.megatron.lora:AdapterOffReference"),
}


def backend_class(strategy: str, *, adapter_off_reference: bool = False) -> type:
    """The Backend class of ``strategy`` (imported on first use), or with
    ``adapter_off_reference`` the class of its LoRA reference (``from_settings(actor,
    settings)``)."""
    if strategy not in _BACKENDS:
        raise ValueError(f"actor_rollout_ref.actor.strategy: unknown {strategy!r}; expected one "
                         f"of {sorted(_BACKENDS)}")
    module, name = _BACKENDS[strategy][1 if adapter_off_reference else 0].split(":")
    return getattr(importlib.import_module(module), name)


def build_backend(role: str, cfg: Config, model_path: str,
                  run_steps: int | None = None) -> Backend:
    """A Backend for ``role`` with the strategy of the actor (critic: its own strategy);
    ``run_steps``: the run's length (the learning-rate schedule's, `role_settings`)."""
    strategy = cfg.critic.strategy if role == "critic" else cfg.actor_rollout_ref.actor.strategy
    return backend_class(strategy).from_settings(role_settings(role, cfg, model_path, run_steps))


def lora_rank(cfg: Config) -> int:
    """The actor's LoRA rank: ``actor_rollout_ref.model.lora_rank``, or the adapter folder's
    with ``lora_adapter_path`` (0: the actor trains all its parameters)."""

    settings = lora_settings(cfg)
    return settings.rank if settings is not None else 0


def build_reference(cfg: Config, actor: Backend, model_path: str) -> Backend:
    """The reference policy: with LoRA the actor's own module with its adapters off (no second
    copy of the model), else a frozen backend of its own loaded from ``model_path``."""
    if lora_rank(cfg):
        reference = backend_class(cfg.actor_rollout_ref.actor.strategy,
                                  adapter_off_reference=True)
        return reference.from_settings(actor, role_settings("ref", cfg, actor.model_path))
    return build_backend("ref", cfg, model_path)


def async_settings(cfg: Config) -> tuple[int, bool, list[int]]:
    """(staleness bound in steps, use_rollout_log_probs, engine CPUs) from
    ``async_training`` (all defaults when the section is absent)."""
    sec = getattr(cfg, "async_training", None)
    if sec is None:
        return 0, True, []
    s = sec.staleness_threshold
    if isinstance(s, bool) or not float(s).is_integer() or s < 0:
        raise UserInputError(
            f"async_training.staleness_threshold={s!r}: megarl takes a whole number of steps "
            "(0 = the synchronous loop, 1 = one-step off-policy, k = batches generated up to "
            "k versions behind the trainer); verl's fractional sample-level thresholds are not "
            "implemented")
    return int(s), bool(sec.use_rollout_log_probs), [int(c) for c in sec.engine_cpus]


def run_engine(cfg: Config, model_path: str, device: torch.device,
               eos_id: int | None = None) -> RolloutEngine:
    """The run's rollout engine (`megarl.rollout.build`): in this process, or, with
    ``async_training.staleness_threshold`` s > 0, in a process of its own with s + 1 weight
    slots, pinned to ``async_training.engine_cpus[local rank]``; disaggregated
    (``actor_rollout_ref.hybrid_engine=false``): the rollout workers (`worker_pool`)."""
    if disaggregated.is_disaggregated(cfg):
        return worker_pool(cfg, model_path, device, eos_id)
    staleness, _, cpus = async_settings(cfg)
    if staleness == 0:
        if adapter_sync(cfg):
            from megarl.rollout.build import engine_from_spec

            return engine_from_spec(with_adapter_sync(
                cfg, engine_spec(rollout_settings(cfg), model_path, device)))
        return build_engine(rollout_settings(cfg), model_path, device)
    from megarl.rollout.engine_process import cores_apart
    from megarl.rollout.process import ProcessRolloutEngine

    local = int(os.environ.get("LOCAL_RANK", "0"))
    mine = [cpus[local % len(cpus)]] if cpus else []
    spec = with_adapter_sync(cfg, engine_spec(rollout_settings(cfg), model_path, device,
                                              own_process=True, cpus=mine))
    spec.tool_cpus = cores_apart(cpus)
    return ProcessRolloutEngine(spec, slots=staleness + 1, timeout_s=_engine_timeout(cfg))


def worker_pool(cfg: Config, model_path: str, device: torch.device,
                eos_id: int | None) -> RolloutEngine:
    """The disaggregated run's rollout workers (`megarl.rollout.worker_pool`), started by
    trainer rank 0 on its node: rollout.n_gpus_per_node of them, worker i on the GPU after the
    node's trainer ranks' (cuda:local_world + i) or pinned to engine_cpus[i]."""
    from megarl.rollout.worker_pool import WorkerPlacement, WorkerPool

    at, ro = cfg.async_training, cfg.actor_rollout_ref.rollout
    timeout = _engine_timeout(cfg)
    placement = None
    if mdist.rank() == 0:
        count = cfg.rollout.nnodes * cfg.rollout.n_gpus_per_node
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", cfg.launch.nproc_per_node))
        if device.type == "cuda" and torch.cuda.device_count() < local_world + count:
            raise UserInputError(
                f"rollout.n_gpus_per_node={count}: the rollout workers take the GPUs after the "
                f"node's {local_world} trainer ranks, but this node has "
                f"{torch.cuda.device_count()} GPUs; lower rollout.n_gpus_per_node or "
                "trainer.n_gpus_per_node")
        specs = []
        for i in range(count):
            cpus = [at.engine_cpus[i % len(at.engine_cpus)]] if at.engine_cpus else []
            # built for the CPU, then placed: rank 0 never touches a worker's GPU (no CUDA
            # context there); the worker sizes its KV cache from its own GPU's free memory
            spec = engine_spec(rollout_settings(cfg), model_path, "cpu", own_process=True,
                               cpus=cpus)
            if device.type == "cuda":
                spec = dataclasses.replace(spec, device=f"cuda:{local_world + i}")
            specs.append(spec)
        placement = WorkerPlacement(  # seed 0: each request brings its own
            specs=specs, sampling=sampling_params(cfg, eos_id, 0), timeout_s=timeout,
            kv_fraction=ro.gpu_memory_utilization if device.type == "cuda" else None,
            max_len=cfg.data.max_prompt_length + cfg.data.max_response_length,
            # the coordinator hands out only while the trainer waits on it: each worker takes
            # its share of the window at once and its session admits from it as slots free
            capacity=disaggregated.worker_capacity(cfg), partial_rollout=at.partial_rollout)
    return WorkerPool(placement, device, bucket_bytes=ro.update_weights_bucket_megabytes << 20,
                      check_digest=cfg.rollout.check_weight_digest)


def _engine_timeout(cfg: Config) -> float:
    timeout = cfg.async_training.engine_timeout_s
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise UserInputError(f"async_training.engine_timeout_s={timeout!r}: expected seconds "
                             "> 0 (how long the trainer waits on a silent engine process)")
    return float(timeout)


def adapter_sync(cfg: Config) -> bool:
    """Whether the engine receives the actor's LoRA adapters at each sync instead of merged
    weights (`megarl.rollout.vllm.lora`: vLLM keeps its base weights, colocated or in an
    engine process of its own, any rollout TP); where not, the reason is logged once and
    merged weights are sent."""
    rank = lora_rank(cfg)
    ro = cfg.actor_rollout_ref.rollout
    if not rank or ro.name != "vllm":
        return False
    from megarl.rollout.vllm.lora import adapter_sync_refusal

    why = adapter_sync_refusal(rank, engine=ro.name)
    if why is not None:
        log.info("LoRA: the engine receives merged weights (%s)", why)
    return why is None


def with_adapter_sync(cfg: Config, spec: EngineSpec) -> EngineSpec:
    """``spec`` (a vLLM engine's) set up for adapter sync when `adapter_sync` holds: started
    with one LoRA slot of the run's rank, sleeping at level 1 (the base weights kept), its
    syncs adapters (`megarl.rollout.build.engine_from_spec`)."""
    if not adapter_sync(cfg):
        return spec
    from megarl.rollout.vllm.lora import lora_engine_kwargs

    lora = lora_settings(cfg)
    spec.settings["engine_kwargs"].update(lora_engine_kwargs(lora.rank))
    spec.settings["sleep_level"] = 1
    spec.settings["lora"] = lora
    return spec


def synced_engine(cfg: Config, engine: RolloutEngine, actor: Backend) -> RolloutEngine:
    """``engine``, wrapped to send the actor's adapters when `adapter_sync` holds (the
    colocated engine's targets checked now; an engine process checks them at the first
    sync)."""
    if not adapter_sync(cfg):
        return engine
    from megarl.rollout.vllm.lora import AdapterSource

    check = getattr(engine, "check_targets", None)
    if check is not None:
        try:
            check(actor.adapted_modules())
        except ValueError as e:
            raise UserInputError(
                f"actor_rollout_ref.model.target_modules="
                f"{cfg.actor_rollout_ref.model.target_modules!r}: {e}; target those modules "
                "only (all-linear does)") from e
    log.info("LoRA: the vLLM engine receives the adapters only at each weight sync")
    return AdapterSource(engine, actor.export_adapter)


@dataclass
class RunParts:
    cfg: Config
    run_dir: Path
    device: torch.device
    tokenizer: Any
    pad_id: int
    eos_id: int
    train_ds: RLDataset
    sampler: PromptSampler | ExternSampler
    val_items: list | None
    actor: Backend
    ref: Backend | None
    critic: Backend | None
    prm: Backend | None  # PURE's process reward model
    engine: RolloutEngine
    scorer: Scorer
    val_scorer: Scorer
    total_steps: int
    model_paths: dict[str, str]
    pool: Any = None  # the reward pool (rank 0 only)
    agent: AgentRollout | None = None  # rollout.multi_turn.enable: the agent loop's tools
    lock: RunDirLock | None = None  # the run directory's lock (rank 0 only)
    outcome_rm: OutcomeRewardModel | None = None  # verl's reward model (a sequence classifier)
    judge: Any = None  # the generative judge (megarl.judge.judge.Judge), this rank's engine

    def close(self) -> None:
        """Release the run's processes and engines. Called after the run's last collective:
        closing a vLLM engine (the rollout's or the judge's) tears down torch's default
        process group."""
        try:
            if self.pool is not None:
                self.pool.close()
            self.engine.close()
        finally:
            try:
                if self.judge is not None:
                    self.judge.close()
            finally:
                if self.lock is not None:
                    self.lock.release()

    def make_logger(self, total_steps: int, resume_step: int | None) -> MetricLogger:
        t = self.cfg.trainer
        return MetricLogger(self.run_dir, list(t.logger), total_steps, rank=mdist.rank(),
                            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                            resume_step=resume_step,
                            title=f"{t.project_name}/{t.experiment_name}",
                            project=t.project_name, experiment=t.experiment_name,
                            config=dataclasses.asdict(self.cfg))

    def export_actor_hf(self) -> str | None:
        """Write the actor as an HF folder under run_dir/hf_actor (collective). With LoRA the
        folder holds the merged weights, and run_dir/lora_adapter the adapters as a PEFT
        folder (``peft.PeftModel.from_pretrained(base, run_dir/"lora_adapter")``)."""
        from megarl.models import read_hf_config, save_hf_checkpoint

        out = self.run_dir / "hf_actor"
        src = self.model_paths["actor"]
        stream = self.actor.export_weights()
        if mdist.rank() == 0:
            save_hf_checkpoint(out, stream, read_hf_config(src), source_dir=src, overwrite=True)
        else:
            for _ in stream:  # every rank takes part in the gathers
                pass
        settings = getattr(self.actor, "lora", None)
        if settings is not None:
            from megarl.models.lora import save_peft_adapter

            adapter = dict(self.actor.export_adapter())
            if mdist.rank() == 0:
                save_peft_adapter(self.run_dir / "lora_adapter", adapter, settings,
                                  base_model_name_or_path=src)
        mdist.barrier()
        return str(out)


def _resolve_all(cfg: Config) -> dict[str, str]:
    """Resolve model paths (embedded:// assets are built by rank 0 first; the rest wait)."""
    wanted = {"actor": cfg.actor_rollout_ref.model.path,
              "tokenizer": cfg.actor_rollout_ref.model.tokenizer_path}
    if cfg.critic.enable:
        wanted["critic"] = cfg.critic.model.path
    if cfg.reward_model.enable or judge_enabled(cfg.reward_model):
        wanted["prm"] = cfg.reward_model.model.path  # the PRM, outcome RM or judge model
    for key in ("train_files", "val_files"):
        files = getattr(cfg.data, key)
        if files:
            wanted[key] = files if isinstance(files, str) else list(files)
    if mdist.rank() == 0:
        resolved = {k: (resolve_path(v) if isinstance(v, str) else [resolve_path(x) for x in v])
                    for k, v in wanted.items()}
    else:
        resolved = None
    mdist.barrier()
    if mdist.rank() != 0:  # assets now exist: resolving is a lookup
        resolved = {k: (resolve_path(v) if isinstance(v, str) else [resolve_path(x) for x in v])
                    for k, v in wanted.items()}
    return resolved


def _total_steps(cfg: Config, sampler: PromptSampler | ExternSampler) -> int:
    if cfg.trainer.total_training_steps:
        return int(cfg.trainer.total_training_steps)
    from_prompts = disaggregated.learner_steps(cfg)  # rollout.total_rollout_steps (verl)
    if from_prompts is not None:
        return from_prompts
    return int(cfg.trainer.total_epochs) * sampler.batches_per_epoch


def build_run(cfg: Config) -> RunParts:
    """Everything a run needs, built in order; rank 0 first takes the run directory's lock
    (one writer per directory: a second run on it is refused here, within its start-up)."""
    check_engine_installed(cfg.actor_rollout_ref.rollout.name)  # before data, assets, models
    from megarl.config import ConfigError
    from megarl.config.preflight import path_problems

    problems = path_problems(cfg)  # the same checks as `python -m megarl.config check`
    if problems:
        raise ConfigError(problems)
    lock = RunDirLock(cfg.trainer.default_local_dir).acquire() if mdist.rank() == 0 else None
    try:
        parts = _build_parts(cfg)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    parts.lock = lock
    return parts


def _build_parts(cfg: Config) -> RunParts:
    rank = mdist.rank()
    device = mdist.resolve_device(cfg.trainer.device)
    paths = _resolve_all(cfg)
    tokenizer = load_tokenizer(paths["tokenizer"])
    # which reward model: said (or refused) before the minutes spent on data and models
    judge_model = serves_judge(cfg, paths)
    rm_kind = (resolved_reward_model_kind(cfg, paths["prm"])
               if cfg.reward_model.enable and not judge_model else None)
    d = cfg.data
    agent = build_agent(cfg, tokenizer)  # a bad tool config fails before data and models
    ds_kwargs = dict(tokenizer=tokenizer, max_prompt_length=d.max_prompt_length,
                     prompt_key=d.prompt_key, truncation=d.truncation,
                     filter_overlong_prompts=d.filter_overlong_prompts,
                     chat_template=d.chat_template, apply_chat_template=d.apply_chat_template,
                     on_bad_row=d.on_bad_row,
                     chat_template_kwargs=dict(getattr(d, "apply_chat_template_kwargs", None) or {}))
    if agent is not None:  # the prompts show the tools' schemas, as verl renders them
        from megarl.rollout.agent import tool_schemas

        ds_kwargs["tools"] = tool_schemas(agent.tools) or None
    # data.custom_cls: the rows of the user's dataset class, else those of the files
    train_ds = prompt_dataset(d, paths["train_files"], **ds_kwargs)
    if train_ds.num_filtered and rank == 0:
        log.warning("data.train_files: %d prompts longer than max_prompt_length=%d were "
                    "filtered", train_ds.num_filtered, d.max_prompt_length)
    # a step's prompts come in rounds of data.gen_batch_size (DAPO's dynamic sampling), else
    # train_batch_size; an epoch and the run's length count these rounds, as verl's dataloader
    # data.sampler: the user's (curriculum) sampler, else megarl's seeded shuffle
    sampler = prompt_sampler(d, train_ds, d.gen_batch_size or d.train_batch_size)
    if getattr(sampler, "curriculum", False) and cfg.async_training.staleness_threshold > 0:
        raise UserInputError(
            "data.sampler.class_name: a curriculum sampler (one with update(batch)) needs "
            "synchronous rollout, where each step's scores reach it before the next batch is "
            "drawn; set async_training.staleness_threshold=0")
    val_items = None
    if paths.get("val_files"):
        val_ds = prompt_dataset(d, paths["val_files"], **ds_kwargs)
        val_items = [val_ds[i] for i in range(len(val_ds))]

    total_steps = _total_steps(cfg, sampler)
    # The engine first: it sizes its memory from what is free, before the training backends
    # hold theirs (asleep, it gives its memory back until the first weight sync).
    engine = run_engine(cfg, paths["actor"], device, tokenizer.eos_token_id)
    # the generative judge next, on this rank's device: it sizes its memory from what the
    # awake rollout engine left free (the engine takes its memory back at each wake)
    try:
        judge = build_run_judge(cfg, paths, device) if judge_model else None
    except BaseException:
        engine.close()
        raise
    try:
        return _build_rest(cfg, paths, device, tokenizer, rm_kind, agent, train_ds, sampler,
                           val_items, total_steps, engine, judge)
    except BaseException:
        if judge is not None:
            judge.close()
        raise


def _build_rest(cfg: Config, paths: dict[str, Any], device: torch.device, tokenizer: Any,
                rm_kind: str | None, agent: AgentRollout | None, train_ds: RLDataset,
                sampler: PromptSampler | ExternSampler, val_items: list | None,
                total_steps: int, engine: RolloutEngine, judge: Any) -> RunParts:
    """The parts built after the engines: the training backends, the reward scoring, the run
    directory."""
    rank = mdist.rank()
    d = cfg.data
    if cfg.actor_rollout_ref.rollout.free_cache_engine:
        engine.sleep()
    torch.manual_seed(cfg.trainer.seed)  # fresh heads (critic) initialise identically everywhere
    actor = build_backend("actor", cfg, paths["actor"], total_steps)
    a = cfg.actor_rollout_ref.actor
    need_ref = a.use_kl_loss or cfg.algorithm.use_kl_in_reward
    ref = build_reference(cfg, actor, paths["actor"]) if need_ref else None
    critic = (build_backend("critic", cfg, paths["critic"], total_steps) if cfg.critic.enable
              else None)
    prm = outcome_rm = None
    if rm_kind is not None:
        rm_backend = build_backend("prm", cfg, paths["prm"])
        if rm_kind == "prm":
            prm = rm_backend
        else:
            outcome_rm = build_outcome_rm(cfg, rm_backend, paths["prm"], tokenizer)
    engine = synced_engine(cfg, engine, actor)
    engine.update_weights(actor.export_weights())

    rm = cfg.reward_model
    manager = val_manager = pool = None
    if rank == 0:
        from megarl.rewards import make_reward_manager, make_reward_pool
        from megarl.rewards.sandbox_fusion import builtin_fn_spec

        pool = make_reward_pool(rm.pool, num_workers=rm.num_workers, timeout_s=rm.timeout_s,
                                memory_mb=rm.memory_mb, ray_address=rm.ray.address)
        custom = cfg.custom_reward_function
        custom_spec = ({"path": custom.path, "name": custom.name,
                        "reward_kwargs": dict(custom.reward_kwargs)} if custom.path else None)
        # the built-in functions get the code sandbox (verl: never a custom function)
        manager = make_reward_manager(rm.reward_manager, pool,
                                      custom_spec or builtin_fn_spec(rm, rm.reward_manager))
        val_manager = make_reward_manager("naive", pool, custom_spec or builtin_fn_spec(rm, "naive"))
        if outcome_rm is not None or judge is not None:
            # the rule reward is logged only: sources without one pass
            from megarl.rewards.managers import RuleRewardBesideModel

            manager = RuleRewardBesideModel(manager)
            val_manager = RuleRewardBesideModel(val_manager)
    overlong = None
    ob = rm.overlong_buffer
    if ob.enable:
        from megarl.rewards import overlong_penalty

        overlong = functools.partial(overlong_penalty,
                                     max_response_length=ob.max_resp_len or d.max_response_length,
                                     buffer_length=ob.len, penalty_factor=ob.penalty_factor)
    scorer = Scorer(manager, tokenizer, d.max_response_length, overlong, log_overlong=ob.log)
    val_scorer = Scorer(val_manager, tokenizer, d.max_response_length)

    run_dir = Path(cfg.trainer.default_local_dir)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        from megarl.config import to_yaml

        (run_dir / "config.yaml").write_text(to_yaml(cfg))
    eos_id = tokenizer.eos_token_id
    return RunParts(
        cfg=cfg, run_dir=run_dir, device=device, tokenizer=tokenizer,
        pad_id=tokenizer.pad_token_id, eos_id=eos_id, train_ds=train_ds, sampler=sampler,
        val_items=val_items, actor=actor, ref=ref, critic=critic, prm=prm, engine=engine,
        scorer=scorer, val_scorer=val_scorer, total_steps=total_steps,
        model_paths={k: v for k, v in paths.items() if isinstance(v, str)}, pool=pool,
        agent=agent, outcome_rm=outcome_rm, judge=judge,
    )


def serves_judge(cfg: Config, paths: dict[str, Any]) -> bool:
    """Whether the run scores with a generative judge: reward_model.use_reward_loop and
    rollout.name set, and the model (``paths["prm"]``, resolved) generative
    (`megarl.judge.judge.is_generative`; a classifier is verl's "disrm": megarl's outcome RM or
    PRM, the rollout keys unread). Said at start-up; combinations the judge cannot serve are
    refused (`refuse_judge_combinations`) before any model is loaded."""
    rm = cfg.reward_model
    if not judge_enabled(rm) or "prm" not in paths:
        return False
    from megarl.judge.judge import is_generative

    if not is_generative(paths["prm"], rm.model.kind):
        if mdist.rank() == 0:
            log.warning("reward_model: %s is a classifier (or reward_model.model.kind=%s): it is "
                        "scored with one forward, not served by reward_model.rollout's engine "
                        "(reward_model.rollout.* not read)", rm.model.path, rm.model.kind)
        return False
    refuse_judge_combinations(cfg)
    if mdist.rank() == 0:
        say_judge(cfg)
    return True


def refuse_judge_combinations(cfg: Config) -> None:
    """UserInputError for a run that configures the generative judge together with something
    it cannot feed: PURE's process-reward modes (reward_model.enable with pure_rloo)."""
    from megarl import algos

    rm, est = cfg.reward_model, cfg.algorithm.adv_estimator
    if rm.enable and "step_scores" in algos.estimator_traits(est):
        raise UserInputError(
            f"reward_model.enable=true with algorithm.adv_estimator={est} asks for PURE's "
            "process reward model, but reward_model.use_reward_loop=true with "
            f"reward_model.rollout.name={rm.rollout.name} serves {rm.model.path} as a generative "
            "judge, and reward_model.enable then means the judge (one score per response, no "
            "step scores). Fix: for PURE with a PRM unset reward_model.rollout.name (or set "
            "reward_model.use_reward_loop=false) and point reward_model.model.path at the PRM; "
            "for PURE's VR mode on the judge's score set reward_model.enable=false")


def say_judge(cfg: Config) -> None:
    """The start-up line of a run with a generative judge (rank 0)."""
    rm = cfg.reward_model
    enable = (" reward_model.enable=true means this judge: no process or outcome reward model "
              "is started." if rm.enable else "")
    log.warning("reward_model: the generative judge %s (reward_model.rollout.name=%s engine on "
                "each rank, one share of the responses each) scores every response; its score "
                "is the training reward in place of the reward manager's (still logged), and "
                "validation scores with the reward manager.%s", rm.model.path, rm.rollout.name,
                enable)


def build_run_judge(cfg: Config, paths: dict[str, Any], device: torch.device) -> Any:
    """This rank's generative judge (`megarl.judge.judge.judge_from_section`) on the
    resolved judge model ``paths["prm"]``."""
    from megarl.judge.judge import judge_from_section

    rm = cfg.reward_model
    local = dataclasses.replace(rm, model=dataclasses.replace(rm.model, path=paths["prm"]))
    return judge_from_section(local, cfg.trainer.seed, device)


def resolved_reward_model_kind(cfg: Config, path: str) -> str:
    """"prm" or "outcome" for ``reward_model.model.path`` (`outcome_rm.reward_model_kind`),
    said once at start-up."""
    from megarl.models import read_hf_config
    from megarl.trainer.outcome_rm import reward_model_kind

    hf = read_hf_config(path)
    kind = reward_model_kind(cfg.reward_model.model.kind, hf, cfg.reward_model.model.path)
    if mdist.rank() == 0:
        arch = ", ".join(hf.get("architectures") or []) or "no architectures"
        what = ("an outcome reward model: one score per response, the training reward in place "
                "of the reward manager's" if kind == "outcome" else
                "a process reward model (PURE): step scores")
        log.warning("reward_model: %s (%s, reward_model.model.kind=%s) is %s",
                    cfg.reward_model.model.path, arch, cfg.reward_model.model.kind, what)
    return kind


def build_outcome_rm(cfg: Config, backend: Backend, path: str, tokenizer: Any) -> OutcomeRewardModel:
    """The outcome reward model over ``backend`` (the ``prm`` role on ``path``): one label, and
    the RM's own tokenizer when its input must be re-rendered (`outcome_rm.load_rm_tokenizer`)."""
    from megarl.trainer.outcome_rm import load_rm_tokenizer

    rm = cfg.reward_model
    labels = getattr(backend, "num_labels", 1)
    if labels != 1:
        raise UserInputError(
            f"reward_model.model.path={rm.model.path}: an outcome reward model has one label "
            f"(num_labels=1), this checkpoint has {labels}")
    rm_tok = load_rm_tokenizer(path, rm.model.input_tokenizer, tokenizer)
    max_length = rm.max_length or cfg.data.max_prompt_length + cfg.data.max_response_length
    if mdist.rank() == 0:
        log.warning("reward_model: the outcome reward model reads %s",
                    "its own chat template's rendering of each decoded response (its tokenizer "
                    f"differs from the policy's; inputs cut at {max_length} tokens)"
                    if rm_tok is not None else "the policy's token ids (same tokenizer)")
    return OutcomeRewardModel(backend, tokenizer, rm_tok, max_length)


def build_agent(cfg: Config, tokenizer: Any) -> AgentRollout | None:
    """``rollout.multi_turn.enable``: the tools of ``multi_turn.tool_config_path``, the
    interactions of ``multi_turn.interaction_config_path`` (each optional, loaded now so a bad
    file fails at start-up) and the agent loop's settings; None when multi-turn rollouts are
    off."""
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    if not mt.enable:
        return None
    from megarl.rollout.agent import AgentLoopSettings, load_interactions, load_tools

    tools = load_tools(resolve_path(mt.tool_config_path)) if mt.tool_config_path else {}
    interactions = (load_interactions(resolve_path(mt.interaction_config_path))
                    if mt.interaction_config_path else None)
    template_kwargs = dict(getattr(cfg.data, "apply_chat_template_kwargs", None) or {})
    settings = AgentLoopSettings.from_config(mt, chat_template_kwargs=template_kwargs)
    return AgentRollout(tools=tools, settings=settings,
                        tokenizer=tokenizer, interactions=interactions)


def pin_threads() -> None:
    """One intra-op thread per rank unless OMP_NUM_THREADS says otherwise (CPU runs on shared
    cores are ~25x slower oversubscribed)."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
