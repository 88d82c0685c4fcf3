"""Worked examples and property tests for the verifiers (in-process, no pool)."""

import subprocess
import sys
from fractions import Fraction

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from megarl.rewards import compute_score, extract_boxed, prime_compute_score, verifier_name
from megarl.rewards.countdown import MAX_ABS, EquationError, countdown_score, evaluate_equation
from megarl.rewards.gsm8k import extract_gsm8k_answer, gsm8k_score

# -- boxed extraction ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The answer is \\boxed{42}.", "42"),
        ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\frac{\\sqrt{3}}{2}} done", "\\frac{\\sqrt{3}}{2}"),
        ("\\boxed{\\boxed{3}}", "3"),
        ("\\fbox{x^{2}+1}", "x^{2}+1"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
        ("\\boxed 7 is it", "7"),
        ("\\boxed{5", None),
        ("no box here, 5", None),
        ("\\boxed{a} and truncated \\boxed{b", None),
    ],
)
def test_extract_boxed_examples(text, expected):
    assert extract_boxed(text) == expected


def _groups(depth=0):
    leaf = st.text(alphabet="abc123+-^ ", max_size=4)
    if depth >= 3:
        return leaf
    return st.lists(st.one_of(leaf, _groups(depth + 1).map(lambda s: "{" + s + "}")), max_size=4).map("".join)


@given(content=_groups(), prefix=st.text(alphabet="xyz {}$ ", max_size=20), suffix=st.text(alphabet="xyz {}$.", max_size=20))
@settings(max_examples=200, deadline=None)
def test_extract_boxed_balanced_content(content, prefix, suffix):
    # Any balanced brace content comes back verbatim, whatever the surrounding text.
    assert extract_boxed(prefix + "\\boxed{" + content + "}" + suffix) == content


# -- math ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "response, gold, expected",
    [
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\dfrac{1}{2}}", "\\frac12", 1.0),
        ("\\boxed{50\\%}", "0.5", 1.0),
        ("\\boxed{3}", "4", 0.0),
        ("\\boxed{1,000}", "1000", 1.0),
        ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", 1.0),
        ("\\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
        ("\\boxed{x^2+2x+2}", "(x+1)^2", 0.0),
        ("\\boxed{\\{2, 1\\}}", "\\{1,2\\}", 1.0),
        ("Answer: 0.5", "0.5", 0.0),  # no box, no reward
        ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)", 1.0),
        ("final \\boxed{5}", "The answer is $\\boxed{5}$.", 1.0),  # gold solution with a box
        ("\\boxed{7}", ["6", "7"], 1.0),  # several accepted answers
    ],
)
def test_math_examples(response, gold, expected):
    assert compute_score("lighteval/MATH", response, gold) == expected


def test_dispatch_names():
    for ds in ["lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "math", "math500", "aime2024",
               "AI-MO/aime25", "amc23", "numina_math", "deepscaler", "arith"]:
        assert verifier_name(ds) == "math", ds
    assert verifier_name("openai/gsm8k") == verifier_name("gsm8k") == "gsm8k"
    assert verifier_name("countdown") == "countdown"
    assert verifier_name("my_private_set") is None
    with pytest.raises(ValueError, match="my_private_set.*custom_reward_function"):
        compute_score("my_private_set", "\\boxed{1}", "1")


def test_arith_fast_path_never_imports_math_verify():
    code = (
        "import sys\n"
        "from megarl.rewards import compute_score\n"
        "assert compute_score('arith', 'so \\\\boxed{123}', '123') == 1.0\n"
        "assert compute_score('arith', '\\\\boxed{-0042}', '-42') == 1.0\n"
        "assert compute_score('arith', '\\\\boxed{124}', '123') == 0.0\n"
        "assert compute_score('arith', '\\\\boxed{' + '9' * 100000 + '}', '9' * 100000) == 1.0\n"
        "assert compute_score('arith', '\\\\boxed{12.0}', '12') == 1.0\n"
        "assert 'math_verify' not in sys.modules\n"
        "assert compute_score('arith', '\\\\boxed{\\\\frac{24}{2}}', '12') == 1.0\n"
        "assert 'math_verify' in sys.modules\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_import_is_light():
    code = (
        "import sys, megarl.rewards\n"
        "bad = [m for m in ('ray', 'torch', 'math_verify') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_hostile_math_outputs_score_zero_in_process():
    # Cheap hostile cases (the slow ones run in the pool tests).
    assert compute_score("math", "\\boxed{__import__('os').system('echo pwned')}", "0") == 0.0
    assert compute_score("math", "\\boxed{" + "(" * 10000 + "1" + ")" * 10000 + "}", "1") == 0.0
    assert compute_score("math", "x" * 2**20 + "\\boxed{" + "1+" * 400000 + "1}", "5") == 0.0


def test_math_verify_timeout_is_reported_not_scored_as_wrong():
    # sympy evaluating 9^(9^9) outlasts math-verify's alarm; math-verify alone would return
    # False ("ok", a wrong answer) and only log a warning.
    from megarl.rewards.execute import run_request
    from megarl.rewards.math_score import (
        MATH_VERIFY_TIMEOUT_S,
        AnswerCheckTimeout,
        math_verify_equal,
    )
    from megarl.rewards.pool import RewardRequest

    with pytest.raises(AnswerCheckTimeout, match=f"over {MATH_VERIFY_TIMEOUT_S} s"):
        math_verify_equal("9^{9^{9}}", "1")
    score, extra, status = run_request(RewardRequest("math", "\\boxed{9^{9^{9}}}", "1"))
    assert (score, status) == (0.0, "timeout") and "AnswerCheckTimeout" in extra["error"]
    # an answer math-verify can decide in time is unaffected
    assert run_request(RewardRequest("math", "\\boxed{\\frac{2}{4}}", "0.5")) == (1.0, {}, "ok")


def test_math_verify_internal_error_is_an_error_not_a_wrong_answer(monkeypatch):
    """A fault inside math-verify is status "error" (counted in reward/errors), not a wrong answer
    with status "ok". Planted faults: math-verify's sympy comparison (`grader.sympy_expr_eq`)
    and its extraction (`parser.extract_target_from_pred`) raise; math-verify passes them on only
    because megarl calls it with raise_on_error=True. Planted bugs: catching the exception as
    False in math_verify_equal, or dropping raise_on_error -> (0.0, {}, "ok") for the right answer
    1/2 = 0.5 and this test fails. An unparsable answer stays a wrong answer (status "ok"), so
    reward/errors counts faults of the checker only."""
    import math_verify.grader
    import math_verify.parser

    from megarl.rewards.execute import run_request
    from megarl.rewards.math_score import AnswerCheckError, fast_equal, math_verify_equal
    from megarl.rewards.pool import RewardRequest

    req = RewardRequest("math", "\\boxed{\\frac{2}{4}}", "0.5")
    assert fast_equal("\\frac{2}{4}", "0.5") is None  # decided by math-verify
    assert run_request(req) == (1.0, {}, "ok")
    assert run_request(RewardRequest("math", "\\boxed{\\frac{}{)}", "0.5")) == (0.0, {}, "ok")

    def fault(*args, **kwargs):
        raise ZeroDivisionError("planted fault")

    for module, name in ((math_verify.grader, "sympy_expr_eq"),
                         (math_verify.parser, "extract_target_from_pred")):
        with monkeypatch.context() as m:
            m.setattr(module, name, fault)
            with pytest.raises(AnswerCheckError, match="ZeroDivisionError: planted fault"):
                math_verify_equal("\\frac{2}{4}", "0.5")
            score, extra, status = run_request(req)
            assert (score, status) == (0.0, "error"), name
            assert "AnswerCheckError" in extra["error"] and "planted fault" in extra["error"]
    assert run_request(req) == (1.0, {}, "ok")


# -- gsm8k ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "response, method, expected_answer",
    [
        ("Step 1 ... 3 + 4 = 7\n#### 72", "strict", "72"),
        ("#### 1,000", "strict", "1000"),
        ("#### $18", "strict", "18"),
        ("#### -5", "strict", "-5"),
        ("she has 3 apples, then 72.", "strict", None),
        ("she has 3 apples, then 72.", "flexible", "72"),
        ("she has 3 apples, then 72.", "strict_then_flexible", "72"),
        ("#### 5 but later 9", "strict_then_flexible", "5"),
        ("no numbers at all", "flexible", None),
    ],
)
def test_gsm8k_extraction(response, method, expected_answer):
    assert extract_gsm8k_answer(response, method) == expected_answer


def test_gsm8k_scores():
    assert compute_score("openai/gsm8k", "... #### 72", "72") == 1.0
    assert compute_score("gsm8k", "... #### 72.00", "72") == 1.0
    assert compute_score("gsm8k", "... #### 71", "72") == 0.0
    assert compute_score("gsm8k", "so the total is 72 dollars", "72") == 1.0  # flexible fallback
    assert gsm8k_score("so the total is 72 dollars", "72", method="strict") == 0.0
    assert gsm8k_score("#### 71", "72", format_score=0.1) == 0.1
    assert gsm8k_score("nothing", "72", format_score=0.1) == 0.0
    assert compute_score("gsm8k", "#### 72", "blah blah #### 72") == 1.0  # raw gsm8k answer field
    assert prime_compute_score("gsm8k", "#### 72", "72") == 1.0


# -- countdown -----------------------------------------------------------------------------

GT = {"target": 24, "numbers": [1, 2, 8]}


@pytest.mark.parametrize(
    "response, expected",
    [
        ("<think>...</think><answer>(1 + 2) * 8</answer>", 1.0),
        ("<answer>8*(2+1)</answer>", 1.0),
        ("<answer>8 * 2 + 1</answer>", 0.1),  # valid, wrong value
        ("<answer>(1 + 2) * 8 * 1</answer>", 0.1),  # reuses 1
        ("<answer>(2 + 2) * 8</answer>", 0.1),  # wrong numbers
        ("<answer>3 * 8</answer>", 0.1),  # misses a number
        ("<answer>(1 + 2) * 8 = 24</answer>", 0.0),  # '=' is not allowed
        ("<answer>8 / (2 - 2) + 1</answer>", 0.0),  # division by zero
        ("<answer>__import__('os').system('echo pwned')</answer>", 0.0),
        ("<answer>10**10**10</answer>", 0.0),
        ("<answer>9**9**9**9</answer>", 0.0),
        ("<answer>" + "(" * 10000 + "1" + ")" * 10000 + "</answer>", 0.0),
        ("<answer>" + "(" * 150 + "1+2*8-1" + ")" * 150 + "</answer>", 0.0),  # depth limit
        ("<answer>1.0 + 2 * 8</answer>", 0.0),
        ("<answer>(1+2)*8</answer> wait <answer>8+2+1</answer>", 0.1),  # last answer counts
        ("I think \\boxed{(1+2)*8}", 1.0),
        ("work...\n(1+2)*8\n", 1.0),  # last line fallback
        ("", 0.0),
        ("<answer>" + "1" * 2**20 + "</answer>", 0.0),
    ],
)
def test_countdown_examples(response, expected):
    assert compute_score("countdown", response, GT) == expected


def test_countdown_exact_rationals_and_bounds():
    gt = {"target": 24, "numbers": [8, 3, 8, 3]}
    assert countdown_score("<answer>8 / (3 - 8 / 3)</answer>", gt) == 1.0  # needs exact 1/3
    assert countdown_score("<answer>8/(3-8/3)</answer>", {"target": 24, "numbers": [3, 3, 8, 8]}) == 1.0
    big = "*".join(["10"] * 101)  # 10**101 > bound
    with pytest.raises(EquationError, match="too large"):
        evaluate_equation(big)
    assert evaluate_equation("*".join(["10"] * 100))[0] == MAX_ABS
    with pytest.raises(ValueError, match="target.*numbers"):
        countdown_score("<answer>1</answer>", {"target": 1})


def _expr_trees():
    leaf = st.integers(0, 30).map(lambda v: ("n", v))
    return st.recursive(
        leaf,
        lambda sub: st.one_of(
            st.tuples(st.sampled_from("+-*/"), sub, sub),
            sub.map(lambda t: ("neg", t)),
            sub.map(lambda t: ("par", t)),
        ),
        max_leaves=12,
    )


def _render(t) -> str:
    # Every binary node is fully parenthesised, so the tree's structure is the parse.
    if t[0] == "n":
        return str(t[1])
    if t[0] == "neg":
        return "-" + _render(t[1])
    if t[0] == "par":
        return "( " + _render(t[1]) + " )"
    return "(" + _render(t[1]) + t[0] + _render(t[2]) + ")"


def _value(t) -> Fraction:
    if t[0] == "n":
        return Fraction(t[1])
    if t[0] == "neg":
        return -_value(t[1])
    if t[0] == "par":
        return _value(t[1])
    a, b = _value(t[1]), _value(t[2])
    if t[0] == "/":
        if b == 0:
            raise ZeroDivisionError
        return a / b
    return {"+": a + b, "-": a - b, "*": a * b}[t[0]]


def _depth(t) -> int:
    return 0 if t[0] == "n" else 1 + max(_depth(c) for c in t[1:])


def _leaves(t) -> list[int]:
    if t[0] == "n":
        return [t[1]]
    return [x for c in t[1:] for x in _leaves(c)]


@given(_expr_trees())
@settings(max_examples=300, deadline=None)
def test_countdown_evaluator_matches_tree_walk(tree):
    assume(_depth(tree) < 90)  # the parser's nesting limit is 100
    text = _render(tree)
    try:
        expected = _value(tree)
    except ZeroDivisionError:
        with pytest.raises(EquationError, match="division by zero"):
            evaluate_equation(text)
        return
    value, literals = evaluate_equation(text)
    assert value == expected
    assert literals == _leaves(tree)
    gt = {"target": int(expected) if expected.denominator == 1 else 10**9, "numbers": _leaves(tree)[::-1]}
    assert countdown_score(f"<answer>{text}</answer>", gt) == (1.0 if expected.denominator == 1 else 0.1)


@given(st.lists(st.integers(1, 99), min_size=2, max_size=5), st.data())
@settings(max_examples=100, deadline=None)
def test_countdown_number_multiset(numbers, data):
    # A sum of the given numbers in any order is correct; dropping or repeating one is not.
    order = data.draw(st.permutations(numbers))
    gt = {"target": sum(numbers), "numbers": numbers}
    assert countdown_score("<answer>" + "+".join(map(str, order)) + "</answer>", gt) == 1.0
    assert countdown_score("<answer>" + "+".join(map(str, order[1:])) + "</answer>", gt) == 0.1
    assert countdown_score("<answer>" + "+".join(map(str, order + order[:1])) + "</answer>", gt) == 0.1
