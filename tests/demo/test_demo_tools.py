"""The demo's tool variant (megarl/demo/tool_sft.py): the traces' content, and their ids being
the ones the agent loop builds at rollout time.

References: the problem's own arithmetic recomputed here from its operands and operators; the
whole conversation rendered by the tokenizer's chat template and tokenized in one piece; a
scripted policy (an engine that emits each assistant turn of a trace) played through
`run_agent_loop` with the real calculator.

Planted: the tool turn encoded without the "\\n" the template puts after <|im_end|> fails the
template and agent-loop comparisons; the loss mask shifted by one token (or 1 on the tool turn)
fails the mask and label checks; a tool answer off by one fails the arithmetic check.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from megarl.demo import arith
from megarl.demo.tool_sft import (
    TOOL_NAME,
    calculator_tool,
    encode_trace,
    tool_sft_batch,
    tool_trace,
)
from megarl.rollout.agent import AgentLoopSettings, run_agent_loop, tool_schemas
from megarl.rollout.agent.chat import ChatContinuation
from megarl.rollout.protocol import Completion

PROBLEMS = arith.sample_problems(7, 24, 3)


def evaluate(expression: str) -> int:
    """Left to right over + and - (the task's only operators), written out here."""
    tokens = re.findall(r"\d+|[+-]", expression)
    value = int(tokens[0])
    for op, x in zip(tokens[1::2], tokens[2::2]):
        value = value + int(x) if op == "+" else value - int(x)
    return value


@pytest.mark.parametrize("tool_ops", [0, 1, 2])
def test_traces_compute_the_answer(tool_ops):
    for p in PROBLEMS:
        msgs = tool_trace(p, tool_ops)
        assert msgs[-1]["content"].endswith("\\boxed{" + str(evaluate(p.text)) + "}")
        if tool_ops == 0:
            assert [m["role"] for m in msgs] == ["assistant"]
            continue
        assert [m["role"] for m in msgs] == ["assistant", "tool", "assistant"]
        call = msgs[0]["content"]
        assert call.startswith("<tool_call>\n") and call.endswith("\n</tool_call>")
        body = json.loads(call[len("<tool_call>"):-len("</tool_call>")])
        assert body["name"] == TOOL_NAME and set(body["arguments"]) == {"expression"}
        expr = body["arguments"]["expression"]
        # a prefix of the problem with tool_ops operations
        assert p.text.startswith(expr) and len(re.findall(r"[+-]", expr)) == tool_ops
        assert msgs[1]["content"] == str(evaluate(expr))
        # the steps after the call start from the tool's value and each is right
        steps = msgs[2]["content"].split("\n\n")
        assert len(steps) == 3 - tool_ops + 1
        assert steps[0].startswith(msgs[1]["content"])
        for s in steps[:-1]:
            lhs, rhs = s.split("=")
            assert evaluate(lhs) == int(rhs)
    with pytest.raises(ValueError, match="tool_ops"):
        tool_trace(PROBLEMS[0], 3)


def test_the_calculator_answers_the_call():
    import asyncio

    tool = calculator_tool()
    for p in PROBLEMS[:5]:
        msgs = tool_trace(p, 2)
        args = json.loads(msgs[0]["content"][len("<tool_call>"):-len("</tool_call>")])["arguments"]
        out, _, _ = asyncio.run(tool.execute("i", args))
        assert out.text == msgs[1]["content"]


def examples(tok, tool_ops):
    chat = ChatContinuation(tok)
    schemas = tool_schemas({TOOL_NAME: calculator_tool()})
    return [(p, encode_trace(p, tool_ops, tok, chat, schemas)) for p in PROBLEMS[:6]]


@pytest.mark.parametrize("tool_ops", [0, 1, 2])
def test_ids_are_the_templates_rendering(tok, tool_ops):
    """ids = the whole conversation rendered by the template, tokenized in one piece (up to the
    final <|im_end|>, the model's last token); mask 1 exactly on the assistant contents and the
    eos closing each of them."""
    for p, ex in examples(tok, tool_ops):
        msgs = [{"role": "user", "content": p.prompt}, *tool_trace(p, tool_ops)]
        text = tok.apply_chat_template(msgs, tokenize=False)
        assert text.endswith("<|im_end|>\n")
        want = tok(text[:-1], add_special_tokens=False)["input_ids"]
        assert ex.ids == want
        kept = [i for i, m in zip(ex.ids, ex.loss_mask) if m]
        assistant = "".join(m["content"] + "<|im_end|>" for m in msgs if m["role"] == "assistant")
        assert tok.decode(kept) == assistant
        masked = tok.decode([i for i, m in zip(ex.ids, ex.loss_mask) if not m])
        prompt = tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
        glue = "".join(f"\n<|im_start|>tool\n{m['content']}<|im_end|>\n<|im_start|>assistant\n"
                       for m in msgs if m["role"] == "tool")
        assert masked == prompt + glue


def test_labels_are_the_next_model_token(tok):
    exs = [e for _, e in examples(tok, 1)[:3]] + [e for _, e in examples(tok, 0)[:2]]
    ids, labels = tool_sft_batch(exs, tok.pad_token_id)
    for row, e in enumerate(exs):
        for t in range(ids.shape[1]):
            nxt = t + 1
            want = e.ids[nxt] if nxt < len(e.ids) and e.loss_mask[nxt] else -100
            assert int(labels[row, t]) == want, (row, t)
        assert ids[row, : len(e.ids)].tolist() == e.ids


class Scripted:
    """Emits the assistant turns of given traces (eos included), one per call."""

    def __init__(self, turns: list[list[list[int]]]):
        self.turns, self.seen = turns, {}

    def generate(self, prompts, sampling, prompt_keys=None):
        out = []
        for i, key in enumerate(prompt_keys):
            k = self.seen.get(key, 0)
            self.seen[key] = k + 1
            ids = self.turns[key][k]
            out.append(Completion(i, ids, torch.zeros(len(ids)), "stop"))
        return out


@pytest.mark.parametrize("tool_ops", [1, 2])
def test_the_agent_loop_builds_the_same_ids(tok, tool_ops):
    """A policy that writes a trace's assistant turns, run through the agent loop with the real
    calculator: its trajectory's ids and mask are the SFT example's."""
    pairs = examples(tok, tool_ops)
    turns, prompts = [], []
    for _, ex in pairs:
        starts = [i for i in range(1, len(ex.ids)) if ex.loss_mask[i] and not ex.loss_mask[i - 1]]
        ends = [i for i in range(1, len(ex.ids) + 1)
                if ex.loss_mask[i - 1] and (i == len(ex.ids) or not ex.loss_mask[i])]
        turns.append([ex.ids[a:b] for a, b in zip(starts, ends)])
        prompts.append(ex.ids[: starts[0]])
    tools = {TOOL_NAME: calculator_tool()}
    from megarl.rollout.protocol import SamplingParams

    trajs = run_agent_loop(Scripted(turns), prompts, SamplingParams(max_new_tokens=200), tok,
                           tools, AgentLoopSettings(enable=True), prompt_messages=[
                               [{"role": "user", "content": p.prompt}] for p, _ in pairs])
    for (_, ex), t in zip(pairs, trajs):
        assert t.finish_reason == "stop" and len(t.tool_calls) == 1 and not t.tool_errors
        assert t.prompt_ids + t.response_ids == ex.ids
        assert t.response_mask == ex.loss_mask[len(t.prompt_ids):]
        assert t.sanity_checked and t.sanity_mismatch is None

