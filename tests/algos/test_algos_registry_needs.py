"""What estimators declare they need (megarl.algos.NEEDS), advantage pipelines, and the names a
config may choose. Planted bugs each check catches are named in the docstrings."""

import pytest
import torch

import megarl.algos as algos
from megarl.algos import (
    ADVANTAGE_ESTIMATORS,
    ADVANTAGE_PIPELINES,
    ESTIMATOR_NEEDS,
    compute_advantages,
    estimator_names,
    estimator_needs,
    register_advantage_estimator,
    register_advantage_pipeline,
)


@pytest.fixture
def cleanup():
    names: list[str] = []
    yield names
    for n in names:
        ADVANTAGE_ESTIMATORS.pop(n, None)
        ADVANTAGE_PIPELINES.pop(n, None)
        ESTIMATOR_NEEDS.pop(n, None)
        algos.ESTIMATOR_TRAITS.pop(n, None)
        algos.registry.ESTIMATOR_CONFIG_BLOCKS.pop(n, None)


def test_built_in_needs():
    """The config's rules rest on these: group estimators refuse rollout.n = 1, gae turns the
    critic on, remax generates greedy baselines. Planted: a group estimator without "groups"
    (n = 1 accepted), remax declared as needing values."""
    want = {"gae": {"values"}, "grpo": {"groups"}, "rloo": {"groups"},
            "reinforce_plus_plus": set(), "reinforce_plus_plus_baseline": {"groups"},
            "remax": {"baselines"}, "opo": {"groups"}, "grpo_passk": {"groups"},
            "pure_rloo": {"groups"}}
    for name, needs in want.items():
        assert estimator_needs(name) == frozenset(needs), name
    assert set(algos.NEEDS) == {"groups", "values", "baselines"}


def test_pipelines_are_names_but_not_dispatched():
    """pure_rloo is a pipeline: listed after the estimators by estimator_names (the config's
    choices), absent from ADVANTAGE_ESTIMATORS, so compute_advantages refuses it."""
    names = estimator_names()
    assert names[:len(ADVANTAGE_ESTIMATORS)] == list(ADVANTAGE_ESTIMATORS)
    assert "pure_rloo" in names and "pure_rloo" not in ADVANTAGE_ESTIMATORS
    assert ADVANTAGE_PIPELINES["pure_rloo"] is algos.pure_rloo_advantages
    assert len(names) == len(set(names))
    with pytest.raises(ValueError, match="unknown advantage estimator 'pure_rloo'"):
        compute_advantages("pure_rloo", token_rewards=torch.zeros(1, 1),
                           response_mask=torch.ones(1, 1))


def test_register_with_needs(cleanup):
    """needs given as a string or any iterable become a frozenset; an unknown need is refused
    naming it and the valid ones; re-registering the same function replaces its needs; a
    function registered without needs needs nothing. Planted: a bare string split into
    letters; the unknown-needs check skipped."""
    cleanup += ["t_needs_a", "t_needs_b", "t_needs_c"]

    def fn(**_):
        return None

    register_advantage_estimator("t_needs_a", needs="values")(fn)
    assert estimator_needs("t_needs_a") == frozenset({"values"})
    register_advantage_estimator("t_needs_a", needs=["groups", "baselines"])(fn)
    assert estimator_needs("t_needs_a") == frozenset({"groups", "baselines"})
    register_advantage_estimator("t_needs_b")(fn)
    assert estimator_needs("t_needs_b") == frozenset()
    with pytest.raises(ValueError, match=r"advantage estimator 't_needs_c': unknown needs "
                                         r"\['critic'\]; valid: \['baselines', 'groups', 'values'\]"):
        register_advantage_estimator("t_needs_c", needs=("groups", "critic"))
    assert "t_needs_c" not in ESTIMATOR_NEEDS
    with pytest.raises(ValueError, match="advantage pipeline 't_needs_c': unknown needs"):
        register_advantage_pipeline("t_needs_c", needs="critc")


def test_estimator_and_pipeline_names_do_not_collide(cleanup):
    """A name is one thing: a pipeline under an estimator's name and an estimator under a
    pipeline's name are both refused (naming the holder); a pipeline's needs are recorded.
    Planted: the cross-registry check dropped (one name, two meanings)."""
    cleanup += ["t_pipe", "t_est"]

    def pipe(**_):
        return None

    def est(**_):
        return None

    register_advantage_pipeline("t_pipe", needs=("groups",))(pipe)
    register_advantage_estimator("t_est")(est)
    assert estimator_needs("t_pipe") == frozenset({"groups"})
    assert estimator_names()[-1] == "t_pipe"
    with pytest.raises(ValueError, match=r"advantage estimator 't_pipe' is already registered "
                                         r"\(.*pipe\)"):
        register_advantage_estimator("t_pipe")(est)
    with pytest.raises(ValueError, match=r"advantage pipeline 't_est' is already registered "
                                         r"\(.*est\)"):
        register_advantage_pipeline("t_est")(pipe)
    with pytest.raises(ValueError, match="non-empty string"):
        register_advantage_pipeline("")
    assert ADVANTAGE_ESTIMATORS["t_est"] is est and ADVANTAGE_PIPELINES["t_pipe"] is pipe


def test_unknown_estimator_lists_the_choices():
    """estimator_needs of an unknown name names it and every valid name, pipelines included."""
    with pytest.raises(ValueError) as err:
        estimator_needs("grpoo")
    msg = str(err.value)
    assert msg.startswith("unknown advantage estimator 'grpoo'; valid names: [")
    for name in ("gae", "grpo", "remax", "pure_rloo"):
        assert repr(name) in msg


def test_traits_and_config_blocks_say_what_the_checks_used_names_for():
    """The checks that compared estimator names now read the registry: GRPO alone defines a
    group of one (rollout.n = 1 allowed, with a caveat), PURE's pipeline alone reads PRM step
    scores and the algorithm.pure block."""
    with_singletons = {n for n in estimator_names() if "singleton_groups" in
                       algos.estimator_traits(n)}
    assert with_singletons == {"grpo"}
    assert {n for n in estimator_names() if "step_scores" in algos.estimator_traits(n)} == {
        "pure_rloo"}
    assert algos.estimators_reading("algorithm.pure") == ["pure_rloo"]
    assert set(algos.TRAITS) == {"singleton_groups", "step_scores"}


def test_a_registered_estimator_brings_its_traits_to_the_config_checks(cleanup):
    """A user estimator registered with ``singleton_groups`` runs at rollout.n = 1 (the config
    check asks the registry, not the name "grpo"); without it the same config is refused. An
    unknown trait is refused naming the valid ones."""
    from megarl.config.loader import resolve_config
    from megarl.errors import UserInputError

    def adv(*, token_rewards, response_mask, **_):
        return token_rewards, token_rewards

    for name, traits in (("one_ok", ("singleton_groups",)), ("groups_only", ())):
        cleanup.append(name)
        register_advantage_estimator(name, needs=("groups",), traits=traits)(adv)
    resolve_config("grpo", ["algorithm.adv_estimator=one_ok", "actor_rollout_ref.rollout.n=1"])
    with pytest.raises(UserInputError, match="compares the responses of one prompt"):
        resolve_config("grpo", ["algorithm.adv_estimator=groups_only",
                                "actor_rollout_ref.rollout.n=1"])
    with pytest.raises(ValueError, match="unknown traits \\['fast'\\]"):
        register_advantage_estimator("bad", traits=("fast",))
