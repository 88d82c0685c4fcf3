"""Rollout rejection sampling, bypass mode and SAPO's temperatures in the trainer's wiring
(megarl.trainer.correction, settings.actor_loss_settings, losses.actor_loss_fn), in process.

Planted while writing (each made the named test fail):
- add_rollout_rejection judging old_logprob even where prox_logprob holds the recomputation:
  test_rejection_reads_the_recomputation (keep [[1, 1, 0], [0, 0, 0]] vs [[0, 1, 0], [1, 0, 0]]);
- without_rejected not carrying the padding mask: test_without_rejected_keeps_the_attention
  (the sequence batch's attention mask lost the rejected token: [0, 1, 0] vs [1, 1, 0]);
- the loss settings ignoring loss_type: test_bypass_reinforce_trains_reinforce ('vanilla');
- ppo_policy_term not passing the options: test_sapo_temperatures_reach_the_loss (loss -0.194, the
  default temperatures', vs 1.528).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from megarl import algos
from megarl.backends.protocol import SequenceBatch
from megarl.config.loader import load_config
from megarl.errors import UserInputError
from megarl.trainer.batch import RolloutBatch
from megarl.trainer.correction import (
    add_rollout_is_weights,
    add_rollout_rejection,
    bypass_logprobs,
    check_lagged_correction,
    require_rollout_logprobs,
    without_rejected,
)
from megarl.trainer.losses import ActorLossSettings, Norm, actor_loss_fn
from megarl.trainer.settings import actor_loss_settings

MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
RS = SimpleNamespace(rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0")


def _batch(**tensors) -> RolloutBatch:
    return RolloutBatch(
        prompt_ids=torch.ones(2, 2, dtype=torch.long), prompt_mask=torch.ones(2, 2, dtype=torch.long),
        response_ids=torch.ones(2, 3, dtype=torch.long), response_mask=MASK.clone(),
        group_index=torch.tensor([0, 0]), data_sources=["a", "a"], ground_truths=[None, None],
        extra_infos=[{}, {}], finish_reasons=["stop", "stop"], tensors=dict(tensors))


def test_bypass_logprobs_pairs_the_ratio_with_the_engine():
    rollout, old = torch.full((2, 3), -1.0), torch.full((2, 3), -2.0)
    b = _batch(rollout_logprob=rollout, old_logprob=old)
    bypass_logprobs(b)
    assert b.tensors["old_logprob"] is rollout and b.tensors["prox_logprob"] is old
    b = _batch(rollout_logprob=rollout)  # no recomputation ran
    bypass_logprobs(b)
    assert b.tensors["old_logprob"] is rollout and "prox_logprob" not in b.tensors
    with pytest.raises(UserInputError, match="bypass_mode=false"):
        bypass_logprobs(_batch(old_logprob=old))


def test_rejection_reads_the_recomputation():
    """With bypass (old = engine's), the statistic is prox vs rollout, as the IS weights."""
    rollout = torch.tensor([[-1.0, -1.0, 0.0], [-1.0, 0.0, 0.0]])
    prox = torch.tensor([[-2.0, -1.1, 0.0], [-1.2, 0.0, 0.0]])  # ratio e^-1 out of [0.5, 2]
    b = _batch(rollout_logprob=rollout, old_logprob=rollout, prox_logprob=prox)
    metrics = add_rollout_rejection(b, RS)
    assert b.tensors["rollout_rs_keep"].tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(1 / 3)
    assert metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(1 / 2)
    b = _batch(rollout_logprob=rollout, old_logprob=prox)  # decoupled: old is the recomputation
    add_rollout_rejection(b, RS)
    assert b.tensors["rollout_rs_keep"].tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]


def test_without_rejected_keeps_the_attention():
    b = _batch(rollout_logprob=torch.zeros(2, 3), old_logprob=torch.zeros(2, 3))
    assert without_rejected(b) is b
    b.tensors["rollout_rs_keep"] = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    t = without_rejected(b)
    assert t.response_mask.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]
    assert b.response_mask.tolist() == MASK.tolist()  # the step's batch is untouched
    assert "response_padding_mask" not in b.tensors
    seq = t.sequence_batch()
    assert seq.attention_mask[:, 2:].tolist() == [[1, 1, 0], [1, 0, 0]]
    assert seq.tensors["response_mask"].tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]


def test_bypass_reinforce_trains_reinforce():
    rc = "algorithm.rollout_correction"
    cfg = load_config("grpo", [f"{rc}.bypass_mode=true", f"{rc}.loss_type=reinforce"])
    assert actor_loss_settings(cfg).loss_mode == "reinforce"
    cfg = load_config("grpo", [f"{rc}.loss_type=reinforce"])  # inert without bypass_mode
    assert actor_loss_settings(cfg).loss_mode == "vanilla"
    cfg = load_config("grpo", ["actor_rollout_ref.actor.tau_pos=3",
                               "actor_rollout_ref.actor.tau_neg=0.5"])
    s = actor_loss_settings(cfg)
    assert (s.tau_pos, s.tau_neg) == (3.0, 0.5)


def test_sapo_temperatures_reach_the_loss():
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    old = -torch.rand(2, 3, generator=g) * mask
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]])
    mb = SequenceBatch(input_ids=torch.zeros(2, 5, dtype=torch.long),
                       attention_mask=torch.ones(2, 5, dtype=torch.long), response_length=3,
                       tensors={"response_mask": mask, "old_logprob": old, "advantages": adv})
    lp = (old + 0.3 * torch.randn(2, 3, generator=g)) * mask
    out = SimpleNamespace(logprob=lp.clone().requires_grad_(), entropy=None, hidden=None)
    norm = Norm(dp_size=1, batch_num_tokens=5, global_batch_size=2, loss_scale_factor=3.0)
    loss, _ = actor_loss_fn(ActorLossSettings(loss_mode="sapo", tau_pos=3.0, tau_neg=0.5),
                            norm)(out, mb)
    want, _ = algos.policy_loss("sapo", logprob=lp, old_logprob=old, advantages=adv,
                                response_mask=mask, options={"tau_pos": 3.0, "tau_neg": 0.5},
                                **norm.kwargs())
    default, _ = algos.policy_loss("sapo", logprob=lp, old_logprob=old, advantages=adv,
                                   response_mask=mask, **norm.kwargs())
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)
    assert abs(want.item() - default.item()) > 1e-3


IS = SimpleNamespace(rollout_is="token", rollout_is_threshold=1.5, rollout_is_batch_normalize=False)


def _truncated(proximal: torch.Tensor, rollout: torch.Tensor) -> torch.Tensor:
    """min(pi/mu, 1.5) on the response tokens, 0 on padding: a float64 loop."""
    return torch.tensor([[min(math.exp(p - r), 1.5) if m else 0.0
                          for p, r, m in zip(pr, rr, mr)]
                         for pr, rr, mr in zip(proximal.double().tolist(),
                                               rollout.double().tolist(), MASK.tolist())])


def test_missing_engine_logprobs_name_the_setting_and_the_fix():
    with pytest.raises(UserInputError) as e:
        require_rollout_logprobs(_batch(old_logprob=torch.zeros(2, 3)), "token")
    assert str(e.value) == (
        "algorithm.rollout_correction.rollout_is='token' needs the rollout engine's logprobs of "
        "the sampled tokens, and this engine returned none for some responses; use an engine "
        "that returns them (actor_rollout_ref.rollout.name=torch, vllm or sglang) or set "
        "algorithm.rollout_correction.rollout_is=null")
    with pytest.raises(UserInputError, match=r"^algorithm\.rollout_correction\.rollout_is='token' "
                                             r"needs .* set algorithm\.rollout_correction\."
                                             r"rollout_is=null$"):
        add_rollout_is_weights(_batch(old_logprob=torch.zeros(2, 3)), IS)
    with pytest.raises(UserInputError, match=r"rollout_rs='token_k1' needs .* set "
                                             r"algorithm\.rollout_correction\.rollout_rs=null$"):
        add_rollout_rejection(_batch(old_logprob=torch.zeros(2, 3)), RS)


def test_truncated_weights_pair_the_recomputation_with_the_engine():
    rollout = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    old = torch.tensor([[-0.2, -2.5, 9.0], [-1.5, 9.0, 9.0]])
    b = _batch(rollout_logprob=rollout, old_logprob=old)  # decoupled: weights applied
    metrics = add_rollout_is_weights(b, IS)
    want = _truncated(old, rollout)
    torch.testing.assert_close(b.tensors["rollout_is_weights"], want, rtol=0, atol=1e-6)
    assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx(  # before truncation
        (math.exp(0.8) + math.exp(-0.5) + math.exp(-1.0)) / 3, abs=1e-6)
    # bypass (the ratio is against the engine's logprobs): measured from prox, not applied
    b = _batch(rollout_logprob=rollout, old_logprob=rollout, prox_logprob=old)
    assert add_rollout_is_weights(b, IS) == metrics
    assert "rollout_is_weights" not in b.tensors
    # ... unless the loss takes no ratio: then the same weights are applied
    b = _batch(rollout_logprob=rollout, old_logprob=rollout, prox_logprob=old)
    add_rollout_is_weights(b, IS, loss_has_ratio=False)
    torch.testing.assert_close(b.tensors["rollout_is_weights"], want, rtol=0, atol=1e-6)
    # the level and the batch normalisation reach the weights
    seq = SimpleNamespace(rollout_is="sequence", rollout_is_threshold=1.5,
                          rollout_is_batch_normalize=True)
    b = _batch(rollout_logprob=rollout, old_logprob=old)
    add_rollout_is_weights(b, seq)
    want, _ = algos.compute_rollout_is_weights(old, rollout, MASK, level="sequence",
                                               threshold=1.5, batch_normalize=True)
    assert torch.equal(b.tensors["rollout_is_weights"], want)
    assert not torch.allclose(want, _truncated(old, rollout).float())


@pytest.mark.parametrize("staleness,has_ratio,rollout_is,refused", [
    (1, False, None, True), (0, False, None, False), (1, True, None, False),
    (2, False, "token", False)])
def test_lagged_samples_without_a_ratio_need_weights(staleness, has_ratio, rollout_is, refused):
    if not refused:
        check_lagged_correction(staleness, "reinforce", has_ratio, rollout_is)
        return
    with pytest.raises(UserInputError) as e:
        check_lagged_correction(staleness, "reinforce", has_ratio, rollout_is)
    assert str(e.value) == (
        "actor_rollout_ref.actor.policy_loss.loss_mode='reinforce' takes no importance ratio, "
        f"so with async_training.staleness_threshold={staleness} and "
        "algorithm.rollout_correction.rollout_is=null the samples of older policy versions "
        "would train uncorrected; set algorithm.rollout_correction.rollout_is=token (truncated "
        "weights pi/mu on each token), or a loss with a ratio "
        "(actor_rollout_ref.actor.policy_loss.loss_mode=vanilla), or "
        "async_training.staleness_threshold=0")


def test_without_rejected_keeps_the_mask_dtype():
    b = _batch()
    b.tensors["rollout_rs_keep"] = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]],
                                                dtype=torch.float64)
    assert without_rejected(b).response_mask.dtype == MASK.dtype
