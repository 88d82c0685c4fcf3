"""GRPO with LoRA on the megatron backend (the embedded demo policy, 2 steps, the torch engine
receiving merged weights), read back with independent tools: PEFT loads the run's adapter
folder onto the demo policy and its merge is the run's ``hf_actor`` (every tensor no adapter
touches bit for bit the folder's); the checkpoint holds the adapters (and their optimizer)
only; the reference is the base model (KL 0 before the first update, > 0 after it) while the
engine samples from the adapted policy; a resume from the adapters-only checkpoint continues
bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from trainer_helpers import metrics, strip_timing, train, train_rows

M = "actor_rollout_ref.model"
LORA = ["actor_rollout_ref.actor.strategy=megatron", f"{M}.lora_rank=8", f"{M}.lora_alpha=16",
        f"{M}.target_modules=[linear_qkv,linear_proj,linear_fc1,linear_fc2]",
        "actor_rollout_ref.actor.optim.lr=3e-2", "actor_rollout_ref.rollout.check_logprobs=true",
        "trainer.save_freq=1", "trainer.export_hf=true"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(2 steps straight, 1 step then a resume to 2) run directories."""
    straight = tmp_path_factory.mktemp("mlora_straight")
    resumed = tmp_path_factory.mktemp("mlora_resumed")
    train(straight, "grpo", *LORA, "trainer.total_training_steps=2")
    train(resumed, "grpo", *LORA, "trainer.total_training_steps=1", "trainer.export_hf=false")
    proc = train(resumed, "grpo", *LORA, "trainer.total_training_steps=2", "trainer.resume=auto")
    assert "resumed from step 1" in proc.stdout
    return straight, resumed


@pytest.mark.e2e
def test_grpo_megatron_lora_two_steps(runs):
    import peft
    import transformers
    from megatron.core import dist_checkpointing
    from safetensors.torch import load_file

    from megarl.backends.megatron import cpu_compat
    from megarl.data import resolve_path

    run = runs[0]
    base_dir = Path(resolve_path("embedded://policy"))
    base = load_file(str(next(base_dir.glob("*.safetensors"))))
    exported = load_file(str(run / "hf_actor" / "model.safetensors"))
    adapter = load_file(str(run / "lora_adapter" / "adapter_model.safetensors"))
    config = json.loads((run / "lora_adapter" / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16
    adapted = {k.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for k in adapter}
    n_layers = 1 + max(int(k.split(".")[2]) for k in base if k.startswith("model.layers."))
    assert len(adapted) == 7 * n_layers  # megatron's four linears = the seven HF ones
    assert sum(float(t.float().norm()) for k, t in adapter.items() if ".lora_B." in k) > 0
    for name, t in base.items():
        module, kind = name.rsplit(".", 1)
        if module not in adapted or kind != "weight":
            assert torch.equal(exported[name], t.to(exported[name].dtype)), name
        else:
            a = adapter[f"base_model.model.{module}.lora_A.weight"].double()
            b = adapter[f"base_model.model.{module}.lora_B.weight"].double()
            want = t.double() + 2.0 * (b @ a)
            assert (exported[name].double() - want).abs().max() <= 1e-6, name
    hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    merged = peft.PeftModel.from_pretrained(hf, run / "lora_adapter").merge_and_unload()
    for name, t in merged.state_dict().items():
        if name in exported:
            assert (t - exported[name].float()).abs().max() <= 1e-6, name

    with cpu_compat.cuda_to_cpu():
        stored = dist_checkpointing.load_tensors_metadata(
            str(run / "checkpoints" / "global_step_2" / "actor"))
    model_keys = [k for k in stored if not k.startswith("optimizer.")]
    assert sorted(model_keys) == sorted(f"lora.{m}.lora_{ab}" for m in adapted for ab in "AB")

    rows = {r["step"]: r for r in metrics(run)}
    assert rows[1]["actor/kl_loss"] == 0.0
    assert rows[2]["actor/kl_loss"] > 1e-2
    assert rows[2]["rollout/logprob_abs_diff_max"] < 1e-3


@pytest.mark.e2e
def test_grpo_megatron_lora_resume_is_exact(runs):
    """1 step, an adapters-only checkpoint and a resume = 2 steps straight: the same metrics
    (timings aside), adapters and merged weights, bit for bit."""
    from safetensors.torch import load_file

    straight, resumed = runs
    a, b = train_rows(straight), train_rows(resumed)
    assert [r["step"] for r in a] == [1, 2] == [r["step"] for r in b]
    assert [strip_timing(r) for r in a] == [strip_timing(r) for r in b]
    for name in ("lora_adapter/adapter_model.safetensors", "hf_actor/model.safetensors"):
        wa, wb = load_file(str(straight / name)), load_file(str(resumed / name))
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), name
