"""bench/gpu_check.sh --dry-run: the GPU check's every step on the CPU with tiny shapes, installed
the way the GPU machine installs it (wheels from `make gpu-wheels`, pip --no-index), so the
script cannot rot between GPU runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STEPS = ["env", "pytest", "model", "megatron_vs_hf", "grpo_torch", "grpo_lora", "grpo_tools",
         "grpo_megatron", "grpo_megatron_lora", "grpo_bf16_params", "kernels", "generate",
         "kernel_bench"]


@pytest.mark.e2e
def test_gpu_check_dry_run(tmp_path):
    wheels, out = tmp_path / "wheels", tmp_path / "out"
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    subprocess.run(["make", "-s", "gpu-wheels", f"PYTHON={sys.executable}", f"GPU_PY={py}",
                    f"GPU_WHEELS={wheels}"], cwd=REPO, check=True, timeout=300)
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(["bash", "bench/gpu_check.sh", "--dry-run", "--out", str(out),
                           "--wheels", str(wheels)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert [r["step"] for r in summary] == STEPS
    # one archive holds every record and log, and nothing of the model or the install
    assert f"results: {out / 'results.tgz'}" in proc.stdout
    with tarfile.open(out / "results.tgz") as tar:
        names = set(tar.getnames())
    assert {"summary.json", *(f"{s}.{e}" for s in STEPS for e in ("json", "log"))} <= names
    assert not any(n.startswith(("site", "work/qwen2")) for n in names), names
    assert all(r["ok"] for r in summary), summary
    # the install is the one that ran: megarl and its needs from the check's own site folder
    env_rec = json.loads((out / "env.json").read_text())["result"]
    for mod, origin in env_rec["imported_from"].items():
        assert origin and origin.startswith(str(out / "site")), (mod, origin)
    res = {r["step"]: r["result"] for r in summary}
    kernel_cases = [c for c in res["kernels"]["cases"] if "triton" in c]
    assert {(c["dtype"], c["temperature"]) for c in kernel_cases} == {
        (d, t) for d in ("float32", "bfloat16") for t in (1.0, 0.6)}
    assert res["grpo_torch"]["steps"] == res["grpo_megatron"]["steps"] == 2
    assert res["grpo_torch"]["logprob_gap_mean"] < 1e-4  # fp32: engine == trainer
    assert res["megatron_vs_hf"]["megatron"]["mean"] < 1e-5
    assert res["generate"]["ours_tok_s"] > 0 and res["generate"]["hf_tok_s"] > 0
    # LoRA: reference = actor at step 1, the policy moved at step 2 and the engine follows it
    # (fp32: engine == trainer), the export is base + (alpha / r) B A and PEFT's merge (the
    # wheel folder carries peft) agrees with it
    lora = res["grpo_lora"]
    assert lora["kl_loss"][0] == 0.0 < lora["kl_loss"][1]
    assert max(lora["logprob_gap_mean"]) < 1e-4
    assert lora["export"]["adapted_modules"] == 7 * 2 and lora["export"]["untouched_tensors"] > 0
    assert lora["export"]["peft_merge_err_eps"] <= 1 and lora["export"]["merge_err_eps"] <= 1
    # megatron LoRA (verl's megatron module names): the same checks as grpo_lora's
    mlora = res["grpo_megatron_lora"]
    assert mlora["ran"]["backend"] == "megatron"
    assert mlora["kl_loss"][0] == 0.0 < mlora["kl_loss"][1]
    assert max(mlora["logprob_gap_mean"]) < 1e-4
    assert mlora["export"]["adapted_modules"] == 7 * 2 and mlora["export"]["merge_err_eps"] <= 1
    # bf16 parameters (model.dtype bf16 on the dry run too): the rounded update moved the
    # policy, finite gradients, the gap within the bf16 bound, both peaks recorded
    bf16 = res["grpo_bf16_params"]
    assert bf16["ran"]["dtype"] == "bf16" and bf16["param_dtype"] == "bf16"
    assert bf16["kl_loss"][0] == 0.0 < bf16["kl_loss"][1]
    assert all(0 < g < float("inf") for g in bf16["grad_norm"])
    assert max(bf16["logprob_gap_mean"]) <= bf16["gap_bound"] == 0.02
    assert bf16["grpo_torch_peak_mem_gb"] == res["grpo_torch"]["peak_mem_gb"]
    # multi-turn: every trajectory model turn, calculator answer, model turn
    for row in res["grpo_tools"]["metrics"]:
        assert row["multi_turn/assistant_turns/mean"] == 2 and row["num_turns/mean"] == 4
        assert row["multi_turn/tool_calls/mean"] == 1 and row["multi_turn/appended_tokens/mean"] > 0
        assert row["rollout/logprob_abs_diff_mean"] < 1e-4


def test_gpu_check_without_wheels_says_what_to_run(tmp_path):
    proc = subprocess.run(["bash", "bench/gpu_check.sh", "--dry-run", "--out", str(tmp_path),
                           "--wheels", str(tmp_path / "none")], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "make gpu-wheels" in proc.stderr


def test_failed_pytest_step_names_the_failing_tests(tmp_path):
    """The pytest step's error names each failing test (read from pytest's JUnit report), so the
    summary says which test failed without the step's log."""
    sys.path.insert(0, str(REPO / "bench"))
    from gpu_check import junit_failures

    (tmp_path / "test_demo.py").write_text(
        "def test_ok():\n    pass\n\n\ndef test_bad():\n    assert 1 == 2, 'one is not two'\n")
    junit = tmp_path / "report.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    f"--junitxml={junit}", "--rootdir", str(tmp_path),
                    str(tmp_path / "test_demo.py")], cwd=tmp_path, capture_output=True, timeout=120)
    got = junit_failures(junit)
    assert len(got) == 1 and got[0].startswith("test_demo::test_bad: ") and "one is not two" in got[0]
    assert junit_failures(tmp_path / "missing.xml") == [f"(no report at {tmp_path / 'missing.xml'})"]


def test_results_archive_holds_the_records_and_logs_only(tmp_path):
    """results.tgz: summary.json, each step's record and log, the install log and the pytest
    step's JUnit reports; never the model's work folder or the install's site folder."""
    sys.path.insert(0, str(REPO / "bench"))
    from gpu_check import write_results

    for name in ("summary.json", "env.json", "env.log", "model.json", "model.log",
                 "install_megarl.log", "work/pytest_0.xml", "work/qwen2_random/model.safetensors",
                 "work/train.parquet", "site/megarl/__init__.py", "notes.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    path = write_results(tmp_path, ["env", "model", "grpo_torch"])  # grpo_torch: no files
    assert path == tmp_path / "results.tgz"
    with tarfile.open(path) as tar:
        assert sorted(tar.getnames()) == sorted([
            "summary.json", "env.json", "env.log", "model.json", "model.log",
            "install_megarl.log", "work/pytest_0.xml"])
        assert tar.extractfile("env.log").read() == b"env.log"


def test_bf16_step_checks_the_kl_after_the_first_update_with_a_signal(monkeypatch):
    """On the GPU the random policy's first responses all score 0 (every advantage 0): the KL is
    checked after step 2's update, not step 1's (the first GPU run failed there); a run with no
    signal at all fails with the scores, never passes."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    from gpu_check_lib import CheckFailed
    from gpu_check_rl import first_signal_step

    def row(lo: float, hi: float) -> dict:
        return {"critic/advantages/min": lo, "critic/advantages/max": hi, "critic/score/mean": 0.0}

    assert first_signal_step([row(0.0, 0.0), row(-0.5, 1.5)]) == 1
    assert first_signal_step([row(-1.0, 1.0), row(0.0, 0.0)]) == 0
    with pytest.raises(CheckFailed, match="every step's advantages were 0"):
        first_signal_step([row(0.0, 0.0), row(0.0, 0.0)])
