"""Reward managers, custom function loading and the overlong penalty."""

import pytest
import torch

from megarl.rewards import (
    BlankRewardManager,
    PrimeRewardManager,
    RewardFnSpec,
    load_custom_reward_fn,
    make_reward_manager,
    overlong_penalty,
)


class _NoPool:
    def score(self, requests):
        raise AssertionError("blank must not score")


def test_naive_scores_by_data_source(pool2):
    mgr = make_reward_manager("naive", pool2)
    responses = ["#### 72", "\\boxed{\\frac{1}{2}}", "<answer>(1+2)*8</answer>", "<answer>8*2+1</answer>", "\\boxed{4}"]
    sources = ["openai/gsm8k", "math500", "countdown", "countdown", "arith"]
    gts = ["72", "0.5", {"target": 24, "numbers": [1, 2, 8]}, {"target": 24, "numbers": [1, 2, 8]}, "5"]
    scores, m = mgr(responses, sources, gts, [None] * 5)
    assert scores.dtype == torch.float32 and scores.shape == (5,)
    assert scores.tolist() == pytest.approx([1.0, 1.0, 1.0, 0.1, 0.0])
    assert m["reward/score/countdown"] == pytest.approx(0.55)
    assert m["reward/score/arith"] == 0.0
    assert m["reward/score/mean"] == pytest.approx(3.1 / 5)
    assert m["reward/timeouts"] == m["reward/errors"] == m["reward/missing_ground_truth"] == 0
    assert [r.status for r in mgr.last_results] == ["ok"] * 5


def test_prime_is_binary_and_covers_any_source(pool2):
    mgr = make_reward_manager("prime", pool2)
    assert isinstance(mgr, PrimeRewardManager)
    responses = ["<answer>8*2+1</answer>", "<answer>(1+2)*8</answer>", "\\boxed{x+1}", "\\boxed{2}", "#### 3"]
    sources = ["countdown", "countdown", "my_private_math", "olympiad", "gsm8k"]
    gts = [{"target": 24, "numbers": [1, 2, 8]}, {"target": 24, "numbers": [1, 2, 8]}, "1+x", "3", "3"]
    scores, _ = mgr(responses, sources, gts)
    assert scores.tolist() == [0.0, 1.0, 1.0, 0.0, 1.0]  # countdown's 0.1 format score becomes 0


def test_naive_unknown_source_fails_before_scoring(pool2):
    mgr = make_reward_manager("naive", pool2)
    with pytest.raises(ValueError, match="'my_private_set'.*custom_reward_function"):
        mgr(["\\boxed{1}"], ["my_private_set"], ["1"])


def test_missing_ground_truth_counted_or_strict(pool2):
    mgr = make_reward_manager("naive", pool2)
    scores, m = mgr(["\\boxed{1}", "\\boxed{1}", "\\boxed{2}"], ["math"] * 3, ["1", None, ""])
    assert scores.tolist() == [1.0, 0.0, 0.0]
    assert m["reward/missing_ground_truth"] == 2 and m["reward/errors"] == 0
    strict = make_reward_manager("naive", pool2, strict_ground_truth=True)
    with pytest.raises(ValueError, match="response 1.*no ground truth"):
        strict(["\\boxed{1}", "\\boxed{1}"], ["math"] * 2, ["1", None])


def test_blank_never_calls_the_pool():
    mgr = make_reward_manager("blank", _NoPool())
    assert isinstance(mgr, BlankRewardManager)
    scores, m = mgr(["a", "b"], ["math", "x"], [None, None])
    assert scores.tolist() == [0.0, 0.0] and scores.dtype == torch.float32
    assert m["reward/timeouts"] == 0


def test_length_mismatch_and_bad_names(pool2):
    with pytest.raises(ValueError, match="len\\(ground_truths\\)=1"):
        make_reward_manager("naive", pool2)(["a", "b"], ["math", "math"], ["1"])
    with pytest.raises(ValueError, match="reward_manager='batch'"):
        make_reward_manager("batch", pool2)
    with pytest.raises(ValueError, match="needs a RewardPool"):
        make_reward_manager("naive", None)


def test_custom_function_loading(tmp_path, hostile_path, pool2):
    fn = load_custom_reward_fn(hostile_path, "compute", {"bonus": 0.5})
    assert fn(data_source="math", solution_str="\\boxed{2}", ground_truth="2") == 1.5
    with pytest.raises(FileNotFoundError, match="custom_reward_function.path.*nope.py"):
        load_custom_reward_fn(tmp_path / "nope.py")
    with pytest.raises(AttributeError, match="name='score_it'.*\\['compute', 'helper_not_the_scorer'\\]"):
        load_custom_reward_fn(hostile_path, "score_it")
    with pytest.raises(AttributeError):  # the manager loads it once at build time
        make_reward_manager("naive", pool2, {"path": hostile_path, "name": "score_it"})
    # path null in the config means "no custom function"
    assert make_reward_manager("naive", pool2, {"path": None, "name": "compute_score"}).fn.kind == "default"
    spec = RewardFnSpec(kind="custom", path=hostile_path, name="compute", kwargs={"bonus": 1.0})
    mgr = make_reward_manager("naive", pool2, spec)
    scores, m = mgr(["\\boxed{2}"], ["anything"], [None], [{"mode": "dict"}])
    # custom: unknown sources and a missing ground truth go to the function as they are
    assert scores.tolist() == [1.5] and m["reward/missing_ground_truth"] == 0
    assert mgr.last_results[0].extra == {"acc": 1, "note": "hi"}


def _dapo_reference(length: int, max_len: int, buf: int, factor: float) -> float:
    # DAPO paper, eq. (13), times the penalty factor.
    if length <= max_len - buf:
        return 0.0
    if length <= max_len:
        return ((max_len - buf) - length) / buf * factor
    return -factor


def test_overlong_penalty_matches_piecewise_definition():
    max_len, buf, factor = 100, 20, 0.5
    lengths = list(range(0, 121))
    got = overlong_penalty(torch.tensor(lengths), max_len, buf, factor)
    want = torch.tensor([_dapo_reference(n, max_len, buf, factor) for n in lengths])
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want)
    assert got[80] == 0 and got[90] == pytest.approx(-0.25) and got[100] == pytest.approx(-0.5)
    with pytest.raises(ValueError, match="buffer_length"):
        overlong_penalty([1], 10, 0)


def test_dapo_scores_as_naive_and_averages_the_extra_numbers(hostile_path, pool2):
    """verl's `dapo` manager: the same scores as `naive`, plus reward/{key}/mean of each number
    the score function returns beside "score" ("acc" here; "note" is text and is not averaged).
    Planted: averaging over the batch including responses without the key gives 0.5, not 1."""
    spec = RewardFnSpec(kind="custom", path=hostile_path, name="compute", kwargs={"bonus": 1.0})
    responses, sources = ["\\boxed{2}", "\\boxed{3}"], ["anything", "anything"]
    infos = [{"mode": "dict"}, None]
    naive_scores, _ = make_reward_manager("naive", pool2, spec)(responses, sources, [None] * 2, infos)
    dapo = make_reward_manager("dapo", pool2, spec)
    scores, m = dapo(responses, sources, [None] * 2, infos)
    assert torch.equal(scores, naive_scores)
    with_acc = [r.extra["acc"] for r in dapo.last_results if "acc" in r.extra]
    assert m["reward/acc/mean"] == sum(with_acc) / len(with_acc) == 1.0
    assert "reward/note/mean" not in m
