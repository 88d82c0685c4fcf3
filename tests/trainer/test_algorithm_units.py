"""megarl.trainer.algorithm without a model: which entry a config runs, what each declares,
the settings each reads from the config, the greedy baselines of ReMax-like estimators (with a
fake engine and scorer), and the registry's rules and errors.

Configs are the recipes loaded without a model path (the embedded demo's settings), with
overrides whose values differ from the defaults, so a setting read from the wrong key or left
at its default fails. Planted bugs each check catches are named in the docstrings."""

from __future__ import annotations

import textwrap
from types import SimpleNamespace

import pytest
import torch

from megarl import algos
from megarl.config import load_config
from megarl.errors import UserInputError
from megarl.trainer import algorithm as A
from megarl.trainer.advantage import AdvantageSettings
from megarl.trainer.batch import RolloutBatch
from megarl.trainer.metrics import Timer
from megarl.trainer.settings import algorithm_name, algorithm_settings


def _cfg(name="grpo", *overrides):
    return load_config(name, list(overrides))


def _build(cfg) -> A.Algorithm:
    """The algorithm a config runs, as the trainer builds it."""
    return A.build_algorithm(algorithm_settings(cfg))


def _batch(groups=(7, 3, 7, 3, 5), prompts=((1, 2), (3,), (1, 2), (3,), (4, 5))):
    B, P = len(groups), max(len(p) for p in prompts)
    ids = torch.zeros(B, P, dtype=torch.long)
    pmask = torch.zeros(B, P, dtype=torch.long)
    for i, p in enumerate(prompts):  # left-padded
        ids[i, P - len(p):] = torch.tensor(p)
        pmask[i, P - len(p):] = 1
    lengths = [3, 1, 2, 3, 2]
    mask = torch.tensor([[1.0] * n + [0.0] * (3 - n) for n in lengths])
    batch = RolloutBatch(
        prompt_ids=ids, prompt_mask=pmask, response_ids=torch.ones(B, 3, dtype=torch.long),
        response_mask=mask, group_index=torch.tensor(groups),
        data_sources=[f"src{i}" for i in range(B)], ground_truths=[f"gt{i}" for i in range(B)],
        extra_infos=[{"row": i} for i in range(B)], finish_reasons=["stop"] * B)
    batch.tensors["verifiable"] = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0])
    return batch


class FakeStep:
    """A StepContext recording what the hook asked for; item k's greedy response scores
    0.25 * (k + 1)."""

    def __init__(self):
        self.items, self.params, self.sampling_args = None, None, None
        self.timer = Timer()

    def context(self) -> A.StepContext:
        def generate(items, params):
            self.items, self.params = items, params
            return [SimpleNamespace(k=k) for k in range(len(items))]

        def sampling(*args, **kwargs):
            self.sampling_args = (args, kwargs)
            return "greedy-params"

        return A.StepContext(generate=generate,
                             score=lambda samples: torch.tensor([0.25 * (s.k + 1) for s in samples]),
                             sampling=sampling, timer=self.timer)


def test_each_config_runs_its_entry_with_its_needs():
    """grpo / gae / remax / reinforce_plus_plus run the PPO family with the needs megarl.algos
    declares; pure_rloo runs PURE, pacs.enable PACS whatever the estimator. Planted bugs: the
    PACS switch checked after the estimator name (remax + pacs runs the PPO family); needs
    mapped from the wrong declaration (gae without critic, remax without greedy baseline)."""
    cases = {
        ("grpo",): (A.PPOFamily, A.Needs(groups=True)),
        ("grpo", "algorithm.adv_estimator=gae"): (A.PPOFamily, A.Needs(critic=True)),
        ("grpo", "algorithm.adv_estimator=remax"): (A.PPOFamily, A.Needs(greedy_baseline=True)),
        ("grpo", "algorithm.adv_estimator=reinforce_plus_plus"): (A.PPOFamily, A.Needs()),
        ("pure_vr",): (A.PureRloo, A.Needs(groups=True)),
        ("pacs", "algorithm.adv_estimator=remax"): (A.Pacs, A.Needs(groups=True, whole_groups=True)),
        ("pacs", "algorithm.adv_estimator=pure_rloo"): (A.Pacs, A.Needs(groups=True, whole_groups=True)),
    }
    for args, (cls, needs) in cases.items():
        algo = _build(_cfg(*args))
        assert type(algo) is cls and algo.needs == needs, args
        assert algo.update_keys == (("scores",) if cls is A.Pacs else ("advantages",))
    with pytest.raises(ValueError, match="unknown advantage estimator 'nope'"):
        A.Needs.of_estimator("nope")


def test_settings_come_from_their_keys():
    """Every AdvantageSettings / ActorLossSettings field is read from its key (values unlike
    the defaults). Planted bugs: clip_ratio_low read for high, kl_loss_coef for entropy_coeff,
    the PRM flag from reward_manager, vr_enabled true for a blank manager, fused always on."""
    cfg = _cfg("pure_prm", "algorithm.gamma=0.9", "algorithm.lam=0.8",
               "algorithm.norm_adv_by_std_in_grpo=false", "algorithm.kl_penalty=low_var_kl",
               "reward_model.credit_assignment=min", "reward_model.verifiable_reward_coef=2.5",
               "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
               "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
               "actor_rollout_ref.actor.clip_ratio_low=0.1",
               "actor_rollout_ref.actor.clip_ratio_high=0.3",
               "actor_rollout_ref.actor.clip_ratio_c=4.0",
               "actor_rollout_ref.actor.entropy_coeff=0.01",
               "actor_rollout_ref.actor.use_kl_loss=true",
               "actor_rollout_ref.actor.kl_loss_coef=0.05",
               "actor_rollout_ref.actor.kl_loss_type=mse",
               "actor_rollout_ref.model.use_fused_kernels=false",
               "algorithm.use_kl_in_reward=true", "algorithm.pure.mask_separator=false",
               "algorithm.pure.normalize=false")
    algo = _build(cfg)
    assert isinstance(algo, A.PureRloo)
    assert algo.adv == AdvantageSettings(
        estimator="pure_rloo", gamma=0.9, lam=0.8, norm_adv_by_std_in_grpo=False,
        use_kl_in_reward=True, kl_penalty="low_var_kl", prm_enabled=True, vr_enabled=False,
        credit_assignment="min", verifiable_reward_coef=2.5)
    assert algo.pure == A.PureSettings(mask_separator=False, normalize=False)
    s = algo.loss
    assert (s.loss_mode, s.agg_mode, s.clip_ratio_low, s.clip_ratio_high, s.clip_ratio_c,
            s.entropy_coeff, s.use_kl_loss, s.kl_loss_coef, s.kl_loss_type, s.fused, s.policy,
            s.on_policy) == ("gspo", "seq-mean-token-mean", 0.1, 0.3, 4.0, 0.01, True, 0.05,
                             "mse", False, None, False)
    on = algo.loss_settings(True)
    assert on.on_policy and on.loss_mode == "gspo" and not algo.loss_settings(False).on_policy
    assert not algo.loss.on_policy  # the stored settings are not changed
    assert _build(_cfg("pure_prm_vr")).adv.vr_enabled


def test_pacs_reads_its_section():
    """pacs.* reaches PACS's objective (reward_method as the string PACS spells, no class
    weights without use_weight); the objective takes no entropy bonus or KL loss. Planted:
    weight_mode kept when use_weight is false; norm_adv_by_std_in_grpo not passed."""
    algo = _build(_cfg("pacs", "pacs.beta=0.5", "pacs.reward_method=2",
                                  "pacs.adv_estimator=grpo", "pacs.use_weight=false",
                                  "pacs.norm_adv_by_std_in_grpo=false"))
    assert algo.loss.policy == A.PacsLoss(beta=0.5, reward_method="2", adv_estimator="grpo",
                                          weight_mode=None, norm_adv_by_std=False)
    assert not algo.loss.regularized and algo.loss.policy.regularized is False
    algo = _build(_cfg("pacs", "pacs.weight_mode=only_negative"))
    assert algo.loss.policy.weight_mode == "only_negative" and algo.loss.policy.beta == 1.0


def test_greedy_baselines_one_greedy_response_per_group():
    """The greedy baselines: one item per group in order of first appearance, each the prompt of
    the group's first row without padding, with its data source, ground truth and info; the
    run's sampling with seed 0, n = 1, greedy; the score of item k broadcast to its group's
    rows; generation and scoring timed as "gen". Planted bugs: the last row of a group used
    (src2 instead of src0); the padded prompt passed; n left at rollout.n; the scores not
    broadcast by group (row order instead)."""
    batch, fake = _batch(), FakeStep()
    got = A.greedy_baselines(batch, fake.context())
    assert got.dtype == torch.float32 and got.tolist() == [0.25, 0.5, 0.25, 0.5, 0.75]
    assert [i.prompt_ids for i in fake.items] == [[1, 2], [3], [4, 5]]
    assert [(i.data_source, i.ground_truth, i.extra_info) for i in fake.items] == [
        ("src0", "gt0", {"row": 0}), ("src1", "gt1", {"row": 1}), ("src4", "gt4", {"row": 4})]
    assert fake.sampling_args == ((0,), {"greedy": True, "n": 1})
    assert fake.params == "greedy-params" and set(fake.timer.times) == {"gen"}


def test_prepare_generates_only_for_estimators_that_need_baselines():
    """remax's prepare writes reward_baselines; grpo's and PACS's generate nothing (planted:
    prepare always generating, or PACS with remax generating as the PPO family would)."""
    batch, fake = _batch(), FakeStep()
    _build(_cfg("grpo", "algorithm.adv_estimator=remax")).prepare(batch, fake.context())
    assert batch.tensors["reward_baselines"].tolist() == [0.25, 0.5, 0.25, 0.5, 0.75]
    for args in (("grpo",), ("pacs", "algorithm.adv_estimator=remax")):
        batch, fake = _batch(), FakeStep()
        _build(_cfg(*args)).prepare(batch, fake.context())
        assert "reward_baselines" not in batch.tensors and fake.items is None


def test_the_hooks_compute_each_entry_s_advantages():
    """The PPO family's hook runs the registered estimator (rloo: S_i minus the others' mean);
    PACS's writes scores and no advantages; PURE's equals pure_advantages with its settings.
    Planted: PURE's hook given default PureSettings (normalize on: advantages rescaled)."""
    batch = _batch()
    _build(_cfg("grpo", "algorithm.adv_estimator=rloo")).advantages(batch, 0.0)
    assert batch.tensors["advantages"][:, 0].tolist() == pytest.approx([1.0, -1.0, -1.0, 1.0, 0.0])
    batch = _batch()
    _build(_cfg("pacs")).advantages(batch, 0.0)
    assert batch.tensors["scores"].tolist() == [1.0, 0.0, 0.0, 1.0, 1.0]
    assert "advantages" not in batch.tensors
    cfg = _cfg("pure_vr", "algorithm.pure.normalize=false", "algorithm.use_kl_in_reward=false")
    algo, batch, ref = _build(cfg), _batch(), _batch()
    algo.advantages(batch, 0.0)
    A.pure_advantages(ref, algo.adv, A.PureSettings(normalize=False), 0.0)
    torch.testing.assert_close(batch.tensors["advantages"], ref.tensors["advantages"], rtol=0, atol=0)
    A.pure_advantages(ref, algo.adv, A.PureSettings(), 0.0)
    assert not torch.equal(batch.tensors["advantages"], ref.tensors["advantages"])


def test_pure_mode_of_each_reward_setup():
    assert A.pure_mode(AdvantageSettings(prm_enabled=True)) == "prm_vr"
    assert A.pure_mode(AdvantageSettings(prm_enabled=True, vr_enabled=False)) == "prm"
    assert A.pure_mode(AdvantageSettings(prm_enabled=False, vr_enabled=False)) == "vr"


@pytest.fixture
def registered():
    """Names registered by a test, removed afterwards."""
    names: list[str] = []
    yield names
    for n in names:
        A.ALGORITHMS.pop(n, None)
        algos.ADVANTAGE_PIPELINES.pop(n, None)
        algos.ESTIMATOR_NEEDS.pop(n, None)


def test_a_registered_algorithm_is_chosen_by_its_name(registered):
    """An entry under a pipeline's name runs when algorithm.adv_estimator names it; a pipeline
    without an entry is an error naming the key. Re-registering the same class is fine, another
    class under a taken name or an empty name is refused."""
    registered += ["unit_pipeline"]
    algos.register_advantage_pipeline("unit_pipeline", needs=("groups",))(lambda **kw: None)

    @A.register_algorithm("unit_pipeline")
    class UnitPipeline(A.Algorithm):
        pass

    cfg = _cfg("grpo", "algorithm.adv_estimator=unit_pipeline")
    algo = _build(cfg)
    assert type(algo) is UnitPipeline and algo.settings == algorithm_settings(cfg)
    assert A.register_algorithm("unit_pipeline")(UnitPipeline) is UnitPipeline
    with pytest.raises(ValueError, match="algorithm 'unit_pipeline' is already registered"):
        A.register_algorithm("unit_pipeline")(type("Other", (A.Algorithm,), {}))
    with pytest.raises(ValueError, match="non-empty string"):
        A.register_algorithm("")

    del A.ALGORITHMS["unit_pipeline"]
    with pytest.raises(UserInputError, match="^algorithm.adv_estimator: 'unit_pipeline' has no "
                                             "algorithm") as err:
        _build(cfg)
    assert "register_algorithm" in str(err.value)


def test_one_name_selects_the_algorithm():
    """PACS's switch is a spelling of the name "pacs", whatever algorithm.adv_estimator says;
    without it the estimator names the entry. Settings made once carry the name, and the entry
    built from them is the one registered under it (planted: the estimator read before the
    switch runs the PPO family for pacs + remax)."""
    assert algorithm_name(_cfg("pacs", "algorithm.adv_estimator=remax")) == "pacs"
    assert algorithm_name(_cfg("pacs", "pacs.enable=false")) == "grpo"
    assert algorithm_name(_cfg("pure_vr")) == "pure_rloo"
    assert algorithm_name(_cfg("grpo", "algorithm.adv_estimator=rloo")) == "rloo"
    assert A.ALGORITHMS["pacs"] is A.Pacs and A.ALGORITHMS["pure_rloo"] is A.PureRloo
    settings = algorithm_settings(_cfg("pacs", "algorithm.adv_estimator=remax"))
    assert settings.name == "pacs" and settings.adv.estimator == "remax"
    assert type(A.build_algorithm(settings)) is A.Pacs


def test_a_user_entry_reads_its_own_options(tmp_path, registered):
    """algorithm.custom_algorithms.options reaches the user's entry as settings.options, a
    read-only plain mapping (nested values too), from the config file's and the command line's
    keys alike (planted: options left at the default {} fails)."""
    registered.append("unit_opts")
    path = tmp_path / "entry.py"
    path.write_text(textwrap.dedent('''
        from megarl.algos import register_advantage_pipeline
        from megarl.trainer.algorithm import PPOFamily, register_algorithm

        register_advantage_pipeline("unit_opts", needs=("groups",))(lambda **kw: None)

        @register_algorithm("unit_opts")
        class UnitOpts(PPOFamily):
            def __init__(self, settings):
                super().__init__(settings)
                self.beta = settings.options["beta"]
                self.tiers = settings.options["tiers"]["names"]
    '''))
    cfg = _cfg("grpo", f"algorithm.custom_algorithms.path={path}",
               "algorithm.adv_estimator=unit_opts", "+algorithm.custom_algorithms.options.beta=0.25",
               "+algorithm.custom_algorithms.options.tiers.names=[a,b]")
    algo = _build(cfg)
    assert (algo.beta, algo.tiers) == (0.25, ["a", "b"])
    with pytest.raises(TypeError):
        algo.settings.options["beta"] = 1.0  # read-only
    assert dict(algorithm_settings(_cfg("grpo")).options) == {}


def test_build_algorithm_imports_the_user_file(tmp_path, registered):
    """algorithm.custom_algorithms.path is imported by build_algorithm itself (settings of a
    Config made in code, never validated): its estimator then runs in the PPO family with its needs; a path
    that is not a file is a UserInputError naming the key."""
    registered.append("unit_file_adv")
    path = tmp_path / "algos_file.py"
    path.write_text(textwrap.dedent('''
        from megarl.algos import register_advantage_estimator

        @register_advantage_estimator("unit_file_adv", needs=("baselines", "groups"))
        def unit_file_adv(*, token_rewards, **_):
            return token_rewards, token_rewards
    '''))
    cfg = _cfg("grpo")
    cfg.algorithm.custom_algorithms.path = str(path)
    cfg.algorithm.adv_estimator = "unit_file_adv"
    try:
        algo = _build(cfg)
        assert algo.needs == A.Needs(groups=True, greedy_baseline=True)
    finally:
        algos.ADVANTAGE_ESTIMATORS.pop("unit_file_adv", None)
    cfg.algorithm.custom_algorithms.path = str(tmp_path / "missing.py")
    with pytest.raises(UserInputError, match=r"^algorithm.custom_algorithms.path: '.*missing.py' "
                                             r"is not a file"):
        _build(cfg)


@pytest.mark.parametrize("args", [("grpo", "algorithm.adv_estimator=rloo"),
                                  ("pure_vr", "algorithm.pure.normalize=false"), ("pacs",)])
def test_each_hook_passes_the_step_s_kl_coef(args):
    """With the KL in the reward, every entry's hook hands the step's kl_coef (0.3) to the
    reward placement: token_level_rewards = scores - 0.3 x (old - ref) on each response token
    (k1), metric reward_kl_penalty_coeff 0.3. Planted bug: a hook passing no coefficient
    (None: the penalty cannot be computed)."""
    batch = _batch()
    mask = batch.response_mask
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(mask.shape, generator=g) * mask
    ref = (old + 0.5 * torch.randn(mask.shape, generator=g)) * mask
    batch.tensors.update(old_logprob=old, ref_logprob=ref)
    cfg = _cfg(*args, "algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=kl")
    metrics = _build(cfg).advantages(batch, 0.3)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.3
    lengths, vr = [3, 1, 2, 3, 2], [1.0, 0.0, 0.0, 1.0, 1.0]
    o, r = old.double().tolist(), ref.double().tolist()
    want = [[(vr[i] if t == n - 1 else 0.0) - (0.3 * (o[i][t] - r[i][t]) if t < n else 0.0)
             for t in range(3)] for i, n in enumerate(lengths)]
    torch.testing.assert_close(batch.tensors["token_level_rewards"].double(),
                               torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=1e-6)


def test_registry_and_build_error_messages_in_full(registered):
    """The two registry errors, matched whole: a taken name says to pick another one; an
    estimator without an algorithm names both ways to provide one and the key of the file."""
    registered.append("unit_taken")
    A.register_algorithm("unit_taken")(type("First", (A.Algorithm,), {}))
    with pytest.raises(ValueError) as err:
        A.register_algorithm("unit_taken")(type("Second", (A.Algorithm,), {}))
    assert str(err.value) == (f"algorithm 'unit_taken' is already registered ({__name__}.First); "
                              "pick another name")
    cfg = _cfg("grpo")
    cfg.algorithm.adv_estimator = "unit_nothing"
    with pytest.raises(UserInputError) as err:
        _build(cfg)
    assert str(err.value) == (
        "algorithm.adv_estimator: 'unit_nothing' has no algorithm that computes it; register an "
        "advantage estimator (megarl.algos.register_advantage_estimator), or an algorithm of "
        "that name (megarl.trainer.algorithm.register_algorithm) in "
        "algorithm.custom_algorithms.path")
