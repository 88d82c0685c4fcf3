"""Tool-call parsers: the decoded text of ONE assistant turn -> the calls it makes.

Only the text of the turn's own generated ids is parsed (never the conversation), and the ids
themselves are never re-tokenized: the parse decides which tools run, nothing else. A parser
also returns one error message per malformed call, which the agent loop sends back to the
model as that call's tool response (a rollout never fails on a model's bad JSON).

Formats are registered by name, as verl's ``actor_rollout_ref.rollout.multi_turn.format``:

- ``hermes`` (the chat templates of Qwen2.5 / Qwen3 and NousResearch Hermes)::

      <tool_call>
      {"name": "calculator", "arguments": {"expression": "1 + 2"}}
      </tool_call>

  each block is one call; ``arguments`` must be a JSON object (a JSON string holding an
  object is accepted too, as some models write it).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MAX_ERROR_CHARS = 300  # the part of a malformed call quoted back to the model


@dataclass
class ToolCall:
    """One parsed call: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]


@dataclass
class ParseError:
    """A malformed call: ``message`` is sent back to the model as its tool response."""

    message: str


@dataclass
class ParsedTurn:
    """entries: the turn's calls in the order written, each a ToolCall or, when malformed, a
    ParseError; content: the turn's text without the call blocks."""

    entries: list[ToolCall | ParseError] = field(default_factory=list)
    content: str = ""

    @property
    def calls(self) -> list[ToolCall]:
        return [e for e in self.entries if isinstance(e, ToolCall)]

    @property
    def errors(self) -> list[str]:
        return [e.message for e in self.entries if isinstance(e, ParseError)]

    @property
    def has_calls(self) -> bool:
        """The turn asked for a tool (well-formed or not): the loop answers it and goes on."""
        return bool(self.entries)


def _quote(text: str) -> str:
    text = text.strip()
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + "..."


class HermesToolParser:
    """``<tool_call>{json}</tool_call>`` blocks (verl's ``hermes`` format)."""

    start, end = "<tool_call>", "</tool_call>"
    _block = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str) -> ParsedTurn:
        out = ParsedTurn(content=self._block.sub("", text))
        for body in self._block.findall(text):
            call, error = self._one(body)
            out.entries.append(call if call is not None else ParseError(error))
        # an opening tag left unclosed after the last complete block
        tail = text[text.rfind(self.end) + len(self.end):] if self.end in text else text
        if self.start in tail:
            out.entries.append(ParseError(f"Error: a {self.start} block was not closed with {self.end}; "
                              "write each call as <tool_call>\\n{\"name\": ..., \"arguments\": "
                              "{...}}\\n</tool_call>"))
        return out

    @staticmethod
    def _one(body: str) -> tuple[ToolCall | None, str]:
        try:
            obj = json.loads(body)
        except (json.JSONDecodeError, RecursionError) as e:
            msg = e.msg if isinstance(e, json.JSONDecodeError) else "nested too deeply"
            return None, f"Error: the tool call is not valid JSON ({msg}): {_quote(body)}"
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None, ('Error: a tool call must be a JSON object {"name": <tool name>, '
                          f'"arguments": {{...}}}}; got: {_quote(body)}')
        args = obj.get("arguments", {})
        if isinstance(args, str):  # arguments written as a JSON string
            try:
                args = json.loads(args) if args.strip() else {}
            except (json.JSONDecodeError, RecursionError):
                pass
        if not isinstance(args, dict):
            return None, (f'Error: the "arguments" of tool {_quote(obj["name"])!r} must be a '
                          f"JSON object; got: {_quote(json.dumps(args, ensure_ascii=False))}")
        return ToolCall(obj["name"], args), ""


PARSERS: dict[str, Callable[[], Any]] = {"hermes": HermesToolParser}


def get_tool_parser(fmt: str):
    """The parser of ``multi_turn.format`` ``fmt``."""
    if fmt not in PARSERS:
        from megarl.errors import UserInputError

        raise UserInputError(f"multi_turn.format={fmt!r} is not a known tool-call format; "
                             f"known: {sorted(PARSERS)}")
    return PARSERS[fmt]()


def register_tool_parser(name: str, factory: Callable[[], Any]) -> None:
    """Add a format: ``factory()`` returns an object with ``parse(text) -> ParsedTurn``."""
    PARSERS[name] = factory
