"""Multi-turn rollouts through the engine process (asynchronous rollout): the agent loop runs in
the engine's process, its tools built there from the tool config, every turn of a trajectory on
the one weight version its request named.

A tiny random qwen2 in `ProcessRolloutEngine` (torch engine, CPU); every stopped turn is read as
a call to the calculator (a tool-call format defined here, which the engine process imports by
reference); the tool YAML names megarl's CalculatorTool. References: the in-process agent loop
on an in-process `TorchRolloutEngine` holding the same weights (same ids, masks, logprobs), and
a float64 transformers forward of the version's weights over each whole trajectory.

Planted: the engine process loading the newest published weights between turns (a request
split per turn from the trainer side) gives turns of version 1 in the version-0 request: its
ids and logprobs leave the version-0 reference; stamping turns with the loaded version + 1
fails the version check; a checkpointed multi-turn request not restored fails the round trip.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
import yaml

from megarl.rollout.agent.tool_parser import ParsedTurn, ToolCall, register_tool_parser
from megarl.rollout.agent.tools import CalculatorTool

pytestmark = pytest.mark.e2e  # starts an engine process

FORMAT = "mt_process_every_turn_calc"


class EveryTurnCalc:
    """Reads a call to the calculator in every turn (importable by the engine process)."""

    def parse(self, text):
        return ParsedTurn([ToolCall("calculator", {"expression": "(3 + 4) * 6"})], text)


register_tool_parser(FORMAT, EveryTurnCalc)


class SlowCalculator(CalculatorTool):
    """The calculator taking TOOL_SECONDS per call (importable by the engine process)."""

    async def execute(self, instance_id, parameters, **kwargs):
        await asyncio.sleep(TOOL_SECONDS)
        return await super().execute(instance_id, parameters, **kwargs)


TOOL_SECONDS = 2.0


def _perturbed(state: dict[str, torch.Tensor], scale: float, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in state.items()}


def _hf_logprobs(model, weights, traj) -> torch.Tensor:
    """float64 logprobs of every response token of ``traj`` under ``weights``."""
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    ids = torch.tensor([traj.prompt_ids + traj.response_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].double(), -1)[len(traj.prompt_ids) - 1:-1]
    return logp.gather(1, torch.tensor(traj.response_ids)[:, None])[:, 0]


@pytest.fixture()
def setup(tiny_folder, tmp_path):
    import transformers
    from test_rollout_process import _spec

    from megarl.models import load_model
    from megarl.rollout.agent import AgentLoopSettings, load_tools
    from megarl.rollout.process import ProcessRolloutEngine
    from megarl.rollout.torch import TorchRolloutEngine
    from megarl.trainer.batch import PromptItem
    from megarl.trainer.generation import AgentRollout

    torch.set_num_threads(1)
    path = tiny_folder("qwen2")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    tools_yaml = tmp_path / "tools.yaml"
    tools_yaml.write_text(yaml.safe_dump({"tools": [
        {"class_name": "megarl.rollout.agent.tools.CalculatorTool", "config": {"type": "native"}}]}))
    settings = AgentLoopSettings(format=FORMAT, max_assistant_turns=3,
                                 tool_config_path=str(tools_yaml))
    agent = AgentRollout(load_tools(tools_yaml), settings, tok)
    items = []
    for k, q in enumerate(("ab", "what is 6*7")):
        text = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                       add_generation_prompt=True)
        items.append(PromptItem(tok(text, add_special_tokens=False)["input_ids"], "arith", "1",
                                {"index": k}))
    base = {k: v.clone() for k, v in load_model(path, head="lm").state_dict().items()}
    ref = TorchRolloutEngine.from_pretrained(path, tokenizer=None, max_num_seqs=8)
    proc = ProcessRolloutEngine(_spec(path, max_num_seqs=8), slots=2)
    yield path, tok, agent, items, base, ref, proc
    proc.close()


def _same(got, want) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert (a.prompt_index, a.sample_index) == (b.prompt_index, b.sample_index)
        assert a.response_ids == b.response_ids and a.response_mask == b.response_mask
        assert a.logprobs == b.logprobs and a.finish_reason == b.finish_reason
        assert [c.response for c in a.tool_calls] == [c.response for c in b.tool_calls]


def test_each_trajectory_is_generated_by_one_version(setup):
    import transformers

    from megarl.rollout.agent import load_tools, run_agent_loop
    from megarl.rollout.agent.remote import trajectory_from_plain
    from megarl.rollout.protocol import SamplingParams
    from megarl.trainer.generation import agent_request, generate

    path, tok, agent, items, base, ref, proc = setup
    new = _perturbed(base, 0.05, 1)
    sp = SamplingParams(n=2, temperature=1.0, seed=5, max_new_tokens=70,
                        stop_token_ids=list(range(40, 70)))  # turns of a few tokens
    request = agent_request(items, [0, 1], sp, 0, agent)
    proc.update_weights(base.items())
    proc.prefetch_agent(agent, request, sp)
    proc.update_weights(new.items())  # published while the version-0 request runs
    v0 = [trajectory_from_plain(d) for d in proc.generate_agent(agent, request, sp)]
    v1 = [trajectory_from_plain(d) for d in proc.generate_agent(agent, request, sp)]  # now: v1

    local_tools = load_tools(agent.settings.tool_config_path)
    for trajs, state, version in ((v0, base, 0), (v1, new, 1)):
        ref.update_weights(state.items())
        want = run_agent_loop(ref, request.prompts, sp, tok, local_tools, agent.settings,
                              interactions={}, **request.loop_kwargs())
        _same(trajs, want)
        assert all(t.turn_versions == [version] * t.turns for t in trajs)
    assert max(t.turns for t in v0) >= 2 and all(t.tool_calls for t in v0)
    assert all(c.response == "42" and not c.error for t in v0 for c in t.tool_calls)
    assert [t.response_ids for t in v0] != [t.response_ids for t in v1]

    # every model token of a version-0 trajectory, in every turn, has version 0's logprob
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    for t in v0:
        mask = torch.tensor(t.response_mask, dtype=torch.bool)
        engine = torch.tensor(t.logprobs, dtype=torch.float64)
        torch.testing.assert_close(engine[mask], _hf_logprobs(hf, base, t)[mask], atol=1e-5,
                                   rtol=0)
    gap = max(float((torch.tensor(t.logprobs, dtype=torch.float64)
                     - _hf_logprobs(hf, new, t)).abs().max()) for t in v0)
    assert gap > 1e-3  # the versions differ where the check looks

    # the trainer's generate through the engine process: samples carry the version
    samples = generate(proc, items, sp, group_offset=0, agent=agent)
    assert {s.policy_version for s in samples} == {1}
    assert [s.response_ids for s in samples] == [t.response_ids for t in v1]
    assert [s.response_mask for s in samples] == [t.response_mask for t in v1]


def test_a_checkpointed_multi_turn_request_is_restored_exactly(setup, tmp_path):
    from megarl.rollout.agent.remote import trajectory_from_plain
    from megarl.rollout.protocol import SamplingParams
    from megarl.trainer.generation import agent_request

    path, tok, agent, items, base, ref, proc = setup
    sp = SamplingParams(n=2, temperature=1.0, seed=9, max_new_tokens=50,
                        stop_token_ids=list(range(40, 70)))
    request = agent_request(items, [1], sp, 7, agent)
    proc.update_weights(base.items())
    proc.prefetch_agent(agent, request, sp)
    torch.save(proc.export_prefetched(), tmp_path / "inflight.pt")
    got = proc.generate_agent(agent, request, sp)
    assert proc.pending() == []
    proc.import_prefetched(torch.load(tmp_path / "inflight.pt", weights_only=True))
    assert len(proc.pending()) == 1
    again = proc.generate_agent(agent, request, sp)
    _same([trajectory_from_plain(d) for d in again], [trajectory_from_plain(d) for d in got])
    assert again == got


def test_a_long_multi_turn_request_reports_progress_after_each_turn(setup, tmp_path):
    """A request of 4 tool rounds of 2 s each (8 s in all) on an engine process whose silence
    timeout is 5 s: the process reports after each turn, so the wait counts from the last
    turn and the request completes. Before: "sent nothing for 5 s" at the request's 5th
    second (a timeout that long agent steps could only outgrow by weakening hang detection)."""
    from test_rollout_process import _spec

    from megarl.rollout.agent import AgentLoopSettings, load_tools
    from megarl.rollout.process import ProcessRolloutEngine
    from megarl.rollout.protocol import SamplingParams
    from megarl.trainer.generation import AgentRollout, agent_request

    path, tok, _, items, base, _, _ = setup
    tools_yaml = tmp_path / "slow_tools.yaml"
    tools_yaml.write_text(yaml.safe_dump({"tools": [
        {"class_name": f"{__name__}.SlowCalculator", "config": {"type": "native"}}]}))
    settings = AgentLoopSettings(format=FORMAT, max_assistant_turns=5,
                                 tool_config_path=str(tools_yaml))
    agent = AgentRollout(load_tools(tools_yaml), settings, tok)
    sp = SamplingParams(n=1, temperature=1.0, seed=3, max_new_tokens=200,
                        stop_token_ids=list(range(40, 70)))
    request = agent_request(items[:1], [0], sp, 0, agent)
    proc = ProcessRolloutEngine(_spec(path, max_num_seqs=8), slots=2)
    try:
        proc.update_weights(base.items())  # start-up under the default bound: a loaded box
        proc.timeout_s = 5.0  # took more than 5 s to start the process and map the ring
        got = proc.generate_agent(agent, request, sp)
    finally:
        proc.close()
    assert [d["user_turns"] for d in got] == [4], [d["finish_reason"] for d in got]
    assert all(c["response"] == "42" for d in got for c in d["tool_calls"])
