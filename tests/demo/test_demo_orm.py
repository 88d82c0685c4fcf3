"""The demo ORM (megarl.demo.orm): the built one scores the mean logit of each written token
under its LM, and transformers' sequence classifier scores it as megarl does; the pieces of the
learned attempt: sampling, labels, the ranking loss, the pairwise measure."""

import math

import pytest
import torch

from megarl.data.batching import pad_left
from megarl.demo import arith
from megarl.demo import orm as orm_lib
from megarl.demo.greedy import greedy_generate
from megarl.demo.sft import policy_config
from megarl.models import ModelArgs, Transformer, save_model

PROBLEM = arith.Problem((38, 61, 45, 74), ("+", "+", "-"))  # 38+61=99, 99+45=144, 144-74=70


@pytest.fixture(scope="module")
def model(tok):
    torch.manual_seed(0)
    cfg = policy_config(tok, hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64)
    return Transformer(ModelArgs.from_hf_config(cfg), head="lm").eval()


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]


def test_labels_from_the_rule_reward_and_the_reference_path(tok):
    right = _ids(tok, PROBLEM.solution)
    wrong_step = _ids(tok, "38+61=98\n\n98+45=143\n\n143-74=69\n\n\\boxed{69}")
    lucky = _ids(tok, "38+61=99\n\n99+45=145\n\n145-74=70\n\n\\boxed{70}")  # wrong path, right box
    no_box = _ids(tok, "38+61=99")
    prompt = orm_lib.prompt_ids([PROBLEM], tok)[0]
    ex = orm_lib.label_samples([PROBLEM], [prompt], [[right, wrong_step, lucky, no_box]], tok)
    assert [e.correct for e in ex] == [1, 0, 1, 0]
    assert ex[0].token_labels == [1] * len(right)
    # "38+61=9" stays on the path (7 tokens: digits are single tokens), the "8" leaves it
    assert ex[1].token_labels == [1] * 7 + [0] * (len(wrong_step) - 7)
    first_off = len(tok.encode("38+61=99\n\n99+45=14", add_special_tokens=False))
    assert ex[2].token_labels[:first_off] == [1] * first_off
    assert ex[2].token_labels[first_off:-1] == [0] * (len(lucky) - first_off - 1)
    assert ex[2].token_labels[-1] == 1  # the last token carries the outcome
    assert ex[3].token_labels[-1] == 0 and ex[3].token_labels[:-1] == [1] * (len(no_box) - 1)
    assert [orm_lib.rank_key(e) for e in ex] == [(1, len(right)), (0, 7), (1, first_off),
                                                  (0, len(no_box) - 1)]
    assert all(e.problem == 0 and e.prompt_ids == prompt for e in ex)


def test_batch_puts_every_last_token_in_the_last_column(tok):
    prompt = orm_lib.prompt_ids([PROBLEM], tok)[0]
    ex = orm_lib.label_samples([PROBLEM], [prompt],
                               [[_ids(tok, PROBLEM.solution), _ids(tok, "38+61=9")]], tok)
    ids, mask, labels = orm_lib.orm_batch(ex)
    for i, e in enumerate(ex):
        n = len(e.prompt_ids) + len(e.response_ids)
        assert ids[i, -n:].tolist() == e.prompt_ids + e.response_ids
        assert mask[i].sum() == n and mask[i, -n:].all()
        assert labels[i, -len(e.response_ids):].tolist() == e.token_labels
        assert (labels[i, : -len(e.response_ids)] == -1).all()


def test_near_zero_temperature_sampling_is_greedy(tok, model):
    prompts = orm_lib.prompt_ids([PROBLEM, arith.Problem((12, 3), ("+",))], tok)
    eos = 99  # an id the random model emits sometimes, to exercise early stops
    greedy = greedy_generate(model, prompts, eos, tok.pad_token_id, max_new_tokens=10)
    sampled = orm_lib.sample_responses(model, prompts, 3, eos, tok.pad_token_id, 10,
                                       temperature=1e-4, seed=1)
    assert sampled == [[g] * 3 for g in greedy]


def test_sampling_follows_the_softmax(tok, model):
    """One new token from one prompt, 4000 draws: frequencies match softmax(logits) (a full
    forward, no cache) within 5 standard errors."""
    prompt = orm_lib.prompt_ids([PROBLEM], tok)[0]
    draws = orm_lib.sample_responses(model, [prompt], 4000, tok.eos_token_id, tok.pad_token_id,
                                     1, seed=3, batch_size=4000)[0]
    with torch.no_grad():
        p = torch.softmax(model(torch.tensor([prompt]))[0, -1].double(), -1)
    counts = torch.bincount(torch.tensor([d[0] for d in draws]), minlength=p.numel()).double()
    se = (p * (1 - p) / 4000).sqrt()
    assert ((counts / 4000 - p).abs() <= 5 * se + 1e-3).all()


def test_ranking_loss_and_pairwise_accuracy():
    scores = torch.tensor([2.0, 0.5, 1.0, -1.0, 3.0], requires_grad=True)
    keys = [(1, 9), (0, 3), (0, 5), (1, 9), (0, 1)]
    groups = [[0, 1, 2], [3, 4]]
    loss = orm_lib.ranking_loss(scores, keys, groups)
    # pairs: (0>1), (0>2), (2>1) in group 0; (3>4) in group 1
    want = -sum(math.log(1 / (1 + math.exp(-d))) for d in (1.5, 1.0, 0.5, -4.0)) / 4
    assert loss.item() == pytest.approx(want, rel=1e-6)
    ex = [orm_lib.ORMExample(g, [], [1], k[0], [k[0]]) for g, k in
          zip([0, 0, 0, 1, 1], keys)]
    r = orm_lib.pairwise_accuracy(ex, scores.detach())
    # correct-vs-wrong pairs: 0>1 yes, 0>2 yes, 3>4 no
    assert r["pairwise_accuracy"] == pytest.approx(2 / 3) and r["pairs"] == 3
    assert r["problems"] == 2 and r["correct_share"] == pytest.approx(0.4)


def test_saved_orm_is_a_sequence_classifier_read_at_the_last_token(tok, model, tmp_path):
    from transformers import AutoModelForSequenceClassification

    save_model(model, tmp_path / "policy")
    orm = orm_lib.new_orm(tmp_path / "policy", seed=5)
    assert orm.score.weight.shape == (1, model.args.hidden_size) and orm.score.bias is None
    save_model(orm, tmp_path / "orm")
    hf = AutoModelForSequenceClassification.from_pretrained(tmp_path / "orm").eval()
    assert hf.config.num_labels == 1
    prompt = orm_lib.prompt_ids([PROBLEM], tok)[0]
    ex = orm_lib.label_samples([PROBLEM], [prompt],
                               [[_ids(tok, PROBLEM.solution), _ids(tok, "38+61=9")]], tok)
    ours = orm_lib.orm_scores(orm, ex)
    with torch.no_grad():
        theirs = [hf(torch.tensor([e.prompt_ids + e.response_ids])).logits[0, 0] for e in ex]
    assert torch.allclose(ours, torch.stack(theirs), atol=1e-4)


@pytest.fixture(scope="module")
def lm(tok):
    """A random LM with room for the built ORM (head size 32 > the ~20 response tokens)."""
    torch.manual_seed(1)
    cfg = policy_config(tok, hidden=64, layers=2, heads=2, kv_heads=1, intermediate=64)
    return Transformer(ModelArgs.from_hf_config(cfg), head="lm").eval()


OTHER = arith.Problem((12, 3), ("+",))  # with PROBLEM: every digit


def test_built_orm_scores_the_mean_logit_of_each_written_token(tok, lm):
    """At every position t the score is mean_{s<=t} of the LM's logit of token s after tokens
    < s (s = 0: its logit after itself), the LM run alone on each row (no padding): rows of
    different lengths, left-padded together, one of 180 tokens (the previous-token head must
    not leak at any distance)."""
    texts = [PROBLEM.solution, "38+61=98\n\n98+45=143\n\n143-74=69\n\n\\boxed{69}",
             OTHER.solution, "\n\n".join([PROBLEM.solution] * 5)]
    rows = [_ids(tok, t) for t in texts]
    token_ids = orm_lib.response_token_ids([PROBLEM, OTHER], tok)
    assert {t for r in rows for t in r} <= set(token_ids)
    orm = orm_lib.surprise_orm(lm, token_ids)
    assert orm.args.num_hidden_layers == lm.args.num_hidden_layers + 2
    ids, mask = pad_left(rows, 0)
    assert ids.shape[1] >= 180
    with torch.no_grad():
        got = orm_lib.orm_logits(orm, ids, mask).double()
        for i, r in enumerate(rows):
            logits = lm(torch.tensor([r]))[0].double()  # [T, V]
            z = torch.stack([logits[0, r[0]]] + [logits[t - 1, r[t]] for t in range(1, len(r))])
            want = torch.cumsum(z, 0) / torch.arange(1, len(r) + 1)
            assert torch.allclose(got[i, -len(r):], want, rtol=1e-3, atol=1e-3), i
    # the score moves with the LM's expectation, not with anything else in the rows
    assert len({round(float(v), 3) for v in got[:, -1]}) == len(rows)


def test_built_orm_loads_as_a_sequence_classifier_with_the_same_score(tok, lm, tmp_path):
    from transformers import AutoModelForSequenceClassification

    orm = orm_lib.surprise_orm(lm, orm_lib.response_token_ids([PROBLEM, OTHER], tok))
    save_model(orm, tmp_path / "orm", source_dir=None)
    hf = AutoModelForSequenceClassification.from_pretrained(tmp_path / "orm").eval()
    assert hf.config.num_labels == 1 and hf.config.hidden_size == 2 * lm.args.hidden_size
    prompt = orm_lib.prompt_ids([PROBLEM], tok)[0]
    ex = orm_lib.label_samples([PROBLEM], [prompt],
                               [[_ids(tok, PROBLEM.solution), _ids(tok, "38+61=9")]], tok)
    ours = orm_lib.orm_scores(orm, ex)
    with torch.no_grad():
        theirs = [hf(torch.tensor([e.prompt_ids + e.response_ids])).logits[0, 0] for e in ex]
    assert torch.allclose(ours, torch.stack(theirs), rtol=1e-4, atol=1e-4)


def test_built_orm_needs_a_head_wider_than_the_response_vocabulary(tok, model):
    with pytest.raises(ValueError, match="too many"):  # model: head size 8
        orm_lib.surprise_orm(model, orm_lib.response_token_ids([PROBLEM, OTHER], tok))
