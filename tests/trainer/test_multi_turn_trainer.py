"""The trainer on multi-turn trajectories (``rollout.multi_turn.enable``; megarl/rollout/agent).

(a) 2 GRPO steps on the embedded demo with the calculator tool (a tool YAML written here): the
    demo policy writes no tool calls, so the run's tool-call format is replaced (in the
    training process only) by one that reads a call to the calculator in every turn, and
    ``max_assistant_turns=2`` ends each trajectory on its second turn: every trajectory is
    [model turn | tool response + template glue | model turn]. The rows carry the multi-turn
    metrics; the reward function sees the whole decoded trajectory and ``extra_info``'s turns,
    tool calls and tool rewards; the actor update's batch has the holes of the loop's masks.
(b) unit level, tiny random model, torch engine: the batch built from trajectories of the agent
    loop has ``response_mask`` exactly the loop's masks (attention on every token); the torch
    backend's recomputed logprobs equal the engine's on the model's tokens (1e-5, the bound
    of tests/rollout/test_rollout_logprobs.py); the actor loss (fused and unfused) on the
    batch equals an independent float64 computation over the model's tokens only. tools_kwargs
    from extra_info reach the tools' create; tool rewards and calls reach extra_info.
(c) unsupported combinations with multi_turn.enable are refused naming the keys.

Planted: a batch whose response_mask is all ones (the AND with the loop's mask dropped) fails
(b)'s mask and loss checks; the fused loss without its filter to model tokens fails (b)'s
fused check (entropy and token counts include tool tokens).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml

from megarl.config import ConfigError
from megarl.config.loader import resolve_config

A = "actor_rollout_ref"
MT = f"{A}.rollout.multi_turn"

# launch/train.py with every turn read as one call to the calculator, and the actor update's
# batch saved (to sys.argv[1])
FORCED_CALLS = """
import runpy, sys
import torch
import megarl.trainer.learner as learner
from megarl.rollout.agent.tool_parser import ParsedTurn, ToolCall, register_tool_parser

class EveryTurnCalls:
    def parse(self, text):
        return ParsedTurn([ToolCall("calculator", {"expression": "(3 + 4) * 6"})], text)

register_tool_parser("hermes", EveryTurnCalls)
out = sys.argv.pop(1)
run_update = learner.run_update

def recording(backend, batch, keys, *args, **kwargs):
    if "advantages" in keys:
        seq = batch.sequence_batch(keys)
        torch.save({"attention_mask": seq.attention_mask, "response_length": seq.response_length,
                    "response_mask": seq.tensors["response_mask"],
                    "advantages": seq.tensors["advantages"]}, out)
    return run_update(backend, batch, keys, *args, **kwargs)

learner.run_update = recording
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""

REWARD = '''
import json

def compute_score(data_source, solution_str, ground_truth, extra_info=None, log=None):
    calls = extra_info["tool_calls"]
    with open(log, "a") as f:
        f.write(json.dumps({"turns": extra_info["turns"], "num_turns": extra_info["num_turns"],
                            "calls": calls, "tool_rewards": extra_info["tool_rewards"],
                            "has_response": "42" in solution_str}) + "\\n")
    return sum(map(ord, solution_str)) % 97 / 97
'''


def tool_yaml(directory) -> str:
    path = directory / "tools.yaml"
    path.write_text(yaml.safe_dump({"tools": [
        {"class_name": "megarl.rollout.agent.tools.CalculatorTool", "config": {"type": "native"}}]}))
    return str(path)


def test_grpo_two_steps_with_the_calculator(tmp_path, demo_assets):
    from trainer_helpers import train, train_rows

    (tmp_path / "reward.py").write_text(REWARD)
    log = tmp_path / "reward_calls.jsonl"
    train(tmp_path / "run", "grpo", "trainer.total_training_steps=2",
          "data.max_response_length=160",  # two turns of the demo's ~40 tokens, and the tool's
          f"{MT}.enable=true", f"{MT}.tool_config_path={tool_yaml(tmp_path)}",
          f"{MT}.max_assistant_turns=2",
          f"custom_reward_function.path={tmp_path / 'reward.py'}",
          "custom_reward_function.name=compute_score",
          f"+custom_reward_function.reward_kwargs.log={log}",
          python_args=("-c", FORCED_CALLS, str(tmp_path / "update.pt")))
    rows = train_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        for key in ("critic/score/mean", "actor/pg_loss", "response_length/mean"):
            assert math.isfinite(row[key]), key
        # two model turns and one tool round each: verl's num_turns counts the user prompt too
        assert row["num_turns/mean"] == row["num_turns/max"] == 4
        assert row["multi_turn/assistant_turns/mean"] == row["multi_turn/assistant_turns/max"] == 2
        assert row["multi_turn/tool_calls/mean"] == 1 and row["multi_turn/tool_errors/mean"] == 0
        assert row["multi_turn/tool_time_s/mean"] >= 0 and "multi_turn/tool_time_s/sum" in row
        assert 0 <= row["multi_turn/truncated_ratio"] <= 1
        assert row["multi_turn/appended_tokens/mean"] > 0
        # the ids equal the whole conversation re-rendered by the template and tokenized
        assert row["multi_turn/sanity_mismatch_ratio"] == 0
        assert row["multi_turn/generated_tokens/mean"] > 0
        # response lengths count every response token, the tool's included
        assert row["response_length/mean"] == pytest.approx(
            row["multi_turn/generated_tokens/mean"] + row["multi_turn/appended_tokens/mean"])
    seen = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(seen) == 2 * 16
    for s in seen:
        assert s["turns"] == 2 and s["num_turns"] == 4 and s["tool_rewards"] == {"calculator": 0.0}
        assert [c["name"] for c in s["calls"]] == ["calculator"]
        assert s["calls"][0]["response"] == "42" and not s["calls"][0]["error"]
        assert s["has_response"]  # the decoded response holds the tool's output
    update = torch.load(tmp_path / "update.pt")
    L = update["response_length"]
    attention = update["attention_mask"][:, -L:].float()
    mask = update["response_mask"]
    assert bool((mask <= attention).all()) and float((attention - mask).sum()) > 0
    assert bool((update["advantages"][mask == 0] == 0).all())
    # every row: model tokens, then a hole (the tool turn), then model tokens again
    for row in mask.tolist():
        runs = [k for k, v in enumerate(row) if k == 0 or row[k - 1] != v]
        assert row[0] == 1 and len(runs) >= 3


# --- (b) ---------------------------------------------------------------------------------------


class RecordingTool:
    """A verl-protocol tool recording its create kwargs; calc_reward 0.25."""

    def __new__(cls):
        from megarl.rollout.agent import BaseTool, ToolResponse

        class _Tool(BaseTool):
            created: list = []

            async def create(self, instance_id=None, **kwargs):
                _Tool.created.append(kwargs.get("create_kwargs"))
                return await super().create(instance_id, **kwargs)

            async def execute(self, instance_id, parameters, **kwargs):
                return ToolResponse(text="ok:" + str(parameters.get("x"))), 0.0, {}

            async def calc_reward(self, instance_id, **kwargs):
                return 0.25

        from megarl.rollout.agent.tools import _schema

        return _Tool({}, _schema("echo", "echo x", "x", "anything"))


@pytest.fixture(scope="module")
def trajectories(tmp_path_factory):
    """Samples of the agent loop on a tiny random qwen2 and the torch engine: every stopped
    turn is a call to ``echo`` (3 turns at most), from two items with tools_kwargs."""
    from megarl.models.testing import make_tiny_hf_model, make_tiny_tokenizer
    from megarl.rollout.agent import AgentLoopSettings
    from megarl.rollout.agent.tool_parser import ParsedTurn, ToolCall, register_tool_parser
    from megarl.rollout.protocol import SamplingParams
    from megarl.rollout.torch import TorchRolloutEngine
    from megarl.trainer.batch import PromptItem
    from megarl.trainer.generation import AgentRollout, generate

    class EveryTurnEcho:
        def parse(self, text):
            return ParsedTurn([ToolCall("echo", {"x": len(text)})], text)

    register_tool_parser("every_turn_echo", EveryTurnEcho)
    path = make_tiny_hf_model(tmp_path_factory.mktemp("mt") / "m", "qwen2")
    tok = make_tiny_tokenizer()
    tool = RecordingTool()
    engine = TorchRolloutEngine.from_pretrained(path, max_num_seqs=8)
    items = []
    for k, q in enumerate(("ab", "what is 6*7")):
        text = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                       add_generation_prompt=True)
        items.append(PromptItem(tok(text, add_special_tokens=False)["input_ids"], "arith", "1",
                                {"index": k, "tools_kwargs": {"echo": {"create_kwargs": {"k": k}}}}))
    sp = SamplingParams(n=2, temperature=1.0, seed=5, max_new_tokens=96,
                        stop_token_ids=list(range(40, 70)))  # turns of a few tokens
    agent = AgentRollout({"echo": tool}, AgentLoopSettings(format="every_turn_echo",
                                                           max_assistant_turns=3), tok)
    samples = generate(engine, items, sp, group_offset=10, agent=agent)
    return path, tok, samples, type(tool).created


def test_samples_carry_the_trajectory(trajectories):
    _, _, samples, created = trajectories
    assert len(samples) == 4 and [s.group for s in samples] == [10, 10, 11, 11]
    assert sorted(c["k"] for c in created) == [0, 0, 1, 1]  # one create per trajectory
    assert any(0 in s.response_mask for s in samples)
    for s in samples:
        info = s.extra_info
        assert info["index"] in (0, 1) and info["tool_rewards"] == {"echo": 0.25}
        assert info["rollout_reward_scores"] == {"echo": 0.25}
        assert len(info["tool_calls"]) == info["turns"] - (s.finish_reason == "stop") \
            or s.finish_reason in ("length", "max_assistant_turns")
        assert all(c["response"].startswith("ok:") for c in info["tool_calls"])
        assert all(lp == 0.0 for lp, m in zip(s.rollout_logprobs, s.response_mask) if not m)
        assert s.multi_turn["turns"] == info["turns"]
        assert s.multi_turn["generated_tokens"] == sum(s.response_mask)


def test_batch_mask_logprobs_and_loss_on_model_tokens(trajectories):
    from megarl.algos import agg_loss
    from megarl.backends.torch import TorchBackend
    from megarl.trainer.batch import RolloutBatch
    from megarl.trainer.losses import ActorLossSettings, Norm, actor_loss_fn

    path, tok, samples, _ = trajectories
    batch = RolloutBatch.from_samples(samples, tok.pad_token_id)
    L = batch.response_ids.shape[1]
    for i, s in enumerate(samples):
        n = len(s.response_ids)
        assert batch.response_mask[i, :n].tolist() == [float(m) for m in s.response_mask]
        assert batch.response_padding_mask[i, :n].tolist() == [1.0] * n
        assert float(batch.response_mask[i, n:].abs().sum()) == 0
    seq = batch.sequence_batch()
    assert torch.equal(seq.attention_mask[:, -L:], batch.response_padding_mask.long())
    assert torch.equal(seq.tensors["response_mask"], batch.response_mask)

    # an independent float64 forward over prompt + the whole response (tool tokens in context)
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    ref = torch.zeros(len(samples), L, dtype=torch.float64)
    ent = torch.zeros(len(samples), L, dtype=torch.float64)
    for i, s in enumerate(samples):
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logp = torch.log_softmax(hf(ids).logits[0], -1)[len(s.prompt_ids) - 1: -1]
        n = len(s.response_ids)
        ref[i, :n] = logp.gather(1, torch.tensor(s.response_ids)[:, None])[:, 0]
        ent[i, :n] = -(logp.exp() * logp).sum(-1)
    mask = batch.response_mask.bool()
    engine_lp = batch.tensors["rollout_logprob"].double()
    torch.testing.assert_close(engine_lp[mask], ref[mask], atol=1e-5, rtol=0)

    from megarl.utils import dist as mdist

    mdist.init_distributed(torch.device("cpu"))  # a world of one
    be = TorchBackend("actor", path, optim={"lr": 0.0, "grad_clip": None})
    lp, _ = be.logprobs(seq, temperature=1.0, with_entropy=True)
    torch.testing.assert_close(lp.double()[mask], ref[mask], atol=1e-5, rtol=0)  # the trainer's
    torch.testing.assert_close(lp.double()[mask], engine_lp[mask], atol=1e-5, rtol=0)

    # the actor loss on the batch: advantages on every response position (tool tokens too, so
    # a loss that read them would differ), old logprobs = the reference (ratio ~1)
    gen = torch.Generator().manual_seed(0)
    adv = torch.randn(len(samples), L, generator=gen) * batch.response_padding_mask
    old = (ref + 0.01 * torch.randn(len(samples), L, generator=gen, dtype=torch.float64)).float()
    batch.tensors.update(advantages=adv, old_logprob=old)
    m = batch.response_mask.double()
    ratio = torch.exp(ref - old.double())
    a = adv.double()
    pg = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2))
    entropy_coeff = 0.01
    want = agg_loss(pg, m, "token-mean") - entropy_coeff * agg_loss(ent, m, "token-mean")
    norm = Norm(dp_size=1, batch_num_tokens=int(m.sum()), global_batch_size=len(samples),
                loss_scale_factor=float(L))
    for fused in (True, False):
        settings = ActorLossSettings(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0,
                                     agg_mode="token-mean", entropy_coeff=entropy_coeff,
                                     on_policy=False, fused=fused)
        fn = actor_loss_fn(settings, norm)
        got = {}

        def capture(out, mb, fn=fn, got=got):
            loss, metrics = fn(out, mb)
            got["loss"] = float(loss.detach())
            return loss, metrics

        be.train_step([batch.sequence_batch(("advantages", "old_logprob"))], capture)
        assert got["loss"] == pytest.approx(float(want), abs=2e-5), fused


# --- (c) ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("extra, keys", [
    (["data.apply_chat_template=false"], [f"{MT}.enable", "data.apply_chat_template"]),
])
def test_unsupported_combinations_are_refused(tmp_path, extra, keys):
    from megarl.errors import UserInputError

    with pytest.raises(UserInputError) as e:
        resolve_config("grpo", [f"{MT}.enable=true", f"{MT}.tool_config_path={tool_yaml(tmp_path)}",
                                *extra])
    assert isinstance(e.value, ConfigError)
    text = str(e.value)
    for key in keys:
        assert key in text, (key, text)


def test_multi_turn_needs_tools_or_an_interaction():
    """multi_turn.enable with neither a tool file nor an interaction file is refused naming
    both keys; an interaction alone is enough."""
    from megarl.errors import UserInputError

    with pytest.raises(UserInputError) as e:
        resolve_config("grpo", [f"{MT}.enable=true"])
    assert f"{MT}.tool_config_path" in str(e.value)
    assert f"{MT}.interaction_config_path" in str(e.value)
    resolve_config("grpo", [f"{MT}.enable=true", f"{MT}.interaction_config_path=i.yaml"])
