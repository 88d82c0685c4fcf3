"""verl's metric names and the validation sampling of rollout.val_kwargs, on real runs, plus the
FLOP count behind perf/mfu against torch's own FLOP counter on a transformers model."""

from __future__ import annotations

import statistics

import pytest
import torch
from trainer_helpers import metrics, train

from megarl.trainer.flops import dense_params, mfu, train_flops
from megarl.trainer.metrics import per_token_timing
from megarl.trainer.validation import reward_metrics

VAL = ["trainer.val_before_train=true", "trainer.total_training_steps=1", "trainer.save_freq=1",
       "data.val_batch_size=128"]


def _val_row(run_dir) -> dict:
    return next(r for r in metrics(run_dir) if r["step"] == 0)


@pytest.fixture(scope="module")
def val_runs(tmp_path_factory, demo_assets):
    """One greedy, one sampled n=1 (T=1) and one sampled n=2 validation of the demo policy."""
    d = tmp_path_factory.mktemp("val")
    runs = {"greedy": [], "sampled1": ["actor_rollout_ref.rollout.val_kwargs.do_sample=true",
                                       "actor_rollout_ref.rollout.val_kwargs.temperature=1.0"],
            "sampled2": ["actor_rollout_ref.rollout.val_kwargs.do_sample=true",
                         "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
                         "actor_rollout_ref.rollout.val_kwargs.n=2"]}
    for name, extra in runs.items():
        train(d / name, "grpo", *VAL, *extra, f"trainer.validation_data_dir={d / name}_val")
    return {name: d / name for name in runs}


def test_validation_names_and_greedy_default(val_runs):
    row = _val_row(val_runs["greedy"])
    assert set(k for k in row if k.startswith("val")) == {
        "val-core/arith/reward/mean@1", "val/test_score/arith"}
    assert row["timing_s/testing"] > 0


def test_validation_samples_when_do_sample_at_n1(val_runs):
    """do_sample=true at n=1 (DAPO's avg@1) samples: at T=1 the accuracy on 500 held-out
    problems differs from the greedy one (the old code ran greedy whenever n == 1: equal)."""
    greedy = _val_row(val_runs["greedy"])["val-core/arith/reward/mean@1"]
    sampled = _val_row(val_runs["sampled1"])["val-core/arith/reward/mean@1"]
    assert sampled != greedy


def test_validation_n2_reports_verl_aux_metrics(val_runs):
    row = _val_row(val_runs["sampled2"])
    mean = row["val-core/arith/reward/mean@2"]
    best, worst = row["val-aux/arith/reward/best@2/mean"], row["val-aux/arith/reward/worst@2/mean"]
    assert worst <= mean <= best and worst < best
    assert 0 <= row["val-aux/arith/reward/std@2"] <= 0.5
    assert "val-core/arith/reward/mean@1" not in row


@pytest.mark.parametrize("name, n", [("greedy", 1), ("sampled2", 2)])
def test_validation_generations_are_dumped(val_runs, name, n):
    """trainer.validation_data_dir (PACS / verl): every validation response with its score;
    the scores are the ones behind val-core."""
    import json

    rows = [json.loads(x) for x in
            (val_runs[name].parent / f"{name}_val" / "0.jsonl").read_text().splitlines()]
    row = _val_row(val_runs[name])
    assert len(rows) == 500 * n and {r["step"] for r in rows} == {0}
    assert all(r["input"] and isinstance(r["output"], str) and r["gts"] for r in rows)
    assert statistics.fmean(r["score"] for r in rows) == pytest.approx(
        row[f"val-core/arith/reward/mean@{n}"], rel=1e-12)


def test_step_timing_names(val_runs):
    step = next(r for r in metrics(val_runs["greedy"]) if r["step"] == 1)
    for key in ("timing_s/update_weights", "timing_s/save_checkpoint", "timing_s/gen",
                "timing_per_token_ms/gen", "timing_per_token_ms/update_actor",
                "response/aborted_ratio", "data/num_filtered_prompts"):
        assert key in step, key
    assert "timing_s/weight_sync" not in step
    assert step["response/aborted_ratio"] == 0.0
    n_resp = step["response_length/mean"] * 4 * 4  # FAST: 4 prompts x 4 responses
    assert step["timing_per_token_ms/gen"] == pytest.approx(
        1e3 * step["timing_s/gen"] / n_resp, rel=1e-6)


def test_reward_metrics_against_a_loop():
    by_prompt = {"a": {0: [1.0, 0.0, 1.0], 1: [0.0, 0.0, 0.25]}, "b": {7: [1.0, 1.0, 1.0]}}
    m = reward_metrics(by_prompt, 3)
    assert m["val-core/a/reward/mean@3"] == pytest.approx(2.25 / 6)
    assert m["val/test_score/a"] == pytest.approx(2 / 6)
    assert m["val-aux/a/reward/best@3/mean"] == pytest.approx((1.0 + 0.25) / 2)
    assert m["val-aux/a/reward/worst@3/mean"] == pytest.approx(0.0)
    stds = [statistics.pstdev([1.0, 0.0, 1.0]), statistics.pstdev([0.0, 0.0, 0.25])]
    assert m["val-aux/a/reward/std@3"] == pytest.approx(sum(stds) / 2)
    assert m["val-core/b/reward/mean@3"] == 1.0


def test_per_token_timing():
    got = per_token_timing({"gen": 2.0, "update_actor": 3.0}, prompt_tokens=100,
                           response_tokens=400)
    assert got == {"timing_per_token_ms/gen": 5.0, "timing_per_token_ms/update_actor": 6.0}


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_train_flops_match_torch_flop_counter(tmp_path, arch):
    """The MFU numerator against torch.utils.flop_counter on transformers' model, forward +
    backward, two sequences of different lengths (no padding: each run alone). Against the
    1e-3 bound: a count that forgets the lm_head is off by ~10% here, one that halves the
    (causal) attention term by ~6%, one that drops the backward of a matmul by ~30%."""
    import transformers
    from torch.utils.flop_counter import FlopCounterMode

    from megarl.models.testing import make_tiny_hf_model

    path = make_tiny_hf_model(tmp_path / arch, arch, hidden_size=64, intermediate_size=96)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager")  # SDPA on CPU is not counted
    lens = [24, 40]
    counted = 0
    for s in lens:
        ids = torch.randint(0, model.config.vocab_size, (1, s))
        with FlopCounterMode(display=False) as fc:
            model(ids).logits.sum().backward()
        counted += fc.get_total_flops()
    assert train_flops(model.config, lens) == pytest.approx(counted, rel=1e-3)
    matmul_weights = sum(p.numel() for n, p in model.named_parameters()
                         if p.dim() == 2 and "embed_tokens" not in n)
    if model.config.tie_word_embeddings:
        matmul_weights += model.config.vocab_size * model.config.hidden_size
    assert dense_params(model.config) == matmul_weights
    # the trainer passes config.json as read_hf_config parses it (a dict): the same count
    from megarl.models import read_hf_config

    assert train_flops(read_hf_config(path), lens) == train_flops(model.config, lens)
    assert mfu(read_hf_config(path), lens, 1, 0.5, 1, 1e12) == pytest.approx(
        train_flops(model.config, lens) / 0.5 / 1e12)


def test_mfu_needs_a_known_peak():
    class Cfg:
        hidden_size, num_hidden_layers, num_attention_heads = 64, 2, 4
        num_key_value_heads, intermediate_size, vocab_size = 2, 128, 100

    assert mfu(Cfg, [10], 1, 1.0, 1, None) is None
    assert mfu(Cfg, [10], 2, 0.5, 2, 1e9) == pytest.approx(2 * train_flops(Cfg, [10]) / 0.5 / 2e9)
