"""A process reward model on multi-turn trajectories: its steps are the model's turns.

A tiny random qwen2 policy on the torch engine runs the agent loop (every stopped turn calls the
``echo`` tool, 3 turns at most, n=2 per prompt); the engine is wrapped to record what each turn
generated. A tiny random token-classification PRM (the torch backend) scores the batch built
from the trajectories with ``score_steps`` as the trainer calls it. Checked against brute-force
references computed here from the recorded turns:

- the step mask is exactly the last token of each model turn (a truncated turn too), every
  scored position is a model token (response_mask 1), none falls in a tool response or the
  template's glue, and the separator's steps (a step at every newline) play no part;
- the step rewards equal p(correct) - p(incorrect) of a float64 transformers forward of the
  PRM over prompt + whole trajectory, with ``prm_step_token`` substituted at the turn ends;
- PURE's strict min-form credit (``pure_rloo_advantages``, leave-one-out token baseline, as
  the trainer calls it): every model token of turn k gets the minimum of the step rewards of
  turns k.. minus the baseline of the model tokens after it, tool and glue tokens get 0.

Planted: turn ends taken at every 0->1 change (a turn's first token) instead, a step kept at
the separator, or the tool tokens counted in the per-step token count each fail.
"""

from __future__ import annotations

import math

import pytest
import torch

from megarl.rollout.protocol import SamplingParams


class RecordingEngine:
    """Forwards to an engine and keeps (prompt ids, generated ids) of every completion."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate(self, prompts, sampling, prompt_keys=None):
        out = self.engine.generate(prompts, sampling, prompt_keys=prompt_keys)
        for c in out:
            self.calls.append((list(prompts[c.prompt_index]), list(c.token_ids)))
        return out


def reference_turns(sample, calls) -> list[tuple[int, int]]:
    """[(start, end)) response positions of each model turn, from the engine's records."""
    full = sample.prompt_ids + sample.response_ids
    turns = []
    for prompt, ids in calls:
        n = len(prompt)
        if n < len(sample.prompt_ids) or full[:n] != prompt:
            continue
        take = min(len(ids), len(full) - n)
        if take and full[n:n + take] == ids[:take]:
            turns.append((n - len(sample.prompt_ids), n - len(sample.prompt_ids) + take))
    return sorted(set(turns))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from megarl.backends.torch import TorchBackend
    from megarl.models.testing import make_tiny_hf_model, make_tiny_tokenizer
    from megarl.rollout.agent import AgentLoopSettings, BaseTool, ToolResponse
    from megarl.rollout.agent.tool_parser import ParsedTurn, ToolCall, register_tool_parser
    from megarl.rollout.agent.tools import _schema
    from megarl.rollout.torch import TorchRolloutEngine
    from megarl.trainer.batch import PromptItem, RolloutBatch
    from megarl.trainer.generation import AgentRollout, generate
    from megarl.utils import dist as mdist

    class EveryTurnEcho:
        def parse(self, text):
            return ParsedTurn([ToolCall("echo", {"x": len(text)})], text)

    class Echo(BaseTool):
        async def execute(self, instance_id, parameters, **kwargs):
            return ToolResponse(text=f"line\nx={parameters.get('x')}\n"), 0.0, {}

    register_tool_parser("prm_every_turn_echo", EveryTurnEcho)
    root = tmp_path_factory.mktemp("mt_prm")
    policy = make_tiny_hf_model(root / "policy", "qwen2")
    prm_path = make_tiny_hf_model(root / "prm", "qwen2", head="token_cls", seed=3)
    tok = make_tiny_tokenizer()
    engine = RecordingEngine(TorchRolloutEngine.from_pretrained(policy, max_num_seqs=8))
    items = []
    for k, q in enumerate(("ab", "what is 6*7", "x")):
        text = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                       add_generation_prompt=True)
        items.append(PromptItem(tok(text, add_special_tokens=False)["input_ids"], "arith", "1",
                                {"index": k}))
    # turns of a few tokens (stop ids 40..69), a budget that cuts some trajectories mid-turn
    sp = SamplingParams(n=2, temperature=1.0, seed=11, max_new_tokens=70,
                        stop_token_ids=list(range(40, 70)))
    tool = Echo({}, _schema("echo", "echo x", "x", "anything"))
    agent = AgentRollout({"echo": tool}, AgentLoopSettings(format="prm_every_turn_echo",
                                                           max_assistant_turns=3), tok)
    samples = generate(engine, items, sp, group_offset=0, agent=agent)
    batch = RolloutBatch.from_samples(samples, tok.pad_token_id)
    mdist.init_distributed(torch.device("cpu"))  # a world of one
    prm = TorchBackend("prm", str(prm_path))
    return tok, samples, engine.calls, batch, prm, prm_path


def test_steps_are_the_model_turns(run):
    from megarl.data.steps import step_end_token_ids
    from megarl.trainer.prm import score_steps

    tok, samples, calls, batch, prm, _ = run
    newline = step_end_token_ids(tok, "\n")  # a separator every tool response contains
    marker = tok.encode("\n", add_special_tokens=False)[0]
    _, step_mask = score_steps(prm, batch, newline, marker)
    turn_counts = []
    for i, s in enumerate(samples):
        turns = reference_turns(s, calls)
        turn_counts.append(len(turns))
        want = [0.0] * batch.response_ids.shape[1]
        for _, end in turns:
            want[end - 1] = 1.0
        assert step_mask[i].tolist() == want, i
        # every scored position is a model token; no tool / glue token is scored
        assert all(s.response_mask[k] == 1 for k in range(len(s.response_ids))
                   if step_mask[i, k] == 1)
        model = sum(end - start for start, end in turns)
        assert model == sum(s.response_mask)  # the recorded turns cover the model's tokens
    assert max(turn_counts) >= 2  # trajectories with several turns
    # tool responses hold the separator: the single-turn split would put steps there
    assert any(tok.decode([t]).endswith("\n") and m == 0
               for s in samples for t, m in zip(s.response_ids, s.response_mask))


def test_step_rewards_match_a_float64_prm_forward(run):
    import transformers

    from megarl.trainer.prm import score_steps

    tok, samples, calls, batch, prm, prm_path = run
    marker = tok.encode("\n", add_special_tokens=False)[0]
    for marker_id in (None, marker):
        rewards, step_mask = score_steps(prm, batch, [marker], marker_id)
        hf = transformers.AutoModelForTokenClassification.from_pretrained(
            prm_path, dtype=torch.float64).eval()
        for i, s in enumerate(samples):
            ends = [end - 1 for _, end in reference_turns(s, calls)]
            response = list(s.response_ids)
            if marker_id is not None:
                for e in ends:
                    response[e] = marker_id
            ids = torch.tensor([s.prompt_ids + response])
            with torch.no_grad():
                p = torch.softmax(hf(ids).logits[0, len(s.prompt_ids):], -1)
            want = torch.zeros(batch.response_ids.shape[1], dtype=torch.float64)
            for e in ends:
                want[e] = p[e, 1] - p[e, 0]
            torch.testing.assert_close(rewards[i].double(), want, atol=2e-6, rtol=0)


@pytest.mark.parametrize("mask_separator", [False, True])
def test_min_form_credit_goes_to_each_turns_model_tokens(run, mask_separator):
    from megarl.algos.pure import pure_rloo_advantages
    from megarl.trainer.prm import score_steps

    tok, samples, calls, batch, prm, _ = run
    rewards, step_mask = score_steps(prm, batch, [0], None)
    _, returns = pure_rloo_advantages(
        step_rewards=rewards.double(), step_mask=step_mask, response_mask=batch.response_mask,
        verifiable_rewards=torch.zeros(len(samples), dtype=torch.float64),
        group_index=batch.group_index, mode="prm", credit_assignment="min",
        mask_separator=mask_separator, normalize=False)
    # brute force, per trajectory: r_k per turn, o = min_k r_k, the others' outcome per model
    # token as the baseline, turn k's tokens: min(r_k..) - baseline * (model tokens of turns
    # k.. other than their last)
    turns = [reference_turns(s, calls) for s in samples]
    r = [[float(rewards[i, end - 1]) for _, end in turns[i]] for i in range(len(samples))]
    lengths = [sum(e - b for b, e in t) for t in turns]
    for i, s in enumerate(samples):
        others = [j for j in range(len(samples)) if samples[j].group == s.group and j != i]
        baseline = (sum(min(r[j]) for j in others) / sum(lengths[j] for j in others)
                    if others else 0.0)
        want = [0.0] * batch.response_ids.shape[1]
        for k, (start, end) in enumerate(turns[i]):
            later = sum(e - b - 1 for b, e in turns[i][k:])
            value = min(r[i][k:]) - baseline * later
            for pos in range(start, end - 1 if mask_separator else end):
                want[pos] = value  # mask_separator: the turn's last token gets no return
        torch.testing.assert_close(returns[i], torch.tensor(want, dtype=torch.float64),
                                   atol=1e-9, rtol=0)


@pytest.mark.parametrize("recipe", ["pure_prm", "pure_prm_vr"])
def test_pure_with_multi_turn_passes_the_config_check(tmp_path, recipe):
    from megarl.config.loader import resolve_config

    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n- class_name: megarl.rollout.agent.tools.CalculatorTool\n"
                     "  config: {type: native}\n")
    mt = "actor_rollout_ref.rollout.multi_turn"
    cfg = resolve_config(recipe, [f"{mt}.enable=true", f"{mt}.tool_config_path={tools}"]).config
    assert cfg.reward_model.enable and cfg.actor_rollout_ref.rollout.multi_turn.enable


@pytest.mark.e2e
def test_pure_trains_on_multi_turn_trajectories(tmp_path, demo_assets):
    """2 PURE (PRM + verifiable reward) steps on the embedded demo with the calculator tool,
    every turn read as a call (test_multi_turn_trainer's wrapper), two model turns each: the
    trainer's PRM steps are the turns (``num_of_steps`` equals the assistant turns of every
    trajectory; the separator's split gives many more), and the update's advantages are 0 on
    every tool and glue token."""
    from test_multi_turn_trainer import FORCED_CALLS, MT, tool_yaml
    from trainer_helpers import train, train_rows

    train(tmp_path / "run", "pure_prm_vr", "trainer.total_training_steps=2",
          "data.max_response_length=160", f"{MT}.enable=true",
          f"{MT}.tool_config_path={tool_yaml(tmp_path)}", f"{MT}.max_assistant_turns=2",
          python_args=("-c", FORCED_CALLS, str(tmp_path / "update.pt")))
    rows = train_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["multi_turn/tool_calls/mean"] == 1
        for stat in ("mean", "max", "min"):
            assert row[f"num_of_steps/{stat}"] == row["multi_turn/assistant_turns/mean"] == 2
        assert all(math.isfinite(row[k]) for k in ("actor/pg_loss", "critic/advantages/mean"))
    update = torch.load(tmp_path / "update.pt")
    mask = update["response_mask"]
    L = update["response_length"]
    tool = (update["attention_mask"][:, -L:].float() - mask) > 0
    assert bool(tool.any()) and bool((update["advantages"][tool] == 0).all())
    assert bool((update["advantages"][mask.bool()] != 0).any())
