"""The LoRA actor on 2 ranks (FSDP2 over both; a 2-stage pipeline; Ulysses over 2), fp32: the weights it sends
are PEFT's merge of the adapters it exports (gathered from shards or stages) onto the folder's
base, the base never moves, the reference (adapters off) is a plain single-process ``ref``
backend of the folder, and a checkpoint written by the world resumes exactly in it.

The worker is this file: ``torchrun --nproc_per_node=2 tests/backends/test_lora_backend_dist.py
MODEL OUT_DIR``; rank 0 saves one ``LAYOUT.pt`` per layout."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from policy_batch import loss_fn, make_batch

ROOT = Path(__file__).resolve().parents[2]
LAYOUTS = {"fsdp2": {"dp_shard": 2}, "pp2": {"pp": 2}, "ulysses2": {"ulysses": 2}}
RANK = 4


def _worker(model: str, out_dir: str) -> None:
    import torch.distributed as dist

    from megarl.backends.torch import TorchBackend
    from megarl.backends.torch.lora_reference import AdapterOffReference
    from megarl.models.lora import LoraSettings, is_adapter_param
    from megarl.utils.dist import destroy, init_distributed

    init_distributed(torch.device("cpu"))
    lora = LoraSettings(rank=RANK, alpha=8.0)

    def actor(kw):
        return TorchBackend("actor", model, device="cpu", optim={"lr": 5e-2, "weight_decay": 0.0},
                            use_fused_kernels=False, lora=lora, seed=3, **kw)

    def adapter_of(b):
        return {n: t.clone() for n, t in b.export_adapter()}

    for name, kw in LAYOUTS.items():
        a = actor(kw)
        start = adapter_of(a)
        dp = a.dp_rank  # the ranks of a sequence-parallel group take the same rows
        for k in range(2):
            a.train_step([make_batch(10 * k + dp)], loss_fn)
        ck = os.path.join(out_dir, f"ck_{name}")
        a.save(ck)
        a.train_step([make_batch(99 + dp)], loss_fn)
        b = actor(kw)
        b.load(ck)
        b.train_step([make_batch(99 + dp)], loss_fn)
        ref = AdapterOffReference(a, forward_max_tokens=64, forward_micro_batch_size=None)
        batch = make_batch(7)
        res = {
            "start": start,
            "adapter": adapter_of(a),
            "resumed": adapter_of(b),
            "weights": dict(a.export_weights()),
            "ref": ref.logprobs(batch, temperature=0.7)[0],
            "actor": a.logprobs(batch, temperature=0.7)[0],
            "n_opt_state": len(a.optimizer.state),
            "n_local_adapters": sum(is_adapter_param(n) for n, _ in a.model.named_parameters()),
        }
        if dist.get_rank() == 0:
            torch.save(res, os.path.join(out_dir, f"{name}.pt"))
        dist.barrier()
    destroy()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from warm_runs import run_script

    from megarl.models.testing import make_tiny_hf_model

    d = tmp_path_factory.mktemp("lora_dist")
    model = make_tiny_hf_model(d / "m", "qwen2", tokenizer=False, lm_head_scale=3.0)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    proc = run_script([str(Path(__file__)), str(model), str(d)], ROOT, env, timeout=600, nproc=2)
    if proc.returncode != 0:
        pytest.fail(f"LoRA worker failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    return model, {n: torch.load(d / f"{n}.pt") for n in LAYOUTS}


@pytest.mark.dist
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lora_actor_on_two_ranks(results, layout):
    import peft
    import transformers

    from megarl.backends.torch import TorchBackend
    from megarl.models import load_model

    model, all_res = results
    r = all_res[layout]
    base = dict(load_model(model).named_parameters())
    adapter = r["adapter"]
    assert len(adapter) == 2 * 7 * 2  # all-linear x 2 layers, gathered from every shard / stage
    assert all(not torch.equal(r["start"][n], t) for n, t in adapter.items() if ".lora_B." in n)
    # PEFT's merge of the exported adapters onto transformers' base = the weights sent
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=RANK, lora_alpha=8.0,
                                                 target_modules="all-linear"))
    params = dict(pm.named_parameters())
    with torch.no_grad():
        for n, t in adapter.items():
            module, ab = n.rsplit(".lora_", 1)
            params[f"base_model.model.{module}.lora_{ab[0]}.default.weight"].copy_(t)
    want = pm.merge_and_unload().state_dict()
    assert set(r["weights"]) == set(want)
    for n, t in r["weights"].items():
        assert (t - want[n]).abs().max() <= 1e-6, n
        if not n.endswith("proj.weight"):  # no adapter: the base, bit for bit
            assert torch.equal(t, base[n]), n
    # the reference is the base model
    from megarl.utils.dist import init_distributed

    init_distributed(torch.device("cpu"))  # a world of one in this process
    plain = TorchBackend("ref", str(model), device="cpu", dtype="fp32", use_fused_kernels=False)
    want_ref, _ = plain.logprobs(make_batch(7), temperature=0.7)
    assert (r["ref"] - want_ref).abs().max() <= 1e-5
    assert (r["actor"] - want_ref).abs().max() > 1e-3
    # optimizer state only for this rank's adapters; the resumed run equals the straight one
    assert r["n_opt_state"] == r["n_local_adapters"] > 0
    for n, t in r["resumed"].items():
        assert torch.equal(t, adapter[n]), n


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    _worker(sys.argv[1], sys.argv[2])
