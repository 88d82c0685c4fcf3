"""Algorithms: what a training step runs between scoring and the weight sync.

``RLTrainer.train_step`` reads, whatever the algorithm (no algorithm name in the loop):

    rollout -> score -> algo.prepare(batch, step) -> PRM / old / ref logprobs, values
    -> algo.advantages(batch, kl_coef) -> updates with algo.loss_settings(on_policy) -> sync

An ``Algorithm`` declares what it needs (``Needs``: groups compared per prompt, a critic, a
greedy baseline per prompt, whole groups on one rank) and supplies the hooks. The entries:

- ``PPOFamily``: any estimator of ``megarl.algos.ADVANTAGE_ESTIMATORS`` (gae, grpo, rloo,
  reinforce_plus_plus(_baseline), remax, opo, grpo_passk, the user's); advantages by
  ``compute_step_advantages``, the registered policy loss ``actor.policy_loss.loss_mode``.
  ReMax is this family with an estimator that needs "baselines": ``prepare`` generates one
  greedy response per prompt and scores it (``reward_baselines`` [B]); any estimator registered
  with ``needs=("baselines",)`` gets the same.
- ``OptimalTokenBaseline`` (``algorithm.adv_estimator=optimal_token_baseline``): verl's OTB
  (``algos.optimal_token_baseline``) on the placed rewards, with the old logprobs and the
  ``sum_pi_squared`` of the actor's old-logprob pass (``Needs.sum_pi_squared``).
- ``PureRloo`` (``algorithm.adv_estimator=pure_rloo``): PURE's pipeline
  (``algos.pure_rloo_advantages``) as the advantage stage, the PPO family's loss.
- ``Pacs`` (``pacs.enable``): the rewards only, ``scores`` = the verifiable reward; PACS's BCE
  (``algos.pacs_loss``) as the loss, each group on one rank and in one micro-batch.

One name selects the algorithm: ``AlgorithmSettings.name``, which is "pacs" under PACS's switch
``pacs.enable`` and ``algorithm.adv_estimator`` otherwise (`megarl.trainer.settings.
algorithm_settings` reads the config once). ``build_algorithm(settings)`` runs the entry
registered under that name (PURE, OTB, PACS), else the PPO family. Entries take the typed
`AlgorithmSettings`, never the config. A user's own entry: ``@register_algorithm("name")`` on an
``Algorithm`` subclass in the file named by ``algorithm.custom_algorithms.path``, its estimator
name registered with ``megarl.algos.register_advantage_pipeline`` (so that the config accepts it);
its own settings come from ``algorithm.custom_algorithms.options`` as ``settings.options``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, TypeVar

import torch

from megarl import algos
from megarl.backends.protocol import SequenceBatch
from megarl.config.algorithms import PATH_KEY, import_custom_algorithms
from megarl.errors import UserInputError
from megarl.rollout.protocol import SamplingParams
from megarl.trainer.advantage import (
    AdvantageSettings,
    compute_step_advantages,
    last_token_mask,
    place_rewards,
)
from megarl.trainer.batch import RolloutBatch, RolloutSample
from megarl.trainer.losses import ActorLossSettings, Norm
from megarl.trainer.metrics import Timer


@dataclass(frozen=True)
class Needs:
    """What an algorithm asks of the config and of the step."""

    groups: bool = False  # compares the responses of one prompt (rollout.n >= 2)
    critic: bool = False  # values [B, L] of a critic before the advantages (critic.enable)
    greedy_baseline: bool = False  # prepare: a greedy response per prompt, scored ([B])
    whole_groups: bool = False  # the loss reads group statistics: a group stays on one DP
    #                             rank and in one micro-batch
    # the actor's old-logprob pass runs (also on-policy) and computes sum_v pi_v^2 per position
    # (``sum_pi_squared`` [B, L]; `advantage.old_logprob_pass`)
    sum_pi_squared: bool = False

    @classmethod
    def of_estimator(cls, name: str) -> Needs:
        """The needs ``megarl.algos`` declares for the estimator or pipeline ``name``."""
        declared = algos.estimator_needs(name)
        return cls(groups="groups" in declared, critic="values" in declared,
                   greedy_baseline="baselines" in declared)


@dataclass
class StepContext:
    """What ``Algorithm.prepare`` may use besides the batch (the trainer builds it each step)."""

    # items (.prompt_ids, .data_source, .ground_truth, .extra_info), sampling -> the samples of
    # every rank, gathered, in item order (group ids = item positions)
    generate: Callable[[list[Any], SamplingParams], list[RolloutSample]]
    score: Callable[[list[RolloutSample]], torch.Tensor]  # -> [len(samples)] verifiable rewards
    sampling: Callable[..., SamplingParams]  # (seed, n=None, greedy=False) -> the run's params
    timer: Timer


def greedy_baselines(batch: RolloutBatch, step: StepContext) -> torch.Tensor:
    """[B] float32: the score of one greedy response to each prompt, broadcast to its group
    (ReMax's baseline; generated and scored under ``timing_s/gen``)."""
    groups, items = batch.group_prompts()
    with step.timer("gen"):
        samples = step.generate(items, step.sampling(0, greedy=True, n=1))
        scores = step.score(samples)
    by_group = dict(zip(groups, scores.tolist()))
    return torch.tensor([by_group[g] for g in batch.group_index.tolist()])


@dataclass(frozen=True)
class PureSettings:
    """``algorithm.pure``: options of PURE's main-branch pipeline."""

    mask_separator: bool = True  # zero the advantage at step-end tokens
    normalize: bool = True  # replay-buffer whitening of the advantages


@dataclass(frozen=True)
class PacsLoss:
    """PACS's objective (``losses.PolicyTerm``): ``algos.pacs_loss`` of a micro-batch holding
    whole groups, with ``scores`` [b] as labels, rescaled from its mean over the micro-batch's
    responses to its share of the mini-batch (x b / global_batch_size x dp). No entropy bonus
    and no KL loss are added (PACS trains a classifier)."""

    beta: float = 1.0
    reward_method: str = "1"
    adv_estimator: str = "rloo"
    weight_mode: str | None = "question"
    norm_adv_by_std: bool = True
    regularized: bool = False

    def __call__(self, logprob: torch.Tensor, old_logprob: torch.Tensor, mask: torch.Tensor,
                 mb: SequenceBatch, norm: Norm) -> tuple[torch.Tensor, dict[str, float]]:
        t = mb.tensors
        loss, _ = algos.pacs_loss(
            logprob=logprob, old_logprob=old_logprob, response_mask=mask, scores=t["scores"],
            group_index=t["group_index"], beta=self.beta, reward_method=self.reward_method,
            adv_estimator=self.adv_estimator, weight_mode=self.weight_mode,
            norm_adv_by_std=self.norm_adv_by_std)
        seq_share = mb.batch_size / max(norm.global_batch_size, 1) * norm.dp_size
        loss = loss * seq_share
        return loss, {"actor/pacs_loss": float(loss.detach())}


@dataclass(frozen=True)
class AlgorithmSettings:
    """What the algorithms read of a config, made once by
    `megarl.trainer.settings.algorithm_settings`."""

    name: str  # the registry entry that runs: "pacs" under pacs.enable, else adv_estimator
    adv: AdvantageSettings  # reward placement and the estimator (algorithm.*, reward_model.*)
    loss: ActorLossSettings  # the PPO family's actor loss (actor_rollout_ref.actor.*)
    pure: PureSettings = PureSettings()  # algorithm.pure
    pacs: PacsLoss = PacsLoss()  # pacs.*
    custom_path: str | None = None  # algorithm.custom_algorithms.path, imported by the build
    # algorithm.custom_algorithms.options: a user entry's own settings (read-only)
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


class Algorithm:
    """Hooks of one training step. The base is verl's PPO family: the registered estimator
    ``algorithm.adv_estimator`` on the placed rewards, the registered policy loss
    ``actor.policy_loss.loss_mode`` on ``advantages``."""

    needs: Needs = Needs()
    update_keys: tuple[str, ...] = ("advantages",)  # batch tensors the actor's loss reads

    def __init__(self, settings: AlgorithmSettings) -> None:
        self.settings = settings
        self.adv = settings.adv
        self.loss = settings.loss

    def prepare(self, batch: RolloutBatch, step: StepContext) -> None:
        """After scoring, before the engine sleeps (it may still generate)."""

    def advantages(self, batch: RolloutBatch, kl_coef: float) -> dict[str, float]:
        """After the logprobs and values: fill what ``update_keys`` names; return metrics
        (``_kl_for_controller``: the step's KL for the adaptive KL controller)."""
        return compute_step_advantages(batch, self.adv, kl_coef)

    def loss_settings(self, on_policy: bool) -> ActorLossSettings:
        """The actor loss of this step's update (``losses.actor_loss_fn``)."""
        return dataclasses.replace(self.loss, on_policy=on_policy)


class PPOFamily(Algorithm):
    """Any registered advantage estimator with any registered policy loss; an estimator that
    needs "baselines" (remax) gets a greedy response per prompt, scored, in ``prepare``."""

    def __init__(self, settings: AlgorithmSettings) -> None:
        super().__init__(settings)
        self.needs = Needs.of_estimator(self.adv.estimator)

    def prepare(self, batch: RolloutBatch, step: StepContext) -> None:
        if self.needs.greedy_baseline:
            batch.tensors["reward_baselines"] = greedy_baselines(batch, step)


AlgoT = TypeVar("AlgoT", bound=type[Algorithm])


ALGORITHMS: dict[str, type[Algorithm]] = {}


def register_algorithm(name: str) -> Callable[[AlgoT], AlgoT]:
    """Decorator: register an ``Algorithm`` subclass (built from `AlgorithmSettings`) under
    ``name``: it runs when the settings' ``name`` is ``name`` (``algorithm.adv_estimator``: an
    estimator or pipeline of ``megarl.algos``)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"algorithm name must be a non-empty string, got {name!r}")

    def decorator(cls: AlgoT) -> AlgoT:
        existing = ALGORITHMS.get(name)
        if existing is not None and existing is not cls:
            raise ValueError(f"algorithm {name!r} is already registered "
                             f"({existing.__module__}.{existing.__qualname__}); "
                             "pick another name")
        ALGORITHMS[name] = cls
        return cls

    return decorator


def build_algorithm(settings: AlgorithmSettings) -> Algorithm:
    """The algorithm ``settings`` select (module doc); imports ``settings.custom_path`` first.
    UserInputError naming the key when the name has no algorithm."""
    try:
        import_custom_algorithms(settings.custom_path)
    except ValueError as err:
        raise UserInputError(f"{PATH_KEY}: {err}") from err
    entry = ALGORITHMS.get(settings.name)
    if entry is not None:
        return entry(settings)
    if settings.name not in algos.ADVANTAGE_ESTIMATORS:
        raise UserInputError(
            f"algorithm.adv_estimator: {settings.name!r} has no algorithm that computes it; "
            "register an advantage estimator (megarl.algos.register_advantage_estimator), or an "
            f"algorithm of that name (megarl.trainer.algorithm.register_algorithm) in {PATH_KEY}")
    return PPOFamily(settings)


# ---------------------------------------------------------------------------------- PURE


def pure_mode(s: AdvantageSettings) -> str:
    """PURE's reward mode: "prm_vr" (PRM and a verifiable reward), "prm" (reward manager
    blank) or "vr" (no PRM)."""
    if s.prm_enabled and s.vr_enabled:
        return "prm_vr"
    return "prm" if s.prm_enabled else "vr"


def pure_advantages(batch: RolloutBatch, s: AdvantageSettings, pure: PureSettings,
                    kl_coef: float) -> dict[str, float]:
    """PURE: the rewards placed as for every algorithm (metrics, KL), then advantages and
    returns [B, L] by ``algos.pure_rloo_advantages`` from the PRM step scores (zeros and the
    last-token mask without a PRM), the raw verifiable rewards and the KL of the reward."""
    metrics, kl = place_rewards(batch, s, kl_coef)
    t = batch.tensors
    mask = batch.response_mask
    step_rewards = t.get("step_rewards", torch.zeros_like(mask))
    step_mask = t.get("step_mask", last_token_mask(mask))
    adv, ret = algos.pure_rloo_advantages(
        step_rewards=step_rewards, step_mask=step_mask, response_mask=mask,
        verifiable_rewards=t["verifiable"].to(torch.float32), group_index=batch.group_index,
        mode=pure_mode(s), credit_assignment=s.credit_assignment,
        vr_coef=s.verifiable_reward_coef, kl=kl, kl_coef=kl_coef if kl is not None else 0.0,
        mask_separator=pure.mask_separator, normalize=pure.normalize)
    t["advantages"] = adv
    t["returns"] = ret
    return metrics


@register_algorithm("pure_rloo")
class PureRloo(PPOFamily):
    """PURE (Cheng et al.): its RLOO pipeline over PRM step scores and verifiable rewards,
    then the PPO family's policy loss."""

    def __init__(self, settings: AlgorithmSettings) -> None:
        super().__init__(settings)
        self.pure = settings.pure

    def advantages(self, batch: RolloutBatch, kl_coef: float) -> dict[str, float]:
        return pure_advantages(batch, self.adv, self.pure, kl_coef)


# ----------------------------------------------------------------- Optimal Token Baseline


def otb_advantages(batch: RolloutBatch, s: AdvantageSettings, kl_coef: float) -> dict[str, float]:
    """verl's Optimal Token Baseline: the rewards placed as for every algorithm, then
    ``algos.optimal_token_baseline`` of the placed rewards with the trainer's recomputed policy
    (``prox_logprob`` where asynchronous rollout moved it there, else ``old_logprob``), the
    same pass's ``sum_pi_squared`` and, when present, ``rollout_is_weights``."""
    metrics, _ = place_rewards(batch, s, kl_coef)
    t = batch.tensors
    if "sum_pi_squared" not in t:
        raise RuntimeError("optimal_token_baseline needs sum_pi_squared from the actor's "
                           "old-logprob pass (advantage.old_logprob_pass with "
                           "sum_pi_squared=True)")
    policy = t["prox_logprob"] if "prox_logprob" in t else t["old_logprob"]
    adv, ret = algos.optimal_token_baseline(
        t["token_level_rewards"], batch.response_mask, batch.group_index, policy,
        t["sum_pi_squared"], rollout_is_weights=t.get("rollout_is_weights"))
    t["advantages"] = adv
    t["returns"] = ret
    return metrics


@register_algorithm("optimal_token_baseline")
class OptimalTokenBaseline(PPOFamily):
    """``algorithm.adv_estimator=optimal_token_baseline``: a baseline per group and position
    weighted by the policy's path variance (`otb_advantages`); the PPO family's loss."""

    def __init__(self, settings: AlgorithmSettings) -> None:
        super().__init__(settings)
        self.needs = dataclasses.replace(self.needs, sum_pi_squared=True)

    def advantages(self, batch: RolloutBatch, kl_coef: float) -> dict[str, float]:
        return otb_advantages(batch, self.adv, kl_coef)


# ---------------------------------------------------------------------------------- PACS


def pacs_advantages(batch: RolloutBatch, s: AdvantageSettings, kl_coef: float) -> dict[str, float]:
    """PACS's advantage stage: the rewards placed (their metrics, the KL controller's input) and
    ``scores`` [B] float32 = the verifiable reward, the labels of its loss; no advantages."""
    metrics, _ = place_rewards(batch, s, kl_coef)
    batch.tensors["scores"] = batch.tensors["verifiable"].to(torch.float32)
    return metrics


@register_algorithm("pacs")
class Pacs(Algorithm):
    """PACS (Li et al.): the actor trained as a classifier of its responses' correctness; the
    advantage is computed inside the loss from the policy itself, so the advantage stage only
    places the rewards (their metrics and KL) and hands the verifiable reward over as
    ``scores``."""

    needs = Needs(groups=True, whole_groups=True)
    update_keys = ("scores",)

    def __init__(self, settings: AlgorithmSettings) -> None:
        super().__init__(settings)
        self.loss = dataclasses.replace(self.loss, policy=settings.pacs)

    def advantages(self, batch: RolloutBatch, kl_coef: float) -> dict[str, float]:
        return pacs_advantages(batch, self.adv, kl_coef)


__all__ = ["ALGORITHMS", "Algorithm", "AlgorithmSettings", "Needs", "PacsLoss", "PureSettings", "OptimalTokenBaseline", "PPOFamily", "StepContext",
           "build_algorithm", "register_algorithm"]
