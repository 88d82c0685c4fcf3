"""What a worker does with one request: resolve the function, call it, normalise the result.

Shared by the local subprocess workers and the Ray actors so both give identical results.
"""

from __future__ import annotations

import functools
import math
import resource
from typing import Any

from megarl.rewards.pool import RewardFnSpec, RewardRequest
from megarl.rewards.scoring import (
    ScoreFn,
    compute_score,
    load_custom_reward_fn,
    prime_compute_score,
)

_MAX_MESSAGE = 500
_fn_cache: dict[tuple, ScoreFn] = {}


class WorkerCrash(Exception):
    """The worker process must be replaced (its memory bound was hit)."""


def resolve(spec: RewardFnSpec) -> ScoreFn:
    key = spec.cache_key()
    fn = _fn_cache.get(key)
    if fn is None:
        if spec.kind in ("default", "prime"):
            # built-in functions take keyword settings (sandbox_fusion: code sources' server)
            fn = compute_score if spec.kind == "default" else prime_compute_score
            if spec.kwargs:
                fn = functools.partial(fn, **dict(spec.kwargs))
        else:
            fn = load_custom_reward_fn(spec.path, spec.name, spec.kwargs)
        _fn_cache[key] = fn
    return fn


def _extra_value(v: Any) -> Any:
    if isinstance(v, bool | int | float | str) or v is None:
        return v if not isinstance(v, str) else v[:_MAX_MESSAGE]
    return repr(v)[:_MAX_MESSAGE]


def run_request(req: RewardRequest) -> tuple[float, dict[str, Any], str]:
    """(score, extra, status) for one request. A TimeoutError raised inside the call (math-verify
    out of time) becomes status "timeout", other exceptions "error"; MemoryError raises
    WorkerCrash (the caller exits so a fresh worker retries)."""
    try:
        out = resolve(req.fn)(
            data_source=req.data_source,
            solution_str=req.solution_str,
            ground_truth=req.ground_truth,
            extra_info=req.extra_info,
        )
        extra: dict[str, Any] = {}
        if isinstance(out, dict):
            if "score" not in out:
                raise TypeError(f"score function returned a dict without 'score' (keys {sorted(out)[:10]})")
            extra = {str(k): _extra_value(v) for k, v in out.items() if k != "score"}
            out = out["score"]
        if isinstance(out, str | bytes) or not hasattr(out, "__float__"):
            raise TypeError(f"score function returned {type(out).__name__}, expected a number or a dict")
        score = float(out)
        if not math.isfinite(score):
            raise ValueError(f"score function returned non-finite {score}")
        return score, extra, "ok"
    except MemoryError as e:
        raise WorkerCrash(("MemoryError (memory bound hit)" + (f": {e}" if str(e) else ""))[:_MAX_MESSAGE]) from None
    except TimeoutError as e:
        return 0.0, {"error": f"{type(e).__name__}: {e}"[:_MAX_MESSAGE]}, "timeout"
    except Exception as e:  # noqa: BLE001 - any failure of one response scores 0
        return 0.0, {"error": f"{type(e).__name__}: {e}"[:_MAX_MESSAGE]}, "error"


def limit_address_space(limit_bytes: int) -> None:
    """Cap this process's virtual memory (RLIMIT_AS) so a runaway call gets MemoryError; no
    core files from crashing workers."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit_bytes = min(limit_bytes, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))


def warm_up() -> None:
    """Import math-verify and run one verification (the first call costs ~0.1 s)."""
    from megarl.rewards.math_score import math_verify_equal

    math_verify_equal("\\frac{1}{2}", "0.5")
