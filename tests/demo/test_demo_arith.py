"""The synthetic arithmetic task, checked against a small independent evaluator."""

import ast
import re

import numpy as np
import pytest

from megarl.demo import arith

STEP = re.compile(r"^(\d+)([+-])(\d+)=(\d+)$")


def evaluate(expr: str) -> int:
    """Left-to-right +/- of integers via the Python AST (no eval)."""

    def walk(node):
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
            a, b = walk(node.left), walk(node.right)
            return a + b if isinstance(node.op, ast.Add) else a - b
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        raise ValueError(expr)

    return walk(ast.parse(expr, mode="eval").body)


@pytest.mark.parametrize("num_ops", [1, 2, 3])
def test_problems_and_solutions_are_correct(num_ops):
    for p in arith.sample_problems(7, 300, num_ops):
        assert p.prompt == "Compute: " + p.text
        assert evaluate(p.text) == p.answer
        nums = [int(x) for x in re.findall(r"\d+", p.text)]
        assert len(nums) == num_ops + 1 and all(10 <= x <= 99 for x in nums)
        steps = p.solution.split("\n\n")
        assert len(steps) == num_ops + 1
        assert steps[-1] == f"\\boxed{{{p.answer}}}"
        value = nums[0]
        for k, s in enumerate(steps[:-1]):
            a, op, b, c = STEP.match(s).groups()
            assert int(a) == value and int(b) == nums[k + 1]
            assert evaluate(f"{a}{op}{b}") == int(c) >= 0  # running value never negative
            value = int(c)
        assert value == p.answer
        assert "\n\n\n" not in p.solution


def test_minus_kept_when_possible_and_mix_of_ops():
    ops = [op for p in arith.sample_problems(1, 500, 3) for op in p.ops]
    assert 0.25 < ops.count("-") / len(ops) < 0.5  # half are drawn "-", some flipped to "+"


def test_deterministic_unique_and_disjoint():
    a = arith.sample_problems(3, 200, 3)
    assert a == arith.sample_problems(3, 200, 3)
    assert len({p.text for p in a}) == 200
    held = {p.text for p in a}
    b = arith.sample_problems(4, 2000, (1, 2, 3), exclude=held)
    assert not held & {p.text for p in b}
    assert {len(p.ops) for p in b} == {1, 2, 3}


def test_parse_and_row_format():
    p = arith.sample_problems(0, 1, 3)[0]
    assert arith.parse_problem(p.prompt) == p == arith.parse_problem(p.text)
    with pytest.raises(ValueError):
        arith.parse_problem("Compute: 1+")
    row = arith.to_row(p, "train", 5, with_response=True)
    assert row["data_source"] == "arith"
    assert row["prompt"] == [{"role": "user", "content": p.prompt}]
    assert row["reward_model"] == {"style": "rule", "ground_truth": str(evaluate(p.text))}
    assert row["response"] == p.solution and row["extra_info"]["index"] == 5


def independent_labels(p: arith.Problem, steps: list[str]) -> list[int]:
    """Step k is right if it starts from the true running value, applies the problem's k-th
    operation and computes it correctly (the boxed step: boxes the true answer); after the
    first wrong step everything is 0."""
    nums = [int(x) for x in re.findall(r"\d+", p.text)]
    ops = re.findall(r"[+-]", p.text)
    value, labels, ok = nums[0], [], True
    for k, s in enumerate(steps):
        if k < len(ops):
            m = STEP.match(s)
            good = bool(m) and int(m[1]) == value and m[2] == ops[k] and int(m[3]) == nums[k + 1]
            good = good and int(m[4]) == evaluate(f"{m[1]}{m[2]}{m[3]}")
            if good:
                value = int(m[4])
        else:
            good = k == len(ops) and s == f"\\boxed{{{evaluate(p.text)}}}"
        ok = ok and good
        labels.append(int(ok))
    return labels


@pytest.mark.parametrize("kind", arith.CORRUPTIONS)
def test_corruptions_and_step_labels(kind):
    rng = np.random.Generator(np.random.PCG64(11))
    for p in arith.sample_problems(5, 150, (2, 3)):
        steps, first_error, got_kind = arith.corrupt_solution(p, rng, kind)
        labels = arith.label_steps(p, steps)
        assert labels == independent_labels(p, steps)
        # first corrupted step and every later step are 0, earlier ones 1
        assert labels == [1] * first_error + [0] * (len(steps) - first_error)
        assert steps[-1].startswith("\\boxed{")
        if got_kind == "clean":
            assert steps == p.steps() and first_error == len(steps)
        else:
            assert first_error < len(steps)
        if got_kind == "arith":  # later steps carry the wrong value forward, arithmetic right
            for a, b in zip(steps[first_error:-2], steps[first_error + 1 : -1]):
                assert STEP.match(a)[4] == STEP.match(b)[1]
                m = STEP.match(b)
                assert evaluate(f"{m[1]}{m[2]}{m[3]}") == int(m[4])
