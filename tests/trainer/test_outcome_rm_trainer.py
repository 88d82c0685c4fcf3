"""GRPO with an outcome reward model (verl's ``reward_model.enable`` with a sequence classifier)
on the embedded demo: the RM's score is the training reward in place of the rule reward, which is
still logged."""

from __future__ import annotations

import math
import shutil

import pytest

from megarl.data import resolve_path
from megarl.models.testing import make_tiny_hf_model

RM_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}]: {{ m['content'] }}\n{% endfor %}"
               "<|im_end|>")


def demo_rm(folder, own_template: bool):
    """A random qwen2 sequence classifier over the demo tokenizer's vocabulary, with the demo's
    tokenizer (``own_template``: under another chat template, so its input is re-rendered)."""
    rm = make_tiny_hf_model(folder, "qwen2", head="seq_cls", tokenizer=False, vocab_size=384,
                            seed=7)
    tok_dir = resolve_path("embedded://tokenizer")
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(f"{tok_dir}/{f}", rm / f)
    if own_template:
        (rm / "chat_template.jinja").write_text(RM_TEMPLATE)
    return rm


@pytest.mark.e2e
@pytest.mark.parametrize("backend,own_template", [("torch", False), ("megatron", True)])
def test_grpo_trains_on_outcome_rm_scores(tmp_path, demo_assets, backend, own_template):
    from trainer_helpers import train, train_rows

    rm = demo_rm(tmp_path / "rm", own_template)
    proc = train(tmp_path / "run", "grpo", "trainer.total_training_steps=2",
                 "reward_model.enable=true", f"reward_model.model.path={rm}",
                 "reward_model.use_dynamic_bsz=true",
                 f"actor_rollout_ref.actor.strategy={backend}")
    said = proc.stdout + proc.stderr
    assert "is an outcome reward model" in said
    assert ("re-render" in said or "own chat template" in said) == own_template
    rows = train_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    # some response earned a rule reward: a sum of the two would show in critic/score
    assert any(r["reward/score/mean"] > 0 for r in rows)
    for row in rows:
        rm_mean = row["reward/rm_score/mean"]
        # the training reward is the RM's score (not the rule reward, not their sum)
        assert math.isclose(row["critic/score/mean"], rm_mean, abs_tol=1e-5)
        assert math.isclose(row["critic/verifiable_reward/mean"], rm_mean, abs_tol=1e-5)
        assert row["reward/score/mean"] != pytest.approx(rm_mean, abs=1e-4)
        assert row["critic/score/max"] > row["critic/score/min"]  # a real per-response score
        assert math.isfinite(row["actor/pg_loss"])


def _hf_score_rows(rm_folder, rows, policy_tokenizer, rm_tokenizer, max_length):
    """transformers' float64 score of each recorded row: the sequence classifier's head at
    the last token of its input, the policy's ids or (``rm_tokenizer`` given) the RM's chat
    template over the prompt's messages and the decoded response (its EOS text removed, as
    verl's ``_switch_chat_template``), cut to ``max_length`` tokens."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(
        rm_folder, dtype=torch.float64).eval()
    want = []
    with torch.no_grad():
        for r in rows:
            if rm_tokenizer is None:
                ids = r["prompt_ids"] + r["response_ids"]
            else:
                text = policy_tokenizer.decode(r["response_ids"])
                text = text.replace(policy_tokenizer.eos_token, "")
                convo = [*r["messages"], {"role": "assistant", "content": text}]
                enc = rm_tokenizer.apply_chat_template(convo, tokenize=True,
                                                       add_generation_prompt=False)
                ids = list(enc["input_ids"] if hasattr(enc, "keys") else enc)
                ids = ids[:max_length] if max_length else ids
            hidden = hf.model(torch.tensor([ids])).last_hidden_state[0, -1]
            want.append(float(hf.score(hidden)[0]))
    return want


@pytest.mark.e2e
@pytest.mark.parametrize("backend,own_template,nproc", [("torch", False, 1),
                                                        ("megatron", True, 2)])
def test_every_training_score_is_the_rms_float64_score(tmp_path, demo_assets, backend,
                                                       own_template, nproc):
    """At trainer level, every response's training score (2 GRPO steps, 16 responses each)
    equals transformers' AutoModelForSequenceClassification (float64) on the same input,
    within the fp32-vs-float64 bound of the RM's shape: on the torch backend reading the
    policy's ids, and on megatron with the RM (and the actor) tensor-parallel over 2 ranks
    re-rendering its input with its own chat template. The scores are recorded as the step used them
    (tests/trainer/orm_probe.py)."""
    import json

    from fp32_bounds import fp32_ref_logit_bound
    from trainer_helpers import FAST, REPO, env
    from warm_runs import run_script

    from megarl.data import load_tokenizer

    rm = demo_rm(tmp_path / "rm", own_template)
    out = tmp_path / "scores.json"
    args = [f"trainer.default_local_dir={tmp_path / 'run'}", *FAST,
            "trainer.total_training_steps=2", "reward_model.enable=true",
            f"reward_model.model.path={rm}", "reward_model.use_dynamic_bsz=true",
            f"actor_rollout_ref.actor.strategy={backend}"]
    if nproc > 1:  # megatron's roles share one parallel state: the actor at TP 2 too
        args += [f"reward_model.parallel.tensor_model_parallel_size={nproc}",
                 f"actor_rollout_ref.actor.parallel.tensor_model_parallel_size={nproc}"]
    proc = run_script(["tests/trainer/orm_probe.py", str(out), "launch/train.py", "--config",
                       "grpo", *args], REPO, env(), 600, nproc if nproc > 1 else None)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    said = proc.stdout + proc.stderr
    assert ("re-render" in said or "own chat template" in said) == own_template
    rows = json.loads(out.read_text())
    assert len(rows) == 2 * 16
    got = [r["score"] for r in rows]
    assert max(got) > min(got)  # a real per-response score
    policy_tok = load_tokenizer(str(resolve_path("embedded://tokenizer")))
    rm_tok = load_tokenizer(str(rm)) if own_template else None
    want = _hf_score_rows(rm, rows, policy_tok, rm_tok, None)
    bound = fp32_ref_logit_bound(rm, tokens=len(rows))
    worst = max(abs(g - w) for g, w in zip(got, want))
    assert worst <= bound, (worst, bound)  # measured: 8.4e-7 / 9.0e-7 under 6.5e-6
