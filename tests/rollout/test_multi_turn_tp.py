"""Multi-turn rollouts on a tensor-parallel engine group (``rollout.tensor_model_parallel_size``
> 1): the group's first rank runs the agent loop and the tools, and every rank of the group
submits the same prompts each turn (`megarl.rollout.agent.group`).

A 2-rank gloo world (this file is also the worker) runs the trainer's `generate` with the agent
loop on a tiny random qwen2, megarl's torch engine on each rank (it holds the whole model, so
the group generates what one tensor-parallel engine would), every stopped turn read as a call
to a counting tool, once with tp_size=1 (two engines, the prompts dealt between them) and once
with tp_size=2 (one engine group). References: the same call in this process (a world of one),
and each rank's record of what it submitted to its engine. tp_size=2 equals the world of one
bit for bit (one engine batches every prompt); tp_size=1 equals it token for token, its
logprobs within 1e-5 (each engine batches its own share: the rounding differs, measured 7e-7).

Planted: both ranks of the group running the loop (no leader) runs every tool twice (rank 1's
count is not 0); a follower dropping the turn's seed submits other requests than the leader's;
a group whose follower stops after the first turn hangs the leader's next broadcast (the world
times out).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

PROMPTS = ("ab", "what is 6*7", "x")


def _setup(model_path: str):
    """(tokenizer, items, sampling, agent, tool) as the worker and the test build them."""
    import transformers

    from megarl.rollout.agent import AgentLoopSettings, BaseTool, ToolResponse
    from megarl.rollout.agent.tool_parser import ParsedTurn, ToolCall, register_tool_parser
    from megarl.rollout.agent.tools import _schema
    from megarl.rollout.protocol import SamplingParams
    from megarl.trainer.batch import PromptItem
    from megarl.trainer.generation import AgentRollout

    class EveryTurnCount:
        def parse(self, text):
            return ParsedTurn([ToolCall("count", {"n": len(text)})], text)

    class Count(BaseTool):
        executed = 0

        async def execute(self, instance_id, parameters, **kwargs):
            Count.executed += 1
            return ToolResponse(text=f"n={parameters.get('n')}"), 0.0, {}

    register_tool_parser("tp_every_turn_count", EveryTurnCount)
    tok = transformers.AutoTokenizer.from_pretrained(model_path)
    items = []
    for k, q in enumerate(PROMPTS):
        text = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                       add_generation_prompt=True)
        items.append(PromptItem(tok(text, add_special_tokens=False)["input_ids"], "arith", "1",
                                {"index": k}))
    sp = SamplingParams(n=2, temperature=1.0, seed=3, max_new_tokens=60,
                        stop_token_ids=list(range(40, 70)))  # turns of a few tokens
    tool = Count({}, _schema("count", "count n", "n", "anything"))
    agent = AgentRollout({"count": tool}, AgentLoopSettings(format="tp_every_turn_count",
                                                            max_assistant_turns=3), tok)
    return tok, items, sp, agent, Count


class Recording:
    """Forwards to an engine and records what was submitted (prompts, keys, seed, budget)."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate(self, prompts, sampling, prompt_keys=None):
        self.calls.append((prompts, list(prompt_keys), sampling.seed, sampling.max_new_tokens))
        return self.engine.generate(prompts, sampling, prompt_keys=prompt_keys)


def _plain(samples) -> list[dict]:
    return [{"group": s.group, "ids": s.response_ids, "mask": s.response_mask,
             "logprobs": s.rollout_logprobs, "finish": s.finish_reason,
             "calls": [c["response"] for c in s.extra_info["tool_calls"]]} for s in samples]


def main(out: str, model_path: str) -> None:
    from megarl.rollout.torch import TorchRolloutEngine
    from megarl.trainer.generation import generate
    from megarl.utils import dist as mdist

    torch.set_num_threads(1)
    mdist.init_distributed(torch.device("cpu"))
    _, items, sp, agent, count = _setup(model_path)
    base = TorchRolloutEngine.from_pretrained(model_path, tokenizer=None, max_num_seqs=8)
    result = {}
    for tp in (1, 2):
        engine = Recording(base)
        count.executed = 0
        samples = generate(engine, items, sp, group_offset=0, tp_size=tp, agent=agent)
        result[tp] = {"samples": _plain(samples), "executed": count.executed,
                      "calls": engine.calls}
    torch.save(result, Path(out) / f"rank{mdist.rank()}.pt")
    mdist.destroy()


@pytest.mark.e2e
@pytest.mark.dist
def test_tp2_group_equals_tp1(tmp_path, tiny_folder):
    from torchrun import run_torchrun

    from megarl.rollout.torch import TorchRolloutEngine
    from megarl.trainer.generation import generate

    path = tiny_folder("qwen2")
    run_torchrun(Path(__file__), 2, [str(tmp_path), str(path)], timeout=300)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]

    torch.set_num_threads(1)
    _, items, sp, agent, count = _setup(str(path))
    count.executed = 0
    engine = TorchRolloutEngine.from_pretrained(path, tokenizer=None, max_num_seqs=8)
    # a world of one, turn by turn like the worker's recording engines (a bare torch engine
    # would run the turns as session requests: tests/rollout/test_agent_loop_session.py)
    want = _plain(generate(Recording(engine), items, sp, group_offset=0, agent=agent))
    calls = sum(len(s["calls"]) for s in want)
    assert count.executed == calls and calls >= len(want)
    assert max(len(s["calls"]) for s in want) >= 2  # trajectories of several turns

    for r in ranks:  # every rank holds the whole gathered list
        # tp=2: one engine generates every prompt, batched as in the world of one: bitwise
        assert r[2]["samples"] == want
        # tp=1: the same trajectories; logprobs up to the batch composition's rounding
        # (each engine batches its share; measured 7e-7)
        for a, b in zip(r[1]["samples"], want, strict=True):
            assert {k: v for k, v in a.items() if k != "logprobs"} == \
                {k: v for k, v in b.items() if k != "logprobs"}
            torch.testing.assert_close(torch.tensor(a["logprobs"]), torch.tensor(b["logprobs"]),
                                       atol=1e-5, rtol=0)
    # tp=1: the prompts dealt to two engines, each running its tools
    assert ranks[0][1]["executed"] + ranks[1][1]["executed"] == calls
    assert ranks[0][1]["executed"] > 0 and ranks[1][1]["executed"] > 0
    # tp=2: the tools ran once per call, on the group's first rank
    assert (ranks[0][2]["executed"], ranks[1][2]["executed"]) == (calls, 0)
    # and both ranks submitted the same requests, turn by turn
    lead, follow = ranks[0][2]["calls"], ranks[1][2]["calls"]
    assert len(lead) >= 3 and lead == follow
    assert [len(c[0]) for c in lead][0] == len(PROMPTS) * sp.n


if __name__ == "__main__":
    main(*sys.argv[1:])
