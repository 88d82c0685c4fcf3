"""megarl's contract with verl's configuration surface, read from the pinned verl wheel.

The wheel (``pip download --no-deps verl==VERL_RELEASE``; read as a zip, never imported) ships
its trainer configs fully expanded (``_generated_ppo_trainer.yaml``, ``..._megatron_...``).
Every key there must have a status in ``megarl.config.verl_compat`` (implemented, mapped, inert,
rejected), ``verl_keys.yaml`` must hold exactly the wheel's keys and defaults, and
``docs/verl_compat.md`` must be what ``megarl.config.verl_docs`` generates from them.

Planted while writing: deleting the ``*sandbox_fusion.*`` rules leaves 6 keys unclassified
(test_every_verl_key_has_a_status names them); mapping ``critic.optim.clip_grad`` to a key
megarl lacks fails test_mapped_keys_are_megarl_keys; editing one default in verl_keys.yaml
fails test_keys_file_is_the_wheels.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from released_wheels import cache_folder, released_wheel

from megarl.config.keys import schema_problem
from megarl.config.verl_compat import OLDER_KEYS, RULES, VERL_RELEASE, classify, verl_keys
from megarl.config.verl_docs import keys_from_wheel, render_doc

DOC = Path(__file__).resolve().parents[2] / "docs" / "verl_compat.md"


@pytest.fixture(scope="module")
def wheel_keys(request, tmp_path_factory) -> dict:
    folder = cache_folder(request, tmp_path_factory, "verl-wheels")
    return keys_from_wheel(released_wheel("verl", VERL_RELEASE, folder))


def test_keys_file_is_the_wheels(wheel_keys):
    pinned = verl_keys()
    assert sorted(set(wheel_keys) ^ set(pinned)) == []
    assert {k: v for k, v in wheel_keys.items() if pinned[k] != v} == {}


def test_every_verl_key_has_a_status(wheel_keys):
    assert len(wheel_keys) > 1000
    assert [k for k in wheel_keys if classify(k) is None] == []


def test_mapped_keys_are_megarl_keys(wheel_keys):
    for key in wheel_keys:
        verdict = classify(key)
        if verdict is not None and verdict.status == "mapped":
            assert schema_problem(verdict.note) is None, (key, verdict.note)


def test_rejected_keys_are_a_small_minority_with_reasons(wheel_keys):
    verdicts = [classify(k) for k in wheel_keys]
    rejected = [v for v in verdicts if v is not None and v.status == "rejected"]
    assert len(rejected) < 0.15 * len(verdicts)
    assert all(len(v.note) > 15 for v in verdicts if v and v.status in ("inert", "rejected"))


def test_no_rule_is_shadowed(wheel_keys):
    """A rule that matches keys, all of them decided earlier (a megarl key or an earlier
    rule), is dead: the status it states is not the one users get."""
    from fnmatch import fnmatchcase

    keys = [*wheel_keys, *OLDER_KEYS]
    dead = []
    for i, rule in enumerate(RULES):
        matched = [k for k in keys if fnmatchcase(k, rule.pattern)]
        reached = [k for k in matched if classify(k) is not None
                   and classify(k).status == rule.status
                   and not any(fnmatchcase(k, r.pattern) for r in RULES[:i])
                   and schema_problem(k) is not None]
        if matched and not reached:
            dead.append(rule.pattern)
    assert dead == []


def test_older_spellings_have_a_status():
    assert [k for k in OLDER_KEYS if classify(k) is None] == []


def test_doc_is_generated_from_the_pinned_keys():
    assert DOC.read_text() == render_doc(verl_keys()), (
        "docs/verl_compat.md is stale: run python -m megarl.config.verl_docs")
