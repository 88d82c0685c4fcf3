"""A user's own advantage estimator and policy loss, registered in a file named by
``algorithm.custom_algorithms.path`` and chosen on the command line, train 2 steps of
launch/train.py (grpo recipe on the embedded demo).

The file records every call (inputs and results, ``torch.save``); the checks recompute them
independently in float64 loops: the estimator's advantages (3 x the RLOO advantage of the
summed token rewards, per group), the loss (-0.5 x A x logprob, token mean over the
mini-batch's tokens x dp), and that what the run logged came from them (critic/advantages/* of
the step are the recorded advantages', actor/pg_loss the recorded loss). Planted: the
policy loss called with "vanilla" instead of loss_mode: no loss call is recorded (the loss test
fails, 0 calls). Without the file both names are refused by the config check (exit 2)."""

from __future__ import annotations

import textwrap

import pytest
import torch
from trainer_helpers import train, train_rows

USER_FILE = '''
"""My algorithms."""
from pathlib import Path

import torch

from megarl import algos
from megarl.algos import register_advantage_estimator, register_policy_loss

CALLS = Path(__file__).with_name("calls")
CALLS.mkdir(exist_ok=True)


def _save(kind, **tensors):
    n = len(list(CALLS.glob(f"{kind}_*.pt")))
    torch.save({k: torch.as_tensor(v).detach().clone() for k, v in tensors.items()},
               CALLS / f"{kind}_{n}.pt")


@register_advantage_estimator("tripled_rloo", needs=("groups",))
def tripled_rloo(*, token_rewards, response_mask, group_index, **_):
    score = torch.where(response_mask, token_rewards, 0.0).sum(-1)
    same = (group_index[:, None] == group_index[None, :]).to(score.dtype)
    others = (same @ score - score) / (same.sum(-1) - 1).clamp(min=1)
    adv = torch.where(response_mask, (3.0 * (score - others))[:, None], 0.0)
    _save("adv", token_rewards=token_rewards, response_mask=response_mask,
          group_index=group_index, advantages=adv)
    return adv, adv.clone()


@register_policy_loss("halved_reinforce")
def halved_reinforce(*, logprob, advantages, response_mask, agg_mode, norm, **_):
    loss = algos.agg_loss(-0.5 * advantages * logprob, response_mask, agg_mode, **norm)
    _save("loss", logprob=logprob, advantages=advantages, response_mask=response_mask,
          loss=loss, dp_size=norm["dp_size"], batch_num_tokens=norm["batch_num_tokens"])
    return loss, {"pg_loss": float(loss), "pg_clipfrac": 0.0, "pg_clipfrac_lower": 0.0,
                  "ppo_kl": 0.0}
'''


@pytest.fixture(scope="module")
def custom_run(tmp_path_factory, demo_assets):
    d = tmp_path_factory.mktemp("custom")
    (d / "my_algos.py").write_text(textwrap.dedent(USER_FILE))
    run = d / "run"
    train(run, "grpo", f"algorithm.custom_algorithms.path={d / 'my_algos.py'}",
          "algorithm.adv_estimator=tripled_rloo",
          "actor_rollout_ref.actor.policy_loss.loss_mode=halved_reinforce",
          "trainer.total_training_steps=2")
    calls = d / "calls"
    load = lambda kind: [torch.load(calls / f"{kind}_{i}.pt", weights_only=True)  # noqa: E731
                         for i in range(len(list(calls.glob(f"{kind}_*.pt"))))]
    return train_rows(run), load("adv"), load("loss")


def test_the_user_estimator_ran_and_its_advantages_were_used(custom_run):
    """One estimator call per step; its advantages are 3 x (S_i - mean of the others' S) with
    S_i the response's summed token rewards (float64 loop), and the step's critic/advantages
    mean / max / min are theirs (tolerance: float32 rounding of a 16-response batch)."""
    rows, adv_calls, _ = custom_run
    assert [r["step"] for r in rows] == [1, 2] and len(adv_calls) == 2
    for row, call in zip(rows, adv_calls):
        mask, groups = call["response_mask"], call["group_index"].tolist()
        r = call["token_rewards"].double()
        S = [float(r[i][mask[i]].sum()) for i in range(len(groups))]
        adv = call["advantages"].double()
        for i, g in enumerate(groups):
            others = [S[j] for j, h in enumerate(groups) if h == g and j != i]
            want = 3.0 * (S[i] - sum(others) / len(others))
            assert adv[i][mask[i]].tolist() == pytest.approx([want] * int(mask[i].sum()),
                                                             abs=1e-5)
        valid = adv[mask]
        assert float(valid.abs().max()) > 0  # the demo's rewards differ within some group
        assert row["critic/advantages/mean"] == pytest.approx(float(valid.mean()), abs=1e-6)
        assert row["critic/advantages/max"] == pytest.approx(float(valid.max()), abs=1e-6)
        assert row["critic/advantages/min"] == pytest.approx(float(valid.min()), abs=1e-6)


def test_the_user_loss_ran_and_its_value_is_logged(custom_run):
    """One loss call per step (one mini-batch, one micro-batch): its value is
    sum_t -0.5 A_t logp_t / batch_num_tokens x dp (token-mean, float64 loop over the recorded
    inputs), the advantages it saw are the estimator's (same rows, any order), and the step's
    actor/pg_loss is that value."""
    rows, adv_calls, loss_calls = custom_run
    assert len(loss_calls) == 2
    for row, adv_call, call in zip(rows, adv_calls, loss_calls):
        lp, a, mask = call["logprob"].double(), call["advantages"].double(), call["response_mask"]
        want = sum(-0.5 * float(a[i, t]) * float(lp[i, t])
                   for i in range(lp.shape[0]) for t in range(lp.shape[1]) if mask[i, t])
        want = want / int(call["batch_num_tokens"]) * int(call["dp_size"])
        assert float(call["loss"]) == pytest.approx(want, rel=1e-5)
        assert row["actor/pg_loss"] == pytest.approx(float(call["loss"]), rel=1e-6)
        per_row = sorted(round(float(x[m].sum()), 4) for x, m in zip(a, mask))
        est = adv_call["advantages"].double()
        assert per_row == sorted(round(float(x[m].sum()), 4)
                                 for x, m in zip(est, adv_call["response_mask"]))


def test_an_unregistered_name_is_refused_before_the_run(tmp_path, demo_assets):
    """Without the file the names are unknown: the config check names both keys and exits 2."""
    proc = train(tmp_path / "run", "grpo", "algorithm.adv_estimator=tripled_rloo",
                 "actor_rollout_ref.actor.policy_loss.loss_mode=halved_reinforce", check=False)
    assert proc.returncode == 2
    assert "algorithm.adv_estimator: invalid choice 'tripled_rloo'" in proc.stderr
    assert "actor_rollout_ref.actor.policy_loss.loss_mode: invalid choice 'halved_reinforce'" \
        in proc.stderr
