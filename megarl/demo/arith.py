"""The embedded demo task: multi-step arithmetic with "\\n\\n"-separated steps and \\boxed{}.

    prompt:   "Compute: 38+61+45-74"
    solution: "38+61=99\\n\\n99+45=144\\n\\n144-74=70\\n\\n\\boxed{70}"

Operands have two digits (10..99), so every prompt with the same number of operations has
the same token length. Intermediate results stay non-negative: a "-" whose operand exceeds the
running value becomes "+". Everything is a pure function of a numpy Generator, so the datasets
are fixed by their seeds.

Step labels (for the PRM): step k of a response is correct (1) when every earlier step is
correct and its text equals the k-th step of the reference solution; otherwise 0 (so every
step after the first error is 0). The last step is the ``\\boxed{}`` answer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DATA_SOURCE = "arith"
SEP = "\n\n"
PROMPT_PREFIX = "Compute: "


@dataclass(frozen=True)
class Problem:
    """``operands[0] op[0] operands[1] op[1] ...``; len(operands) = len(ops) + 1."""

    operands: tuple[int, ...]
    ops: tuple[str, ...]

    @property
    def text(self) -> str:
        out = str(self.operands[0])
        for op, x in zip(self.ops, self.operands[1:]):
            out += f"{op}{x}"
        return out

    @property
    def prompt(self) -> str:
        return PROMPT_PREFIX + self.text

    def running_values(self) -> list[int]:
        """The value after each operation (len = number of ops)."""
        values, v = [], self.operands[0]
        for op, x in zip(self.ops, self.operands[1:]):
            v = v + x if op == "+" else v - x
            values.append(v)
        return values

    @property
    def answer(self) -> int:
        return self.running_values()[-1]

    def steps(self) -> list[str]:
        """Reference steps: one per operation, then ``\\boxed{answer}``."""
        out, v = [], self.operands[0]
        for op, x, r in zip(self.ops, self.operands[1:], self.running_values()):
            out.append(f"{v}{op}{x}={r}")
            v = r
        return out + [boxed(v)]

    @property
    def solution(self) -> str:
        return SEP.join(self.steps())


def boxed(value: int | str) -> str:
    return "\\boxed{" + str(value) + "}"


def sample_problem(rng: np.random.Generator, num_ops: int) -> Problem:
    """Two-digit operands, "+"/"-" with equal odds, "-" flipped to "+" if it would go below 0."""
    if num_ops < 1:
        raise ValueError(f"num_ops must be >= 1, got {num_ops}")
    operands = [int(x) for x in rng.integers(10, 100, size=num_ops + 1)]
    minus = rng.random(num_ops) < 0.5
    ops, v = [], operands[0]
    for k in range(num_ops):
        x = operands[k + 1]
        op = "-" if minus[k] and x <= v else "+"
        v = v + x if op == "+" else v - x
        ops.append(op)
    return Problem(tuple(operands), tuple(ops))


def sample_problems(
    seed: int, count: int, num_ops: int | tuple[int, ...], exclude: set[str] = frozenset(),
    unique: bool = True,
) -> list[Problem]:
    """``count`` problems (op counts drawn uniformly from ``num_ops``), none whose text is in
    ``exclude``; unique texts when ``unique``."""
    rng = np.random.Generator(np.random.PCG64(seed))
    choices = (num_ops,) if isinstance(num_ops, int) else tuple(num_ops)
    seen, out = set(exclude), []
    while len(out) < count:
        p = sample_problem(rng, int(choices[int(rng.integers(len(choices)))]))
        if p.text in seen:
            continue
        if unique:
            seen.add(p.text)
        out.append(p)
    return out


def parse_problem(text: str) -> Problem:
    """Inverse of ``Problem.text`` / ``Problem.prompt`` (accepts the "Compute: " prefix)."""
    body = text.removeprefix(PROMPT_PREFIX).strip()
    operands, ops, num = [], [], ""
    for ch in body:
        if ch.isdigit():
            num += ch
        elif ch in "+-" and num:
            operands.append(int(num))
            ops.append(ch)
            num = ""
        else:
            raise ValueError(f"not an arith problem: {text!r}")
    if not num:
        raise ValueError(f"not an arith problem: {text!r}")
    operands.append(int(num))
    return Problem(tuple(operands), tuple(ops))


def label_steps(problem: Problem, steps: list[str]) -> list[int]:
    """1 for each step that matches the reference while all earlier ones do; else 0."""
    ref, labels, ok = problem.steps(), [], True
    for k, s in enumerate(steps):
        ok = ok and k < len(ref) and s == ref[k]
        labels.append(int(ok))
    return labels


def to_row(problem: Problem, split: str, index: int, with_response: bool = False) -> dict:
    """verl row format; ``response`` (the full solution) is added for SFT rows."""
    row = {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": problem.prompt}],
        "ability": "arith",
        "reward_model": {"style": "rule", "ground_truth": str(problem.answer)},
        "extra_info": {"split": split, "index": index, "num_ops": len(problem.ops),
                       "solution": problem.solution},
    }
    if with_response:
        row["response"] = problem.solution
    return row


# ---------------------------------------------------------------- corrupted solutions (PRM)

CORRUPTIONS = ("clean", "arith", "arith_no_propagate", "copy", "boxed", "early_box")
CORRUPTION_WEIGHTS = (0.35, 0.35, 0.05, 0.1, 0.1, 0.05)


def _wrong_value(rng: np.random.Generator, value: int) -> int:
    """A plausible wrong result: off by 1, 2, 10 or 20, or one digit changed; never negative."""
    while True:
        kind = int(rng.integers(3))
        if kind < 2:
            delta = int(rng.choice([1, 2, 10, 20])) * (1 if rng.random() < 0.5 else -1)
            wrong = value + delta
        else:
            digits = list(str(value))
            j = int(rng.integers(len(digits)))
            digits[j] = str(int(rng.integers(10)))
            wrong = int("".join(digits))
        if wrong != value and wrong >= 0:
            return wrong


def _steps_from(problem: Problem, start: int, value: int) -> tuple[list[str], int] | None:
    """Arithmetic steps ``start..`` done correctly from a (possibly wrong) running ``value``;
    None if a value would go negative."""
    out = []
    for op, x in zip(problem.ops[start:], problem.operands[start + 1 :]):
        r = value + x if op == "+" else value - x
        if r < 0:
            return None
        out.append(f"{value}{op}{x}={r}")
        value = r
    return out, value


def corrupt_solution(problem: Problem, rng: np.random.Generator, kind: str | None = None
                     ) -> tuple[list[str], int, str]:
    """A (possibly) wrong solution for ``problem``.

    Returns ``(steps, first_error, kind)``: the step texts (last one boxed), the index of the
    first wrong step (len(steps) for a clean solution) and the corruption kind:
    clean; arith (a wrong result, later steps computed correctly from it); arith_no_propagate
    (a wrong result, later steps continue from the right value); copy (a step starts from a
    wrong number, or uses the wrong operand/operator, with correct arithmetic); boxed (a wrong
    boxed answer after correct steps); early_box (an intermediate result boxed).
    """
    if kind is None:
        kind = str(rng.choice(CORRUPTIONS, p=CORRUPTION_WEIGHTS))
    ref = problem.steps()
    n = len(problem.ops)
    values = problem.running_values()
    for _ in range(100):
        k = int(rng.integers(n))
        prev = problem.operands[0] if k == 0 else values[k - 1]
        op, x = problem.ops[k], problem.operands[k + 1]
        if kind == "clean":
            return ref, len(ref), kind
        if kind in ("arith", "arith_no_propagate"):
            wrong = _wrong_value(rng, values[k])
            head = ref[:k] + [f"{prev}{op}{x}={wrong}"]
            if kind == "arith_no_propagate":
                steps = head + ref[k + 1 :]
                return steps, k, kind
            tail = _steps_from(problem, k + 1, wrong)
            if tail is None:
                continue
            return head + tail[0] + [boxed(tail[1])], k, kind
        if kind == "copy":
            what = int(rng.integers(3))
            a, b, o = prev, x, op
            if what == 0:
                a = _wrong_value(rng, prev)
            elif what == 1:
                b = _wrong_value(rng, x)
            else:
                o = "-" if op == "+" else "+"
            r = a + b if o == "+" else a - b
            if r < 0:
                continue
            tail = _steps_from(problem, k + 1, r)
            if tail is None:
                continue
            return ref[:k] + [f"{a}{o}{b}={r}"] + tail[0] + [boxed(tail[1])], k, kind
        if kind == "boxed":
            return ref[:n] + [boxed(_wrong_value(rng, values[-1]))], n, kind
        if kind == "early_box":
            if n < 2:
                return ref[:n] + [boxed(_wrong_value(rng, values[-1]))], n, "boxed"
            j = int(rng.integers(1, n))  # box after j of n steps
            return ref[:j] + [boxed(values[j - 1])], j, kind
        raise ValueError(f"unknown corruption {kind!r}; one of {CORRUPTIONS}")
    return ref, len(ref), "clean"
