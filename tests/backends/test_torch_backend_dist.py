"""TorchBackend under real process groups (gloo): every parallel layout against a plain
single-process model with autograd on the whole batch (tests/dist/torch_backend_ref.py), and
the single-process path against transformers in float64.

Three launches (grouped to pay process start-up once each), results read from JSON:
  two:    torchrun x2  TP=2, TP=2+SP, TP=2 naive head, FSDP=2 (+AC), PP=2, tied TP=2; critic
          (TP+SP, FSDP, PP); PRM (PP, TP); non-finite skip; DCP saved at TP=2 -> FSDP=2, PP=2
  four:   torchrun x4  TP=2 x FSDP=2, PP=2 x FSDP=2, TP=2+SP x PP=2
  single: python (world of one)  transformers float64, padding, accumulation, schedule,
          DCP TP=2 -> TP=1, bf16, roles

Per actor layout the checks are: export_weights equals the HF safetensors exactly; logprobs /
entropy within 1e-5 of the reference; gradients of 3 unequal micro-batches (token-mean loss with
the global normaliser) within 1e-5 of whole-batch autograd; the loss metric sums to 1 over
micro-batches and DP; train-forward logprobs bit-identical to ``logprobs`` on the same
micro-batches; 3 clipped AdamW steps within 1e-5 of torch.optim.AdamW on the reference.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from torchrun import run_torchrun, worker_env

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "dist" / "torch_backend_worker.py"
TOL = 1e-5
ACTOR_CHECKS = ("export_exact", "logprob_err", "entropy_err", "grad_err", "tokens_metric_err",
                "bit_identical", "adamw3_err", "grad_norm_err")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    from megarl.models.testing import make_tiny_hf_model

    d = tmp_path_factory.mktemp("torch_backend_models")
    return {
        # qwen3 with attention bias: q/k norms (TP-sharded heads), biases on q/k/v/o
        "main": str(make_tiny_hf_model(d / "main", "qwen3", attention_bias=True,
                                       tokenizer=False)),
        "tied": str(make_tiny_hf_model(d / "tied", "llama", tie_word_embeddings=True,
                                       tokenizer=False)),
        "critic": str(make_tiny_hf_model(d / "critic", "qwen2", head="token_cls", num_labels=1,
                                         tokenizer=False)),
        "prm": str(make_tiny_hf_model(d / "prm", "qwen2", head="token_cls", num_labels=2,
                                      tokenizer=False)),
    }


def _launch(scenario: str, nproc: int, models: dict, work: Path, timeout: int) -> dict:
    out = work / f"{scenario}.json"
    args = [scenario, "--models", json.dumps(models), "--work", str(work), "--out", str(out)]
    no_triton = {"TRITON_INTERPRET": None}  # CPU runs use the torch kernel path
    if nproc == 1:  # a plain process: the backend's world-of-one path
        proc = subprocess.run([sys.executable, str(WORKER), *args], cwd=ROOT,
                              env=worker_env(no_triton), capture_output=True, text=True,
                              timeout=timeout)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    else:
        run_torchrun(WORKER, nproc, args, timeout, env=no_triton)
    assert out.is_file(), f"{scenario} worker wrote no results"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("torch_backend_work")


@pytest.fixture(scope="module")
def two(models, work) -> dict:
    return _launch("two", 2, models, work, timeout=300)


@pytest.fixture(scope="module")
def four(models, work) -> dict:
    return _launch("four", 4, models, work, timeout=300)


@pytest.fixture(scope="module")
def single(models, work, two) -> dict:  # loads the checkpoint written by `two`
    return _launch("single", 1, models, work, timeout=300)


def _check(results: dict, key: str) -> None:
    assert key in results, f"{key} missing from worker results: {sorted(results)}"
    value = results[key]
    if isinstance(value, bool):
        assert value, key
    else:
        assert isinstance(value, float) and value <= TOL, f"{key} = {value} > {TOL}"


@pytest.mark.parametrize("layout", ["tp2", "tp2_sp", "tp2_naive", "fsdp2_ac", "pp2", "tp2_tied"])
@pytest.mark.parametrize("check", ACTOR_CHECKS)
def test_actor_two_procs(two, layout, check):
    _check(two, f"{layout}/{check}")


@pytest.mark.parametrize("layout", ["tp2_fsdp2", "pp2_fsdp2", "tp2_sp_pp2"])
@pytest.mark.parametrize("check", ACTOR_CHECKS)
def test_actor_four_procs(four, layout, check):
    _check(four, f"{layout}/{check}")


@pytest.mark.parametrize("key", [
    "critic_tp2_sp/values_err", "critic_tp2_sp/grad_err", "critic_fsdp2/values_err",
    "critic_fsdp2/grad_err", "critic_pp2/values_err", "critic_pp2/grad_err",
    "prm_pp2/scores_err", "prm_tp2/scores_err", "prm_fsdp2/scores_err",
    "ref_fsdp2/logprob_err", "ref_fsdp2/frozen",
])
def test_value_and_prm_heads_two_procs(two, key):
    _check(two, key)


@pytest.mark.parametrize("layout", ["fsdp2", "tp2", "pp2"])
def test_bf16_mixed_precision_two_procs(two, layout):
    """bf16 compute with fp32 masters: logprobs within bf16 error of the fp32 reference,
    gradients within 5% (global relative L2), a step trains and exports fp32 weights."""
    assert two[f"{layout}/bf16_logprob_diff"] < 0.1
    assert two[f"{layout}/bf16_grad_rel_diff"] < 0.05
    assert two[f"{layout}/bf16_trains"] is True


@pytest.mark.parametrize("key", ["skip_fsdp2/skipped", "skip_fsdp2/unchanged",
                                 "skip_fsdp2/recovers"])
def test_non_finite_grad_skips_step_fsdp(two, key):
    _check(two, key)


@pytest.mark.parametrize("target", ["tp2_to_fsdp2", "tp2_to_pp2"])
@pytest.mark.parametrize("check", ["dcp_logprob_err", "dcp_next_step_err", "dcp_step_ok"])
def test_checkpoint_tp2_loads_at_other_layouts(two, target, check):
    """Saved at TP=2 after 3 steps: same logprobs, and one more step equals the uninterrupted
    TP=2 run (optimizer state and step counter continue)."""
    _check(two, f"{target}/{check}")


@pytest.mark.parametrize("check", ["dcp_logprob_err", "dcp_next_step_err", "dcp_step_ok"])
def test_checkpoint_tp2_loads_in_one_process(single, check):
    _check(single, f"tp2_to_tp1/{check}")


@pytest.mark.parametrize("key", [
    "plain_unwrapped",
    "hf64/logprob_err", "hf64/entropy_err", "hf64/zero_outside_mask",
    "padded/extra_padding_err", "padded/extra_columns_zero", "padded/row_by_row_err",
    "accum/grad_err", "accum/bit_identical",
    "naive/logprob_err", "naive/grad_err", "ac/grad_err",
    "ref/equals_actor", "ref/frozen",
    "sched/lr_err", "sched/skip_flags", "sched/step_counter", "sched/lr0_step_unchanged",
    "hf_export/logprob_err",
    "critic/values_err", "prm/scores_err", "critic/fresh_head_seeded",
    "bf16/trains", "bf16/fp32_masters", "bf16/ref_bf16_weights",
])
def test_single_process(single, key):
    _check(single, key)


@pytest.mark.parametrize("key", ["bf16/logprob_close", "bf16/ref_logprob_close"])
def test_bf16_close_to_fp32(single, key):
    assert single[key] < 0.1, f"{key} = {single[key]}"
