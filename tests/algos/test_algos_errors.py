"""Every public function of megarl.algos rejects a bad argument with an error that names it.

The contract (CONTRIBUTING: "bad input gets a clear error naming the field"): a non-tensor, an
integer tensor where floats are needed, a tensor of the wrong rank or shape, each raises before
any arithmetic, and the message names the argument (and, for a shape mismatch, the argument it is
compared with) as the caller spelled it. Without these checks a `[B, 1]` tensor broadcasts
silently against `[B, L]`.

The names are matched with word boundaries and case-sensitively, so a message naming
`XXlogprobXX`, `LOGPROB` or `None` fails. Planted: dropping `old_logprob=` from policy_loss's
shape check lets a `[B, L + 1]` old_logprob through to a torch broadcasting error that names no
argument (test fails); naming the reference `None` in `check_mask` fails every mask case.
"""

from __future__ import annotations

import re

import pytest
import torch

from megarl import algos

B, L = 4, 5


def _f(*shape):
    return torch.randn(*shape, dtype=torch.float64)


def _mask():
    m = torch.ones(B, L, dtype=torch.bool)
    m[1, 3:] = False
    return m


def _groups():
    return torch.tensor([0, 0, 1, 1])


def _call_adv(estimator):
    def run(**kw):
        return algos.compute_advantages(estimator, **kw)
    return run


def _call_policy(**kw):
    return algos.policy_loss("vanilla", **kw)


# (id, function, valid keyword arguments, the argument compared with for shapes)
CASES = [
    ("grpo", _call_adv("grpo"),
     lambda: dict(token_rewards=_f(B, L), response_mask=_mask(), group_index=_groups()),
     "token_rewards"),
    ("gae", _call_adv("gae"),
     lambda: dict(token_rewards=_f(B, L), response_mask=_mask(), values=_f(B, L)),
     "token_rewards"),
    ("remax", _call_adv("remax"),
     lambda: dict(token_rewards=_f(B, L), response_mask=_mask(), baselines=_f(B)),
     "token_rewards"),
    ("policy_loss", _call_policy,
     lambda: dict(logprob=_f(B, L), old_logprob=_f(B, L), advantages=_f(B, L),
                  response_mask=_mask(), rollout_is_weights=_f(B, L).abs()),
     "logprob"),
    ("value_loss", algos.value_loss,
     lambda: dict(vpreds=_f(B, L), returns=_f(B, L), values=_f(B, L), response_mask=_mask()),
     "vpreds"),
    ("agg_loss", algos.agg_loss,
     lambda: dict(loss_mat=_f(B, L), response_mask=_mask()),
     "loss_mat"),
    ("kl_penalty", algos.kl_penalty,
     lambda: dict(logprob=_f(B, L), ref_logprob=_f(B, L), kind="k3"),
     "logprob"),
    ("apply_kl_in_reward", algos.apply_kl_in_reward,
     lambda: dict(token_scores=_f(B, L), old_logprob=_f(B, L), ref_logprob=_f(B, L),
                  response_mask=_mask(), kl_coef=0.1),
     "token_scores"),
    ("masked_mean", algos.masked_mean,
     lambda: dict(values=_f(B, L), mask=_mask()),
     "values"),
    ("masked_sum", algos.masked_sum,
     lambda: dict(values=_f(B, L), mask=_mask()),
     "values"),
    ("pacs_loss", algos.pacs_loss,
     lambda: dict(logprob=_f(B, L), old_logprob=_f(B, L), response_mask=_mask(),
                  scores=torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64),
                  group_index=_groups()),
     "logprob"),
    ("pure_credit_assignment", algos.pure_credit_assignment,
     lambda: dict(step_rewards=_f(B, L), step_mask=_mask()),
     "step_rewards"),
    ("pure_rloo_advantages", algos.pure_rloo_advantages,
     lambda: dict(step_rewards=_f(B, L), step_mask=_mask(), response_mask=_mask(),
                  verifiable_rewards=torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64),
                  group_index=_groups(), kl=_f(B, L), kl_coef=0.1),
     "step_rewards"),
]

# which arguments are per-token floats [B, L], masks [B, L], per-row floats [B], group indices
FLOAT_2D = {"token_rewards", "values", "logprob", "old_logprob", "advantages",
            "rollout_is_weights", "vpreds", "returns", "loss_mat", "ref_logprob", "token_scores",
            "step_rewards", "kl"}
MASKS = {"response_mask", "step_mask", "mask"}
FLOAT_ROW = {"baselines", "scores", "verifiable_rewards"}
GROUPS = {"group_index"}


def _word(name: str) -> str:
    return rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])"


def _expect(fn, kw, exc, *names):
    with pytest.raises(exc) as info:
        fn(**kw)
    msg = str(info.value)
    for name in names:
        assert re.search(_word(name), msg), f"{name!r} not named in {msg!r}"
    return msg


def _bad_cases():
    for case_id, fn, make, ref in CASES:
        for arg, value in make().items():
            if not isinstance(value, torch.Tensor):
                continue
            yield pytest.param(fn, make, ref, arg, id=f"{case_id}-{arg}")


@pytest.mark.parametrize("fn,make,ref,arg", list(_bad_cases()))
def test_non_tensor_is_rejected_by_name(fn, make, ref, arg):
    """A Python list in place of a tensor: TypeError naming the argument and 'list'."""
    kw = make()
    kw[arg] = kw[arg].tolist()
    msg = _expect(fn, kw, TypeError, arg)
    assert "list" in msg


@pytest.mark.parametrize("fn,make,ref,arg", list(_bad_cases()))
def test_wrong_shape_or_dtype_is_rejected_by_name(fn, make, ref, arg):
    """Integer floats, a wrong rank and a wrong length each fail naming the argument; a shape
    mismatch also names the argument it is compared with."""
    kw = make()
    good = kw[arg]
    if (arg in FLOAT_2D or arg in FLOAT_ROW) and fn not in (algos.masked_mean, algos.masked_sum):
        kw[arg] = torch.ones_like(good, dtype=torch.int64)
        msg = _expect(fn, kw, TypeError, arg)
        assert "floating-point" in msg and "int64" in msg
    if arg in FLOAT_ROW or arg in GROUPS:
        kw = make()
        kw[arg] = good[:-1]
        msg = _expect(fn, kw, ValueError, arg)
        assert f"({B},)" in msg and f"({B - 1},)" in msg
    if arg in GROUPS:
        for dtype in (torch.float32, torch.bool):
            kw = make()
            kw[arg] = good.to(dtype)
            msg = _expect(fn, kw, TypeError, arg)
            assert str(dtype) in msg
    if arg in FLOAT_2D or arg in MASKS:
        kw = make()
        kw[arg] = torch.cat([good, good[:, :1]], dim=1)  # [B, L + 1]
        if arg == ref:
            # the reference itself: the first argument compared with it is named instead
            with pytest.raises(ValueError, match="shape mismatch"):
                fn(**kw)
        else:
            msg = _expect(fn, kw, ValueError, arg, ref)
            assert f"({B}, {L + 1})" in msg and f"({B}, {L})" in msg


# masked_* reduce tensors of any rank: no rank check to test there
RANKED = [c for c in CASES if c[3] in FLOAT_2D and not c[0].startswith("masked")]


@pytest.mark.parametrize("case_id,fn,make,ref", RANKED, ids=[c[0] for c in RANKED])
def test_reference_of_wrong_rank_is_rejected_by_name(case_id, fn, make, ref):
    """The [B, L] reference given as [B*L]: ValueError naming it and its shape (kl_penalty,
    elementwise, accepts any rank)."""
    kw = make()
    kw[ref] = kw[ref].reshape(-1)
    if case_id == "kl_penalty":
        kw["ref_logprob"] = kw["ref_logprob"].reshape(-1)
        assert fn(**kw).shape == (B * L,)
        return
    for k in list(kw):
        if k != ref and isinstance(kw[k], torch.Tensor) and kw[k].shape == (B, L):
            kw[k] = kw[k].reshape(-1)
    msg = _expect(fn, kw, ValueError, ref)
    assert f"({B * L},)" in msg and "2-D" in msg


def test_group_index_missing_says_what_it_must_be():
    with pytest.raises(ValueError, match=r"advantage estimator 'grpo' needs group_index"):
        algos.compute_advantages("grpo", token_rewards=_f(B, L), response_mask=_mask())
    pure = dict(step_rewards=_f(B, L), step_mask=_mask(), response_mask=_mask(),
                verifiable_rewards=torch.ones(B, dtype=torch.float64), group_index=None)
    for fn, kw in (
        (algos.pure_rloo_advantages, pure),
        (algos.pacs_loss, dict(logprob=_f(B, L), old_logprob=_f(B, L), response_mask=_mask(),
                               scores=torch.ones(B, dtype=torch.float64), group_index=None)),
    ):
        with pytest.raises(ValueError, match=r"^group_index is required: an int64 \[B\] tensor, "
                                             r"same value = same prompt$"):
            fn(**kw)


def test_unknown_names_list_the_valid_ones():
    """Unknown estimator / loss names (also an unhashable one) give ValueError with the kind and
    the valid names; so do unknown KL kinds, including the straight-through '+' variants."""
    kw = dict(token_rewards=_f(B, L), response_mask=_mask(), group_index=_groups())
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'nope'; valid names: .*'grpo'"):
        algos.compute_advantages("nope", **kw)
    pkw = dict(logprob=_f(B, L), old_logprob=_f(B, L), advantages=_f(B, L), response_mask=_mask())
    with pytest.raises(ValueError, match=r"unknown policy loss 'nope'; valid names: .*'vanilla'"):
        algos.policy_loss("nope", **pkw)
    with pytest.raises(ValueError, match=r"unknown policy loss \['vanilla'\]"):
        algos.policy_loss(["vanilla"], **pkw)
    with pytest.raises(ValueError, match=r"unknown kl kind 'k9'; valid: \[.*'k3', .*'k3\+'"):
        algos.kl_penalty(_f(B, L), _f(B, L), "k9")
    with pytest.raises(ValueError, match=r"kl kind must be a string, got 3"):
        algos.kl_penalty(_f(B, L), _f(B, L), 3)
    with pytest.raises(NotImplementedError, match=r"^kl kind 'full' needs the full-vocabulary"):
        algos.kl_penalty(_f(B, L), _f(B, L), "full")
    with pytest.raises(ValueError, match=r"unknown credit assignment mode 'softmin'; valid: a "
                                         r"temperature T > 0 \(float\), \['min', "):
        algos.pure_credit_assignment(_f(B, L), _mask(), "softmin")


def test_registering_a_taken_name_names_the_kind():
    @algos.register_policy_loss("vanilla_copy_for_test")
    def a(**_):
        return None

    try:
        with pytest.raises(ValueError, match=r"policy loss 'vanilla_copy_for_test' is already "
                                             r"registered \(.*\); pick another name"):
            @algos.register_policy_loss("vanilla_copy_for_test")
            def b(**_):
                return None
        with pytest.raises(ValueError, match=r"advantage estimator 'grpo' is already registered"):
            @algos.register_advantage_estimator("grpo")
            def c(**_):
                return None
        with pytest.raises(ValueError, match=r"^policy loss name must be a non-empty string"):
            algos.register_policy_loss("")
        with pytest.raises(ValueError, match=r"^advantage estimator name must be a non-empty"):
            algos.register_advantage_estimator("")
    finally:
        algos.POLICY_LOSSES.pop("vanilla_copy_for_test", None)


def test_range_errors_name_the_value():
    """Out-of-range numbers: the message names the key and the value given."""
    with pytest.raises(ValueError, match=r"^masked_var: the mask selects no element; the variance is undefined$"):
        algos.masked_var(_f(B, L), torch.zeros(B, L, dtype=torch.bool))
    one = torch.zeros(B, L, dtype=torch.bool)
    one[0, 0] = True
    with pytest.raises(ValueError, match=r"masked_var: the mask selects a single element; the "
                                         r"unbiased variance is undefined \(pass unbiased=False"):
        algos.masked_var(_f(B, L), one)
    with pytest.raises(ValueError, match=r"dp_size must be >= 1, got 0"):
        algos.agg_loss(_f(B, L), _mask(), dp_size=0)
    for key in ("batch_num_tokens", "global_batch_size", "loss_scale_factor"):
        with pytest.raises(ValueError, match=rf"^{key} must be > 0 \(a total over the mini-batch\), got 0"):
            algos.agg_loss(_f(B, L), _mask(), **{key: 0})
        with pytest.raises(ValueError, match=rf"^{key} must be > 0 .*, got -2.0"):
            algos.agg_loss(_f(B, L), _mask(), **{key: torch.tensor(-2.0)})
    pkw = dict(logprob=_f(B, L), old_logprob=_f(B, L), advantages=_f(B, L), response_mask=_mask())
    with pytest.raises(ValueError, match=r"clip ratios must be >= 0, got clip_ratio_low=-0.1, "
                                         r"clip_ratio_high=0.2"):
        algos.policy_loss("vanilla", clip_ratio_low=-0.1, **pkw)
    with pytest.raises(ValueError, match=r"clip_ratio_low=0.2, clip_ratio_high=-0.1"):
        algos.policy_loss("vanilla", clip_ratio_high=-0.1, **pkw)
    with pytest.raises(ValueError, match=r"cliprange_value must be >= 0, got -0.5"):
        algos.value_loss(_f(B, L), _f(B, L), _f(B, L), _mask(), cliprange_value=-0.5)
    with pytest.raises(ValueError, match=r"target_kl must be > 0, got 0"):
        algos.AdaptiveKLController(0.1, 0, 100)
    with pytest.raises(ValueError, match=r"horizon must be > 0, got 0"):
        algos.AdaptiveKLController(0.1, 0.1, 0)
    with pytest.raises(ValueError, match=r"unknown kl controller type 'nope'; valid: "):
        algos.build_kl_controller("nope")
    pure = dict(step_rewards=_f(B, L), step_mask=_mask(), response_mask=_mask(),
                group_index=_groups())
    bad = torch.tensor([1.0, 0.0, 1.5, 0.0], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"^verifiable_rewards must be correctness scores in "
                                         r"\[0, 1\] \(1 = correct\)"):
        algos.pure_rloo_advantages(verifiable_rewards=bad, **pure)
    pacs = dict(logprob=_f(B, L), old_logprob=_f(B, L), response_mask=_mask(),
                group_index=_groups())
    with pytest.raises(ValueError, match=r"^scores must be correctness labels in \[0, 1\] "
                                         r"\(1 = correct\)"):
        algos.pacs_loss(scores=bad, **pacs)
    with pytest.raises(ValueError, match=r"global_batch_size must be > 0, got 0"):
        algos.pacs_loss(scores=bad.clamp(0, 1), global_batch_size=0, **pacs)


def test_entropy_and_credit_mode_errors_name_what_is_wrong():
    with pytest.raises(TypeError, match=r"^logits must be a torch.Tensor, got list"):
        algos.entropy_from_logits([[0.0, 1.0]])
    with pytest.raises(TypeError, match=r"^logits must be a floating-point tensor .*int64"):
        algos.entropy_from_logits(torch.zeros(2, 3, dtype=torch.int64))
    sr, steps = _f(B, L), _mask()
    with pytest.raises(ValueError, match=r"^credit assignment mode must be a temperature or a "
                                         r"name, got True$"):
        algos.pure_credit_assignment(sr, steps, True)
    with pytest.raises(ValueError, match=r"^credit assignment temperature must be a finite float "
                                         r"> 0, got -1.0$"):
        algos.pure_credit_assignment(sr, steps, -1.0)
    with pytest.raises(ValueError, match=r"^credit assignment mode must be a float or a string, "
                                         r"got list$"):
        algos.pure_credit_assignment(sr, steps, [0.1])
    outside = _mask()
    outside[1, 4] = True  # a step end on padding
    with pytest.raises(ValueError, match=r"^step_mask marks tokens outside response_mask; step "
                                         r"ends must be response tokens$"):
        algos.pure_rloo_advantages(step_rewards=sr, step_mask=outside, response_mask=_mask(),
                                   verifiable_rewards=torch.ones(B, dtype=torch.float64),
                                   group_index=_groups())
