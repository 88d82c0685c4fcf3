"""Outcome reward models (HF *ForSequenceClassification): which kind a checkpoint is, and the
score megarl reads (the torch backend's ``prm`` role) against transformers'
AutoModelForSequenceClassification in float64, on the policy's ids and on a re-rendered input
(an RM whose tokenizer differs)."""

from __future__ import annotations

import pytest
import torch

from megarl.backends.torch import TorchBackend
from megarl.errors import UserInputError
from megarl.models import read_hf_config
from megarl.models.testing import PAD_TOKEN_ID, make_tiny_hf_model, make_tiny_tokenizer
from megarl.trainer.outcome_rm import (
    OutcomeRewardModel,
    load_rm_tokenizer,
    reward_model_kind,
)
from megarl.utils import dist as mdist


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    mdist.init_distributed(torch.device("cpu"))

# ids of the tiny character tokenizer: 3 specials, then printable ASCII from id 3
ROWS = [  # (prompt ids, response ids): lengths differ so the batch is padded both sides
    ([1, 40, 41, 42, 43, 2, 1, 50], [60, 61, 62, 63, 64, 65, 2]),
    ([1, 44, 45, 2], [70, 71, 72]),
    ([1, 46, 47, 48, 49, 51, 52, 53, 54, 2, 1], [80]),
]


def hf_rm(path, **kwargs):
    import transformers

    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        path, dtype=torch.float64, **kwargs)
    return model.eval()


def hf_scores_one_by_one(model, seqs: list[list[int]]) -> torch.Tensor:
    """transformers' score of each sequence run alone (no padding)."""
    with torch.no_grad():
        return torch.stack([model(torch.tensor([s])).logits[0, 0] for s in seqs])


def hf_scores_left_padded(model, seqs: list[list[int]], pad: int) -> torch.Tensor:
    """transformers' own batched reading: left padding, the last non-pad token by pad_token_id."""
    width = max(len(s) for s in seqs)
    ids = torch.tensor([[pad] * (width - len(s)) + s for s in seqs])
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(s) for s in seqs])[:, None])
    model.config.pad_token_id = pad
    with torch.no_grad():
        return model(ids, attention_mask=mask.long()).logits[:, 0]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3_moe"])
def rm_folder(request, tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp(request.param), request.param,
                              head="seq_cls", seed=3)


def hf_reference(folder):
    """transformers' model in float64 (MoE experts by its eager loop: grouped_mm has no
    float64)."""
    moe = "moe" in read_hf_config(folder)["model_type"]
    return hf_rm(folder, **({"experts_implementation": "eager"} if moe else {}))


def test_sequence_classifier_loads_without_bias_and_scores_like_transformers(rm_folder):
    config = read_hf_config(rm_folder)
    assert config["architectures"][0].endswith("ForSequenceClassification")
    backend = TorchBackend("prm", str(rm_folder))
    assert backend.num_labels == 1 and backend.model.score.bias is None
    tok = make_tiny_tokenizer()
    orm = OutcomeRewardModel(backend, tok)
    got = orm.score([p for p, _ in ROWS], [r for _, r in ROWS]).double()
    seqs = [p + r for p, r in ROWS]
    ref = hf_reference(rm_folder)
    want = hf_scores_one_by_one(ref, seqs)
    assert torch.allclose(got, want, atol=1e-5), (got, want)
    # transformers' batched, left-padded reading agrees (PAD never occurs inside the rows)
    assert torch.allclose(hf_scores_left_padded(ref, seqs, PAD_TOKEN_ID), want, atol=1e-10)
    # the score is the last token's: the second-to-last token's differs (no off-by-one passes)
    before = hf_scores_one_by_one(ref, [s[:-1] for s in seqs])
    assert (before - want).abs().min() > 1e-3


def test_kind_follows_the_architecture_and_a_conflict_names_the_key():
    seq = {"architectures": ["LlamaForSequenceClassification"]}
    tok = {"architectures": ["Qwen2ForTokenClassification"]}
    assert reward_model_kind("auto", seq, "rm") == "outcome"
    assert reward_model_kind("auto", tok, "prm") == "prm"
    assert reward_model_kind("outcome", seq, "rm") == "outcome"
    assert reward_model_kind("prm", tok, "prm") == "prm"
    assert reward_model_kind("outcome", {}, "rm") == "outcome"  # no architectures: as told
    for kind, cfg in (("prm", seq), ("outcome", tok)):
        with pytest.raises(UserInputError, match="reward_model.model.kind"):
            reward_model_kind(kind, cfg, "x")
    with pytest.raises(UserInputError, match="reward_model.model.kind=outcome or prm"):
        reward_model_kind("auto", {"architectures": ["LlamaForCausalLM"]}, "x")


RM_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}]: {{ m['content'] }}\n{% endfor %}"
               "<|im_end|>")


def test_differing_tokenizer_rerenders_the_conversation(tmp_path):
    """An RM with its own chat template: the response is decoded (EOS dropped) and the RM
    template renders the prompt's messages plus the assistant's answer; the score is
    transformers' on that text, encoded by the RM's tokenizer."""
    rm = make_tiny_hf_model(tmp_path / "rm", "llama", head="seq_cls", seed=5)
    rm_tok = make_tiny_tokenizer()
    rm_tok.chat_template = RM_TEMPLATE
    rm_tok.save_pretrained(rm)
    policy = make_tiny_tokenizer()
    assert load_rm_tokenizer(str(rm), None, policy) is not None  # differs: re-rendered
    orm = OutcomeRewardModel(TorchBackend("prm", str(rm)), policy,
                             load_rm_tokenizer(str(rm), None, policy), max_length=None)
    messages = [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1?"}],
                [{"role": "user", "content": "Say hi"}]]
    responses = [policy.encode("It is 2.", add_special_tokens=False) + [policy.eos_token_id],
                 policy.encode("hi there", add_special_tokens=False)]
    prompts = [[1, 3, 4], [1, 5]]  # unused when re-rendering
    texts = ["[system]: be brief\n[user]: 1+1?\n[assistant]: It is 2.\n<|im_end|>",
             "[user]: Say hi\n[assistant]: hi there\n<|im_end|>"]
    seqs = [rm_tok.encode(t, add_special_tokens=False) for t in texts]
    assert orm.inputs(prompts, responses, messages) == seqs
    want = hf_scores_one_by_one(hf_rm(rm), seqs)
    got = orm.score(prompts, responses, messages).double()
    assert torch.allclose(got, want, atol=1e-5), (got, want)
    # max_length cuts at the right (verl's truncation), as the score then shows
    short = OutcomeRewardModel(orm.backend, policy, orm.rm_tokenizer, max_length=12)
    cut = hf_scores_one_by_one(hf_rm(rm), [s[:12] for s in seqs])
    assert torch.allclose(short.score(prompts, responses, messages).double(), cut, atol=1e-5)
    with pytest.raises(UserInputError, match="chat messages"):
        orm.score(prompts, responses, None)


def test_same_tokenizer_reads_the_policy_ids(tmp_path):
    rm = make_tiny_hf_model(tmp_path / "rm", "qwen2", head="seq_cls")
    policy = make_tiny_tokenizer()
    assert load_rm_tokenizer(str(rm), None, policy) is None
    # verl's input_tokenizer set: always re-rendered
    assert load_rm_tokenizer(str(rm), str(rm), policy) is not None
    bare = make_tiny_hf_model(tmp_path / "bare", "qwen2", head="seq_cls", tokenizer=False)
    assert load_rm_tokenizer(str(bare), None, policy) is None


def test_rule_reward_beside_an_outcome_rm_skips_sources_without_one():
    """verl never runs the rule reward when the RM scores (hh_rlhf has none): next to an outcome
    RM a source without a rule scores 0 instead of failing; the others are scored as usual."""
    from megarl.rewards import make_reward_manager, make_reward_pool
    from megarl.rewards.managers import RuleRewardBesideModel

    pool = make_reward_pool("local", num_workers=1, timeout_s=10.0, memory_mb=1024)
    try:
        naive = make_reward_manager("naive", pool)
        with pytest.raises(ValueError, match="no built-in reward"):
            naive(["x"], ["Dahoas/full-hh-rlhf"], ["a"])
        beside = RuleRewardBesideModel(naive)
        scores, metrics = beside(["#### 4", "hello", "#### 5"],
                                 ["gsm8k", "Dahoas/full-hh-rlhf", "gsm8k"], ["4", None, "4"])
        assert scores.tolist() == [1.0, 0.0, 0.0]
        assert metrics["reward/score/mean"] == 0.5  # over the two gsm8k responses
        scores, metrics = beside(["hi"], ["Dahoas/full-hh-rlhf"], [None])
        assert scores.tolist() == [0.0] and metrics == {}
    finally:
        pool.close()
