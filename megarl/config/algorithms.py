"""The algorithm names a config may choose, and the user's file that registers more.

``algorithm.adv_estimator`` takes a name of ``megarl.algos``'s estimator registries
(``estimator_names()``: the estimators of ``compute_advantages`` and the pipelines a trainer
algorithm computes, PURE's ``pure_rloo``), ``actor_rollout_ref.actor.policy_loss.loss_mode`` a
name of ``POLICY_LOSSES``. ``algorithm.custom_algorithms.path`` names a Python file that is
imported first (once per process, before these names are checked and before the run is built),
so that its ``@register_advantage_estimator`` / ``@register_policy_loss`` (and
``megarl.trainer.algorithm.register_algorithm``) add names a config or the command line may
then choose. The file is trusted code, like ``custom_reward_function.path``.

``megarl.algos`` (torch) is imported on the first check, not with ``megarl.config``.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

PATH_KEY = "algorithm.custom_algorithms.path"
ESTIMATOR_KEY = "algorithm.adv_estimator"
LOSS_KEY = "actor_rollout_ref.actor.policy_loss.loss_mode"

_IMPORTED: dict[Path, ModuleType] = {}


def import_custom_algorithms(path: str | None) -> ModuleType | None:
    """Import the Python file ``path`` (None: nothing) as module
    ``megarl_custom_algorithms_<hash of its path>``; a file already imported by this process is
    not imported again (its registrations stand). Raises ValueError (the text after the key:
    what is wrong and the fix) when the file is missing or its import fails."""
    if path is None:
        return None
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"{str(path)!r} is not a file; point it at a .py file that registers "
                         "advantage estimators or policy losses (megarl.algos)")
    p = p.resolve()
    if p in _IMPORTED:
        return _IMPORTED[p]
    name = "megarl_custom_algorithms_" + hashlib.sha1(str(p).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, p)
    if spec is None or spec.loader is None:
        raise ValueError(f"{str(path)!r} cannot be imported as a Python module; use a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling in the file look it up there
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        sys.modules.pop(name, None)
        raise ValueError(f"importing {str(path)!r} failed with {type(err).__name__}: {err}") from err
    _IMPORTED[p] = module
    return module


def custom_algorithms_problem(path: str | None) -> str | None:
    """``import_custom_algorithms``; what went wrong (the text after the key), else None."""
    try:
        import_custom_algorithms(path)
    except ValueError as err:
        return str(err)
    return None


def _unknown(value: object, choices: list[str]) -> str:
    """``invalid choice 'x'; expected one of 'a', 'b'; did you mean 'a'? (...)``"""
    msg = f"invalid choice {value!r}; expected one of {', '.join(map(repr, choices))}"
    close = difflib.get_close_matches(str(value), choices, n=3, cutoff=0.6)
    if close:
        msg += f"; did you mean {' or '.join(map(repr, close))}?"
    return msg + f" (a file named by {PATH_KEY} may register more)"


def unknown_estimator(name: str) -> str | None:
    """What is wrong with an ``algorithm.adv_estimator`` no registry holds (the text after the
    key), else None."""
    from megarl import algos

    names = algos.estimator_names()
    return None if name in names else _unknown(name, names)


def unknown_policy_loss(name: str) -> str | None:
    """What is wrong with a ``policy_loss.loss_mode`` no registry holds, else None."""
    from megarl import algos

    names = list(algos.POLICY_LOSSES)
    return None if name in names else _unknown(name, names)


def estimator_needs(name: str) -> frozenset[str]:
    """What the estimator ``name`` needs (``megarl.algos.NEEDS``: groups, values, baselines);
    empty for a name no registry holds (reported by ``unknown_estimator``)."""
    from megarl import algos

    try:
        return algos.estimator_needs(name)
    except ValueError:
        return frozenset()


def estimator_traits(name: str) -> frozenset[str]:
    """The traits of the estimator ``name`` (``megarl.algos.TRAITS``: singleton_groups,
    step_scores); empty for a name no registry holds."""
    from megarl import algos

    try:
        return algos.estimator_traits(name)
    except ValueError:
        return frozenset()


def estimators_reading(block: str) -> list[str]:
    """The estimators registered as the readers of config block ``block`` (e.g.
    ``algorithm.pure``)."""
    from megarl import algos

    return algos.estimators_reading(block)
