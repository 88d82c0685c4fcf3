"""``data.apply_chat_template_kwargs``: extra variables of the chat template (Qwen3's
``enable_thinking``, gpt-oss's ``reasoning_effort``) reach every rendering, as verl passes them
to ``apply_chat_template`` (its RLHFDataset and agent loop): the dataset's prompts and the agent
loop's continuations equal transformers' own ``apply_chat_template`` given the same kwargs."""

from __future__ import annotations

import pytest

from megarl.data import RLDataset
from megarl.errors import UserInputError
from megarl.models.testing import make_tiny_tokenizer
from megarl.rollout.agent.chat import ChatContinuation
from megarl.rollout.agent.loop import AgentLoopSettings

# reads both variables: a system line for reasoning_effort, an empty think block after every
# assistant header when enable_thinking is false (as Qwen3's template does)
TEMPLATE = (
    "{% if reasoning_effort is defined %}<|im_start|>system\nReasoning: {{ reasoning_effort }}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
KWARGS = {"enable_thinking": False, "reasoning_effort": "high"}
MESSAGES = [{"role": "user", "content": "What is 2+3?"}]


@pytest.fixture(scope="module")
def tok():
    t = make_tiny_tokenizer()
    t.chat_template = TEMPLATE
    return t


def _rows():
    return [{"prompt": MESSAGES, "data_source": "gsm8k",
             "reward_model": {"ground_truth": "5"}, "extra_info": {}}]


def test_dataset_prompts_equal_transformers_with_the_kwargs(tok):
    ds = RLDataset.from_rows("rows", _rows(), tok, max_prompt_length=200,
                             chat_template_kwargs=KWARGS)
    want = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False, **KWARGS)
    plain = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert "Reasoning: high" in want and "<think>\n\n</think>" in want and want != plain
    item = ds[0]
    assert item.prompt_text == want
    assert item.prompt_ids == tok(want, add_special_tokens=False)["input_ids"]
    # without the kwargs: the template's defaults
    assert RLDataset.from_rows("rows", _rows(), tok, max_prompt_length=200)[0].prompt_text == plain


def test_dataset_kwargs_with_data_chat_template(tok):
    """data.chat_template given: the kwargs reach that template."""
    other = "{% for m in messages %}[{{ m.content }}|{{ reasoning_effort }}]{% endfor %}"
    ds = RLDataset.from_rows("rows", _rows(), tok, max_prompt_length=200, chat_template=other,
                             chat_template_kwargs={"reasoning_effort": "low"})
    want = tok.apply_chat_template(MESSAGES, chat_template=other, add_generation_prompt=True,
                                   tokenize=False, reasoning_effort="low")
    assert ds[0].prompt_text == want == "[What is 2+3?|low]"


def test_agent_continuations_equal_transformers_with_the_kwargs(tok):
    """The tool turn's text plus the next assistant header (the part the agent loop appends)
    is what transformers renders for the longer conversation after the shorter one."""
    chat = ChatContinuation(tok, KWARGS)
    before = [*MESSAGES, {"role": "assistant", "content": "<tool_call>x</tool_call>"}]
    after = [*before, {"role": "tool", "content": "5"}]
    short = tok.apply_chat_template(before, tokenize=False, **KWARGS)
    full = tok.apply_chat_template(after, add_generation_prompt=True, tokenize=False, **KWARGS)
    assert full.startswith(short)
    assert chat.tool_turn_text(["5"]) == full[len(short):]
    assert chat.tool_turn_text(["5"]).endswith("<think>\n\n</think>\n\n")
    assert chat.render(after, True) == full
    assert not ChatContinuation(tok).tool_turn_text(["5"]).endswith("</think>\n\n")


def test_agent_settings_carry_the_kwargs():
    s = AgentLoopSettings(enable=True, chat_template_kwargs=KWARGS)
    assert s.chat_template_kwargs == KWARGS
    assert AgentLoopSettings().chat_template_kwargs == {}


@pytest.mark.parametrize("bad", [{"tools": []}, {"add_generation_prompt": False},
                                 {"not a name": 1}, ["enable_thinking"]])
def test_bad_kwargs_name_the_key(tok, bad):
    with pytest.raises(UserInputError, match="data.apply_chat_template_kwargs"):
        RLDataset.from_rows("rows", _rows(), tok, max_prompt_length=200, chat_template_kwargs=bad)
    with pytest.raises(UserInputError, match="data.apply_chat_template_kwargs"):
        ChatContinuation(tok, bad)
