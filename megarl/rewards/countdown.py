"""Countdown: build `target` from `numbers` (each used once) with + - * / and parentheses.

The equation is model output, so it is never eval'd: a tokenizer that knows only integers,
`+ - * / ( )` and whitespace, a recursive-descent parser with a nesting limit, and exact
rational arithmetic (`fractions.Fraction`) with a magnitude bound.
"""

from __future__ import annotations

from collections.abc import Mapping
from fractions import Fraction

from megarl.rewards.extract import extract_boxed, last_nonempty_line, last_tag_content

MAX_EQUATION_CHARS = 512
MAX_DEPTH = 100
MAX_ABS = 10**100  # bound on |numerator| and denominator of every literal and intermediate

_OPS = frozenset("+-*/()")
_SPACE = frozenset(" \t\r\n")


class EquationError(ValueError):
    """The equation is not a valid, bounded + - * / ( ) expression over integers."""


def tokenize(expr: str) -> list[str | int]:
    """Integers and single-character operators; anything else raises EquationError."""
    if len(expr) > MAX_EQUATION_CHARS:
        raise EquationError(f"equation longer than {MAX_EQUATION_CHARS} characters")
    tokens: list[str | int] = []
    i, n = 0, len(expr)
    while i < n:
        c = expr[i]
        if c in _SPACE:
            i += 1
        elif c in _OPS:
            tokens.append(c)
            i += 1
        elif "0" <= c <= "9":
            j = i
            while j < n and "0" <= expr[j] <= "9":
                j += 1
            if j - i > 101:
                raise EquationError("number too large")
            tokens.append(int(expr[i:j]))
            i = j
        else:
            raise EquationError(f"illegal character {c!r}")
    return tokens


def _check(x: Fraction) -> Fraction:
    if abs(x.numerator) > MAX_ABS or x.denominator > MAX_ABS:
        raise EquationError("intermediate value too large")
    return x


class _Parser:
    """expr := term (('+'|'-') term)*; term := factor (('*'|'/') factor)*;
    factor := ('+'|'-') factor | INT | '(' expr ')'."""

    def __init__(self, tokens: list[str | int]):
        self.tokens = tokens
        self.pos = 0
        self.depth = 0
        self.literals: list[int] = []

    def _peek(self):
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def _enter(self) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise EquationError(f"nesting deeper than {MAX_DEPTH}")

    def parse(self) -> Fraction:
        if not self.tokens:
            raise EquationError("empty equation")
        value = self.expr()
        if self.pos != len(self.tokens):
            raise EquationError(f"unexpected token {self.tokens[self.pos]!r}")
        return value

    def expr(self) -> Fraction:
        value = self.term()
        while self._peek() in ("+", "-"):
            op = self.tokens[self.pos]
            self.pos += 1
            rhs = self.term()
            value = _check(value + rhs if op == "+" else value - rhs)
        return value

    def term(self) -> Fraction:
        value = self.factor()
        while self._peek() in ("*", "/"):
            op = self.tokens[self.pos]
            self.pos += 1
            rhs = self.factor()
            if op == "*":
                value = _check(value * rhs)
            else:
                if rhs == 0:
                    raise EquationError("division by zero")
                value = _check(value / rhs)
        return value

    def factor(self) -> Fraction:
        tok = self._peek()
        if tok is None:
            raise EquationError("equation ends early")
        self.pos += 1
        if isinstance(tok, int):
            self.literals.append(tok)
            return _check(Fraction(tok))
        if tok in ("+", "-"):
            self._enter()
            value = self.factor()
            self.depth -= 1
            return -value if tok == "-" else value
        if tok == "(":
            self._enter()
            value = self.expr()
            if self._peek() != ")":
                raise EquationError("unbalanced parentheses")
            self.pos += 1
            self.depth -= 1
            return value
        raise EquationError(f"unexpected token {tok!r}")


def evaluate_equation(expr: str) -> tuple[Fraction, list[int]]:
    """Exact value of `expr` and the integer literals it uses (in order). Raises EquationError."""
    parser = _Parser(tokenize(expr))
    return parser.parse(), parser.literals


def extract_equation(solution_str: str) -> str | None:
    """The last `<answer>...</answer>`, else the last `\\boxed{}`, else the last non-empty line."""
    for extract in (lambda s: last_tag_content(s, "answer"), extract_boxed, last_nonempty_line):
        found = extract(solution_str)
        if found is not None and found.strip():
            return found.strip()
    return None


def _parse_ground_truth(ground_truth) -> tuple[int, list[int]]:
    if not isinstance(ground_truth, Mapping) or "target" not in ground_truth or "numbers" not in ground_truth:
        raise ValueError(
            "countdown ground_truth must be a mapping {'target': int, 'numbers': list[int]}; "
            f"got {type(ground_truth).__name__}: {str(ground_truth)[:200]!r}"
        )
    return int(ground_truth["target"]), [int(x) for x in ground_truth["numbers"]]


def countdown_score(
    solution_str: str, ground_truth, format_score: float = 0.1, score: float = 1.0
) -> float:
    """`score` if the equation uses each given number exactly once and equals the target;
    `format_score` if it is a valid equation that misses (wrong value or wrong numbers);
    0.0 if there is none or it is not a valid bounded + - * / ( ) expression (illegal
    characters, too long or deep, division by zero, values beyond 10**100)."""
    target, numbers = _parse_ground_truth(ground_truth)
    equation = extract_equation(solution_str)
    if equation is None:
        return 0.0
    try:
        value, used = evaluate_equation(equation)
    except EquationError:
        return 0.0
    if sorted(used) != sorted(numbers):
        return format_score
    return score if value == target else format_score
