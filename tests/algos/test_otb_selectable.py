"""``algorithm.adv_estimator=optimal_token_baseline`` end to end below the trainer: the config
accepts it (a registered pipeline needing groups), `build_algorithm` picks
the OptimalTokenBaseline entry whose needs ask the old-logprob pass for ``sum_pi_squared``, and
its advantage hook equals a float64 loop over python floats written from verl's
``compute_optimal_token_baseline_advantage`` (``brute_otb`` of test_algos_verl_round2.py) on the
placed rewards (the outcome at the last token), with the recomputed policy and, when present,
the rollout importance weights.

Planted: the hook reading ``rollout_logprob`` (the engine's) instead of ``old_logprob`` (fails
the loop), ``prox_logprob`` ignored under asynchronous rollout (fails the prox case),
``rollout_is_weights`` not passed (fails the IS case), the entry's needs without
``sum_pi_squared`` (the needs assertion)."""

from __future__ import annotations

import pytest
import torch
from test_algos_verl_round2 import brute_otb

from megarl import algos
from megarl.config import load_config
from megarl.trainer import algorithm as A
from megarl.trainer.batch import RolloutBatch
from megarl.trainer.settings import algorithm_settings

D = torch.float64


def _batch(seed: int = 0) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    groups = torch.tensor([4, 2, 4, 2, 4, 8])  # 8: a singleton
    B, L = len(groups), 5
    lengths = [5, 2, 3, 4, 1, 3]
    mask = torch.tensor([[1.0] * n + [0.0] * (L - n) for n in lengths])
    batch = RolloutBatch(
        prompt_ids=torch.ones(B, 2, dtype=torch.long), prompt_mask=torch.ones(B, 2, dtype=torch.long),
        response_ids=torch.ones(B, L, dtype=torch.long), response_mask=mask,
        group_index=groups, data_sources=["s"] * B, ground_truths=["g"] * B,
        extra_infos=[{}] * B, finish_reasons=["stop"] * B)
    t = batch.tensors
    t["verifiable"] = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.5])
    t["old_logprob"] = -torch.rand(B, L, generator=g) * 2
    t["rollout_logprob"] = -torch.rand(B, L, generator=g) * 2
    t["sum_pi_squared"] = torch.rand(B, L, generator=g) * 0.9 + 0.05
    return batch


def _loop(batch: RolloutBatch, policy: torch.Tensor, w_is=None):
    mask = batch.response_mask
    rewards = batch.tensors["token_level_rewards"].double()
    L = lambda x: x.double().tolist()  # noqa: E731
    adv, ret = brute_otb(L(rewards), L(mask), batch.group_index.tolist(), L(policy),
                         L(batch.tensors["sum_pi_squared"]),
                         None if w_is is None else L(w_is))
    return torch.tensor(adv, dtype=D), torch.tensor(ret, dtype=D)


def test_config_accepts_it_and_the_entry_asks_for_sum_pi_squared():
    assert "optimal_token_baseline" in algos.estimator_names()
    assert algos.estimator_needs("optimal_token_baseline") == {"groups"}
    cfg = load_config("grpo", ["algorithm.adv_estimator=optimal_token_baseline"])
    algo = A.build_algorithm(algorithm_settings(cfg))
    assert isinstance(algo, A.OptimalTokenBaseline)
    assert algo.needs.sum_pi_squared and algo.needs.groups and not algo.needs.critic
    assert not A.build_algorithm(algorithm_settings(load_config("grpo", []))).needs.sum_pi_squared


@pytest.mark.parametrize("case", ["plain", "is_weights", "prox", "kl"])
def test_hook_equals_the_float64_loop(case):
    kl = ["algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=kl"] if case == "kl" else []
    cfg = load_config("grpo", ["algorithm.adv_estimator=optimal_token_baseline", *kl])
    algo = A.build_algorithm(algorithm_settings(cfg))
    batch = _batch()
    t = batch.tensors
    w_is = None
    policy = t["old_logprob"]
    if case == "is_weights":
        w_is = torch.rand(t["old_logprob"].shape, generator=torch.Generator().manual_seed(3)) * 2
        t["rollout_is_weights"] = w_is
    if case == "prox":  # asynchronous rollout: old_logprob is the engine's, prox the trainer's
        t["prox_logprob"] = t["old_logprob"]
        t["old_logprob"] = t["rollout_logprob"]
    coef = 0.0
    if case == "kl":  # the reward is the score at the last token minus coef x (old - ref)
        coef = 0.3
        t["ref_logprob"] = t["old_logprob"] + 0.5 * torch.rand(t["old_logprob"].shape)
    algo.advantages(batch, coef)
    mask = batch.response_mask
    last = torch.zeros_like(mask)
    last[torch.arange(mask.shape[0]), mask.sum(-1).long() - 1] = 1.0
    want_rewards = last * t["verifiable"][:, None]
    if case == "kl":
        want_rewards = want_rewards - coef * (t["old_logprob"] - t["ref_logprob"]) * mask
    torch.testing.assert_close(t["token_level_rewards"], want_rewards, rtol=1e-6, atol=1e-6)
    adv, ret = _loop(batch, policy, w_is)
    torch.testing.assert_close(t["advantages"].double(), adv, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(t["returns"].double(), ret, rtol=1e-6, atol=1e-6)
    if case != "kl":  # the outcome at each response's last token: G = score everywhere
        assert t["returns"][0].tolist() == [1.0] * 5
    assert torch.equal(t["advantages"][5], t["returns"][5])  # a singleton group: no baseline


def test_hook_without_sum_pi_squared_says_what_is_missing():
    algo = A.build_algorithm(algorithm_settings(
        load_config("grpo", ["algorithm.adv_estimator=optimal_token_baseline"])))
    batch = _batch()
    del batch.tensors["sum_pi_squared"]
    with pytest.raises(RuntimeError) as err:
        algo.advantages(batch, 0.0)
    assert str(err.value) == (
        "optimal_token_baseline needs sum_pi_squared from the actor's old-logprob pass "
        "(advantage.old_logprob_pass with sum_pi_squared=True)")
