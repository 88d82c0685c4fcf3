"""Score functions by data source, PURE's verifiable reward, and custom functions from files.

A score function has the verl signature
`fn(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float | dict`
(a dict carries the score under "score" plus extra numbers to log).

verl's code data sources (codecontests, apps, codeforces, taco) are scored by running the
response's program on the row's test cases through a SandboxFusion server
(`megarl.rewards.sandbox_fusion`) when the built-in functions get its settings as the kwarg
``sandbox_fusion`` (from ``reward_model.sandbox_fusion.*``, see ``sandbox_fusion.fn_kwargs``).
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
from megarl.rewards.sandbox_fusion import CODE_SOURCES, SandboxSettings, sandbox_score

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


def is_code_source(data_source: str) -> bool:
    """verl's code data sources ('codecontests', 'apps', 'codeforces', 'taco'; case-insensitive,
    also after an `org/`): scored through a SandboxFusion server."""
    ds = str(data_source).strip().lower()
    return ds in CODE_SOURCES or ds.rsplit("/", 1)[-1] in CODE_SOURCES


def has_builtin_rule(data_source: str, fn_kwargs: Mapping[str, Any] | None = None) -> bool:
    """Whether `compute_score` called with `fn_kwargs` scores `data_source`: a built-in
    verifier's source, or a code source when the kwargs carry a sandbox_fusion url."""
    if verifier_name(data_source) is not None:
        return True
    sandbox = (fn_kwargs or {}).get("sandbox_fusion") or {}
    return is_code_source(data_source) and bool(sandbox.get("url"))


_NO_SANDBOX = ("code data sources ('codecontests', 'apps', 'codeforces', 'taco') are scored by "
               "running the program on the row's test cases through a SandboxFusion server: set "
               "reward_model.sandbox_fusion.url=http://HOST:PORT/run_code")


def _unknown(data_source: str) -> ValueError:
    if is_code_source(data_source):
        return ValueError(f"data_source={data_source!r} needs a code sandbox. Fix: {_NO_SANDBOX} "
                          "(or score it with reward_model.custom_reward_function.path).")
    return ValueError(
        f"no built-in reward for data_source={data_source!r}. Built-ins: gsm8k ('openai/gsm8k', "
        "'gsm8k'), math ('lighteval/MATH', 'DigitalLearningGmbH/MATH-lighteval', 'math', "
        "'math500', 'aime*', 'amc*', 'numina*', 'deepscaler', 'arith'), countdown ('countdown'); "
        f"{_NO_SANDBOX}. Fix: rename the data source, or set "
        "reward_model.custom_reward_function.path (a .py file) and .name (a function "
        "compute_score(data_source, solution_str, ground_truth, extra_info))."
    )


def code_score(solution_str: str, ground_truth: Any, sandbox_fusion: Mapping[str, Any] | None,
               data_source: str = "") -> float | dict[str, float]:
    """verl's code reward: the pass share of the first 10 test cases (`continuous`), run through
    the SandboxFusion server that ``sandbox_fusion`` ({url, max_concurrent, memory_limit_mb,
    deadline_s}) names. No url -> ValueError naming the fix.

    A case the server gave no verdict on (deadline_s reached, an HTTP or sandbox error) counts
    as not passed, as in verl; then the result is {"score", "sandbox_unjudged": count} so that
    it is seen. When it gave none at all, the call raises (TimeoutError when deadline_s cut it,
    else RuntimeError with the first error): 0 in the pool, counted as a timeout / an error
    instead of passing for a wrong program."""
    if not sandbox_fusion or not sandbox_fusion.get("url"):
        raise _unknown(data_source or "taco")
    settings = SandboxSettings(**dict(sandbox_fusion))
    result = sandbox_score(solution_str, ground_truth, settings, continuous=True)
    n, unjudged = len(result.details), result.unjudged
    if n and unjudged == n:
        first = result.details[0]
        if result.timed_out:
            raise TimeoutError(f"SandboxFusion at {settings.url}: deadline_s="
                               f"{settings.deadline_s} reached with none of {n} cases judged")
        raise RuntimeError(f"SandboxFusion at {settings.url} judged none of the {n} cases: "
                           f"{first.get('error') or first.get('message') or first.get('status')}")
    if unjudged:
        return {"score": result.score, "sandbox_unjudged": float(unjudged)}
    return result.score


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth,
    extra_info: Mapping | None = None,
    sandbox_fusion: Mapping[str, Any] | None = None,
) -> float | dict[str, float]:
    """Verifiable reward of one response, dispatched on `data_source` (see `verifier_name`).

    gsm8k: 1.0 / 0.0 on the `####` (else last) number. math: 1.0 / 0.0 on the last `\\boxed{}`.
    countdown: 1.0 correct, 0.1 valid-but-wrong equation, 0.0 otherwise.
    code sources (`is_code_source`): `code_score` through ``sandbox_fusion``.
    Unknown data source -> ValueError naming it and the fix.
    """
    if is_code_source(data_source):
        return code_score(solution_str, ground_truth, sandbox_fusion, data_source)
    kind = verifier_name(data_source)
    if kind == "gsm8k":
        return gsm8k_score(solution_str, ground_truth)
    if kind == "math":
        return math_score(solution_str, ground_truth)
    if kind == "countdown":
        return countdown_score(solution_str, ground_truth)
    raise _unknown(data_source)


def prime_compute_score(
    data_source: str,
    solution_str: str,
    ground_truth,
    extra_info: Mapping | None = None,
    sandbox_fusion: Mapping[str, Any] | None = None,
) -> float | dict[str, float]:
    """PURE's verifiable reward in {0, 1}: the data source's verifier where it is gsm8k or
    countdown (1.0 only when fully correct), math verification for every other source except
    code sources, which get verl's code reward (`code_score`: a pass share, as verl's prime
    manager gives them)."""
    if is_code_source(data_source):
        return code_score(solution_str, ground_truth, sandbox_fusion, data_source)
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
