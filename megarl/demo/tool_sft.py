"""The demo's tool variant: arithmetic traces with a calculator call, their SFT tokens, and the
accuracy of a policy run through the agent loop.

A trace calls the calculator (hermes format, as Qwen2.5 writes it) on a prefix of the problem
and finishes the remaining steps by hand from the tool's value::

    user:       Compute: 38+61+45-74
    assistant:  <tool_call>\\n{"name": "calculator", "arguments": {"expression": "38+61+45"}}
                \\n</tool_call>
    tool:       144
    assistant:  144-74=70\\n\\n\\boxed{70}

``tool_ops`` = the operations the calculator computes: 0 (no call: the plain solution), 1 or 2
(never all three: the call is for a sub-expression). The ids of a trace are those the agent
loop builds at rollout time (`megarl.rollout.agent.chat.ChatContinuation`): each assistant
turn tokenized alone and closed by the eos token, then the template's own rendering of the
tool turn and the next assistant header, appended with loss mask 0.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from megarl.data.batching import pad_right
from megarl.data.tokenizer import render_prompt
from megarl.demo.arith import SEP, Problem, boxed
from megarl.demo.sft import boxed_answer
from megarl.rollout.agent.tools import CalculatorTool

TOOL_NAME = "calculator"
TOOL_OPS = (0, 1, 2)  # operations the calculator computes in a trace (0: no call)


def calculator_tool() -> CalculatorTool:
    """The built-in calculator, as configs/tools/calculator.yml configures it."""
    return CalculatorTool({"type": "native"})


def tool_call_text(expression: str) -> str:
    """One hermes call of the calculator, as Qwen2.5's template writes it."""
    body = json.dumps({"name": TOOL_NAME, "arguments": {"expression": expression}})
    return f"<tool_call>\n{body}\n</tool_call>"


def prefix_expression(problem: Problem, ops: int) -> str:
    """The problem's first ``ops`` operations as text ("38+61" for ops=1)."""
    out = str(problem.operands[0])
    for op, x in zip(problem.ops[:ops], problem.operands[1:ops + 1]):
        out += f"{op}{x}"
    return out


def tool_trace(problem: Problem, tool_ops: int) -> list[dict[str, str]]:
    """The messages after the user prompt: no call (tool_ops=0), or a call on the first
    ``tool_ops`` operations, the tool's answer, and the remaining steps from its value."""
    if tool_ops == 0:
        return [{"role": "assistant", "content": problem.solution}]
    if not 0 < tool_ops < len(problem.ops):
        raise ValueError(f"tool_ops={tool_ops}: 0, or 1 to {len(problem.ops) - 1} operations")
    value = problem.running_values()[tool_ops - 1]
    steps, v = [], value
    for op, x in zip(problem.ops[tool_ops:], problem.operands[tool_ops + 1:]):
        r = v + x if op == "+" else v - x
        steps.append(f"{v}{op}{x}={r}")
        v = r
    return [{"role": "assistant", "content": tool_call_text(prefix_expression(problem, tool_ops))},
            {"role": "tool", "content": str(value)},
            {"role": "assistant", "content": SEP.join([*steps, boxed(v)])}]


@dataclass
class ToolSFTExample:
    """ids: prompt + response; loss_mask [len(ids)]: 1 on the model's tokens (the assistant
    turns and their eos), 0 on the prompt and the appended tool turns."""

    ids: list[int]
    loss_mask: list[int]
    tool_ops: int


def encode_trace(problem: Problem, tool_ops: int, tokenizer, chat, tools: list[dict] | None
                 ) -> ToolSFTExample:
    """The trace's ids as the agent loop builds them. chat: the loop's `ChatContinuation` of
    ``tokenizer``; tools: the schemas rendered into the prompt (as the trainer does)."""
    prompt = render_prompt(tokenizer, [{"role": "user", "content": problem.prompt}], tools=tools)
    ids = chat.encode(prompt)
    mask = [0] * len(ids)
    tail = ""
    for m in tool_trace(problem, tool_ops):
        if m["role"] == "assistant":
            turn = chat.encode(m["content"]) + [tokenizer.eos_token_id]
            ids += turn
            mask += [1] * len(turn)
            tail = chat.open_tail(turn, stopped=True)
        else:
            glue = chat.tool_turn_ids(tail, [m["content"]])
            ids += glue
            mask += [0] * len(glue)
    return ToolSFTExample(ids, mask, tool_ops)


def tool_sft_batch(examples: Sequence[ToolSFTExample], pad_id: int):
    """(ids [B, T], labels [B, T]) right-padded; ``labels[:, t]`` is token t+1 where it is a
    model token (loss mask 1), else -100."""
    ids, _ = pad_right([e.ids for e in examples], pad_id)
    keep, _ = pad_right([e.loss_mask for e in examples], 0)
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = torch.where(keep[:, 1:] == 1, ids[:, 1:], -100)
    return ids, labels


@dataclass
class ToolEval:
    accuracy: float
    tool_share: float  # trajectories with at least one tool call
    tool_errors: float  # erroneous calls per trajectory
    texts: list[str]


def agent_accuracy(model, tokenizer, problems: Sequence[Problem], max_response_length: int = 128,
                   max_num_seqs: int = 256) -> ToolEval:
    """Greedy accuracy of the final \\boxed{} answer of trajectories run through the agent loop
    (`run_agent_loop`) on megarl's torch engine with the calculator, as the trainer validates."""
    from megarl.rollout.agent import AgentLoopSettings, run_agent_loop, tool_schemas
    from megarl.rollout.protocol import SamplingParams
    from megarl.rollout.torch import TorchRolloutEngine

    was_training = model.training
    model.eval()
    tools = {TOOL_NAME: calculator_tool()}
    schemas = tool_schemas(tools)
    msgs = [[{"role": "user", "content": p.prompt}] for p in problems]
    prompts = [tokenizer(render_prompt(tokenizer, m, tools=schemas),
                         add_special_tokens=False)["input_ids"] for m in msgs]
    engine = TorchRolloutEngine(model, tokenizer=tokenizer, max_num_seqs=max_num_seqs,
                                eos_token_ids=[tokenizer.eos_token_id])
    settings = AgentLoopSettings(enable=True, tokenization_sanity_check_mode="disable")
    trajs = run_agent_loop(engine, prompts, SamplingParams(temperature=0.0, logprobs=False,
                                                          max_new_tokens=max_response_length),
                           tokenizer, tools, settings)
    model.train(was_training)
    texts = tokenizer.batch_decode([t.response_ids for t in trajs], skip_special_tokens=True)
    correct = [boxed_answer(s) == str(p.answer) for s, p in zip(texts, problems)]
    n = len(trajs)
    return ToolEval(
        accuracy=float(np.mean(correct)) if n else math.nan,
        tool_share=sum(bool(t.tool_calls) for t in trajs) / n if n else math.nan,
        tool_errors=sum(len(t.tool_errors) for t in trajs) / n if n else math.nan,
        texts=texts,
    )
