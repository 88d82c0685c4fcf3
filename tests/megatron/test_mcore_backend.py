"""The megatron backend in this process (TP = PP = DP = 1) against transformers in float64:
every model family and head, the Backend protocol methods, recompute, bf16, skipped steps,
the config adapter; plus the CPU compatibility layer and the import guard."""

import math
import multiprocessing
import queue

import mcore_testlib as lib
import pytest
import torch
from safetensors.torch import load_file

from megarl.models.state_dict_adapter import hf_sort_key
from megarl.trainer.settings import role_settings

# fp32 megatron against transformers in float64: tolerances derived from each model's shape and
# weights and the batch (`lib.fp32_tols`, tests/fp32_bounds.py), not a fixed 1e-5 (which sat 3x
# above the logits' error on one CPU): per logit lambda |w_j| max|g| (L + 1) sqrt(n) u / T
# (1.2e-5 to 1.5e-5 here), per logprob twice that plus the logsumexp's sum (2.7e-5 to 3.2e-5),
# per entropy its sensitivity sum p |log p + H| of it plus its own sum (2.6e-5 to 3.0e-5).
LM_ZOO = ("llama_tied_gqa", "qwen2_bias", "qwen3_qknorm", "llama3_rope")


@pytest.fixture
def backend_cls(mcore_dist):
    from megarl.backends.megatron import MegatronBackend

    return MegatronBackend


@pytest.mark.parametrize("name", LM_ZOO)
def test_lm_logits_logprobs_entropy_match_transformers(zoo, backend_cls, name):
    """Logits / T, logprobs and entropies at T 0.8 within `lib.fp32_tols` of transformers in
    float64. Measured on the 2-core Intel Xeon (error / tolerance): logits 1.7e-6 / 1.4e-5 to
    2.1e-6 / 1.4e-5, logprobs 7.8e-7 to 1.1e-6 (tolerances 2.7e-5 to 3.2e-5), entropies
    2.5e-7 to 5.6e-7 (2.6e-5 to 3.0e-5). Planted in megarl, each reverted: the megatron head
    at temperature 1.001 T: logits off by 3.1e-3 to 3.7e-3, logprobs 2.5e-3 to 2.8e-3,
    entropies 1.3e-3 to 1.8e-3 (about 100 x their tolerances); RMSNorm epsilon 10 x: logits
    1.4e-3 to 3.2e-3, logprobs 4.2e-4 to 1.5e-3, entropies 7.3e-5 to 3.1e-4."""
    path = lib.zoo_model(zoo, name)
    be = backend_cls("ref", str(path))
    batch = lib.make_batch(seed=5)
    ref_lp, ref_ent, ref_logits = lib.hf_logprobs(lib.hf_model(path), batch, temperature=0.8)
    tol = lib.fp32_tols(path, ref_logits, batch.response_mask, 0.8)
    lp, ent = be.logprobs(batch, temperature=0.8, with_entropy=True)
    assert lp.shape == ent.shape == batch.response_mask.shape
    assert lib.max_diff(be.logits(batch, temperature=0.8), ref_logits) < tol["logits"]
    assert lib.max_diff(lp, ref_lp) < tol["logprob"]
    assert lib.max_diff(ent, ref_ent) < tol["entropy"]
    assert torch.all(lp[batch.response_mask == 0] == 0)
    # HF -> megatron -> HF is bit-exact for every tensor, names included
    source = load_file(str(path / "model.safetensors"))
    exported = dict(be.export_weights())
    assert sorted(exported) == sorted(source)
    assert list(exported) == sorted(exported, key=hf_sort_key)  # HF state_dict order
    for k, v in source.items():
        assert torch.equal(exported[k].cpu(), v), k


def test_fallback_and_fused_kernel_paths_agree(zoo, backend_cls):
    path = lib.zoo_model(zoo, "qwen2_bias")
    batch = lib.make_batch(seed=6)
    a = backend_cls("ref", str(path), use_fused_kernels=True).logprobs(batch, 1.0, True)
    b = backend_cls("ref", str(path), use_fused_kernels=False).logprobs(batch, 1.0, True)
    assert lib.max_diff(a[0], b[0]) < 1e-5 and lib.max_diff(a[1], b[1]) < 1e-5


def test_critic_and_prm_heads_match_token_classification(zoo, backend_cls):
    """Values and scores within `lib.fp32_value_tol` of transformers in float64 (the logit
    bound with the score head's rows: 5.8e-6 critic, 6.6e-6 PRM). Measured on the 2-core Intel
    Xeon: 8.0e-7 and 1.0e-6. Planted (RMSNorm epsilon 10 x in megarl's megatron config):
    critic 9.0e-4, PRM 6.9e-4 (about 100 x)."""
    batch = lib.make_batch(seed=7)
    path = lib.zoo_model(zoo, "qwen2_critic")
    critic = backend_cls("critic", str(path))
    tol = lib.fp32_value_tol(path, batch.response_mask)
    assert lib.max_diff(critic.values(batch), lib.hf_values(lib.hf_model(path, "token_cls"),
                                                            batch)) < tol
    path = lib.zoo_model(zoo, "qwen3_prm")
    prm = backend_cls("prm", str(path))
    scores = prm.token_scores(batch)
    assert scores.shape == (*batch.response_mask.shape, 2)
    tol = lib.fp32_value_tol(path, batch.response_mask)
    assert lib.max_diff(scores, lib.hf_scores(lib.hf_model(path, "token_cls"), batch)) < tol
    exported = dict(prm.export_weights())
    assert exported["score.weight"].shape == (2, 64) and "lm_head.weight" not in exported
    with pytest.raises(TypeError, match="prm role"):
        critic.token_scores(batch)
    with pytest.raises(TypeError, match="LM head"):
        prm.logprobs(batch)


def test_critic_from_lm_checkpoint_gets_a_fresh_head(zoo, backend_cls):
    path = lib.zoo_model(zoo, "qwen2_bias")
    critic = backend_cls("critic", str(path), seed=3)
    w = dict(critic.export_weights())
    source = load_file(str(path / "model.safetensors"))
    assert torch.equal(w["model.layers.1.mlp.up_proj.weight"].cpu(),
                       source["model.layers.1.mlp.up_proj.weight"])
    assert w["score.weight"].shape == (1, 64) and torch.all(w["score.bias"] == 0)
    assert 0.005 < float(w["score.weight"].std()) < 0.05  # N(0, initializer_range=0.02)
    with pytest.raises(Exception, match="score"):
        backend_cls("prm", str(path))  # a PRM must come with its head


def test_agrees_with_megarl_models(zoo, backend_cls):
    models = pytest.importorskip("megarl.models")
    path = lib.zoo_model(zoo, "qwen3_qknorm")
    batch = lib.make_batch(seed=8)
    ours = models.load_model(path)
    mask = batch.attention_mask
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        out = ours(batch.input_ids, attention_mask=mask, position_ids=pos)
    logits = out if torch.is_tensor(out) else out.logits
    P = batch.input_ids.shape[1] - batch.response_length
    ref = logits[:, P - 1 : -1] * batch.response_mask[..., None]
    # two fp32 forwards: twice one side's logit bound (1.9e-5; measured 1.2e-6; planted head
    # temperature 1.001: 2.8e-3, RMSNorm epsilon 10 x: 8.2e-4)
    from fp32_bounds import fp32_ref_logit_bound

    tol = 2 * fp32_ref_logit_bound(path, int(batch.response_mask.sum()))
    assert lib.max_diff(backend_cls("ref", str(path)).logits(batch), ref) < tol


def test_train_step_gradients_metrics_and_frozen_roles(zoo, backend_cls):
    path = lib.zoo_model(zoo, "qwen2_bias")
    be = backend_cls("actor", str(path), optim={"grad_clip": 0.0, "lr": 1e-3})
    hf = lib.hf_model(path)
    batch = lib.make_batch(seed=9)
    n = float(batch.response_mask.sum())
    ref_lp, _, _ = lib.hf_logprobs(hf, batch, temperature=0.9)
    (-(ref_lp.sum()) / n).backward()
    metrics = be.train_step(
        [batch.select(slice(0, 1)), batch.select(slice(1, 3)), batch.select(slice(3, 4))],
        lambda o, mb: lib.pg_loss(o, mb, n),
        temperature=0.9,
    )
    grads = dict(be.export_grads())
    for k, p in hf.named_parameters():
        assert lib.rel_diff(grads[k], p.grad) < 1e-4, k
    assert metrics["tokens"] == n  # summed over the 3 micro-batches
    assert metrics["loss"] == pytest.approx(float(-(ref_lp.sum()) / n), rel=1e-5)
    assert metrics["skipped"] == 0.0 and metrics["lr"] == 1e-3 and be.step == 1
    ref = backend_cls("ref", str(path))
    assert all(not p.requires_grad for m in ref.modules for p in m.parameters())
    with pytest.raises(TypeError, match="without an optimizer"):
        ref.train_step([batch], lambda o, mb: lib.pg_loss(o, mb, n))


def test_non_finite_grad_norm_skips_the_step(zoo, backend_cls):
    path = lib.zoo_model(zoo, "llama_tied_gqa")
    be = backend_cls("actor", str(path), optim={"lr": 1e-2})
    batch = lib.make_batch(seed=10)
    before = dict(be.export_weights())

    def nan_loss(outputs, mb):
        return (outputs.logprob * float("nan")).sum(), {}

    metrics = be.train_step([batch], nan_loss)
    assert metrics["skipped"] == 1.0 and not math.isfinite(metrics["grad_norm"])
    assert be.step == 0
    after = dict(be.export_weights())
    assert all(torch.equal(before[k], after[k]) for k in before)
    metrics = be.train_step([batch], lambda o, mb: lib.pg_loss(o, mb, 10.0))
    assert metrics["skipped"] == 0.0 and be.step == 1


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_activation_recompute_keeps_gradients(zoo, backend_cls, recompute):
    path = lib.zoo_model(zoo, "qwen3_qknorm")
    batch = lib.make_batch(seed=11)
    grads = []
    for rc in (None, recompute):
        be = backend_cls("actor", str(path), recompute=rc, optim={"grad_clip": 0})
        be.train_step([batch], lambda o, mb: lib.pg_loss(o, mb, 10.0))
        grads.append(dict(be.export_grads()))
    for k in grads[0]:
        assert torch.allclose(grads[0][k], grads[1][k], atol=1e-7, rtol=1e-6), k


def spread_copy(src, dst, scale: float = 3.0):
    """A copy of the HF folder `src` with its output head scaled by `scale` (logit std 0.8 ->
    2.4: the tiny random models' near-uniform logits hide a temperature error)."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    w = load_file(str(dst / "model.safetensors"))
    key = "lm_head.weight" if "lm_head.weight" in w else "model.embed_tokens.weight"
    w[key] = w[key] * scale
    save_file(w, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_bf16_params_and_logprobs(zoo, backend_cls, tmp_path):
    """bf16 logprobs against transformers run in bf16, on a model with logit spread (std 2.4):
    max |diff| < 0.2 and mean < 0.08 over the response tokens (measured at T 0.7 / 1.0: max
    0.092 / 0.060, mean 0.050 / 0.030; megatron's bf16 kernels round differently from
    transformers', so the bound is above one bf16 ulp of the logits). Planted T' = 1.05 T moves
    the same logprobs by mean 0.30 / 0.17 (max 0.66 / 0.42); planted in the backend it fails
    at max 0.65, mean 0.28. Before, a bound of 0.15 against fp32 on the unscaled model let it
    pass."""
    path = spread_copy(lib.zoo_model(zoo, "qwen2_bias"), tmp_path / "spread")
    be = backend_cls("actor", str(path), dtype="bf16", optim={"lr": 1e-3})
    batch = lib.make_batch(seed=12)
    hf16 = lib.hf_model(path, dtype=torch.bfloat16)
    resp = batch.response_mask.bool()
    for temperature in (0.7, 1.0):
        with torch.no_grad():
            ref_lp, _, ref_logits = lib.hf_logprobs(hf16, batch, temperature=temperature)
        assert float(ref_logits[resp].std(-1).mean()) * temperature > 2.0  # real spread
        lp, _ = be.logprobs(batch, temperature=temperature)
        assert lp.dtype == torch.float32
        d = (lp.double() - ref_lp)[resp].abs()
        assert float(d.max()) < 0.2 and float(d.mean()) < 0.08, (temperature, d.max(), d.mean())
    metrics = be.train_step([batch], lambda o, mb: lib.pg_loss(o, mb, 10.0))
    assert metrics["skipped"] == 0.0 and math.isfinite(metrics["grad_norm"])
    assert all(t.dtype == torch.bfloat16 for _, t in be.export_weights())


def test_checkpoint_roundtrip_restores_weights_optimizer_and_step(zoo, backend_cls, tmp_path):
    path = lib.zoo_model(zoo, "llama3_rope")
    batch = lib.make_batch(seed=13)

    def step(be):
        return be.train_step([batch], lambda o, mb: lib.pg_loss(o, mb, 10.0))

    optim = {"lr": 1e-2, "lr_warmup_steps": 2}
    a = backend_cls("actor", str(path), optim=optim)
    step(a)
    children = multiprocessing.active_children()
    a.save(str(tmp_path / "ckpt"))
    # megatron's writer reports through an in-process queue, not a spawned Manager's
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    assert type(filesystem_async._results_queue) is queue.Queue
    assert multiprocessing.active_children() == children
    m_a = step(a)
    b = backend_cls("actor", str(path), optim=optim)
    b.load(str(tmp_path / "ckpt"))
    assert b.step == 1
    m_b = step(b)  # same Adam moments, same LR position
    assert m_b["lr"] == m_a["lr"] == pytest.approx(0.5e-2)
    wa, wb = dict(a.export_weights()), dict(b.export_weights())
    assert max(lib.max_diff(wa[k], wb[k]) for k in wa) < 1e-6
    with pytest.raises(FileExistsError):
        a.save(str(tmp_path / "ckpt"))
    # saved before any update: resuming gives the same first update (Adam step count 0)
    c = backend_cls("actor", str(path), optim={"lr": 1e-2})
    c.save(str(tmp_path / "ckpt0"))
    d = backend_cls("actor", str(path), optim={"lr": 1e-2})
    d.load(str(tmp_path / "ckpt0"))
    step(c), step(d)
    wc, wd = dict(c.export_weights()), dict(d.export_weights())
    assert max(lib.max_diff(wc[k], wd[k]) for k in wc) == 0.0


def test_from_config_reads_the_project_config(zoo, backend_cls):
    config = pytest.importorskip("megarl.config")
    path = lib.zoo_model(zoo, "qwen2_bias")
    cfg = config.Config()
    cfg.actor_rollout_ref.model.path = str(path)
    cfg.actor_rollout_ref.model.dtype = "fp32"
    cfg.actor_rollout_ref.actor.optim.lr = 3e-4
    cfg.actor_rollout_ref.actor.grad_clip = 0.7
    cfg.actor_rollout_ref.actor.megatron.recompute_granularity = "full"
    be = backend_cls.from_settings(role_settings("actor", cfg))
    assert be.optim.lr == 3e-4 and be.optim.grad_clip == 0.7 and be.dtype == torch.float32
    assert be.config.recompute_granularity == "full"
    # critic.model.path -> the actor's
    critic = backend_cls.from_settings(role_settings("critic", cfg))
    assert critic.num_labels == 1 and critic.optim.lr == cfg.critic.optim.lr
    with pytest.raises(ValueError, match="reward_model.model.path"):
        backend_cls.from_settings(role_settings("prm", cfg))


def test_bad_batch_layout_is_refused(zoo, backend_cls):
    from megarl.backends.protocol import SequenceBatch

    be = backend_cls("ref", str(lib.zoo_model(zoo, "qwen2_bias")))
    batch = lib.make_batch(seed=14)
    mask = batch.attention_mask.clone()
    mask[0, -batch.response_length] = 0  # a hole at the start of the response
    mask[0, -1] = 1
    with pytest.raises(ValueError, match="row 0"):
        be.logprobs(SequenceBatch(batch.input_ids, mask, batch.response_length))


def test_cpu_compat_is_idempotent_and_scoped(mcore_dist):
    from megarl.backends.megatron import cpu_compat

    if not cpu_compat.needed():
        pytest.skip("CUDA present: the CPU patches are not applied")
    cpu_compat.apply()
    cpu_compat.apply()
    assert torch.cuda.current_device() == torch.device("cpu")
    t = torch.zeros(2)
    assert t.type() == "torch.FloatTensor"
    with cpu_compat.cuda_type_strings():
        assert t.type() == "torch.cuda.FloatTensor"
        assert t.type(torch.float64).dtype == torch.float64
    assert t.type() == "torch.FloatTensor"
    with cpu_compat.cuda_to_cpu():
        assert torch.ones(1, device="cuda").device.type == "cpu"
    from megatron.core.transformer import utils

    assert torch.equal(utils.get_default_causal_mask(3), torch.triu(torch.ones(3, 3), 1).bool())


def test_import_guard_names_the_broken_transformer_engine(tmp_path, monkeypatch, mcore_dist):
    import sys

    from megarl.backends.megatron import MegatronUnavailableError, check_environment

    pkg = tmp_path / "transformer_engine"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "raise RuntimeError('Found empty transformer-engine meta package installed.')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "transformer_engine", raising=False)
    with pytest.raises(MegatronUnavailableError, match="pip uninstall transformer-engine"):
        check_environment()
    monkeypatch.delitem(sys.modules, "transformer_engine", raising=False)
    (pkg / "__init__.py").write_text("")
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec",
        lambda name, *a: None if name.startswith("megatron") else real(name, *a),
    )
    with pytest.raises(MegatronUnavailableError, match=r"pip install megarl\[megatron\]"):
        check_environment()
