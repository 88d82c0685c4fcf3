"""Pieces of the SFT / PRM builds with tiny step counts: batches, labels, greedy decoding."""

import numpy as np
import pytest
import torch

from megarl.data import step_end_token_ids
from megarl.demo import arith
from megarl.demo import prm as prm_lib
from megarl.demo.greedy import greedy_generate
from megarl.demo.sft import boxed_answer, encode_sft, policy_config, sft_batch, train_sft
from megarl.models import ModelArgs, Transformer


@pytest.fixture(scope="module")
def model(tok):
    torch.manual_seed(0)
    cfg = policy_config(tok, hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64)
    return Transformer(ModelArgs.from_hf_config(cfg), head="lm").eval()


def test_policy_config_is_a_tiny_qwen2(tok):
    from transformers import Qwen2Config

    cfg = policy_config(tok)
    hf = Qwen2Config(**cfg)
    assert hf.model_type == "qwen2" and hf.tie_word_embeddings
    m = Transformer(ModelArgs.from_hf_config(cfg), head="lm")
    assert 0.7e6 < sum(p.numel() for p in m.parameters()) < 1.0e6


def test_greedy_matches_full_recompute(tok, model):
    prompts = [tok.encode(t, add_special_tokens=False) for t in ("12+3", "<|im_start|>user\n9", "7")]
    eos = 99  # an id the random model emits sometimes, to exercise early stops
    got = greedy_generate(model, prompts, eos, tok.pad_token_id, max_new_tokens=12)
    for p, g in zip(prompts, got):
        seq = list(p)
        ref = []
        for _ in range(12):  # no cache, one unpadded row: argmax of a full forward each step
            nxt = int(model(torch.tensor([seq]))[0, -1].argmax())
            ref.append(nxt)
            seq.append(nxt)
            if nxt == eos:
                break
        assert g == ref


def test_sft_batch_labels(tok):
    probs = arith.sample_problems(0, 3, (1, 3))
    ex = encode_sft([[{"role": "user", "content": p.prompt}] for p in probs],
                    [p.solution for p in probs], tok)
    ids, labels = sft_batch(ex, tok.pad_token_id)
    for i, (e, p) in enumerate(zip(ex, probs)):
        target = [t for t in labels[i].tolist() if t != -100]
        assert tok.decode(target) == p.solution + "<|im_end|>"  # exactly the response + eos
        pos = [j for j, t in enumerate(labels[i].tolist()) if t != -100]
        assert pos[0] == e.prompt_len - 1 and all(labels[i, j] == ids[i, j + 1] for j in pos)


def test_sft_loss_goes_down(tok, model):
    probs = arith.sample_problems(1, 16, 2)
    ex = encode_sft([[{"role": "user", "content": p.prompt}] for p in probs],
                    [p.solution for p in probs], tok)
    m = Transformer(model.args, head="lm")
    ids, labels = sft_batch(ex, tok.pad_token_id)

    def loss():
        with torch.no_grad():
            lg = m(ids)
            return float(torch.nn.functional.cross_entropy(lg.flatten(0, 1), labels.flatten()))

    before = loss()
    train_sft(m, ex, tok.pad_token_id, steps=15, batch_size=16, lr=3e-3, warmup=1)
    assert loss() < before - 1.0


def test_boxed_answer():
    assert boxed_answer("1+1=2\n\n\\boxed{2}") == "2"
    assert boxed_answer("\\boxed{1} \\boxed{ 30 }") == "30"
    assert boxed_answer("no") is None


def test_prm_labels_sit_on_step_ends(tok):
    sep = tok.encode("\n\n", add_special_tokens=False)[0]
    step_ids = step_end_token_ids(tok)
    rng = np.random.Generator(np.random.PCG64(0))
    probs = arith.sample_problems(2, 40, (2, 3))
    examples = []
    for p in probs:
        steps, first, _ = arith.corrupt_solution(p, rng)
        examples.append((p, steps, first, prm_lib.make_example(p, steps, tok)))
    ids, mask, labels = prm_lib.prm_batch([e[3] for e in examples], tok.pad_token_id, step_ids)
    L = labels.shape[1]
    for i, (_, steps, first, ex) in enumerate(examples):
        resp = ids[i, -L:].tolist()
        # brute force: the step ends are the separator tokens and the eos, in order
        ends = [j for j, t in enumerate(resp[: len(ex.response_ids)])
                if t == sep or t == tok.eos_token_id]
        assert [j for j in range(L) if labels[i, j] != -100] == ends
        assert [int(labels[i, j]) for j in ends] == [1] * first + [0] * (len(steps) - first)
        assert prm_lib.step_texts(ex.response_ids, tok, step_ids) == steps


def test_prm_evaluation_counts(tok):
    step_ids = step_end_token_ids(tok)
    p = arith.sample_problems(3, 1, 3)[0]
    ex = prm_lib.make_example(p, p.steps(), tok)
    torch.manual_seed(0)
    cfg = policy_config(tok, hidden=32, layers=1, heads=4, kv_heads=2, intermediate=64)
    m = Transformer(ModelArgs.from_hf_config(cfg), head="token_cls", num_labels=2)
    with torch.no_grad():  # a PRM that always says "correct"
        m.score.weight.zero_()
        m.score.bias.copy_(torch.tensor([0.0, 1.0]))
    wrong = prm_lib.make_example(p, p.steps()[:1] + ["1+1=3"] + p.steps()[2:], tok)
    r = prm_lib.evaluate_prm(m, [ex, wrong], tok.pad_token_id, step_ids)
    assert r["num_steps"] == 8
    assert r["accuracy_on_correct_steps"] == 1.0 and r["accuracy_on_wrong_steps"] == 0.0
    assert r["step_accuracy"] == 5 / 8 and r["first_error_found"] == 0.0


def test_bucketed_batches_and_fine_eval(tok, model, monkeypatch):
    import megarl.demo.sft as sft_mod

    probs = arith.sample_problems(4, 40, (1, 3))
    ex = encode_sft([[{"role": "user", "content": p.prompt}] for p in probs],
                    [p.solution for p in probs], tok)
    ops = [len(p.ops) for p in probs]
    seen = []
    real = sft_mod.sft_batch

    def spy(batch, pad_id):
        seen.append({ops[ex.index(e)] for e in batch})
        return real(batch, pad_id)

    monkeypatch.setattr(sft_mod, "sft_batch", spy)
    m = Transformer(model.args, head="lm")
    calls = []

    def fake_eval():
        calls.append(len(seen))
        return 0.0

    train_sft(m, ex, tok.pad_token_id, steps=12, batch_size=4, buckets=ops, eval_fn=fake_eval,
              eval_every=5, fine_eval_every=2, fine_below_loss=-1.0)
    assert all(len(s) == 1 for s in seen) and {1, 3} == set().union(*seen)
    assert calls == [5, 10]  # the loss never falls below -1: coarse cadence only
    calls.clear()
    seen.clear()
    r = train_sft(m, ex, tok.pad_token_id, steps=6, batch_size=4, eval_fn=lambda: 0.5,
                  eval_every=5, fine_eval_every=2, fine_below_loss=100.0, stop_at=0.4)
    assert r.steps == 2  # fine cadence from the start, and the first eval >= stop_at stops
    accs = iter([0.0, 0.06, 0.1, 0.3])
    r = train_sft(m, ex, tok.pad_token_id, steps=30, batch_size=4, eval_fn=lambda: next(accs),
                  eval_every=5, fine_eval_every=2, fine_below_loss=-1.0, fine_from_acc=0.05,
                  stop_at=0.25)
    # coarse at 5 and 10; 0.06 >= fine_from_acc switches to every 2 steps: 12, then 14 stops
    assert [h["step"] for h in r.history] == [5, 10, 12, 14] and r.steps == 14


def test_dense_prefix_labels(tok):
    step_ids = step_end_token_ids(tok)
    rng = np.random.Generator(np.random.PCG64(3))
    examples = []
    for p in arith.sample_problems(6, 30, (2, 3)):
        steps, first, _ = arith.corrupt_solution(p, rng)
        ex = prm_lib.make_example(p, steps, tok)
        # independent: the first token where the response text stops matching the reference
        resp_text = [tok.decode(ex.response_ids[: t + 1]) for t in range(len(ex.response_ids))]
        ref = p.solution + "<|im_end|>"
        expected = []
        for t, text in enumerate(resp_text):
            ok = ref.startswith(text) and (t == 0 or expected[-1] == 1)
            expected.append(int(ok))
        assert ex.token_labels == expected
        examples.append(ex)
    _, _, dense = prm_lib.prm_batch(examples, tok.pad_token_id, step_ids, dense=True)
    _, _, sparse = prm_lib.prm_batch(examples, tok.pad_token_id, step_ids)
    at = sparse != -100
    assert torch.equal(dense[at], sparse[at])  # dense labels agree with step labels at step ends
    assert int((dense != -100).sum()) == sum(len(e.response_ids) for e in examples)
