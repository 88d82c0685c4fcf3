"""Score functions by data source, PURE's verifiable reward, and custom functions from files.

A score function has the verl signature
`fn(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float | dict`
(a dict carries the score under "score" plus extra numbers to log).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import inspect
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from megarl.rewards.countdown import countdown_score
from megarl.rewards.gsm8k import gsm8k_score
from megarl.rewards.math_score import math_score

ScoreFn = Callable[..., "float | dict[str, Any]"]

_GSM8K = frozenset({"openai/gsm8k", "gsm8k"})
_MATH = frozenset(
    {
        "lighteval/math",
        "digitallearninggmbh/math-lighteval",
        "math",
        "math500",
        "huggingfaceh4/math-500",
        "deepscaler",
        "arith",
    }
)
_MATH_PREFIXES = ("aime", "amc", "numina")


def verifier_name(data_source: str) -> str | None:
    """'gsm8k' | 'math' | 'countdown' for a built-in data source, else None (case-insensitive;
    `aime*`, `amc*`, `numina*` and `countdown*` match by prefix, also after an `org/`)."""
    ds = str(data_source).strip().lower()
    if ds in _GSM8K:
        return "gsm8k"
    if ds in _MATH:
        return "math"
    short = ds.rsplit("/", 1)[-1]
    if any(x.startswith(_MATH_PREFIXES) for x in (ds, short)):
        return "math"
    if any(x.startswith("countdown") for x in (ds, short)):
        return "countdown"
    return None


def _unknown(data_source: str) -> ValueError:
    return ValueError(
        f"no built-in reward for data_source={data_source!r}. Built-ins: gsm8k ('openai/gsm8k', "
        "'gsm8k'), math ('lighteval/MATH', 'DigitalLearningGmbH/MATH-lighteval', 'math', "
        "'math500', 'aime*', 'amc*', 'numina*', 'deepscaler', 'arith'), countdown ('countdown'). "
        "Fix: rename the data source, or set reward_model.custom_reward_function.path (a .py file) "
        "and .name (a function compute_score(data_source, solution_str, ground_truth, extra_info))."
    )


def compute_score(
    data_source: str, solution_str: str, ground_truth, extra_info: Mapping | None = None
) -> float:
    """Verifiable reward of one response, dispatched on `data_source` (see `verifier_name`).

    gsm8k: 1.0 / 0.0 on the `####` (else last) number. math: 1.0 / 0.0 on the last `\\boxed{}`.
    countdown: 1.0 correct, 0.1 valid-but-wrong equation, 0.0 otherwise.
    Unknown data source -> ValueError naming it and the fix.
    """
    kind = verifier_name(data_source)
    if kind == "gsm8k":
        return gsm8k_score(solution_str, ground_truth)
    if kind == "math":
        return math_score(solution_str, ground_truth)
    if kind == "countdown":
        return countdown_score(solution_str, ground_truth)
    raise _unknown(data_source)


def prime_compute_score(
    data_source: str, solution_str: str, ground_truth, extra_info: Mapping | None = None
) -> float:
    """PURE's verifiable reward in {0, 1}: the data source's verifier where it is gsm8k or
    countdown (1.0 only when fully correct), math verification for every other source."""
    kind = verifier_name(data_source)
    if kind in ("gsm8k", "countdown"):
        return 1.0 if compute_score(data_source, solution_str, ground_truth, extra_info) >= 1.0 else 0.0
    return math_score(solution_str, ground_truth)


def load_custom_reward_fn(
    path: str | Path, name: str = "compute_score", reward_kwargs: Mapping[str, Any] | None = None
) -> ScoreFn:
    """Import function `name` from the Python file `path` (trusted config, like verl's
    `reward_model.custom_reward_function.{path,name,reward_kwargs}`); kwargs are bound."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(
            f"reward_model.custom_reward_function.path={str(path)!r} is not a file. Fix: point it "
            f"at a .py file that defines {name}(data_source, solution_str, ground_truth, extra_info)."
        )
    p = p.resolve()
    module_name = "megarl_custom_reward_" + hashlib.sha1(str(p).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(module_name, p)
    if spec is None or spec.loader is None:
        raise ImportError(f"reward_model.custom_reward_function.path={str(path)!r} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        defined = sorted(
            k for k, v in vars(module).items() if inspect.isfunction(v) and v.__module__ == module_name
        )
        raise AttributeError(
            f"reward_model.custom_reward_function.name={name!r}: no such function in {p}. "
            f"Functions defined there: {defined}. Fix: set .name to one of them."
        )
    kwargs = dict(reward_kwargs or {})
    return functools.partial(fn, **kwargs) if kwargs else fn
