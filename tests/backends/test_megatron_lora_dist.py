"""The megatron LoRA actor on 2 ranks (TP=2, TP=2 with sequence parallelism, PP=2, DP=2) against
the same actor in one process (fp32, the same adapters, a tied-embedding GQA Qwen2 with q/k/v
biases): logits, adapter gradients and one optimizer step agree, also with adapter dropout on
the input or the output (but PP=2); the merged weights it sends
are PEFT's merge of the adapters it exports onto the folder's base; the reference (adapters
off) is the base model; a checkpoint (adapters + optimizer only) resumes exactly.

The worker is this file: ``torchrun --nproc_per_node=2 tests/backends/test_megatron_lora_dist.py
MODEL OUT_DIR``; rank 0 saves one ``LAYOUT.pt`` per layout."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from policy_batch import loss_fn, make_batch, seed_megatron_dropout

ROOT = Path(__file__).resolve().parents[2]
# dp2: both ranks take the same batch, so the DP average is one process's gradient; the
# distributed optimizer shards the adapters' state over the two ranks
LAYOUTS = {"tp2": {"tp": 2}, "tp2sp": {"tp": 2, "sp": True}, "pp2": {"pp": 2}, "dp2": {}}
RANK, ALPHA, T = 4, 8.0, 0.7
DROPOUT_POSITIONS = ("pre", "post")
OPTIM = {"lr": 1e-2, "weight_decay": 0.0, "eps": 1e-8}


def start_adapter(model: str) -> dict[str, torch.Tensor]:
    """Full adapters with non-zero B (a fresh adapter's B is 0: no gradient reaches A)."""
    from megarl.backends.megatron.lora import adapter_specs
    from megarl.models.args import ModelArgs
    from megarl.models.hf_io import read_hf_config
    from megarl.models.lora import LoraSettings

    args = ModelArgs.from_hf_config(read_hf_config(model))
    g = torch.Generator().manual_seed(11)
    out = {}
    for s in adapter_specs(args, LoraSettings(rank=RANK, alpha=ALPHA)):
        out[f"{s.module}.lora_A.weight"] = torch.randn(RANK, s.in_features, generator=g) * 0.2
        out[f"{s.module}.lora_B.weight"] = torch.randn(s.out_features, RANK, generator=g) * 0.2
    return out


def run_layout(model: str, kw: dict, ck: str | None) -> dict:
    """Everything compared, from one layout (every rank runs it; the results are full tensors
    on every rank)."""
    from megarl.backends.megatron import MegatronBackend
    from megarl.backends.megatron.lora import AdapterOffReference
    from megarl.models.lora import LoraSettings

    def actor(**lora):
        return MegatronBackend("actor", model, lora=LoraSettings(rank=RANK, alpha=ALPHA, **lora),
                               optim=OPTIM, use_fused_kernels=False, seed=3, **kw)

    a = actor()
    fresh = {n: t.clone() for n, t in a.export_adapter()}
    a.load_adapter(start_adapter(model))
    batch = make_batch(7)
    res = {"fresh": fresh, "logits": a.logits(batch, temperature=T),
           "ref": AdapterOffReference(a).logprobs(batch, temperature=T)[0]}
    res["metrics"] = a.train_step([make_batch(1), make_batch(2)], loss_fn, temperature=T)
    if a.dp_size == 1:
        res["grads"] = {n: t.clone() for n, t in a.export_adapter(grads=True)}
    else:  # the distributed optimizer reduce-scattered them: each rank has its shard only
        with pytest.raises(RuntimeError, match="dp_size x context_parallel_size == 1"):
            next(a.export_adapter(grads=True))
    res["adapter"] = {n: t.clone() for n, t in a.export_adapter()}
    res["weights"] = dict(a.export_weights())
    for position in DROPOUT_POSITIONS:  # the same update with adapter dropout 0.5
        dropped = actor(dropout=0.5, dropout_position=position)
        dropped.load_adapter(start_adapter(model))
        seed_megatron_dropout(17)  # every rank: the same generator state
        # 10 columns: SP pads a batch to a multiple of TP, and a mask is drawn for the padded
        # [b, S, features]; at one length every layout draws the same masks
        dropped.train_step([make_batch(1, P=6), make_batch(2, P=6)], loss_fn, temperature=T)
        res[f"dropped_{position}"] = {n: t.clone() for n, t in dropped.export_adapter()}
    res["n_opt_params"] = sum(len(g["params"]) for g in a.optimizer.param_groups)
    res["n_local_adapters"] = sum(p.numel() > 0 for c in a.chunks for p in c.lora.parameters())
    if ck is not None:
        a.save(ck)
        a.train_step([make_batch(3)], loss_fn, temperature=T)
        res["straight"] = {n: t.clone() for n, t in a.export_adapter()}
        b = actor()
        b.load(ck)
        b.train_step([make_batch(3)], loss_fn, temperature=T)
        res["resumed"] = {n: t.clone() for n, t in b.export_adapter()}
    return res


def _worker(model: str, out_dir: str) -> None:
    import torch.distributed as dist

    from megarl.backends.megatron import parallel
    from megarl.utils.dist import destroy, init_distributed

    init_distributed(torch.device("cpu"))
    for name, kw in LAYOUTS.items():
        res = run_layout(model, kw, os.path.join(out_dir, f"ck_{name}"))
        if dist.get_rank() == 0:
            torch.save(res, os.path.join(out_dir, f"{name}.pt"))
        dist.barrier()
        parallel.reset_model_parallel()
    destroy()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from warm_runs import run_script

    from megarl.models.testing import make_tiny_hf_model

    d = tmp_path_factory.mktemp("mlora_dist")
    model = make_tiny_hf_model(d / "m", "qwen2", tokenizer=False,
                               tie_word_embeddings=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    proc = run_script([str(Path(__file__)), str(model), str(d)], ROOT, env, timeout=600, nproc=2)
    if proc.returncode != 0:
        pytest.fail(f"megatron LoRA worker failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    # the same actor in this process (a world of one: TP = PP = 1)
    sys.path.insert(0, str(ROOT / "tests" / "megatron"))
    import mcore_testlib as lib

    lib.ensure_dist()
    from megarl.backends.megatron import parallel

    parallel.reset_model_parallel()
    one = run_layout(str(model), {}, None)
    parallel.reset_model_parallel()
    return model, one, {n: torch.load(d / f"{n}.pt") for n in LAYOUTS}, d


def _close(got: dict, want: dict, rel: float) -> None:
    assert set(got) == set(want)
    for n, t in want.items():
        scale = float(t.abs().max()) or 1.0
        assert (got[n] - t).abs().max() <= rel * scale, (n, float((got[n] - t).abs().max()))


@pytest.mark.e2e
@pytest.mark.dist
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_megatron_lora_layouts_equal_one_process(results, layout):
    """TP=2 (with and without SP) and PP=2 give one process's logits, adapter gradients and
    updated adapters (fp32, reduction order apart). Planted: B's TP split taken along the wrong
    dim, the row-parallel partial A x not summed over TP, the SP tag off (A's gradient a
    partial sum): each breaks the gradients of the tp2 / tp2sp layouts by O(1)."""
    _, one, all_res, _ = results
    r = all_res[layout]
    # the fresh adapters do not depend on the layout: PEFT's A draw, B = 0
    _close(r["fresh"], one["fresh"], 0.0)
    assert all(float(t.abs().max()) == 0 for n, t in r["fresh"].items() if ".lora_B." in n)
    assert (r["logits"] - one["logits"]).abs().max() <= 2e-5 * one["logits"].abs().max()
    if layout != "dp2":
        _close(r["grads"], one["grads"], 3e-5)
    assert all(float(t.abs().max()) > 0 for t in one["grads"].values())
    _close(r["adapter"], one["adapter"], 3e-5)
    assert r["metrics"]["loss"] == pytest.approx(one["metrics"]["loss"], rel=1e-5)
    # adapter dropout: each TP rank draws the whole mask and keeps its part, so TP and SP drop
    # what one process drops (DP=2: both ranks the same batch and generator state); pipeline
    # stages draw from their own generators. Planted: the row-parallel mask not sliced to the
    # rank's input columns, or the SP shard's mask drawn for its own rows only: O(1) apart.
    for position in DROPOUT_POSITIONS:
        key = f"dropped_{position}"
        moved = max(float((one[key][n] - t).abs().max()) for n, t in one["adapter"].items())
        assert moved > 1e-3, (position, moved)  # the masks changed the update
        if layout != "pp2":
            _close(r[key], one[key], 3e-5)
    # the optimizer holds this rank's adapters only (under DP=2 the distributed optimizer
    # holds a share of them)
    if layout == "dp2":
        assert 0 < r["n_opt_params"] < r["n_local_adapters"]
    else:
        assert r["n_opt_params"] == r["n_local_adapters"] > 0


@pytest.mark.e2e
@pytest.mark.dist
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_megatron_lora_merge_reference_and_resume(results, layout):
    import peft
    import transformers

    model, one, all_res, d = results
    r = all_res[layout]
    # the merged weights sent = PEFT's merge of the exported adapters onto transformers' base
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    base = {n: t.clone() for n, t in hf.state_dict().items()}
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=RANK, lora_alpha=ALPHA,
                                                 target_modules="all-linear"))
    params = dict(pm.named_parameters())
    with torch.no_grad():
        for n, t in r["adapter"].items():
            module, ab = n.rsplit(".lora_", 1)
            params[f"base_model.model.{module}.lora_{ab[0]}.default.weight"].copy_(t)
    want = pm.merge_and_unload().state_dict()
    want.pop("lm_head.weight")  # tied: HF saves the embedding only
    assert set(r["weights"]) == set(want)
    for n, t in r["weights"].items():
        assert (t - want[n]).abs().max() <= 1e-6, n
        if not n.endswith("proj.weight"):  # no adapter: the base, bit for bit
            assert torch.equal(t, base[n]), n
    # the reference is the base model: a plain ref backend of the folder, one process
    assert (r["ref"] - one["ref"]).abs().max() <= 2e-5
    from megarl.backends.megatron import MegatronBackend, parallel

    plain = MegatronBackend("ref", str(model), use_fused_kernels=False)
    want_ref, _ = plain.logprobs(make_batch(7), temperature=T)
    parallel.reset_model_parallel()
    assert (one["ref"] - want_ref).abs().max() <= 1e-6
    # the checkpoint holds the adapters (full shapes, PEFT's module names) and their optimizer
    from megatron.core import dist_checkpointing

    from megarl.backends.megatron import cpu_compat

    with cpu_compat.cuda_to_cpu():
        stored = dist_checkpointing.load_tensors_metadata(str(d / f"ck_{layout}"))
    model_keys = {k: tuple(v.global_shape) for k, v in stored.items()
                  if not k.startswith("optimizer.")}
    assert model_keys == {f"lora.{n.removesuffix('.weight')}": tuple(t.shape)
                          for n, t in r["adapter"].items()}
    # a resumed run equals the straight one, bit for bit
    for n, t in r["straight"].items():
        assert torch.equal(r["resumed"][n], t), n
    assert any(not torch.equal(r["straight"][n], t) for n, t in r["adapter"].items())


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    _worker(sys.argv[1], sys.argv[2])
