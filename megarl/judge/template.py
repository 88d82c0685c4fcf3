"""The judge prompt: a template with named fields, validated once, rendered per response.

Fields: ``{prompt}`` (the question as the policy saw it), ``{response}`` (the policy's answer,
required) and ``{ground_truth}`` (the reference answer; empty when a row has none). ``{{`` and
``}}`` are literal braces. Rendering substitutes the fields' text as it is: a response that
contains braces or format fields is never formatted again, and the template may use no
attribute, index, conversion or format spec (``{response.x}``, ``{response!r}``,
``{response:>9}`` are refused).
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megarl.errors import UserInputError

KEY = "reward_model.rollout.template"
FIELDS = ("prompt", "response", "ground_truth")

DEFAULT_TEMPLATE = (
    "You are grading a response to a question.\n\n"
    "Question:\n{prompt}\n\n"
    "Reference answer (empty if none is given):\n{ground_truth}\n\n"
    "Response:\n{response}\n\n"
    "Decide whether the response answers the question correctly. Reason briefly, then end "
    "with your verdict on its own line: \\boxed{{1}} if the response is correct, "
    "\\boxed{{0}} if it is not."
)


@dataclass(frozen=True)
class JudgeTemplate:
    """A validated template: ``parts`` alternates literal text and field names, as
    ``("literal", text)`` / ``("field", name)``; ``source`` says where it came from."""

    parts: tuple[tuple[str, str], ...]
    source: str

    def render(self, prompt: str, response: str, ground_truth: Any = None) -> str:
        """The judge prompt of one response (text; fields substituted once, verbatim)."""
        values = {"prompt": str(prompt), "response": str(response),
                  "ground_truth": ground_truth_text(ground_truth)}
        return "".join(values[v] if kind == "field" else v for kind, v in self.parts)


def ground_truth_text(ground_truth: Any) -> str:
    """A ground truth as template text: "" for None, a str as it is, anything else (a list of
    accepted answers, a dict) as JSON."""
    if ground_truth is None:
        return ""
    if isinstance(ground_truth, str):
        return ground_truth
    return json.dumps(ground_truth, default=str, ensure_ascii=False)


def parse_template(text: str, source: str = "inline") -> JudgeTemplate:
    """Validate ``text`` as a judge template; UserInputError naming the key and the fix."""
    where = f"{KEY} ({source})"
    try:
        pieces = list(string.Formatter().parse(text))
    except ValueError as err:  # a single '{' or '}'
        raise UserInputError(f"{where}: {err}. Fix: write a literal brace as '{{{{' or "
                             "'}}}}'") from None
    parts: list[tuple[str, str]] = []
    seen = set()
    for literal, name, spec, conversion in pieces:
        if literal:
            parts.append(("literal", literal))
        if name is None:
            continue
        if name not in FIELDS:
            raise UserInputError(
                f"{where}: unknown field {{{name}}}. Fix: use only {{prompt}}, {{response}} "
                "and {ground_truth} (no attribute or index access), or write a literal brace "
                "as '{{' / '}}'")
        if spec or conversion:
            shown = name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "")
            raise UserInputError(f"{where}: field {{{shown}}} has a conversion or format spec. "
                                 f"Fix: write it as {{{name}}}")
        parts.append(("field", name))
        seen.add(name)
    if "response" not in seen:
        raise UserInputError(f"{where}: the template has no {{response}} field, so the judge "
                             "would never see the response. Fix: add {response} to it")
    return JudgeTemplate(tuple(parts), source)


def load_template(value: str | None) -> JudgeTemplate:
    """The judge template of ``reward_model.rollout.template``: None = `DEFAULT_TEMPLATE`; a
    string containing ``{response}`` is the template itself; any other string is the path of a
    UTF-8 file holding one."""
    if value is None:
        return parse_template(DEFAULT_TEMPLATE, "the built-in template")
    if "{response}" in value:
        return parse_template(value, "inline")
    path = Path(value).expanduser()
    if not path.is_file():
        raise UserInputError(
            f"{KEY}={value!r}: not a template (it has no {{response}} field) and not a file. "
            "Fix: give the template text with {prompt} / {response} / {ground_truth} fields, or "
            "the path of a file holding it, or null for the built-in template")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise UserInputError(f"{KEY}={value!r}: cannot read the file ({err})") from None
    return parse_template(text, f"file {path}")
