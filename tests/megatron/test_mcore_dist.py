"""Multi-process checks of the megatron backend (torchrun, 2 gloo ranks each): TP=2 (+SP),
PP=2 (1F1B and interleaved), DP=2 with the distributed optimizer; all against transformers in
float64, plus checkpoint resharding TP=2 -> PP=2 and TP=2 -> TP=1."""

import mcore_testlib as lib
import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.dist

# fp32 against the float64 reference (logits, logprobs, entropies, the loss, values, scores):
# tolerances each worker derives from the model and batch (`lib.fp32_tols`, `lib.fp32_value_tol`,
# tests/fp32_bounds.py: per logit lambda |w_j| max|g| (L + 1) sqrt(n) u / T, per logprob twice
# that plus the logsumexp's sum), recorded next to the errors as `<name>.tol` / `<key>_tol`; they
# replace a fixed 1e-5 that sat 3.2x above the logits' error on one CPU (3.1e-6, llama_tied_gqa
# at TP=2). Measured on the 2-core Intel Xeon (error / tolerance; T 0.7 at TP=2, 1.3 at PP=2):
# logits 1.7e-6 to 3.1e-6 / 1.4e-5 to 1.7e-5, logprobs 5.6e-7 to 1.9e-6 / 3.1e-5 to 3.6e-5,
# entropies 2.7e-7 to 5.5e-7 / 2.4e-5 to 3.5e-5, values 6.1e-7 and 8.2e-7 / 5.6e-6, scores
# 1.1e-6 / 6.5e-6. Planted (megarl's megatron head at temperature 1.001 T): logits 2.6e-3 to
# 4.5e-3, logprobs 2.1e-3 to 4.0e-3, entropies 6.6e-4 to 3.0e-3, losses 5.3e-4 to 1.4e-3: all
# fail, 27 x their tolerances and more.
GRAD_TOL = 1e-4  # relative to the largest entry of each gradient tensor
RESHARD_TOL = 5e-6  # weights after the step following a resharded load (see the test)


def _check_lm(res, name, failures):
    tol = res[f"{name}.tol"]
    for key in ("logits", "logprob", "entropy"):
        if not res[f"{name}.{key}"] < tol[key]:
            failures.append(f"{name}.{key} = {res[f'{name}.{key}']} (tolerance {tol[key]})")
    for key in ("export_exact", "export_names", "grad_names", "no_entropy_is_none"):
        if key in (k.split(".", 1)[1] for k in res if k.startswith(name + ".")) and not res[
            f"{name}.{key}"
        ]:
            failures.append(f"{name}.{key} is False")
    if not res[f"{name}.grads"] < GRAD_TOL:
        failures.append(f"{name}.grads rel diff = {res[f'{name}.grads']}")
    if not res[f"{name}.loss"] < tol["logprob"]:  # a token mean: at most the largest term
        failures.append(f"{name}.loss diff = {res[f'{name}.loss']}")


def test_tp2_pp2_and_checkpoint_resharding(zoo, tmp_path, mcore_dist):
    """TP=2 (+SP) and PP=2 against transformers, then a TP=2 checkpoint (one AdamW step in)
    loaded at PP=2 and at TP=1: logprobs equal the trained TP=2 model's, and the NEXT step
    (same batch, same AdamW settings `RESHARD_OPTIM`) lands on the weights of the
    uninterrupted TP=2 run, all HF-named tensors gathered in full.

    RESHARD_TOL = 5e-6 = lr / 200, absolute: the runs differ only in fp32 reduction order
    (TP all-reduces vs one rank's matmuls, pipeline-padded micro-batches), and each Adam
    update is ~lr per entry with a relative error of (gradient noise) / (|g| + eps); norm
    weights near 1 carry an ulp of 1.2e-7. Measured: PP=2 4.5e-7, TP=1 4.2e-7.
    Planted (exp_avg and exp_avg_sq zeroed after the load, step counters kept): 1.4e-3 at
    PP=2 and TP=1 (only exp_avg_sq zeroed: 2.9e2; only exp_avg: 6.7e-4; step counter reset
    to 0: 3.4e-4). The zeroed-moments case stays in the test as a check that the bound can
    fail."""
    ckpt = tmp_path / "ckpt_tp2"
    lib.run_torchrun("megatron_tp2.py", 2, [str(zoo), str(tmp_path / "tp2.json"), str(ckpt)])
    tp2 = lib.read_results(tmp_path / "tp2.json")
    failures = []
    for name in ("llama_tied_gqa", "qwen3_qknorm", "qwen2_bias"):
        _check_lm(tp2, name, failures)
        if tp2[f"{name}.metric_tokens"] != tp2[f"{name}.tokens"]:
            failures.append(f"{name}: metrics are not summed over micro-batches")
        if not tp2[f"{name}.grad_norm"] < GRAD_TOL:
            failures.append(f"{name}.grad_norm rel diff = {tp2[f'{name}.grad_norm']}")
    for key in ("critic.values", "prm.scores"):
        if not tp2[key] < tp2[f"{key}_tol"]:
            failures.append(f"tp2 {key} = {tp2[key]} (tolerance {tp2[f'{key}_tol']})")
    if not tp2["critic.grads"] < GRAD_TOL:
        failures.append(f"tp2 critic.grads = {tp2['critic.grads']}")
    assert tp2["prm.shape"] == [4, 5, 2]
    assert tp2["qwen2_bias.step"] == 1

    lib.run_torchrun("megatron_pp2.py", 2, [str(zoo), str(tmp_path / "pp2.json"), str(ckpt)])
    pp2 = lib.read_results(tmp_path / "pp2.json")
    for name in ("pp2", "vpp2"):
        _check_lm(pp2, name, failures)
    if not pp2["critic.values"] < pp2["critic.values_tol"]:
        failures.append(f"pp2 critic.values = {pp2['critic.values']}")
    trained = torch.tensor(tp2["qwen2_bias.trained_logprob"])
    diff = lib.max_diff(torch.tensor(pp2["ckpt.logprob"]), trained)
    # two fp32 forwards of the same trained weights (T 1): twice one side's logprob bound
    from fp32_bounds import fp32_ref_gap_bound

    ckpt_tol = 2 * fp32_ref_gap_bound(lib.zoo_model(zoo, "qwen2_bias"),
                                      int(lib.make_batch(seed=1).response_mask.sum()))
    if not diff < ckpt_tol:
        failures.append(f"TP=2 checkpoint at PP=2: logprob diff {diff}")
    assert pp2["ckpt.step"] == 1 and pp2["ckpt.step_after"] == 2
    uninterrupted = load_file(str(lib.next_step_path(ckpt, "tp2")))
    diff = _weights_diff(load_file(str(lib.next_step_path(ckpt, "pp2"))), uninterrupted)
    if not diff < RESHARD_TOL:
        failures.append(f"TP=2 checkpoint at PP=2: weights after the next step differ by {diff}")

    # the same checkpoint at TP=1 in this process (model + optimizer state)
    actor = _load_tp1(zoo, ckpt)
    diff = lib.max_diff(actor.logprobs(lib.make_batch(seed=1))[0], trained)
    if not diff < ckpt_tol:
        failures.append(f"TP=2 checkpoint at TP=1: logprob diff {diff}")
    assert actor.step == 1
    diff = _weights_diff(lib.reshard_next_step(actor), uninterrupted)
    if not diff < RESHARD_TOL:
        failures.append(f"TP=2 checkpoint at TP=1: weights after the next step differ by {diff}")
    # the bound can fail: Adam moments lost in the load move the next step far outside it
    planted = _load_tp1(zoo, ckpt)
    assert lib.zero_adam_moments(planted) > 0
    diff = _weights_diff(lib.reshard_next_step(planted), uninterrupted)
    if not diff > 10 * RESHARD_TOL:
        failures.append(f"zeroed Adam moments stay within {diff} of the uninterrupted run")
    assert not failures, "\n".join(failures)


def _load_tp1(zoo, ckpt):
    from megarl.backends.megatron import MegatronBackend

    actor = MegatronBackend("actor", str(lib.zoo_model(zoo, "qwen2_bias")),
                            optim=lib.RESHARD_OPTIM)
    actor.load(str(ckpt))
    return actor


def _weights_diff(a: dict, b: dict) -> float:
    """Max abs difference over all HF-named tensors (the name sets must agree)."""
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))
    return max(lib.max_diff(a[k], b[k]) for k in a)


def test_dp2_distributed_optimizer_matches_dp1_and_torch_adamw(zoo, tmp_path, mcore_dist):
    """Three AdamW steps of megatron's distributed optimizer at DP=2 against the same run at
    DP=1 in this process and torch.optim.AdamW on transformers in float64
    (lr 2e-2 with warmup 1 and cosine: 0, 2e-2, 1.1e-2; eps 1e-6; clip 0.5; betas 0.9 / 0.95;
    wd 0.1), entry by entry within bounds derived from the computation
    (`lib.dp_adamw_bounds`, tests/fp32_bounds.py): each fp32 run's step-k gradient is off from
    float64 by `fp32_grad_rel_bound` (one side: lambda (L + 1) sqrt(max(n, V)) u and the logit
    errors through the softmax) of each tensor's largest entry, plus what its earlier weight
    gap does to the gradient (float64 at both weight sets), clipped; `AdamErrorBound` carries
    that through AdamW (about 2 lr delta / |g| where the gradient is well above its error, up
    to 2 lr near 0: a fixed 1e-5 = lr / 2000 met 6.4e-6). DP=2 vs DP=1: the sum of the two
    runs' bounds; DP=1 vs float64: its own. Grad norms and losses stay within rel 1e-5
    (measured 3e-7 of 6.4).

    Measured on the 2-core Intel Xeon: DP=2 vs DP=1 6.4e-6 = 0.011 of its bound (the fixed
    1e-5 before: 1.6x), DP=1 vs float64 1.3e-5 = 0.033 of its bound (1e-4 before). Planted in
    megarl (each reverted): DP gradients not reduced (finalize_model_grads a no-op): DP=2 vs
    DP=1 6.1e-2 = 3320 x the bound; Adam's bias correction dropped from step 2: DP=1 vs
    float64 2.3e-2 = 1610 x; weight decay not applied: 1.3e-2 = 368 x; DP gradients summed
    instead of averaged (bucket scaling 1): grad norm 13.73 vs 6.87 (the clipped AdamW steps
    are scale-free: the weights cannot see it, the grad-norm check does)."""
    lib.run_torchrun("megatron_dp2.py", 2, [str(zoo), str(tmp_path)])
    res = lib.read_results(tmp_path / "dp2.json")
    assert res["dp_size"] == 2
    assert res["logprob"] < res["logprob_tol"]
    dp2_steps = [load_file(str(tmp_path / f"dp2_weights_step{k}.safetensors"))
                 for k in range(lib.DP_STEPS)]
    dp2 = load_file(str(tmp_path / "dp2_weights.safetensors"))

    from fp32_bounds import bound_ratio

    from megarl.backends.megatron import MegatronBackend

    path = lib.zoo_model(zoo, "qwen3_qknorm")
    be = MegatronBackend("actor", str(path), optim=lib.DP_OPTIM)
    metrics, dp1_steps = [], []
    for step in range(lib.DP_STEPS):
        mbs, n = lib.dp_micro_batches(step, 0, 1)
        metrics.append(be.train_step(mbs, lambda o, mb, n=n: lib.pg_loss(o, mb, n)))
        dp1_steps.append({k: v.detach().cpu().clone() for k, v in be.export_weights()})
    dp1 = dp1_steps[-1]
    ref, bounds, _ = lib.dp_adamw_bounds(path, {"dp1": dp1_steps, "dp2": dp2_steps})

    assert sorted(dp1) == sorted(dp2)
    both = {k: bounds["dp1"][k] + bounds["dp2"][k] for k in dp1}
    worst_dp = max(lib.max_diff(dp2[k], dp1[k]) for k in dp1)
    worst_ref = max(lib.max_diff(dp1[k], ref[k]) for k in dp1)
    ratio_dp = bound_ratio(dp2, dp1, both)
    ratio_ref = bound_ratio(dp1, {k: ref[k] for k in dp1}, {k: bounds["dp1"][k] for k in dp1})
    assert ratio_dp <= 1, f"DP=2 vs DP=1 weights differ by {worst_dp} ({ratio_dp} x the bound)"
    assert ratio_ref <= 1, f"megatron vs torch AdamW (float64): {worst_ref} ({ratio_ref} x bound)"
    moved = max(lib.max_diff(dp1[k], load_file(str(path / "model.safetensors"))[k]) for k in dp1)
    assert moved > 1e-2  # the steps really changed the weights
    for m1, m2, step in zip(metrics, res["metrics"], range(lib.DP_STEPS)):
        assert m1["lr"] == pytest.approx(lib.DP_OPTIM["lr"] * lib.lr_lambda(step))
        assert m2["lr"] == pytest.approx(m1["lr"])
        assert m2["loss"] == pytest.approx(m1["loss"], rel=1e-5)
        assert m2["grad_norm"] == pytest.approx(m1["grad_norm"], rel=1e-5)
        assert m1["skipped"] == m2["skipped"] == 0.0


@pytest.mark.parametrize("layout,nproc", [("cp2", 2), ("cp2_tp2_sp", 4), ("cp2_pp2", 4)])
def test_context_parallel_against_transformers(zoo, tmp_path, layout, nproc, mcore_dist):
    """Context parallelism 2 (alone, with TP 2 + sequence parallelism, with PP 2): every
    sequence split over two ranks in megatron's load-balanced chunks, attention over the
    all-gathered keys and values. Logprobs, entropies, logits, critic values and PRM scores
    against transformers in float64 within the fp32 bounds the other layouts use, and every
    gradient (summed over the context-parallel ranks by megatron's DDP) within GRAD_TOL. At
    CP 2 alone, a checkpoint of the trained actor loads at CP 1 (in this process) with the same
    logprobs and step.
    Measured at cp2: logprobs 9.5e-7 to 1.8e-6, gradients 1.2e-6 to 1.9e-6 relative.
    Planted (the causal mask shows each query one column past itself): logprobs 0.91 to 2.5,
    values 1.1, scores 2.3, gradients 1.1 to 1.6: all fail."""
    out, ckpt = tmp_path / f"{layout}.json", tmp_path / "ckpt_cp2"
    lib.run_torchrun("megatron_cp2.py", nproc,
                     [str(zoo), str(out), layout, *([str(ckpt)] if layout == "cp2" else [])])
    res = lib.read_results(out)
    assert res["cp_size"] == 2 and res["dp_size"] == 1
    failures = []
    for name in ("llama_tied_gqa", "qwen3_qknorm", "qwen2_bias"):
        _check_lm(res, name, failures)
        if not res[f"{name}.grad_norm"] < GRAD_TOL:
            failures.append(f"{name}.grad_norm rel diff = {res[f'{name}.grad_norm']}")
        if res[f"{name}.metric_tokens"] != res[f"{name}.tokens"]:
            failures.append(f"{name}: token count {res[f'{name}.metric_tokens']}")
    for key in ("critic.values", "prm.scores"):
        if not res[key] < res[f"{key}_tol"]:
            failures.append(f"{key} = {res[key]} (tolerance {res[f'{key}_tol']})")
    if not res["critic.grads"] < GRAD_TOL:
        failures.append(f"critic.grads = {res['critic.grads']}")
    assert res["prm.shape"] == [4, 5, 2]
    if layout == "cp2":  # the CP 2 checkpoint (one AdamW step in) loaded at CP 1 here
        from megarl.backends.megatron import MegatronBackend

        actor = MegatronBackend("actor", str(lib.zoo_model(zoo, "qwen2_bias")),
                                optim=lib.RESHARD_OPTIM, use_distributed_optimizer=False)
        actor.load(str(ckpt))
        trained = torch.tensor(res["qwen2_bias.trained_logprob"])
        from fp32_bounds import fp32_ref_gap_bound

        tol = 2 * fp32_ref_gap_bound(lib.zoo_model(zoo, "qwen2_bias"),
                                     int(lib.make_batch(seed=1).response_mask.sum()))
        diff = lib.max_diff(actor.logprobs(lib.make_batch(seed=1))[0], trained)
        if not diff < tol:
            failures.append(f"CP=2 checkpoint at CP=1: logprob diff {diff} (tolerance {tol})")
        assert actor.step == res["qwen2_bias.step"] == 1
    assert not failures, "\n".join(failures)
