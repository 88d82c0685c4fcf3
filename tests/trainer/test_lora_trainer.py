"""GRPO with LoRA on the embedded demo policy (torch and megatron backends, 2 steps, the torch
engine receiving merged weights): the run's outputs read back with independent tools. PEFT loads the run's adapter folder onto the demo policy read by
transformers, and its merged model is the run's ``hf_actor`` (so the base weights the run
trained on are the folder's: every tensor no adapter touches is bit for bit the folder's);
the adapters moved; the checkpoint holds the adapters only; the reference is the base model
(KL 0 before the first update, > 0 after it); a resume from the adapters-only checkpoint
continues bit for bit, adapter dropout included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from trainer_helpers import metrics, train

M = "actor_rollout_ref.model"
# a large learning rate moves the policy far from the base in one step (KL ~0.1), so the
# engine's logprobs show whether it runs the merged adapters or the base; the entropy bonus
# makes that step's gradient non-zero by construction (a step-1 batch whose groups all score
# alike has none: on an AMD EPYC the adapters then stayed at B = 0 and the KL at 0)
LORA = [f"{M}.lora_rank=8", f"{M}.lora_alpha=16", f"{M}.target_modules=all-linear",
        "actor_rollout_ref.actor.optim.lr=3e-2", "actor_rollout_ref.rollout.check_logprobs=true",
        "actor_rollout_ref.actor.entropy_coeff=0.01", "trainer.save_freq=1",
        "trainer.export_hf=true"]
# megatron: the adapters named by megatron-core's four linears (= the seven HF ones). Adapter
# dropout in training (PEFT's key on torch, verl's megatron block on megatron): the resume
# must restore the generators it draws from
STRATEGY = {"torch": [f"{M}.lora_dropout=0.1"], "megatron": [
    "actor_rollout_ref.actor.strategy=megatron",
    f"{M}.target_modules=[linear_qkv,linear_proj,linear_fc1,linear_fc2]",
    f"+{M}.lora.dropout=0.1", f"+{M}.lora.dropout_position=post"]}


def assert_engine_runs_the_adapted_policy(run: Path) -> None:
    """Step 1: actor = reference (KL 0). Step 2: the policy moved from the base (KL > 0.01)
    while the engine's sampling logprobs equal the trainer's recomputation of the adapted
    actor (an engine left on the base weights would differ by about the KL's scale)."""
    rows = {r["step"]: r for r in metrics(run)}
    assert rows[1]["actor/kl_loss"] == 0.0
    assert rows[2]["actor/kl_loss"] > 1e-2
    assert rows[2]["rollout/logprob_abs_diff_max"] < 1e-3


@pytest.fixture(scope="module", params=list(STRATEGY))
def runs(request, tmp_path_factory):
    """(strategy, 2 steps straight, 1 step then a resume to 2) run directories."""
    args = [*LORA, *STRATEGY[request.param]]
    straight = tmp_path_factory.mktemp(f"lora_{request.param}_straight")
    resumed = tmp_path_factory.mktemp(f"lora_{request.param}_resumed")
    train(straight, "grpo", *args, "trainer.total_training_steps=2")
    train(resumed, "grpo", *args, "trainer.total_training_steps=1", "trainer.export_hf=false")
    proc = train(resumed, "grpo", *args, "trainer.total_training_steps=2", "trainer.resume=auto")
    assert "resumed from step 1" in proc.stdout
    return request.param, straight, resumed


@pytest.mark.e2e
def test_grpo_lora_two_steps(runs):
    import peft
    import torch.distributed.checkpoint as dcp
    import transformers
    from megatron.core import dist_checkpointing
    from safetensors.torch import load_file

    from megarl.backends.megatron import cpu_compat
    from megarl.data import resolve_path

    strategy, run = runs[0], runs[1]
    base_dir = Path(resolve_path("embedded://policy"))
    base = load_file(str(next(base_dir.glob("*.safetensors"))))
    exported = load_file(str(run / "hf_actor" / "model.safetensors"))
    adapter = load_file(str(run / "lora_adapter" / "adapter_model.safetensors"))
    config = json.loads((run / "lora_adapter" / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16

    adapted = {k.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for k in adapter}
    n_layers = 1 + max(int(k.split(".")[2]) for k in base if k.startswith("model.layers."))
    assert len(adapted) == 7 * n_layers  # all-linear: q k v o gate up down, not the head
    # the adapters trained: B starts at zero
    b_norm = sum(float(t.float().norm()) for k, t in adapter.items() if ".lora_B." in k)
    assert b_norm > 0
    # untouched tensors: bit for bit the folder's; adapted ones: base + (alpha / r) B A
    for name, t in base.items():
        module, kind = name.rsplit(".", 1)
        if module not in adapted or kind != "weight":  # biases are not adapted
            assert torch.equal(exported[name], t.to(exported[name].dtype)), name
        else:
            a = adapter[f"base_model.model.{module}.lora_A.weight"].double()
            b = adapter[f"base_model.model.{module}.lora_B.weight"].double()
            want = t.double() + 2.0 * (b @ a)
            assert (exported[name].double() - want).abs().max() <= 1e-6, name

    # PEFT's own merge of the run's adapter onto transformers' base = the run's merged actor
    hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    merged = peft.PeftModel.from_pretrained(hf, run / "lora_adapter").merge_and_unload()
    for name, t in merged.state_dict().items():
        if name in exported:
            assert (t - exported[name].float()).abs().max() <= 1e-6, name

    # the checkpoint holds the adapters (and their optimizer state) only
    ckpt = run / "checkpoints" / "global_step_2" / "actor"
    if strategy == "torch":
        meta = dcp.FileSystemReader(str(ckpt)).read_metadata()
        model_keys = [k for k in meta.state_dict_metadata if k.startswith("model.")]
        assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys)
        assert len(model_keys) == 2 * len(adapted)
    else:
        with cpu_compat.cuda_to_cpu():
            stored = dist_checkpointing.load_tensors_metadata(str(ckpt))
        model_keys = [k for k in stored if not k.startswith("optimizer.")]
        assert sorted(model_keys) == sorted(f"lora.{m}.lora_{ab}" for m in adapted for ab in "AB")

    assert_engine_runs_the_adapted_policy(run)


@pytest.mark.e2e
def test_grpo_lora_resume_is_exact(runs):
    """1 step, a checkpoint (adapters only) and a resume = 2 steps straight: the same metrics
    (timings aside), adapters and merged weights, bit for bit."""
    from safetensors.torch import load_file
    from trainer_helpers import strip_timing, train_rows

    _, straight, resumed = runs
    a, b = train_rows(straight), train_rows(resumed)
    assert [r["step"] for r in a] == [1, 2] == [r["step"] for r in b]
    assert [strip_timing(r) for r in a] == [strip_timing(r) for r in b]
    for name in ("lora_adapter/adapter_model.safetensors", "hf_actor/model.safetensors"):
        wa, wb = load_file(str(straight / name)), load_file(str(resumed / name))
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), name


# runs launch/train.py, appending {"kind", "bytes"} per weight sync of the vLLM engine to argv[1]
SYNC_LOG = """
import json, runpy, sys
log = sys.argv.pop(1)
from megarl.rollout.vllm import engine, lora

def record(cls, method, kind):
    original = getattr(cls, method)

    def recorded(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        with open(log, "a") as f:
            f.write(json.dumps({"kind": kind, "bytes": self.last_sync_bytes}) + "\\n")
        return out

    setattr(cls, method, recorded)

record(lora.AdapterSyncedEngine, "load_adapter", "adapter")
record(engine.VLLMEngine, "update_weights", "merged")
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.e2e
@pytest.mark.vllm
def test_grpo_lora_vllm_engine_gets_the_adapters(tmp_path):
    """vLLM (in the rank's process) receives the adapters only, at start and after each update
    (the adapter file's bytes, under a tenth of the merged weights'), and samples from the
    adapted policy."""
    from safetensors.torch import load_file

    from megarl.data import resolve_path

    run, log = tmp_path / "vllm", tmp_path / "syncs.jsonl"
    train(run, "grpo", *LORA, "trainer.total_training_steps=2", "trainer.save_freq=-1",
          "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.enforce_eager=true",
          python_args=("-c", SYNC_LOG, str(log)))
    assert_engine_runs_the_adapted_policy(run)
    syncs = [json.loads(line) for line in log.read_text().splitlines()]
    adapter = load_file(str(run / "lora_adapter" / "adapter_model.safetensors"))
    adapter_bytes = sum(t.numel() * 4 for t in adapter.values())  # fp32 training weights
    assert syncs == [{"kind": "adapter", "bytes": adapter_bytes}] * 3, syncs
    steps = [r for r in metrics(run) if r["step"] > 0]  # the metric of each step's sync
    assert [r["rollout/weight_sync_bytes"] for r in steps] == [adapter_bytes] * 2
    base = load_file(str(next(Path(resolve_path("embedded://policy")).glob("*.safetensors"))))
    assert adapter_bytes * 10 < sum(t.numel() * 4 for t in base.values())


@pytest.mark.e2e
@pytest.mark.dist
@pytest.mark.vllm
def test_grpo_lora_vllm_two_ranks(tmp_path):
    """2 ranks, one vLLM engine spanning both (rollout tensor_model_parallel_size 2: each
    worker takes its slice of the full adapters), the megatron actor tensor parallel with its
    adapters split over the ranks (the torch actor's adapter sync:
    test_grpo_lora_vllm_engine_gets_the_adapters): the engine samples from the adapted policy.
    Before: a tensor-parallel engine was refused adapter sync and took merged weights."""
    layout = [*STRATEGY["megatron"], "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"]
    train(tmp_path, "grpo", *LORA, *layout, "trainer.total_training_steps=2",
          "trainer.save_freq=-1", "trainer.export_hf=false", "actor_rollout_ref.rollout.name=vllm",
          "actor_rollout_ref.rollout.enforce_eager=true",
          "actor_rollout_ref.rollout.tensor_model_parallel_size=2", nproc=2)
    assert_engine_runs_the_adapted_policy(tmp_path)
    # each sync moved the adapters (whole, TP-split ones gathered), not merged weights
    from safetensors.torch import load_file

    from megarl.data import resolve_path

    base = load_file(str(next(Path(resolve_path("embedded://policy")).glob("*.safetensors"))))
    synced = [r["rollout/weight_sync_bytes"] for r in metrics(tmp_path) if r["step"] > 0]
    assert len(synced) == 2 and len(set(synced)) == 1
    assert 0 < synced[0] * 10 < sum(t.numel() * 4 for t in base.values()), synced


@pytest.mark.e2e
@pytest.mark.vllm
def test_grpo_lora_async_engine_process_gets_the_adapters(tmp_path):
    """Asynchronous rollout (staleness 1: vLLM in an engine process of its own): every publish
    puts the adapters only in the weight ring (the same bytes each step, under a tenth of the
    base weights'), and the run trains (KL > 0 once the policy moved). Before: an engine process
    was refused adapter sync and the ring carried merged weights."""
    from megarl.data import resolve_path

    train(tmp_path, "grpo", *LORA, "trainer.total_training_steps=3", "trainer.save_freq=-1",
          "trainer.export_hf=false", "actor_rollout_ref.rollout.check_logprobs=false",
          "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.enforce_eager=true",
          "async_training.staleness_threshold=1")
    rows = [r for r in metrics(tmp_path) if r["step"] > 0]
    synced = [r["rollout/weight_sync_bytes"] for r in rows]
    from safetensors.torch import load_file

    base = load_file(str(next(Path(resolve_path("embedded://policy")).glob("*.safetensors"))))
    assert len(synced) == 3 and len(set(synced)) == 1
    assert 0 < synced[0] * 10 < sum(t.numel() * 4 for t in base.values()), synced
    assert rows[-1]["actor/kl_loss"] > 0
