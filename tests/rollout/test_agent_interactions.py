"""Interactions in the agent loop (megarl/rollout/agent/interactions.py): a simulated user who
answers the model's turns, verl's ``BaseInteraction`` protocol and interaction YAML.

A scripted policy (tests/rollout/test_agent_loop.py's: fixed texts per turn, then EOS) with the
character-level tokenizer carrying Qwen2.5's chat template. Every appended user turn is
checked id for id against the turn written out by hand ("\\n" after the model's <|im_end|>, the
user turn, the next assistant header; mask 0, logprob 0), and the whole trajectory against the
template's rendering of the conversation (the sanity check). Checked: verl's gsm8k interaction
(loaded by verl's class name: megarl's built-in) says "try again" to a wrong answer and ends
the conversation on the right one (nothing appended after it); turn scores and the final
calculate_score; max_user_turns (the model answers the last user turn, as in verl); tool calls
and interaction turns in one trajectory; verl's base interaction (calculate_score without an
instance id); the errors a user meets (no interaction_kwargs, an unknown name, a bad file).
"""

from __future__ import annotations

import pytest
import yaml
from test_agent_loop import EOS, QWEN25_TEMPLATE, ScriptedPolicy, call, enc, prompt_of, tool_turn

from megarl.errors import UserInputError
from megarl.models.testing import make_tiny_tokenizer
from megarl.rollout.agent import AgentLoopSettings, CalculatorTool, run_agent_loop
from megarl.rollout.agent.interactions import Gsm8kInteraction, load_interactions
from megarl.rollout.protocol import SamplingParams


@pytest.fixture(scope="module")
def tok():
    t = make_tiny_tokenizer()
    t.chat_template = QWEN25_TEMPLATE
    return t


def user_turn(tok, text: str) -> list[int]:
    """Qwen2.5's user turn after an assistant's <|im_end|>, written out by hand."""
    return enc(tok, f"\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture()
def interaction_yaml(tmp_path):
    path = tmp_path / "interaction.yaml"
    path.write_text(yaml.safe_dump({"interaction": [
        {"name": "gsm8k", "class_name": "verl.interactions.gsm8k_interaction.Gsm8kInteraction",
         "config": {}},
        {"class_name": "megarl.rollout.agent.interactions.BaseInteraction", "config": {}}]}))
    return str(path)


def test_gsm8k_interaction_turns_masks_scores_and_limits(tok, interaction_yaml, caplog):
    interactions = load_interactions(interaction_yaml)
    assert sorted(interactions) == ["base", "gsm8k"]  # verl's default name: class name - suffix
    assert isinstance(interactions["gsm8k"], Gsm8kInteraction)
    assert "runs as megarl's built-in" in caplog.text
    tools = {"calculator": CalculatorTool()}
    scripts = [
        ["I think #### 5", "Sorry: #### 7"],  # wrong, then right: the interaction ends it
        ["#### 1", "#### 2", "#### 3", "#### 4"],  # never right: max_user_turns=2
        [call("calculator", '{"expression": "3 + 4"}'), "So #### 7"],  # a tool, then right
        ["hello", "again", "more"],  # verl's base interaction: never ends, scores 0.8
    ]
    prompts = [prompt_of(tok, q, tools) for q in ("q0", "q1", "q2", "q3")]
    kwargs = [{"name": "gsm8k", "ground_truth": "7"}, {"name": "gsm8k", "ground_truth": "9"},
              {"name": "gsm8k", "ground_truth": "7"}, {"name": "base"}]
    policy = ScriptedPolicy(tok, scripts)
    trajs = run_agent_loop(policy, [p for _, p in prompts], SamplingParams(max_new_tokens=2000),
                           tok, tools, AgentLoopSettings(max_user_turns=2),
                           prompt_messages=[m for m, _ in prompts],
                           interaction_kwargs=kwargs, interactions=interactions)
    model = [[enc(tok, x) + [EOS] for x in s] for s in scripts]
    wrong = user_turn(tok, Gsm8kInteraction.INCORRECT)

    t0, t1, t2, t3 = trajs
    assert t0.response_ids == model[0][0] + wrong + model[0][1]
    assert t0.response_mask == [1] * len(model[0][0]) + [0] * len(wrong) + [1] * len(model[0][1])
    assert all(lp == 0.0 for lp, m in zip(t0.logprobs, t0.response_mask) if not m)
    assert (t0.finish_reason, t0.turns, t0.user_turns) == ("stop", 2, 1)
    assert t0.turn_scores == [0.0, 1.0] and t0.interaction_score == 1.0
    assert t0.messages[-2:] == [{"role": "user", "content": Gsm8kInteraction.INCORRECT},
                                {"role": "assistant", "content": "Sorry: #### 7"}]

    assert t1.response_ids == model[1][0] + wrong + model[1][1] + wrong + model[1][2]
    assert (t1.finish_reason, t1.turns, t1.user_turns) == ("max_user_turns", 3, 2)
    assert t1.turn_scores == [0.0, 0.0] and t1.interaction_score == 0.0

    calc = tool_turn(tok, "7")
    assert t2.response_ids == model[2][0] + calc + model[2][1]
    assert t2.response_mask == [1] * len(model[2][0]) + [0] * len(calc) + [1] * len(model[2][1])
    assert (t2.finish_reason, t2.user_turns, t2.turn_scores) == ("stop", 1, [1.0])

    hello = user_turn(tok, "Your current result seems acceptable.")
    assert t3.response_ids == model[3][0] + hello + model[3][1] + hello + model[3][2]
    assert t3.turn_scores == [0.8, 0.8] and t3.interaction_score == 0.0  # base: no instance id
    for t in trajs:
        assert t.interaction == kwargs[t.prompt_index]["name"]
        assert t.sanity_checked and t.sanity_mismatch is None, t.sanity_mismatch
    assert interactions["gsm8k"]._instances == {}  # finalize_interaction ran for each
    # one engine call per turn over the live trajectories, in key order
    assert [keys for _, _, keys in policy.calls] == [[0, 1, 2, 3], [0, 1, 2, 3], [1, 3]]


def test_interaction_settings_and_errors(tok, interaction_yaml, tmp_path):
    tools = {"calculator": CalculatorTool()}
    _, p = prompt_of(tok, "q", tools)
    run = lambda kwargs, **kw: run_agent_loop(  # noqa: E731
        ScriptedPolicy(tok, [["#### 3", "#### 4"]]), [p], SamplingParams(max_new_tokens=500),
        tok, tools, AgentLoopSettings(interaction_config_path=interaction_yaml,
                                      max_assistant_turns=3), interaction_kwargs=kwargs, **kw)
    t = run([{"name": "gsm8k", "ground_truth": "4"}])[0]  # loaded from the settings' path
    assert (t.finish_reason, t.turn_scores, t.interaction_score) == ("stop", [0.0, 1.0], 1.0)
    with pytest.raises(UserInputError, match="no extra_info.interaction_kwargs"):
        run(None)
    with pytest.raises(UserInputError, match="name='nope' is not among"):
        run([{"name": "nope"}])
    only = {"gsm8k": Gsm8kInteraction({})}  # one interaction: the name may be left out
    t = run([{"ground_truth": "3"}], interactions=only)[0]
    assert t.turns == 1 and t.interaction_score == 1.0
    for body, match in [({"interactions": []}, "top-level 'interaction:'"),
                        ({"interaction": [{"class_name": "nowhere.X"}]}, "cannot import"),
                        ({"interaction": [{"class_name": "megarl.rollout.agent.tools.CalculatorTool"}]},
                         "not a subclass"),
                        ({"interaction": [{"class_name": "verl.interactions.gsm8k_interaction.Gsm8kInteraction"},
                                          {"class_name": "megarl.rollout.agent.interactions.Gsm8kInteraction"}]},
                         "a second interaction named 'gsm8k'")]:
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump(body))
        with pytest.raises(UserInputError, match=match) as e:
            load_interactions(path)
        assert str(path) in str(e.value)


def test_the_trainer_generation_passes_rows_interactions_and_reports_scores(tok):
    """`megarl.trainer.generation.generate` with an interaction: each row's
    ``extra_info.interaction_kwargs`` reaches the loop, and each sample's extra_info carries
    the turn scores and the final interaction score for the reward (verl's names), with the
    loop's mask. Before the wiring the trainer refused interaction_config_path."""
    from megarl.trainer.batch import PromptItem
    from megarl.trainer.generation import AgentRollout, generate

    tools = {"calculator": CalculatorTool()}
    prompts = [prompt_of(tok, q, tools) for q in ("q0", "q1")]
    items = [PromptItem(prompt_ids=p, data_source="gsm8k", ground_truth=gt,
                        extra_info={"interaction_kwargs": {"name": "gsm8k", "ground_truth": gt}})
             for (_, p), gt in zip(prompts, ("7", "9"))]
    policy = ScriptedPolicy(tok, [["#### 5", "#### 7"], ["#### 9"]])
    agent = AgentRollout(tools=tools, settings=AgentLoopSettings(max_user_turns=2),
                         tokenizer=tok, interactions={"gsm8k": Gsm8kInteraction({})})
    samples = generate(policy, items, SamplingParams(max_new_tokens=2000), 0, agent=agent)
    s0, s1 = samples
    assert s0.extra_info["turn_scores"] == [0.0, 1.0] and s0.extra_info["interaction_score"] == 1.0
    assert s1.extra_info["turn_scores"] == [1.0] and s1.extra_info["interaction_score"] == 1.0
    assert s0.extra_info["num_turns"] == 1 + 2 + 1
    wrong = user_turn(tok, Gsm8kInteraction.INCORRECT)
    first = enc(tok, "#### 5") + [EOS]
    assert s0.response_mask[:len(first) + len(wrong)] == [1] * len(first) + [0] * len(wrong)
