"""Loading HF tokenizers (a hub id downloads unless HF_HUB_OFFLINE=1: megarl.utils.hub) and
turning chat messages into prompt text."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from megarl.data.locations import resolve_path
from megarl.errors import UserInputError

logger = logging.getLogger(__name__)


def load_tokenizer(path: str, **kwargs: Any):
    """``AutoTokenizer.from_pretrained(path)``.

    ``path`` is a local tokenizer/model folder, ``embedded://tokenizer`` (or any embedded model),
    or a hub id: downloaded unless the user set HF_HUB_OFFLINE=1 (then it must be in the local
    HF cache); a local path never reaches the network (`megarl.utils.hub.decide_offline`). A
    tokenizer without a pad token gets its eos token as pad (logged).
    """
    from megarl.utils import hub

    local = resolve_path(path)
    hub.decide_offline([local])
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer

    if os.path.exists(local) and not os.path.isdir(local):
        raise NotADirectoryError(
            f"tokenizer path {local!r} is a file; give the folder that holds tokenizer.json / "
            f"tokenizer_config.json (an HF model or tokenizer folder)"
        )
    hub_like = not os.path.isabs(local) and not local.startswith(".") and local.count("/") == 1
    if not os.path.isdir(local) and not hub_like:
        raise FileNotFoundError(
            f"tokenizer folder not found: {local!r}. Give a local HF tokenizer/model folder, a hub "
            f"id (org/name), or embedded://tokenizer"
        )
    try:
        tok = AutoTokenizer.from_pretrained(local, **kwargs)
    except Exception as e:  # noqa: BLE001 - HF raises OSError/ValueError/... depending on version
        why = (f"; it is a hub id and {hub.HOW_TO_DOWNLOAD}" if hub_like and hub.offline()
               else "")
        raise FileNotFoundError(
            f"could not load a tokenizer from {local!r} ({type(e).__name__}: {e}). Give a local "
            f"HF tokenizer/model folder, a hub id (org/name), or embedded://tokenizer{why}"
        ) from e
    if tok.pad_token_id is None:
        if tok.eos_token_id is None:
            raise UserInputError(f"tokenizer at {local!r} has neither a pad nor an eos token")
        logger.info("tokenizer %s has no pad token; using eos %r as pad", local, tok.eos_token)
        tok.pad_token = tok.eos_token
    return tok


TEMPLATE_KWARGS_KEY = "data.apply_chat_template_kwargs"
# arguments of apply_chat_template that megarl sets itself when it renders a prompt
_OWN_ARGS = frozenset({"conversation", "messages", "chat_template", "add_generation_prompt",
                       "tokenize", "tools", "return_dict", "return_tensors", "padding",
                       "truncation", "max_length", "continue_final_message", "documents",
                       "return_assistant_tokens_mask", "tokenizer_kwargs"})


def chat_template_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """``data.apply_chat_template_kwargs`` checked: a mapping of variable name -> value that the
    chat template reads (``enable_thinking``, ``reasoning_effort``, ...), passed to every
    ``apply_chat_template`` that renders a prompt or a multi-turn continuation. Names that
    megarl sets itself (``tools``, ``add_generation_prompt``, ...) are refused."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise UserInputError(
            f"{TEMPLATE_KWARGS_KEY}={kwargs!r}: give a mapping of chat-template variables, "
            f"e.g. {{enable_thinking: false}}")
    bad = [k for k in kwargs if not isinstance(k, str) or not k.isidentifier()]
    own = sorted(k for k in kwargs if k in _OWN_ARGS)
    if bad or own:
        raise UserInputError(
            f"{TEMPLATE_KWARGS_KEY}: {sorted(map(str, bad + own))} cannot be passed: give "
            "template variable names (identifiers); tools, add_generation_prompt, tokenize and "
            "the template itself are set by megarl (tools from "
            "actor_rollout_ref.rollout.multi_turn.tool_config_path, the template from "
            "data.chat_template)")
    return dict(kwargs)


def render_prompt(
    tokenizer,
    messages: list[dict[str, str]],
    apply_chat_template: bool = True,
    chat_template: str | None = None,
    tools: list[dict] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """Prompt text for a list of chat messages.

    apply_chat_template=True: the tokenizer's chat template (or ``chat_template`` when given)
    with ``add_generation_prompt=True``. False: the message contents joined by newlines, no
    template (for base models prompted with plain text). ``tools``: the OpenAI function
    schemas the template renders into the prompt (multi-turn rollouts with tools).
    ``template_kwargs``: extra variables the template reads (``data.apply_chat_template_kwargs``,
    see `chat_template_kwargs`).
    """
    if not apply_chat_template:
        return "\n".join(m["content"] for m in messages)
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise UserInputError(
            "the tokenizer has no chat template: set data.chat_template to a Jinja template, or "
            "data.apply_chat_template=false to feed the message text as is"
        )
    extra = {**chat_template_kwargs(template_kwargs), **({"tools": tools} if tools else {})}
    return tokenizer.apply_chat_template(
        messages, chat_template=template, add_generation_prompt=True, tokenize=False, **extra
    )
