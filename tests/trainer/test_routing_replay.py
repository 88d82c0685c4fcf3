"""Rollout routing replay (R3, ``actor_rollout_ref.actor.router_replay.mode=R3``) end to end:
the torch engine records each token's experts (`Completion.routed_experts`), the step's
`RolloutBatch` carries them (``tensors["routed_experts"]`` [B, P + L, n_sparse, k], -1 on
padding), and a `TorchBackend` with ``router_replay`` routes its forwards (``logprobs`` and
the update's) with them; so does a `MegatronBackend` (its layouts with random routing in
tests/megatron/test_mcore_replay.py). The config key turns both on (`backend_kwargs`, the engine's
``from_config``), and a 2-step GRPO run with it keeps the trainer's logprobs on the engine's.

Reference for the mismatch: the engine's own logprobs of the tokens it sampled, compared with
`megarl.algos.rollout_correction.logprob_diff_metrics` (the trainer's ``rollout/logprob_abs_diff_*``
metrics). With the engine's weights, replayed logprobs equal the engine's within the fp32 gap
bound tests/fp32_bounds.py derives from the model (`dense_bound`). The trainer's router then
moves while the engine's does not (noise of std 0.001, 1% of the routers' weights, added to
every router weight of the trainer's model only, as an engine/trainer numerics gap or an update
would): without replay, tokens whose top-k set flips change their experts outright; with replay
they keep the engine's experts and only the mixing weights move by ~1%. Measured (qwen3_moe /
qwen2_moe, 16 responses of 24 tokens, 1008 routing decisions): 10 / 7 top-k sets flipped; max
|engine - trainer| 5.8 / 0.52 without replay, 0.042 / 0.023 with it (mean 0.052 / 0.0076
without, 0.0052 / 0.0027 with). Same weights, with replay: max 5.2e-6 / 4.1e-6 (AMD EPYC),
4.8e-6 / 4.1e-6 (Intel Xeon).

`dense_bound`: two fp32 forwards of the same weights routed to the same experts (the engine's
KV-cache decode and a trainer's full forward, or two backends) differ by rounding only, however
each orders its sums; tests/fp32_bounds.py bounds the largest logprob gap from the model's
layers, widths, vocabulary, head and final-norm weights and the token count: 8.1e-5
(qwen3_moe) / 9.8e-5 (qwen2_moe) over the fixture's 16 x 24 tokens, 8.4e-5 over a trainer
step's 16 x 48 (qwen3_moe). The former constant 1e-5 (set on the AMD EPYC the suite grew up
on) had 1.75x to spare on an Intel Xeon (engine vs megatron: 5.7e-6). A routing or weight
error moves logprobs by 0.1 and more (below), three orders above the bound.

Planted bugs (run by hand): `RolloutBatch.sequence_batch` not attaching ``routed_experts``
(the backend never sees them): the replayed mismatch stays 5.8 / 0.52, fails; the packed routing
rows shifted by one token (`backends.torch.moe.packed_routing`): same-weights mismatch 6.7 / 3.2,
fails; the update's forward given no ``routing`` (``forward_backward``): its logprobs are not
the replayed ``logprobs``, fails; `replay_metrics` counting expert order swaps as flips (ordered
rows compared instead of sets): its flipped fraction differs, fails; the routing kept out of
the checkpointed layer call (the checkpointed update routed by the router): its gradients
differ from the replayed update's, fails. With `dense_bound` in place of 1e-5 (Intel Xeon): the
packed routing shifted by one token gives 6.7 / 3.2 against 8.1e-5 / 9.8e-5
(test_replayed_logprobs_equal_the_engines), megatron's routers not armed 5.8 / 0.52
(test_megatron_replays_the_engines_routing), and the engine not given the weights after step 1
(staleness 0) step 2's gap 0.1 (test_trainer_steps_with_replay_match_the_engine[torch-0]):
all fail.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from trainer_helpers import FAST, env

from megarl.algos.rollout_correction import METRIC_MAX, METRIC_MEAN, logprob_diff_metrics
from megarl.backends.torch import TorchBackend
from megarl.backends.torch.moe import replay_metrics
from megarl.models.moe import moe_blocks
from megarl.rollout.protocol import SamplingParams
from megarl.rollout.torch import TorchRolloutEngine
from megarl.trainer import generation as R
from megarl.trainer.batch import RolloutBatch
from megarl.trainer.settings import role_settings, rollout_settings
from megarl.utils import dist as mdist

torch.set_num_threads(1)
FAMILIES = ("qwen3_moe", "qwen2_moe")
SP = SamplingParams(n=2, temperature=1.0, seed=3, max_new_tokens=24, ignore_eos=True)
FIXTURE_TOKENS = 16 * SP.max_new_tokens  # 8 prompts x 2 samples (`runs`)
STEP_TOKENS = 16 * 48  # a trainer step: 4 prompts x 4 responses of 48 tokens at most (FAST)


def dense_bound(path, tokens: int = FIXTURE_TOKENS) -> float:
    """The largest logprob gap of two fp32 forwards of ``path``'s weights with the same
    routing (module docstring; tests/fp32_bounds.py): 8.1e-5 / 9.8e-5 here."""
    from fp32_bounds import fp32_gap_bound  # tests/ is on pytest's path, not this worker's

    bound = fp32_gap_bound(path, tokens)
    assert bound < 1e-3, bound  # far below a routing or weight error's gap (>= 0.1)
    return bound


def items(n: int = 8) -> list[SimpleNamespace]:
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(n):
        length = int(torch.randint(3, 12, (1,), generator=g))
        out.append(SimpleNamespace(
            prompt_ids=[1] + torch.randint(3, 100, (length,), generator=g).tolist(),
            data_source="t", ground_truth=str(i), extra_info={}))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """family -> (model folder, completions' RolloutBatch, per-completion routing)."""
    from megarl.models.testing import make_tiny_hf_model

    mdist.init_distributed(torch.device("cpu"))
    out = {}
    for fam in FAMILIES:
        path = make_tiny_hf_model(tmp_path_factory.mktemp(fam) / "m", fam, lm_head_scale=3.0)
        engine = TorchRolloutEngine.from_pretrained(path, max_num_seqs=5,
                                                    return_routed_experts=True)
        its = items()
        completions = engine.generate([it.prompt_ids for it in its], SP)
        samples = R.generate(engine, its, SP, group_offset=0)
        out[fam] = (path, RolloutBatch.from_samples(samples, pad_id=0), completions, its)
    return out


def actor(path, replay: bool) -> TorchBackend:
    return TorchBackend("actor", str(path), device="cpu", dtype="fp32", router_replay=replay,
                        optim={"lr": 1e-3, "grad_clip": None})


def mismatch(backend: TorchBackend, batch: RolloutBatch) -> dict[str, float]:
    lp, _ = backend.logprobs(batch.sequence_batch())
    return logprob_diff_metrics(batch.tensors["rollout_logprob"], lp, batch.response_mask)


def perturb_routers(backend: TorchBackend, std: float = 0.001) -> None:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for block in moe_blocks(backend.model).values():
            w = block.gate.weight
            w.add_(std * torch.randn(w.shape, generator=g, dtype=w.dtype))


@pytest.mark.parametrize("family", FAMILIES)
def test_batch_carries_each_tokens_recorded_experts(runs, family):
    """[B, P + L, 2, 2] int16: each completion's routing at its prompt's (left-padded) and
    response's (right-padded) columns, -1 on padding and on the last response token."""
    _, batch, completions, its = runs[family]
    routed = batch.tensors["routed_experts"]
    P, L = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    assert routed.shape == (16, P + L, 2, 2) and routed.dtype == torch.int16
    real = torch.cat([batch.prompt_mask, batch.response_mask.long()], 1).bool()
    assert (routed[~real] == -1).all()
    for i, c in enumerate(completions):
        prompt = its[c.prompt_index].prompt_ids
        row = routed[i, P - len(prompt): P + len(c.token_ids)]
        assert torch.equal(row, c.routed_experts)
        assert (row[-1] == -1).all() and (row[:-1] >= 0).all()
    seq = batch.sequence_batch()
    assert torch.equal(seq.tensors["routed_experts"], routed)
    assert torch.equal(batch.select([3, 1]).sequence_batch().tensors["routed_experts"],
                       routed[[3, 1]])


@pytest.mark.parametrize("family", FAMILIES)
def test_replayed_logprobs_equal_the_engines(runs, family):
    path, batch, _, _ = runs[family]
    m = mismatch(actor(path, replay=True), batch)
    print(family, "same weights, replay:", m, "bound", dense_bound(path))
    assert m[METRIC_MAX] <= dense_bound(path), m


@pytest.mark.parametrize("family", FAMILIES)
def test_router_moved_mismatch_large_without_replay_small_with(runs, family):
    from megarl.models.moe import record_experts, stack_layers

    path, batch, _, _ = runs[family]
    backend = actor(path, replay=False)
    perturb_routers(backend)
    seq = batch.sequence_batch()
    with torch.no_grad(), record_experts(backend.model) as chosen:  # the trainer's own choice
        backend.model(seq.input_ids, attention_mask=seq.attention_mask)
    own = stack_layers(chosen, backend.model.args).view(batch.batch_size, -1, 2, 2)
    recorded = batch.tensors["routed_experts"]
    ran = (recorded >= 0).all(-1)
    flipped = int(((own.sort(-1).values != recorded.sort(-1).values).any(-1) & ran).sum())
    without = mismatch(backend, batch)
    assert replay_metrics(backend, seq, batch.tensors["rollout_logprob"]) == {}  # replay off
    backend.router_replay = True
    with_replay = mismatch(backend, batch)
    print(f"{family}: {flipped} of {int(ran.sum())} decisions flipped; without replay "
          f"{without}; with replay {with_replay}")
    assert flipped > 0
    assert without[METRIC_MAX] > 0.1
    logged = replay_metrics(backend, seq, batch.tensors["rollout_logprob"])
    assert logged == {f"{METRIC_MEAN}_no_replay": without[METRIC_MEAN],
                      f"{METRIC_MAX}_no_replay": without[METRIC_MAX],
                      "moe/replay_flipped_fraction": flipped / int(ran.sum())}, logged
    assert backend.router_replay is True
    assert with_replay[METRIC_MAX] < min(0.05, without[METRIC_MAX] / 10)
    assert with_replay[METRIC_MEAN] < without[METRIC_MEAN] / 2


@pytest.mark.parametrize("family", FAMILIES[:1])
def test_update_forward_replays_too(runs, family):
    """The logprobs a ``train_step`` loss sees are the replayed ``logprobs`` bitwise, and the
    router gets a gradient through the replayed weights."""
    path, batch, _, _ = runs[family]
    backend = actor(path, replay=True)
    perturb_routers(backend)
    seq = batch.sequence_batch()
    replayed, _ = backend.logprobs(seq)
    backend.router_replay = False
    plain, _ = backend.logprobs(seq)
    backend.router_replay = True
    assert (replayed - plain).abs().max() > 1e-3
    seen = []

    def loss_fn(out, mb):
        seen.append(out.logprob.detach())
        return -(out.logprob * mb.tensors["response_mask"]).sum(), {}

    backend.forward_backward([seq], loss_fn)
    assert torch.equal(seen[0], replayed)
    router_grads = [float(b.gate.weight.grad.abs().max()) for b in moe_blocks(backend.model).values()]
    assert min(router_grads) > 0
    # activation checkpointing recomputes each block in backward: with the same replayed experts
    ckpt = TorchBackend("actor", str(path), device="cpu", dtype="fp32", router_replay=True,
                        activation_checkpointing=True)
    perturb_routers(ckpt)
    ckpt.forward_backward([seq], loss_fn)
    want = dict(backend.full_grads())
    for name, g in ckpt.full_grads():
        assert (g - want[name]).abs().max() <= 1e-6, name


def _replayed_results(path: str, seq, layout: dict | None = None) -> dict[str, torch.Tensor]:
    """Replayed logprobs and gradients of one update forward of ``seq`` (rank 0's view)."""
    backend = TorchBackend("actor", path, device="cpu", dtype="fp32", router_replay=True,
                           **(layout or {}))
    lp, _ = backend.logprobs(seq)
    # one micro-batch per DP rank, the rows dealt round-robin; FSDP averages over the ranks
    dp = backend.dp_size
    rows = list(range(backend.dp_rank, seq.batch_size, dp))
    backend.forward_backward([seq.select(rows)], lambda out, mb: (
        -(out.logprob * mb.tensors["response_mask"]).sum() * dp / seq.batch_size, {}))
    return {"logprob": lp, **dict(backend.full_grads())}


LAYOUTS_2 = {"fsdp2": {"dp_shard": 2}, "ulysses2": {"ulysses": 2}, "pp2": {"pp": 2}}


@pytest.mark.dist
@pytest.mark.parametrize("layout", list(LAYOUTS_2))
def test_replay_on_two_ranks_matches_one_process(runs, tmp_path, layout):
    """On 2 gloo ranks, FSDP2 (experts and routers sharded, rows split over DP), Ulysses
    (each rank routes its sequence shard) or PP=2 (each stage replays its own layers' rows):
    replayed logprobs and gradients of a trainer whose routers moved equal the single
    process's within 1e-5 (fp32 reduction order); measured 1.4e-6 (FSDP2), 1.1e-6 (Ulysses),
    0.0 (PP2). Planted (by hand): replay skipped when DP > 1: logprobs off by 5.8; every
    Ulysses rank given the first shard's routing rows: logprobs off by 6.0; given the whole
    row's: refused by the MoE block (520 rows for 260 tokens); no routing passed to the
    pipeline's training schedule: off by 1.05; all fail."""
    from pathlib import Path

    from torchrun import run_torchrun

    path, batch, _, _ = runs["qwen3_moe"]
    folder = moved_routers_folder(path, tmp_path / "moved")
    seq = batch.sequence_batch()
    torch.save({"seq": seq, "path": folder}, tmp_path / "in.pt")
    want = _replayed_results(folder, seq)
    run_torchrun(Path(__file__), 2, [str(tmp_path), layout], timeout=400,
                 env={"TRITON_INTERPRET": None})
    got = torch.load(tmp_path / "out.pt")
    assert got.keys() == want.keys()
    errs = {k: float((got[k] - want[k]).abs().max()) for k in want}
    print(layout, "vs one process:", max(errs.values()), max(errs, key=errs.get))
    assert max(errs.values()) <= 1e-5, errs
    assert float(want["logprob"].abs().max()) > 0.1


def moved_routers_folder(path, folder) -> str:
    """An HF folder of ``path``'s model with every router weight moved by noise of std 0.001
    (the same noise as `perturb_routers`)."""
    from megarl.models import load_model, save_model

    moved = load_model(path)
    perturb_routers(SimpleNamespace(model=moved))
    return str(save_model(moved, folder, source_dir=path))


@pytest.mark.parametrize("family", FAMILIES)
def test_megatron_replays_the_engines_routing(runs, family, tmp_path):
    """The megatron backend with ``router_replay`` on the engine's recorded routing: with the
    engine's weights its logprobs equal the engine's within `dense_bound`; with moved routers
    they equal the torch backend's replayed logprobs (two fp32 forwards: `dense_bound`), and
    its replay metrics equal the torch backend's (the same flipped fraction; each no-replay gap
    within `dense_bound`, as |max|e - m| - max|e - t|| <= max|m - t| when both route alike).
    Measured on an Intel Xeon: 5.7e-6 / 4.8e-6 (same weights), 4.3e-6 / 3.8e-6 (moved
    routers), no-replay gaps 1.9e-6 / 0.0; bounds 8.1e-5 / 9.8e-5. Layouts (TP+SP, EP, PP,
    VPP, recompute) are covered with random routing in tests/megatron. Planted (by hand):
    megatron's routers not armed for the forward: replayed gap 5.8 / 0.52, fails."""
    from megarl.backends.megatron import MegatronBackend

    path, batch, _, _ = runs[family]
    seq, engine_lp = batch.sequence_batch(), batch.tensors["rollout_logprob"]
    same = MegatronBackend("actor", str(path), dtype="fp32", router_replay=True)
    m = logprob_diff_metrics(engine_lp, same.logprobs(seq)[0], batch.response_mask)
    assert m[METRIC_MAX] <= dense_bound(path), m
    del same
    moved = moved_routers_folder(path, tmp_path / "moved")
    mega = MegatronBackend("actor", moved, dtype="fp32", router_replay=True)
    reference = actor(moved, replay=True)
    diff = float((mega.logprobs(seq)[0] - reference.logprobs(seq)[0]).abs().max())
    assert diff <= dense_bound(moved), diff
    got = mega.routing_metrics(seq, engine_lp)
    want = replay_metrics(reference, seq, engine_lp)
    print(family, "megatron", got, "torch", want)
    assert got.keys() == want.keys()
    assert got["moe/replay_flipped_fraction"] == want["moe/replay_flipped_fraction"] > 0
    for key in (f"{METRIC_MEAN}_no_replay", f"{METRIC_MAX}_no_replay"):
        assert abs(got[key] - want[key]) <= dense_bound(moved), key
    assert want[f"{METRIC_MAX}_no_replay"] > 0.1


def test_refusals(runs, tmp_path):
    from megarl.config import load_config
    from megarl.config.errors import ConfigError
    from megarl.errors import UserInputError
    from megarl.models.testing import make_tiny_hf_model

    dense = make_tiny_hf_model(tmp_path / "dense", "qwen2", tokenizer=False)
    with pytest.raises(UserInputError, match=r"router_replay.mode=R3 needs a mixture-of-experts"):
        actor(dense, replay=True)
    on = "actor_rollout_ref.actor.router_replay.mode=R3"
    with pytest.raises(ConfigError, match=r"R3 needs actor_rollout_ref.rollout.name=torch: only "
                                          r"megarl's torch engine"):
        load_config("grpo", [on, "actor_rollout_ref.rollout.name=vllm"])
    load_config("grpo", [on, "actor_rollout_ref.actor.strategy=megatron"])  # both backends
    load_config("grpo", [on, "async_training.staleness_threshold=1"])  # the engine process
    cfg = load_config("grpo", ["actor_rollout_ref.actor.megatron.router_replay.mode=R3"])
    assert cfg.actor_rollout_ref.actor.router_replay.mode == "R3"  # verl's megatron spelling
    with pytest.raises(ConfigError, match="router_replay.mode"):
        load_config("grpo", ["actor_rollout_ref.actor.router_replay.mode=R4"])
    load_config("grpo", ["actor_rollout_ref.actor.router_replay.mode=R2"])  # any engine


def test_config_turns_on_recording_and_replay(runs):
    """R3 in the config: the engine records routing, the actor replays it, the ref does not."""
    from megarl.backends.torch.config import backend_kwargs

    path = str(runs["qwen3_moe"][0])
    cfg = load_config_r3(path)
    assert backend_kwargs(role_settings("actor", cfg, None))[1]["router_replay"] == "R3"
    assert "router_replay" not in backend_kwargs(role_settings("ref", cfg, None))[1]
    engine = TorchRolloutEngine.from_rollout_settings(rollout_settings(cfg), path)
    assert engine.return_routed_experts is True
    off = load_config_r3(path, mode="disabled")
    assert backend_kwargs(role_settings("actor", off, None))[1]["router_replay"] == "disabled"
    engine = TorchRolloutEngine.from_rollout_settings(rollout_settings(off), path)
    assert engine.return_routed_experts is False


def load_config_r3(path: str, mode: str = "R3"):
    from megarl.config import load_config

    return load_config("grpo", [f"actor_rollout_ref.model.path={path}",
                                f"actor_rollout_ref.actor.router_replay.mode={mode}"], demo=True)


# the check step's routing metrics (Backend.routing_metrics; values tested in
# tests/models/test_moe_metrics.py and above): what replay changes on both backends; expert
# load, router entropy and the aux loss on the torch backend (megatron reports its aux loss on
# every update instead)
REPLAY_KEYS = ("moe/replay_flipped_fraction", METRIC_MAX + "_no_replay")
ROUTING_KEYS = {"torch": ("moe/router_entropy", "moe/aux_loss", "moe/load_imbalance",
                          "moe/layer_0/load_max", *REPLAY_KEYS),
                "megatron": REPLAY_KEYS}


# A score every response gets from its own text (a hash of it): every group has advantages, so
# each step's update is real (the demo task's reward is 0 for a random MoE policy: grad_norm 0,
# and step 2's weights were step 1's but for weight decay)
HASH_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return sum(map(ord, solution_str)) % 97 / 97
"""
# Adam's first update moves every parameter by ~lr: 3e-5 moves the routers of the lagged step
# 2 enough to flip some top-k sets, and the dense weights little enough that the flips dominate
# the no-replay gap
LR = 3e-5
# the off-policy step's gap with replay is at most this fraction of the gap without it
REPLAY_MARGIN = 1 / 3


@pytest.mark.parametrize("strategy,staleness", [("torch", 0), ("megatron", 0), ("torch", 1)])
def test_trainer_steps_with_replay_match_the_engine(runs, tmp_path, demo_assets, strategy,
                                                     staleness):
    """GRPO, 2 steps on the embedded prompts with a Qwen3-MoE policy, R3 on either backend and
    a hash of the response text as reward (every step's update is real: grad_norm > 0). On
    same-weights steps (step 1; both steps at staleness 0) the trainer's recomputed logprobs
    equal the engine's (rollout.check_logprobs) within `dense_bound` over a step's tokens
    (8.4e-5); measured max 4.3e-6 / 3.6e-6 (torch), 3.8e-6 / 3.8e-6 (megatron) on an Intel
    Xeon. Routing agrees there with or without replay,
    so only the off-policy step tests replay: at staleness 1 (the engine in its own process,
    its routing sent back with the tokens) step 2's batch was sampled one update behind (lag
    1), the trainer's routers moved and flip some of the engine's top-k sets; replay keeps the
    engine's experts, leaving only the dense weights' drift. Measured on step 2: flipped
    fraction 0.0076 (21 of 2752 decisions), max gap 0.100 with replay against 0.947 without
    (mean 0.020 / 0.027); asserted: flipped > 0 and the replayed max gap below a third of the
    no-replay one. Each check step logs the routing metrics.

    Planted: the trainer's old-logprob pass given the batch without ``routed_experts``
    (trainer.py; the routing metrics still get it): step 2's gap is the no-replay gap (0.947
    both): fails (the earlier checks of that step, lag 1 and 0 <= flipped <= 1, pass on it).
    The trainer not calling Backend.routing_metrics, megatron's from_config not reading
    router_replay.mode, or the engine process not returning the routing (the batch has none to
    replay): the moe/* keys are missing. The engine not given the weights after step 1
    (trainer.py's update_weights skipped once) at staleness 0: step 2's gap 0.0999 against
    `dense_bound` 8.4e-5 (Intel Xeon), fails."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    reward = tmp_path / "hash_reward.py"
    reward.write_text(HASH_REWARD)
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "launch/train.py", "--config", "grpo", "--demo", "on",
           f"trainer.default_local_dir={run_dir}", *FAST, "trainer.total_training_steps=2",
           f"actor_rollout_ref.model.path={runs['qwen3_moe'][0]}",
           f"actor_rollout_ref.actor.strategy={strategy}",
           "actor_rollout_ref.actor.router_replay.mode=R3",
           "actor_rollout_ref.rollout.check_logprobs=true",
           f"async_training.staleness_threshold={staleness}",
           f"custom_reward_function.path={reward}", f"actor_rollout_ref.actor.optim.lr={LR}"]
    proc = subprocess.run(cmd, cwd=repo, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    rows = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2]
    bound = dense_bound(runs["qwen3_moe"][0], STEP_TOKENS)
    for r in rows:
        print(strategy, staleness, "step", r["step"],
              {k: r.get(k) for k in (METRIC_MEAN, METRIC_MAX, *REPLAY_KEYS,
                                     METRIC_MEAN + "_no_replay", "actor/grad_norm",
                                     "async/policy_version_lag/max")})
        assert r["actor/grad_norm"] > 0.1, r["actor/grad_norm"]
        for key in ROUTING_KEYS[strategy]:
            assert key in r, (key, sorted(k for k in r if k.startswith("moe/")))
        if r["step"] == 1 or staleness == 0:
            assert r[METRIC_MAX] <= bound, (r[METRIC_MAX], bound)
        else:
            assert r["async/policy_version_lag/max"] == 1
            assert r["moe/replay_flipped_fraction"] > 0
            no_replay = r[METRIC_MAX + "_no_replay"]
            assert r[METRIC_MAX] < REPLAY_MARGIN * no_replay, (r[METRIC_MAX], no_replay)


if __name__ == "__main__":  # the 2-rank worker of test_replay_on_two_ranks_matches_one_process
    import sys
    from pathlib import Path

    work = Path(sys.argv[1])
    mdist.init_distributed(torch.device("cpu"))
    given = torch.load(work / "in.pt", weights_only=False)
    res = _replayed_results(given["path"], given["seq"], LAYOUTS_2[sys.argv[2]])
    if mdist.rank() == 0:
        torch.save(res, work / "out.pt")
    mdist.destroy()
