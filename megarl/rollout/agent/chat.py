"""`ChatContinuation`: what a chat template renders around the turns the agent loop appends.

The loop never re-tokenizes what the model generated; it appends, after the model's turn, the
text the template itself puts there: the tail of the assistant turn, the tool (or interaction
user) turn and the next assistant header, computed by rendering small conversations with
marker contents. Tool output is tokenized as plain text (a special token's string in it is
spelled out); the template's markup around it keeps its special tokens.
"""

from __future__ import annotations

from typing import Any

from jinja2 import TemplateError

from megarl.data.tokenizer import chat_template_kwargs
from megarl.errors import UserInputError

_SENTINEL = "\u2063MEGARL_ASSISTANT\u2063"
_PREFIX = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]


class ChatContinuation:
    """The text a chat template puts after an assistant turn's content, and the rendering of
    tool responses plus the next assistant header, computed from the template itself."""

    def __init__(self, tokenizer: Any, template_kwargs: dict[str, Any] | None = None):
        self.tokenizer = tokenizer
        self.template_kwargs = chat_template_kwargs(template_kwargs)
        closed = self.render([*_PREFIX, {"role": "assistant", "content": _SENTINEL}], False)
        if _SENTINEL not in closed:
            raise UserInputError("the chat template does not render an assistant message's "
                                 "content; multi-turn rollouts need one that does")
        self._closed = closed
        self.tail = closed[closed.rindex(_SENTINEL) + len(_SENTINEL):]
        self._added: list[str] | None = None

    def render(self, messages: list[dict], add_generation_prompt: bool,
               tools: list[dict] | None = None) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt,
            **self.template_kwargs)

    def tool_turn_text(self, contents: list[str], role: str = "tool") -> str:
        """The template's rendering of ``role`` messages ``contents`` (tool responses, or the
        interaction's user turn) and the assistant header after them (not the tail of the
        assistant turn before)."""
        msgs = [{"role": role, "content": c} for c in contents]
        with_tools = self.render(
            [*_PREFIX, {"role": "assistant", "content": _SENTINEL}, *msgs], True)
        if with_tools.startswith(self._closed):
            return with_tools[len(self._closed):]
        # The template renders the assistant turn differently once a message follows it
        # (Qwen3 drops an empty think block): the messages after [system, user] instead, and
        # last after [system] alone (verl's way; templates that need a user query, as Qwen3's
        # does, raise on it).
        errors = []
        for base in (_PREFIX, _PREFIX[:1]):
            try:
                before = self.render(base, False)
                after = self.render([*base, *msgs], True)
            except TemplateError as e:
                errors.append(str(e))
                continue
            if after.startswith(before):
                return after[len(before):]
        raise UserInputError(f"the chat template renders {role} messages differently "
                             "depending on what precedes them; cannot append them "
                             f"incrementally{' (' + '; '.join(errors) + ')' if errors else ''}")

    def open_tail(self, model_ids: list[int], stopped: bool) -> str:
        """What of the tail the model did not generate: the tail after the model's stop token
        when the turn ended with it (Qwen: "\\n" after <|im_end|>), else the whole tail."""
        if stopped and model_ids:
            last = self.tokenizer.decode(model_ids[-1:], skip_special_tokens=False)
            if last and self.tail.startswith(last):
                return self.tail[len(last):]
        return self.tail

    def assistant_content(self, model_ids: list[int], stopped: bool) -> str:
        """The assistant message's content as the template would hold it (the decoded ids
        without the part of the tail the model generated)."""
        text = self.tokenizer.decode(model_ids, skip_special_tokens=False)
        generated_tail = self.tail[: len(self.tail) - len(self.open_tail(model_ids, stopped))]
        if generated_tail and text.endswith(generated_tail):
            text = text[: -len(generated_tail)]
        return text

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode_plain(self, text: str) -> list[int]:
        """``text`` tokenized as plain text: a special token's string in it (a tool that
        prints ``<|im_end|>``) is spelled out, never the turn delimiter itself."""
        return list(self.tokenizer(text, add_special_tokens=False,
                                   split_special_tokens=True)["input_ids"])

    def has_token_strings(self, text: str) -> bool:
        """Whether ``text`` holds the string of one of the tokenizer's added tokens."""
        if self._added is None:
            self._added = [t for t in getattr(self.tokenizer, "added_tokens_encoder", {}) if t]
        return any(t in text for t in self._added)

    def encode_with_plain(self, text: str, plain: dict[str, str]) -> list[int]:
        """Ids of ``text`` in which each key of ``plain`` (a marker the template rendered in
        place of a message's content) stands for that content, tokenized as plain text; the
        rest (the template's markup) is tokenized as `encode` does."""
        ids: list[int] = []
        rest = text
        for mark, content in plain.items():
            head, found, rest = rest.partition(mark)
            if not found:
                raise UserInputError("the chat template did not render a tool response's "
                                     "content as given; cannot tokenize it apart")
            ids += self.encode(head) + self.encode_plain(content)
        return ids + self.encode(rest)

    def tool_turn_ids(self, open_tail: str, contents: list[str], role: str = "tool"
                      ) -> list[int]:
        """Ids of ``open_tail`` + `tool_turn_text` with every content tokenized as plain text
        (a content without added-token strings tokenizes the same either way)."""
        if not any(self.has_token_strings(c) for c in contents):
            return self.encode(open_tail + self.tool_turn_text(contents, role))
        marks = {f"\u2063MEGARL_CONTENT_{i}\u2063": c for i, c in enumerate(contents)}
        return self.encode_with_plain(open_tail + self.tool_turn_text(list(marks), role), marks)
