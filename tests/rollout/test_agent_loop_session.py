"""The agent loop on an engine session (megarl/rollout/agent/drivers.py `continuously`): each
trajectory's next turn joins the running batch the step its tool call returns, instead of one
``generate`` per turn over every live trajectory.

On a tiny random qwen2 whose turns end at random lengths (a stop id range), every stopped turn
a call to a counting tool, up to 4 turns, 6 prompts x 2 samples, every one in a slot of its own:

- the trajectories equal the turn-by-turn loop's (the same engine behind a generate-only
  wrapper): ids, masks, finish reasons and tool calls exactly (each turn draws the noise of
  (seed of its turn, the trajectory's key), so only the logits' rounding differs), logprobs
  within 1e-5 (each batch's composition differs: float reassociation, as across max_num_seqs
  in test_rollout_batching.py);
- the model runs fewer decode steps: a turn no longer waits for the longest turn of the others;
- the same call gives the same bits again (the schedule depends only on when turns finish).
"""

from __future__ import annotations

import pytest
import torch

PROMPTS = ("ab", "what is 6*7", "x", "hello there", "7", "q?")


class Counted:
    """Counts the model's decode steps (forwards of one token per sequence) and the tokens of
    its prefills."""

    def __init__(self, engine):
        self.decode_steps = self.prefill_tokens = 0
        engine.model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        ids = args[0]
        if ids.shape[1] == 1:
            self.decode_steps += 1
        else:
            self.prefill_tokens += int(ids.numel())


class TurnByTurn:
    """The engine behind its ``generate`` only: the agent loop then runs turn by turn."""

    def __init__(self, engine):
        self.engine = engine

    def generate(self, prompts, sampling, prompt_keys=None):
        return self.engine.generate(prompts, sampling, prompt_keys=prompt_keys)


@pytest.fixture(scope="module")
def setup(tiny_folder):
    import transformers

    from megarl.rollout.agent import AgentLoopSettings, BaseTool, ToolResponse
    from megarl.rollout.agent.tool_parser import ParsedTurn, ToolCall, register_tool_parser
    from megarl.rollout.agent.tools import _schema
    from megarl.rollout.protocol import SamplingParams

    class EveryTurnCount:
        def parse(self, text):
            return ParsedTurn([ToolCall("count", {"n": len(text)})], text)

    class Count(BaseTool):
        async def execute(self, instance_id, parameters, **kwargs):
            return ToolResponse(text=f"n={parameters.get('n')}"), 0.0, {}

    register_tool_parser("session_every_turn_count", EveryTurnCount)
    path = tiny_folder("qwen2")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True),
                   add_special_tokens=False)["input_ids"] for q in PROMPTS]
    sp = SamplingParams(n=2, temperature=1.0, seed=3, max_new_tokens=120,
                        stop_token_ids=list(range(40, 70)))  # turns of a few tokens
    tools = {"count": Count({}, _schema("count", "count n", "n", "anything"))}
    settings = AgentLoopSettings(format="session_every_turn_count", max_assistant_turns=4,
                                 tokenization_sanity_check_mode="disable")
    return path, tok, prompts, sp, tools, settings


def _run(setup, wrap):
    from megarl.rollout.agent import run_agent_loop
    from megarl.rollout.torch import TorchRolloutEngine

    path, tok, prompts, sp, tools, settings = setup
    engine = TorchRolloutEngine.from_pretrained(path, tokenizer=None, max_num_seqs=16)
    counted = Counted(engine)
    trajs = run_agent_loop(wrap(engine), prompts, sp, tok, tools, settings,
                           prompt_keys=list(range(len(prompts))))
    return trajs, counted


def _plain(trajs):
    return [(t.response_ids, t.response_mask, t.finish_reason, t.turns,
             [c.response for c in t.tool_calls]) for t in trajs]


def test_session_turns_equal_turn_by_turn_in_fewer_decode_steps(setup):
    torch.set_num_threads(1)
    session, session_count = _run(setup, lambda e: e)
    turns, turn_count = _run(setup, TurnByTurn)
    assert _plain(session) == _plain(turns)
    for a, b in zip(session, turns):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs),
                                   atol=1e-5, rtol=0)
    # the precondition of "fewer": trajectories of several turns whose lengths differ
    assert max(t.turns for t in turns) >= 3
    assert len({t.num_generated for t in turns}) > 3
    # turn by turn, each turn lasts as long as its longest; in a session each trajectory
    # goes at its own pace (measured: 39 decode steps instead of 46); the prompts are
    # prefilled alike, in more forwards of fewer rows (fewer padded tokens: 3,073 vs 3,276)
    steps = (session_count.decode_steps, turn_count.decode_steps)
    assert steps[0] < steps[1], steps


def test_a_session_run_repeats_bit_for_bit(setup):
    a, _ = _run(setup, lambda e: e)
    b, _ = _run(setup, lambda e: e)
    assert _plain(a) == _plain(b)
    assert all(x.logprobs == y.logprobs for x, y in zip(a, b))
