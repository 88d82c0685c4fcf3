"""megatron backend on mixture-of-experts models (megatron's own MoELayer: TopKRouter,
SequentialMLP experts, shared expert with its gate) against transformers in float64.

Tolerances (fp32 megatron vs float64 transformers), derived from each model's shape and weights
and the batch (tests/fp32_bounds.py through `lib.fp32_tols` / `lib.fp32_grad_tol`, recorded by
`moe_testlib` next to each error) instead of a fixed 1e-5 that sat 3x above the error on one CPU:
logprobs and the loss lambda 2 |w_j| max|g| (L + 1) sqrt(n) u / T plus the logsumexp's sum,
entropies by their sensitivity, gradients per tensor relative to its largest entry
`fp32_grad_rel_bound` (one side: lambda ((L + 1) sqrt(max(n, V)) u + 2 x the logit error +
sqrt(tokens) u)). Tolerances at T 0.7: logprobs 2.7e-5 to 5.9e-5 (4 layers), gradients 4.1e-5 to
9.1e-5. Measured on the 2-core Intel Xeon, as a fraction of them: at most 0.084 (EP=1 logprob
8.9e-7 to 1.7e-6, entropy 3.4e-7, gradients 1.1e-6 to 1.4e-6; EP=2 the same; TP=2+SP x EP=2
logprob 1.3e-6 / 3.4e-6 (qwen2_moe_kv2: the 3.4e-6 a fixed 1e-5 had 3x over), gradients 1.6e-6
/ 2.2e-6; expert-TP 2: logprob 3.1e-6, gradients 2.6e-6; PP=2 x VPP=2: gradients 3.0e-6; routing
replay: logprob 2.2e-6, gradients 2.4e-6).

Planted bugs (in-process, EP=1, `test_planted_bugs_fail`):
- experts loaded into the wrong slots (local expert i takes expert i+1's weights, as an
  expert-parallel rank offset off by one would): qwen3_moe logprob 1.57, entropy 1.43,
  gradients 3.8 relative; qwen2_moe logprob 1.56;
- top-k probabilities not renormalised (moe_router_pre_softmax flipped, i.e. norm_topk_prob
  ignored): qwen3_moe logprob 0.48, gradients 0.60; on qwen2_moe (norm_topk_prob False) the
  same flip renormalises: logprob 0.25, gradients 0.87.
Both fail `test_planted_bugs_fail`'s 100 x the derived logprob tolerance (2.7e-3 to 3.1e-3).
The EP=2 -> EP=1 checkpoint check fails with the Adam moments zeroed after the load (see
`test_ep2_tp2_layouts_and_checkpoint_resharding`).
"""

import mcore_testlib as lib
import moe_testlib as ml
import pytest
import torch
from safetensors.torch import load_file

from megarl.trainer.settings import role_settings

RESHARD_TOL = 1e-6  # weights after the step following an EP=2 -> EP=1 load (measured 3.7e-8)


@pytest.fixture(scope="module")
def moe_zoo(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_zoo")
    for name in ml.MOE_ZOO:
        ml.moe_model(root, name)
    return root


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe", "qwen3_moe_mixed"])
def test_ep1_matches_transformers(moe_zoo, mcore_dist, name):
    res = {}
    ml.moe_checks(res, ml.moe_model(moe_zoo, name), name)
    assert not ml.failures(res, name), ml.failures(res, name)
    assert res[f"{name}.expert_grads_nonzero"] > 0


def _planted(monkeypatch, moe_zoo, name, bug):
    from megarl.backends.megatron import moe

    if bug == "expert_slots":
        real = moe.moe_layer_entries

        def shifted(args, layer, local, ep_rank, ep_size):
            out = []
            for mcore, hf, kind, inner, expert in real(args, layer, local, ep_rank, ep_size):
                if expert is not None and mcore:
                    j = (expert + 1) % args.num_experts
                    hf = tuple(h.replace(f".experts.{expert}.", f".experts.{j}.") for h in hf)
                out.append((mcore, hf, kind, inner, expert))
            return out

        monkeypatch.setattr(moe, "moe_layer_entries", shifted)
    else:
        real_kwargs = moe.moe_config_kwargs

        def flipped(*a, **k):
            out = real_kwargs(*a, **k)
            out["moe_router_pre_softmax"] = not out["moe_router_pre_softmax"]
            return out

        monkeypatch.setattr(moe, "moe_config_kwargs", flipped)
    res = {}
    ml.moe_checks(res, ml.moe_model(moe_zoo, name), name)
    return res


@pytest.mark.parametrize(("name", "bug"), [("qwen3_moe", "expert_slots"),
                                           ("qwen3_moe", "topk_norm"),
                                           ("qwen2_moe", "topk_norm")])
def test_planted_bugs_fail(moe_zoo, mcore_dist, monkeypatch, name, bug):
    res = _planted(monkeypatch, moe_zoo, name, bug)
    assert res[f"{name}.logprob"] > 100 * res[f"{name}.tol"]["logprob"], res


AUX_TOL = 1e-5  # moe_aux_loss metric (absolute) and gradients (relative to the largest entry)


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe", "qwen3_moe_mixed"])
def test_aux_loss_matches_switch_loss_on_transformers_router_logits(moe_zoo, mcore_dist, name):
    """moe_aux_loss_coeff=0.5: the gradients equal transformers' (float64) of
    -sum(logprob)/tokens + 0.5 x (megatron's Switch loss per micro-batch over real tokens,
    summed over sparse layers, averaged over the 2 micro-batches), written out in
    `moe_testlib.hf_aux_loss`; the reported moe_aux_loss equals that average. Measured:
    gradients 1.1e-6 to 1.3e-6, metric 4.9e-8 to 1.5e-7. Dropping the aux term moves the
    reference gradients by 0.77 to 0.87 (relative); planted padding mask with the convention
    megatron's docstrings state (True = real token; its code reads True as padding): gradients
    off by 1.9 to 2.1, metric by 0.29 to 0.51."""
    res = {}
    ml.aux_checks(res, ml.moe_model(moe_zoo, name), name)
    assert res[f"{name}.aux_grads"] < AUX_TOL, res
    assert res[f"{name}.aux_metric"] < AUX_TOL, res
    assert res[f"{name}.aux_effect"] > 1e4 * AUX_TOL, res


def test_aux_loss_planted_padding_convention_fails(moe_zoo, mcore_dist, monkeypatch):
    from megarl.backends.megatron import moe

    real = moe.padding_mask
    monkeypatch.setattr(moe, "padding_mask", lambda *a, **k: ~real(*a, **k))
    res = {}
    ml.aux_checks(res, ml.moe_model(moe_zoo, "qwen3_moe"), "planted")
    assert res["planted.aux_grads"] > 1e4 * AUX_TOL, res
    assert res["planted.aux_metric"] > 1e3 * AUX_TOL, res


def _layout_groups(layout: str, models: tuple[str, ...]) -> set[str]:
    """The result groups `megatron_moe.py` writes at one layout: every model against
    transformers, and the first model's aux loss and routing replay."""
    return {f"{layout}.{m}" for m in models} | {f"{layout}.{models[0]}.{c}"
                                                for c in ("aux", "replay")}


# Written out here, not read from the worker, so a layout it stops emitting fails the test.
EP2_GROUPS = (_layout_groups("ep2", ("qwen3_moe", "qwen2_moe", "qwen3_moe_mixed"))
              | _layout_groups("tp2_ep2", ("qwen3_moe_kv2", "qwen2_moe_kv2"))
              | _layout_groups("tp2_etp2", ("qwen3_moe_kv2", "qwen2_moe_kv2"))
              | _layout_groups("pp2_vpp2", ("qwen3_moe_4l",)))


@pytest.mark.dist
def test_ep2_tp2_layouts_and_checkpoint_resharding(moe_zoo, tmp_path, mcore_dist):
    """On 2 gloo ranks: EP=2 (three models, one with a dense layer and 8 experts), TP=2+SP x
    EP=2, TP=2+SP with expert-TP 2 and the interleaved pipeline (PP=2 x VPP=2, 4 layers, one
    dense; measured logprob 1.3e-6, gradients 1.8e-6), each against transformers, and at each
    layout the load-balancing loss (moe_aux_loss_coeff=0.5; per DP rank's micro-batches,
    DP-averaged); then a checkpoint written at EP=2 (distributed optimizer, one AdamW step in,
    DP=2) loads here at EP=1: logprobs equal
    the trained EP=2 model's and the next AdamW step lands on the weights of the uninterrupted
    EP=2 run within RESHARD_TOL (measured 3.7e-8; zeroed Adam moments: far outside). Every
    group of EP2_GROUPS must be there: planted, the worker skipping pp2_vpp2 -> fails
    ("layouts not checked: ['pp2_vpp2.qwen3_moe_4l', ...]")."""
    ckpt = tmp_path / "ckpt_ep2"
    lib.run_torchrun("megatron_moe.py", 2, [str(moe_zoo), str(tmp_path / "moe.json"), str(ckpt)],
                     timeout=400)
    res = lib.read_results(tmp_path / "moe.json")
    groups = {k.rsplit(".", 1)[0] for k in res if not k.startswith("ckpt.")}
    assert not EP2_GROUPS - groups, f"layouts not checked: {sorted(EP2_GROUPS - groups)}"
    failures = []
    for key in sorted(groups):
        if key.endswith(".aux"):
            failures += [f"{key}.{m} = {res[f'{key}.{m}']}" for m in ("aux_grads", "aux_metric")
                         if not res[f"{key}.{m}"] < AUX_TOL]
            continue
        if key.endswith(".replay"):
            failures += ml.replay_failures(res, key)
            continue
        failures += ml.failures(res, key)
    assert not failures, "\n".join(failures)
    assert res["ckpt.dp_size"] == 2

    from megarl.backends.megatron import MegatronBackend

    def load():
        be = MegatronBackend("actor", str(ml.moe_model(moe_zoo, "qwen3_moe")),
                             optim=lib.RESHARD_OPTIM)
        be.load(str(ckpt))
        return be

    be = load()
    assert be.step == 1
    trained = torch.tensor(res["ckpt.trained_logprob"])
    # two fp32 forwards of the same trained weights (T 1): twice one side's logprob bound
    from fp32_bounds import fp32_ref_gap_bound

    batch = lib.make_batch(B=4, seed=1)
    tol = 2 * fp32_ref_gap_bound(ml.moe_model(moe_zoo, "qwen3_moe"),
                                 int(batch.response_mask.sum()))
    assert lib.max_diff(be.logprobs(batch)[0], trained) < tol
    uninterrupted = load_file(str(lib.next_step_path(ckpt, "ep2")))
    after = ml.next_step(be)
    assert sorted(after) == sorted(uninterrupted)
    diff = max(lib.max_diff(after[k], uninterrupted[k]) for k in after)
    assert diff < RESHARD_TOL, f"EP=2 checkpoint at EP=1: next step differs by {diff}"
    planted = load()
    assert lib.zero_adam_moments(planted) > 0
    after = ml.next_step(planted)
    diff = max(lib.max_diff(after[k], uninterrupted[k]) for k in after)
    assert diff > 100 * RESHARD_TOL, f"zeroed Adam moments stay within {diff}"


def test_from_config_reads_verls_expert_keys_and_aux_coefficient(moe_zoo, mcore_dist):
    """verl's spellings: actor.megatron.expert_model_parallel_size / expert_tensor_parallel_size
    (read as written) and megatron.override_transformer_config.moe_aux_loss_coeff (mapped onto
    actor.megatron.moe_aux_loss_coeff) reach the backend; a dense model refuses EP > 1 with the
    key to change. Planted: from_config not reading moe_aux_loss_coeff fails (0.0 != 0.01)."""
    from megarl.backends.megatron import MegatronBackend
    from megarl.config.loader import validate
    from megarl.config.schema import Config

    cfg = Config()
    cfg.actor_rollout_ref.model.path = str(ml.moe_model(moe_zoo, "qwen3_moe"))
    cfg.actor_rollout_ref.model.dtype = "fp32"
    cfg.actor_rollout_ref.actor.strategy = "megatron"
    cfg.data.train_files = "train.parquet"
    prefix = "actor_rollout_ref.actor.megatron"
    cfg = validate(cfg, [f"{prefix}.expert_model_parallel_size=1",
                         f"{prefix}.expert_tensor_parallel_size=1",
                         f"+{prefix}.override_transformer_config.moe_aux_loss_coeff=0.01"])
    assert cfg.actor_rollout_ref.actor.megatron.moe_aux_loss_coeff == 0.01
    be = MegatronBackend.from_settings(role_settings("actor", cfg))
    assert be.moe_aux_loss_coeff == 0.01 and be.config.moe_aux_loss_coeff == 0.01
    assert be.config.moe_router_load_balancing_type == "aux_loss"
    assert (be.layout.ep, be.layout.expert_tp) == (1, 1)
    ref = MegatronBackend.from_settings(role_settings("ref", cfg))
    assert ref.moe_aux_loss_coeff == 0.0 and ref.layout.ep == 1
    with pytest.raises(ValueError, match="expert_model_parallel_size=2"):
        MegatronBackend("actor", str(lib.zoo_model(moe_zoo, "qwen2_bias")), ep=2)


@pytest.mark.dist
def test_ep2_pp2_on_four_ranks(moe_zoo, tmp_path, mcore_dist):
    """EP=2 x PP=2 (4 gloo ranks, about 25 s on 2 cores): one sparse layer per stage, 2
    experts per rank; logprobs, entropies, gradients and the aux-loss gradients (padding mask
    on the second stage too) against transformers. Measured as at EP=2: logprob 1.0e-6,
    gradients 1.2e-6, aux gradients 1.1e-6."""
    lib.run_torchrun("megatron_moe.py", 4, [str(moe_zoo), str(tmp_path / "moe.json"),
                                            str(tmp_path / "unused"), "ep2_pp2"], timeout=300)
    res = lib.read_results(tmp_path / "moe.json")
    failures = ml.failures(res, "ep2_pp2.qwen3_moe") + ml.failures(res, "ep2_pp2.qwen2_moe")
    failures += [m for m in ("aux_grads", "aux_metric")
                 if not res[f"ep2_pp2.qwen3_moe.aux.{m}"] < AUX_TOL]
    failures += ml.replay_failures(res, "ep2_pp2.qwen3_moe.replay")
    assert not failures, failures


@pytest.mark.dist
def test_cp2_ep2_on_two_ranks(moe_zoo, tmp_path, mcore_dist):
    """Context parallelism 2 with the experts over the same 2 ranks (EP=2): each rank routes
    its load-balanced half of every sequence and megatron's dispatcher exchanges the tokens;
    logprobs, entropies, gradients and the aux-loss gradients and metric (token counts over
    TP x CP) against transformers, as at EP=2. Measured: logprob 1.0e-6, gradients 1.3e-6, aux
    gradients 1.1e-6, aux metric 2.7e-8 (of 2.25; summed over TP only it reads half)."""
    lib.run_torchrun("megatron_moe.py", 2, [str(moe_zoo), str(tmp_path / "moe.json"),
                                            str(tmp_path / "unused"), "cp2_ep2"], timeout=300)
    res = lib.read_results(tmp_path / "moe.json")
    failures = ml.failures(res, "cp2_ep2.qwen3_moe") + ml.failures(res, "cp2_ep2.qwen2_moe")
    failures += [m for m in ("aux_grads", "aux_metric")
                 if not res[f"cp2_ep2.qwen3_moe.aux.{m}"] < AUX_TOL]
    assert not failures, failures


def _grads_after_step(path, **kw):
    from megarl.backends.megatron import MegatronBackend

    be = MegatronBackend("actor", str(path), optim=lib.RESHARD_OPTIM,
                         use_distributed_optimizer=False, moe_aux_loss_coeff=ml.AUX_COEFF, **kw)
    batch = lib.make_batch(B=4, seed=1)
    n = float(batch.response_mask.sum())
    metrics = be.train_step([batch.select(slice(0, 2)), batch.select(slice(2, 4))],
                            lambda o, mb: lib.pg_loss(o, mb, n))
    return {k: v.clone() for k, v in be.export_grads()}, metrics["moe_aux_loss"]


def test_recompute_gives_the_same_gradients_and_aux_loss(moe_zoo, mcore_dist, monkeypatch):
    """Activation recompute (full, selective) with the aux loss on: gradients and moe_aux_loss
    bitwise those without recompute (the router's aux loss is attached once, in the recompute,
    not also in the no-grad first pass). Planted: the aux loss attached twice per router call
    moves the gradients by 0.87 (relative) and doubles moe_aux_loss (2.25 -> 4.49)."""
    path = ml.moe_model(moe_zoo, "qwen3_moe")
    plain, aux = _grads_after_step(path)
    for recompute in ("full", "selective"):
        grads, aux_r = _grads_after_step(path, recompute=recompute)
        assert aux_r == aux
        assert all(torch.equal(grads[k], plain[k]) for k in plain), recompute
    from megatron.core.transformer.moe.router import TopKRouter

    real = TopKRouter._apply_aux_loss
    monkeypatch.setattr(TopKRouter, "_apply_aux_loss",
                        lambda self, probs, *a, **k: real(self, real(self, probs, *a, **k), *a, **k))
    grads, _ = _grads_after_step(path, recompute="full")
    assert max(lib.rel_diff(grads[k], plain[k]) for k in plain) > 1e-2


@pytest.mark.parametrize(("layout", "match"), [
    ({"ep": 3}, r"expert_model_parallel_size=3 must divide num_experts \(4\)"),
    ({"etp": 5}, r"expert_tensor_parallel_size=5 must divide moe_intermediate_size \(48\)"),
    ({"tp": 2, "ep": 2}, r"tensor_model_parallel_size=2 on a mixture-of-experts model needs "
                         r"sequence_parallel=True"),
])
def test_bad_expert_layouts_are_refused_naming_the_key(layout, match):
    """Layout checks run before any process group is touched (pure function of the config)."""
    from megarl.backends.megatron.moe import check_moe_supported
    from megarl.models.args import ModelArgs
    from megarl.models.testing import tiny_hf_config

    args = ModelArgs.from_hf_config(tiny_hf_config("qwen3_moe").to_dict())
    tp = layout.get("tp", 1)
    with pytest.raises(ValueError, match=match):
        check_moe_supported(args, tp, layout.get("ep", 1), layout.get("etp", tp), False)


def test_dense_model_refuses_expert_tensor_parallel_size():
    from megarl.backends.megatron.moe import check_moe_supported
    from megarl.models.args import ModelArgs
    from megarl.models.testing import tiny_hf_config

    args = ModelArgs.from_hf_config(tiny_hf_config("qwen3").to_dict())
    with pytest.raises(ValueError, match="need a mixture-of-experts model; qwen3 has no experts"):
        check_moe_supported(args, 1, 1, 2, False)
    check_moe_supported(args, 2, 1, 2, True)  # the defaults of a dense model pass
