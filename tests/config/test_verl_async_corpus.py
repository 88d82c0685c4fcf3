"""verl's asynchronous recipes read by megarl's config check: every command line of
``verl/experimental/fully_async_policy/shell``, ``one_step_off_policy/shell`` and their
end-to-end tests (``verl_corpus/lines_async.jsonl``, expanded by ``expand.py --set async`` from
the commit of the main corpus), with the entry point changed: the recipe's config file (the one
named, or the entry's default) read as verl reads it, its keys before the script's, and the
one-step-off entry read as ``async_training.staleness_threshold=1``
(``verl_corpus/corpus.py``).

- The outcome of each line equals the committed table ``verl_corpus/outcomes_async.json``.
- Each line is refused only for what megarl does not build: an engine other than its own on
  the rollout workers (vLLM, SGLang), rollout engine groups of several ranks, rollout workers on
  other nodes, multi-turn rollouts on the workers, or a key megarl's verl rules refuse as not
  built; or it is in ``NOT_PASSING`` with the reason.
- With those four set to what megarl builds (its engine, TP 1, one node, single-turn), every
  disaggregated line passes (15 of 20: not ``NOT_PASSING``'s and the three that set
  ``optim.lr_decay_steps``, refused as not built) and reads verl's keys with verl's meaning: the fully-async window (staleness, sync interval, require_batches, partial rollout,
  the step's prompts from ``train_batch_size=0``), the proximal logprobs of
  ``compute_prox_log_prob``, validation every ``rollout.test_freq`` syncs, and the one-step-off
  batches of ``train_batch_size`` prompts in ``train_batch_size / ppo_mini_batch_size``
  updates, one step stale.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "verl_corpus"))
from corpus import (  # noqa: E402
    ASYNC_LINES,
    ASYNC_OUTCOMES,
    LINES,
    changed_lines,
    command_line,
    line_id,
    not_built,
    outcomes,
    problem_key,
    read_lines,
)

from megarl.config.errors import ConfigError  # noqa: E402
from megarl.config.loader import resolve_config  # noqa: E402

# what the disaggregated mode does not build yet, by the key its refusal names
NOT_BUILT = {
    "actor_rollout_ref.rollout.name": "actor_rollout_ref.rollout.name=torch",
    "actor_rollout_ref.rollout.tensor_model_parallel_size":
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "rollout.nnodes": "rollout.nnodes=1",
    "actor_rollout_ref.rollout.multi_turn.enable": "actor_rollout_ref.rollout.multi_turn.enable=false",
}
_UNEVEN = ("megarl gives every data-parallel rank the same number of whole prompt groups; the "
           "layout's trainer ranks (the node's GPUs less the rollout's, divided by the Ulysses "
           "size) do not divide the batch")
_SPLIT = ("fsdp_size 2 under Ulysses 4 would shard inside a sequence-parallel group, a layout "
          "megarl's FSDP2 meshes do not build (megarl.config.fsdp_size)")
_E2E = "verl/experimental/one_step_off_policy/shell/"
NOT_PASSING = {
    "tests/special_e2e/run_one_step_off_policy.sh#0": ({"data.train_batch_size"}, _UNEVEN),
    "verl/experimental/fully_async_policy/shell/dapo_7b_math_fsdp2_4_12.sh#0": (
        {"data.train_batch_size", "actor_rollout_ref.actor.ppo_mini_batch_size"}, _UNEVEN),
    f"{_E2E}dapo_7b_math_fsdp2_4_12.sh#0": (
        {"actor_rollout_ref.actor.fsdp_config.fsdp_size", "data.train_batch_size"},
        f"{_SPLIT}; {_UNEVEN}"),
    f"{_E2E}dapo_7b_math_fsdp2_sglang_4_12.sh#0": (
        {"actor_rollout_ref.actor.fsdp_config.fsdp_size", "data.train_batch_size"},
        f"{_SPLIT}; {_UNEVEN}"),
    f"{_E2E}dapo_7b_math_megatron_4_12.sh#0": ({"data.train_batch_size"}, _UNEVEN),
    f"{_E2E}dapo_7b_math_fsdp2_colocate.sh#0": (
        {"actor_rollout_ref.actor.fsdp_config.fsdp_size"}, _SPLIT),
    f"{_E2E}dapo_7b_math_fsdp2_sglang_colocate.sh#0": (
        {"actor_rollout_ref.actor.fsdp_config.fsdp_size"}, _SPLIT),
}


@pytest.fixture(scope="module")
def today() -> dict[str, dict]:
    return outcomes(ASYNC_LINES)


def _everyday(problems: list[str]) -> set[str]:
    """The keys of ``problems`` that are neither an unbuilt part of the disaggregated mode nor
    a key megarl's verl rules refuse as not built."""
    return {problem_key(p) for p in problems
            if problem_key(p) not in NOT_BUILT and not_built(problem_key(p)) is None}


def test_corpus_is_verls_async_recipes():
    header, lines = read_lines(ASYNC_LINES)
    main, _ = read_lines(LINES)
    assert header["verl_commit"] == main["verl_commit"] and not header["failed"]
    assert len(lines) == header["lines"] == 26
    entries = {x["entry"].rsplit(".", 2)[-2] for x in lines}
    assert entries == {"fully_async_policy", "one_step_off_policy", "trainer"}
    assert len({line_id(x) for x in lines}) == len(lines)


def test_outcomes_equal_the_table(today):
    changed = changed_lines(today, ASYNC_OUTCOMES)
    assert not changed, "outcome changed for: " + ", ".join(changed) + "; rewrite the table " \
        "with python tests/config/verl_corpus/corpus.py if meant"


def test_lines_are_refused_only_for_what_is_not_built(today):
    unexplained = {}
    for lid, got in today.items():
        for p in got["problems"]:
            if problem_key(p) in NOT_BUILT:
                assert "not built yet" in p, p
        everyday = _everyday(got["problems"])
        if everyday != (NOT_PASSING[lid][0] if lid in NOT_PASSING else set()):
            unexplained[lid] = everyday
    assert not unexplained, unexplained


def _on_megarls_engine(line: dict):
    recipe, args = command_line(line)
    return resolve_config(recipe, [*args, *NOT_BUILT.values()]).config


def test_on_megarls_engine_the_disaggregated_lines_pass_with_verls_meaning():
    _, lines = read_lines(ASYNC_LINES)
    by_script = {}
    for line in lines:
        if "actor_rollout_ref.hybrid_engine=False" not in line["args"]:
            continue  # the colocated baselines of the one-step-off recipe
        lid = line_id(line)
        try:
            by_script[line["script"].removeprefix("verl/experimental/")] = \
                _on_megarls_engine(line)
        except ConfigError as e:  # only a key refused as not built, or a listed layout
            assert _everyday(e.problems) <= NOT_PASSING.get(lid, (set(),))[0], (lid, e.problems)
    assert len(by_script) == 15, sorted(by_script)
    # fully async (dapo_7b_math_fsdp2_8_8.sh): verl's window and stream as written
    cfg = by_script["fully_async_policy/shell/dapo_7b_math_fsdp2_8_8.sh"]
    at = cfg.async_training
    assert (at.staleness_threshold, at.trigger_parameter_sync_step, at.require_batches,
            at.partial_rollout, at.use_rollout_log_probs) == (0.1, 4, 4, True, True)
    assert cfg.data.train_batch_size == 32 * 4  # train_batch_size=0: mini x require_batches
    assert cfg.trainer.test_freq == 10 * 4  # rollout.test_freq=10 syncs of 4 steps
    assert cfg.trainer.total_training_steps is None and cfg.rollout.total_rollout_steps == 51200
    # compute_prox_log_prob=True: the ratio against the trainer's recomputation
    assert by_script["fully_async_policy/shell/dapo_7b_math_fsdp2_64_64_mis.sh"].async_training \
        .use_rollout_log_probs is False
    # one-step-off (grpo_3b_gsm8k_fsdp2_2_6.sh): 1152 prompts a step in 1152 / 192 updates,
    # sampled one step stale, weights every step, the ratio against the rollout's logprobs
    cfg = by_script["one_step_off_policy/shell/grpo_3b_gsm8k_fsdp2_2_6.sh"]
    at = cfg.async_training
    assert (at.staleness_threshold, at.trigger_parameter_sync_step, at.require_batches) == \
        (1, 1, 6)
    assert cfg.data.train_batch_size == 1152 and at.use_rollout_log_probs is True
