"""Judge templates and verdict parsers on crafted and hostile text.

The parsers are checked against `reference_parse` (tests/rewards/test_judge.py: a slow scan
that tries every position), over every combination of crafted pieces; hostile outputs (huge,
deeply nested, eval-looking, non-ASCII digits, non-finite numbers) must give no score or the
documented one, in bounded time.
"""

from __future__ import annotations

import itertools
import time

import pytest
from test_judge import reference_parse

from megarl.errors import UserInputError
from megarl.judge.parse import parse_verdict
from megarl.judge.template import DEFAULT_TEMPLATE, load_template, parse_template

# ------------------------------------------------------------------------------ templates


def test_default_template_renders_every_field_verbatim():
    t = load_template(None)
    text = t.render("What is {x}?", "It is {response} \\boxed{2}", ["2", "two"])
    want = DEFAULT_TEMPLATE.replace("{{", "\0").replace("}}", "\1")
    for field, value in (("{prompt}", "What is {x}?"),
                         ("{response}", "It is {response} \\boxed{2}"),
                         ("{ground_truth}", '["2", "two"]')):
        want = want.replace(field, value)
    assert text == want.replace("\0", "{").replace("\1", "}")
    assert "\\boxed{1}" in text and "{{" not in text  # escaped braces became literal ones
    assert "{x}" in text and "{response}" in text  # field text is never formatted again


def test_template_from_file_and_ground_truth_forms(tmp_path):
    path = tmp_path / "judge.txt"
    path.write_text("Q={prompt}|R={response}|G={ground_truth}|{{lit}}", encoding="utf-8")
    t = load_template(str(path))
    assert t.source == f"file {path}"
    assert t.render("a", "b", None) == "Q=a|R=b|G=|{lit}"
    assert t.render("a", "b", {"target": 24}) == 'Q=a|R=b|G={"target": 24}|{lit}'
    inline = load_template("R={response} R2={response}")
    assert inline.render("p", "x") == "R=x R2=x"


@pytest.mark.parametrize("text, match", [
    ("{prompt} only", "no {response} field"),
    ("{response.__class__}", r"unknown field \{response.__class__\}"),
    ("{response[0]}", r"unknown field \{response\[0\]\}"),
    ("{0} {response}", r"unknown field \{0\}"),
    ("{} {response}", r"unknown field \{\}"),
    ("{response!r}", r"\{response!r\} has a conversion"),
    ("{response:>9}", r"\{response:>9\} has a conversion or format spec"),
    ("{response} {", "Single '{'"),
    ("{response} }", "Single '}'"),
])
def test_bad_templates_are_refused_naming_the_key(text, match):
    with pytest.raises(UserInputError, match=match) as err:
        parse_template(text)
    assert str(err.value).startswith("reward_model.rollout.template")


# ------------------------------------------------------------------------------ parsers

PREFIXES = ["", "Reasoning: 2+2=4.\n", "\\boxed{0} then ", "[[NO]] ", "Score: 3\n"]
VERDICTS = ["\\boxed{1}", "\\boxed{ 0.5 }", "\\boxed{-2}", "\\boxed{+.25}", "\\boxed{7.}",
            "\\boxed {3}", "\\boxed{\\boxed{4}}", "\\boxed{{5}}", "\\boxed{1e3}", "\\boxed{nan}",
            "\\boxed{7/10}", "\\boxed{1", "\\boxedx{2}", "\\boxed{1_000}", "\\boxed{}",
            "Score: 8", "score :  -1.5", "SCORE:9.25", "Score: 8 points", "Scores: 8",
            "[[YES]]", "[[NO]]", "[[YES]] [[NO]]", "[[NO]][[YES]]", "[[yes]]", "nothing", ""]
SUFFIXES = ["", "\n", "\n\n  \n", " trailing words", "\n[[YES]]"]


@pytest.mark.parametrize("mode", ["boxed", "score", "yes_no"])
def test_parsers_equal_the_brute_force_reference(mode):
    checked = parsed = 0
    for pre, verdict, post in itertools.product(PREFIXES, VERDICTS, SUFFIXES):
        text = pre + verdict + post
        assert parse_verdict(text, mode) == reference_parse(text, mode), (mode, text)
        checked += 1
        parsed += reference_parse(text, mode) is not None
    assert checked == len(PREFIXES) * len(VERDICTS) * len(SUFFIXES)
    assert 20 < parsed < checked - 20  # both outcomes represented


@pytest.mark.parametrize("text, mode, want", [
    ("\\boxed{\\boxed{\\boxed{3}}}", "boxed", 3.0),  # nested: the innermost, last-started box
    ("\\boxed{__import__('os').system('rm -rf /')}", "boxed", None),
    ("\\boxed{9**9**9**9}", "boxed", None),
    ("\\boxed{1+1}", "boxed", None),
    ("\\boxed{inf}", "boxed", None),
    ("\\boxed{1e999}", "boxed", None),
    ("\\boxed{0x10}", "boxed", None),
    ("\\boxed{\u0661}", "boxed", None),  # an Arabic-Indic digit: float() would take it
    ("\\boxed{\uff17}", "boxed", None),  # a fullwidth 7
    ("\\boxed{" + "9" * 33 + "}", "boxed", None),  # longer than 32 characters
    ("\\boxed{" + "9" * 32 + "}", "boxed", float("9" * 32)),
    ("Score: 7\x00", "score", None),
    ("Score: 1.5", "score", 1.5),
])
def test_hostile_verdicts(text, mode, want):
    assert parse_verdict(text, mode) == want == reference_parse(text, mode)


def test_score_bounds():
    assert parse_verdict("\\boxed{10}", "boxed", 1, 10) == 10.0
    assert parse_verdict("\\boxed{11}", "boxed", 1, 10) is None
    assert parse_verdict("\\boxed{0.5}", "boxed", 1, 10) is None
    assert parse_verdict("[[YES]]", "yes_no", None, 0.5) is None
    with pytest.raises(ValueError, match="score_parse='regex'"):
        parse_verdict("x", "regex")


@pytest.mark.parametrize("mode", ["boxed", "score", "yes_no"])
def test_huge_outputs_parse_in_linear_time(mode):
    """Outputs of 2 to 4 MB built to hurt a backtracking or quadratic scan."""
    hostile = ["{" * 2_000_000 + "}", "\\boxed{" * 400_000, "\\boxed{" + "{" * 2_000_000,
               ("[[YES" * 500_000) + "]", "Score:" + " " * 2_000_000 + "1x",
               "\n" * 2_000_000, "9" * 4_000_000]
    t0 = time.perf_counter()
    for text in hostile:
        assert parse_verdict(text, mode) is None
    assert time.perf_counter() - t0 < 10.0
    tail = "x" * 3_000_000 + {"boxed": "\\boxed{2}", "score": "\nScore: 2",
                              "yes_no": "[[YES]]"}[mode]
    assert parse_verdict(tail, mode) == (1.0 if mode == "yes_no" else 2.0)
