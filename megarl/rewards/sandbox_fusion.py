"""Code rewards through a SandboxFusion server (verl's ``reward_model.sandbox_fusion.*``).

A response's program is sent to a SandboxFusion ``/run_code`` endpoint once per test case and
its stdout compared with the expected output; the score is the share of passed cases. Model
output is untrusted: it is only ever sent to the server (never run, imported or eval'd here).

Behaviour follows verl's ``verl.utils.reward_score.sandbox_fusion``:

- code: the last fenced ``python`` block of the response, else the first fenced block (its
  first line dropped when it is a bare language name); no fenced block scores 0;
- test cases (the ground truth, a dict or its JSON text): ``inputs`` (each case's stdin) and
  ``outputs`` (its expected stdout; ``None`` = any successful run passes); ``assert_case``
  (a list of code snippets appended to the program, one per case); ``fn_name`` (call-based
  cases: each input line is one JSON argument, the function's result is printed);
- a case passes when the server says Success, the run Finished and its stdout equals the
  expected output after trailing newlines are stripped from both (``str()`` of each);
- a compile error in case i marks every later case as a compile error too;
- ``continuous``: the pass share of the first 10 cases (verl's code rewards always use it);
  otherwise the pass share of all cases. A continuous call sends only those 10 (its score
  depends on no other case; verl sends them all);
- a request is retried on HTTP 504 (Gateway Timeout) only, 3 attempts at most, 1 s then 2 s
  apart; its HTTP timeout is compile_timeout + run_timeout + 10 s;
- requests in flight are bounded by ``max_concurrent`` per process (verl shares one bound
  across its reward processes; here each worker process has its own) and, per call, by
  ``MAX_THREADS`` (4: reward workers run under an address-space limit).

Added bounds: ``deadline_s`` bounds one whole call (waiting for a slot, requests, retries) so
that it ends before the reward pool's own per-response timeout; the response body read is
capped (``MAX_RESPONSE_BYTES``) and the stdout/stderr kept in the per-case details are cut to
``KEPT_CHARS``.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from megarl.config.schema_reward import sandbox_fusion_problems as settings_problems
from megarl.rewards.pool import RewardFnSpec

CODE_SOURCES = frozenset({"codecontests", "apps", "codeforces", "taco"})  # verl's list
CASE_TIMEOUT_S = 10.0  # verl's compile and run timeout per case, seconds
API_MARGIN_S = 10.0  # added to compile + run timeouts for the HTTP timeout (verl's API_TIMEOUT)
MAX_ATTEMPTS = 3  # verl's MAX_RETRIES: attempts per request on HTTP 504
RETRY_DELAY_S = 1.0  # the k-th retry waits k * RETRY_DELAY_S
CONTINUOUS_CASES = 10  # continuous scores count the first 10 cases, as verl
MAX_RESPONSE_BYTES = 8 << 20  # a larger response body is an error, not read on
KEPT_CHARS = 1000  # stdout / stderr characters kept per case in the details
# threads per call: each costs address space (stack, malloc arena) and reward workers run
# under RLIMIT_AS (reward_model.memory_mb): 10 live threads did not start in a 512 MiB worker
# (they did in 1024 MiB); 4 start in 256 MiB
MAX_THREADS = 4

# verl's per-case result codes
PASSED, WRONG, API_ERROR, RUNTIME_ERROR, RUN_TIMEOUT, COMPILE_ERROR = True, False, -1, -2, -3, -4


@dataclass(frozen=True)
class SandboxSettings:
    """Where and how to run code. Timeouts in seconds; ``deadline_s`` None = no whole-call bound
    (each request is still bounded)."""

    url: str
    max_concurrent: int = 64
    memory_limit_mb: int = 1024
    compile_timeout_s: float = CASE_TIMEOUT_S
    run_timeout_s: float = CASE_TIMEOUT_S
    deadline_s: float | None = None
    language: str = "python"

    def __post_init__(self) -> None:
        problems = settings_problems(self.url, self.max_concurrent, self.memory_limit_mb)
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def request_timeout_s(self) -> float:
        return self.compile_timeout_s + self.run_timeout_s + API_MARGIN_S


@dataclass
class CodeScore:
    """score in [0, 1]; results: one verl code per case run (True, False, -1 api/sandbox error,
    -2 runtime error, -3 run timeout, -4 compile error); details: per case, a dict with
    "status" and what the server said (stdout/stderr cut to KEPT_CHARS); error: why nothing
    was run (no code block, bad test cases), else None; timed_out: deadline_s cut the call."""

    score: float
    results: list[bool | int] = field(default_factory=list)
    details: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    timed_out: bool = False

    @property
    def unjudged(self) -> int:
        """Cases the server gave no verdict on (no answer in time, an HTTP or sandbox error)."""
        return sum(1 for d in self.details
                   if d.get("status") in ("api_error", "deadline", "sandbox_error"))


_slots_lock = threading.Lock()
_slots: dict[int, threading.BoundedSemaphore] = {}


def process_slots(max_concurrent: int) -> threading.BoundedSemaphore:
    """This process's bound on requests in flight (one per max_concurrent value)."""
    with _slots_lock:
        if max_concurrent not in _slots:
            _slots[max_concurrent] = threading.BoundedSemaphore(max_concurrent)
        return _slots[max_concurrent]


def extract_code(response: str) -> str | None:
    """The program in a response, as verl takes it; None when there is no fenced block."""
    if "```python" in response:
        return response.split("```python")[-1].split("```")[0]
    if "```" not in response:
        return None
    block = response.split("```")[1]
    first, sep, rest = block.partition("\n")
    return rest if sep and first.strip().isalpha() else block


_CALL_IMPORTS = ("string", "re", "datetime", "collections", "heapq", "bisect", "copy", "math",
                 "random", "statistics", "itertools", "functools", "operator", "io", "sys", "json",
                 "builtins", "typing")


def call_program(code: str, fn_name: str) -> str:
    """A program that runs ``code`` (after the star-imports verl puts before it), then calls
    ``fn_name`` (a global function, else a method of ``Solution()``) with one argument per
    stdin line (each JSON) and prints the result (JSON for dict/list/tuple/None/bool, else
    str). It exits 1 on any error. Runs in the sandbox only."""
    head = "\n".join(f"from {m} import *" for m in _CALL_IMPORTS)
    head += "\n" + "\n".join(f"import {m}" for m in _CALL_IMPORTS if m != "builtins")
    tail = f"""
def _megarl_call(_name):
    import json as _j, sys as _s
    _text = _s.stdin.read()
    _args = [_j.loads(_l) for _l in _text.split("\\n")] if _text.strip() else []
    _g = globals()
    _fn = _g[_name] if _name in _g else getattr(_g["Solution"](), _name)
    _out = _fn(*_args)
    if isinstance(_out, (dict, list, tuple, bool)) or _out is None:
        print(_j.dumps(_out))
    else:
        print(str(_out))

if __name__ == "__main__":
    _megarl_call({json.dumps(fn_name)})
"""
    return f"{head}\n\n{code}\n{tail}"


def request_body(code: str, stdin: str | None, s: SandboxSettings) -> dict[str, Any]:
    """The JSON of one ``/run_code`` request (SandboxFusion's RunCodeRequest)."""
    return {
        "compile_timeout": s.compile_timeout_s,
        "run_timeout": s.run_timeout_s,
        "code": code,
        "stdin": stdin,
        "memory_limit_MB": s.memory_limit_mb,
        "language": s.language,
        "files": {},
        "fetch_files": [],
    }


def post_run_code(body: dict[str, Any], s: SandboxSettings, deadline: float | None
                  ) -> tuple[dict[str, Any] | None, str | None]:
    """(response JSON, None) or (None, error). Retries on HTTP 504 only; every wait and request
    ends by ``deadline`` (a time.monotonic() value)."""
    data = json.dumps(body).encode()
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    error = "no attempt made"
    for attempt in range(MAX_ATTEMPTS):
        timeout = s.request_timeout_s
        if deadline is not None:
            timeout = min(timeout, deadline - time.monotonic())
            if timeout <= 0:
                return None, f"deadline reached after {attempt} attempt(s) ({error})"
        req = urllib.request.Request(s.url, data=data, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - http(s) only
                raw = resp.read(MAX_RESPONSE_BYTES + 1)
            if len(raw) > MAX_RESPONSE_BYTES:
                return None, f"response larger than {MAX_RESPONSE_BYTES} bytes"
            out = json.loads(raw)
            if not isinstance(out, dict):
                return None, f"response is JSON {type(out).__name__}, not an object"
            return out, None
        except urllib.error.HTTPError as e:
            if e.code != 504:
                return None, f"HTTP {e.code} {e.reason}"
            error = f"HTTP 504 Gateway Timeout on attempt {attempt + 1}/{MAX_ATTEMPTS}"
            if attempt + 1 < MAX_ATTEMPTS:
                delay = RETRY_DELAY_S * (attempt + 1)
                if deadline is not None and time.monotonic() + delay >= deadline:
                    return None, f"deadline reached ({error})"
                time.sleep(delay)
        except (urllib.error.URLError, TimeoutError, OSError) as e:
            reason = getattr(e, "reason", e)
            said = f"{type(reason).__name__}: {reason}"
            if deadline is not None and time.monotonic() >= deadline - 0.05:
                return None, f"deadline reached during attempt {attempt + 1} ({said})"
            return None, f"request failed: {said}"
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return None, f"response is not JSON: {e}"
    return None, error


def _cut(text: Any) -> Any:
    return text[:KEPT_CHARS] if isinstance(text, str) else text


def judge_case(resp: dict[str, Any], expected: Any) -> tuple[bool | int, dict[str, Any]]:
    """verl's reading of one RunCodeResponse: (result code, details)."""
    comp, run = resp.get("compile_result"), resp.get("run_result")
    comp = comp if isinstance(comp, dict) else None
    run = run if isinstance(run, dict) else None
    info: dict[str, Any] = {"api_status": resp.get("status")}
    if comp:
        info.update(compile_status=comp.get("status"), compile_stderr=_cut(comp.get("stderr")))
    if run:
        info.update(run_status=run.get("status"), stdout=_cut(run.get("stdout")),
                    stderr=_cut(run.get("stderr")), exit_code=run.get("return_code"),
                    duration=run.get("execution_time"))
    api = resp.get("status")
    if api == "SandboxError":
        return API_ERROR, {**info, "status": "sandbox_error", "message": _cut(resp.get("message"))}
    if api == "Failed":
        c_status = comp.get("status") if comp else None
        if comp and (c_status in ("Error", "TimeLimitExceeded")
                     or (c_status == "Finished" and comp.get("return_code") != 0)):
            kind = "compile_timeout" if c_status == "TimeLimitExceeded" else "compile_error"
            return COMPILE_ERROR, {**info, "status": kind}
        if run:
            r_status = run.get("status")
            if r_status == "TimeLimitExceeded":
                return RUN_TIMEOUT, {**info, "status": "timeout"}
            if r_status == "Error" or (r_status == "Finished" and run.get("return_code") != 0):
                return RUNTIME_ERROR, {**info, "status": "runtime_error"}
            return API_ERROR, {**info, "status": "unknown_failure"}
        return API_ERROR, {**info, "status": "unknown_failure_state"}
    if api == "Success":
        if not (run and run.get("status") == "Finished"):
            return API_ERROR, {**info, "status": "unexpected_success_state"}
        stdout = run.get("stdout")
        actual = "" if stdout is None else str(stdout)
        if expected is None or actual.rstrip("\n") == str(expected).rstrip("\n"):
            return PASSED, {**info, "status": "success"}
        return WRONG, {**info, "status": "wrong_answer"}
    return API_ERROR, {**info, "status": f"unknown_api_status_{api}"}


def _run_case(program: str, stdin: Any, expected: Any, s: SandboxSettings,
              deadline: float | None) -> tuple[bool | int, dict[str, Any]]:
    stdin_text = None if stdin is None else str(stdin)
    slots = process_slots(s.max_concurrent)
    wait = None if deadline is None else max(0.0, deadline - time.monotonic())
    if not slots.acquire(timeout=wait):
        return API_ERROR, {"status": "deadline", "error": "deadline reached waiting for a slot"}
    try:
        resp, error = post_run_code(request_body(program, stdin_text, s), s, deadline)
    finally:
        slots.release()
    if error is not None:
        status = "deadline" if error.startswith("deadline") else "api_error"
        return API_ERROR, {"status": status, "error": error}
    return judge_case(resp, expected)


def _read_cases(ground_truth: Any) -> tuple[dict[str, Any] | None, str | None]:
    cases = ground_truth
    if not isinstance(cases, dict):
        try:
            cases = json.loads(cases)
        except (TypeError, json.JSONDecodeError) as e:
            return None, f"test cases are not JSON: {e}"
    if not isinstance(cases, dict):
        return None, f"test cases are a {type(cases).__name__}, not a JSON object"
    cases = dict(cases)
    asserts = cases.get("assert_case")
    if isinstance(asserts, list):
        cases.setdefault("inputs", ["" for _ in asserts])
        cases.setdefault("outputs", [None for _ in asserts])
    elif not cases or "inputs" not in cases or "outputs" not in cases:
        return None, "test cases have no inputs/outputs"
    return cases, None


def sandbox_score(response: str, ground_truth: Any, s: SandboxSettings,
                  continuous: bool = False) -> CodeScore:
    """Run the response's program on the test cases of ``ground_truth`` through the server
    (all of them; the first 10 when ``continuous``)."""
    code = extract_code(response)
    if code is None:
        return CodeScore(0.0, error="no code block in the response")
    cases, error = _read_cases(ground_truth)
    if cases is None:
        return CodeScore(0.0, error=error)
    inputs, outputs = list(cases["inputs"]), list(cases["outputs"])
    n = len(inputs)
    if n == 0:
        return CodeScore(0.0, error="no test cases")
    asserts = cases["assert_case"] if cases.get("assert_case") is not None else [""] * n
    if len(outputs) != n or len(asserts) != n:
        return CodeScore(0.0, [API_ERROR] * n, [{"status": "count_mismatch"}] * n,
                         error=f"{n} inputs, {len(outputs)} outputs, {len(asserts)} assert cases")
    if continuous:
        n = min(n, CONTINUOUS_CASES)
    fn_name = cases.get("fn_name")
    deadline = None if s.deadline_s is None else time.monotonic() + s.deadline_s

    def one(i: int) -> tuple[bool | int, dict[str, Any]]:
        program = code + "\n\n" + str(asserts[i])
        if fn_name and s.language == "python":
            program = call_program(program, str(fn_name))
        return _run_case(program, inputs[i], outputs[i], s, deadline)

    with ThreadPoolExecutor(max_workers=min(n, MAX_THREADS, s.max_concurrent)) as ex:
        done = list(ex.map(one, range(n)))
    results = [r for r, _ in done]
    details = [{"case_index": i, **d} for i, (_, d) in enumerate(done)]
    first_compile = next((i for i, r in enumerate(results) if r == COMPILE_ERROR), None)
    if first_compile is not None:
        for i in range(first_compile + 1, n):
            if results[i] != COMPILE_ERROR:
                results[i] = COMPILE_ERROR
                details[i]["status"] = "compile_error_skipped"
    score = sum(1 for r in results if r is True) / n
    timed_out = any(d.get("status") == "deadline" for d in details)
    return CodeScore(float(score), results, details, timed_out=timed_out)


def fn_kwargs(url: str | None, max_concurrent: int, memory_limit_mb: int,
              timeout_s: float) -> dict[str, Any]:
    """The kwargs the built-in score functions take for code sources
    (``megarl.rewards.scoring.compute_score``), from ``reward_model.sandbox_fusion.*`` and the
    pool's per-response ``reward_model.timeout_s`` (the call's deadline ends 0.5 s before it);
    {} when url is None."""
    if url is None:
        return {}
    return {"sandbox_fusion": {"url": url, "max_concurrent": max_concurrent,
                               "memory_limit_mb": memory_limit_mb,
                               "deadline_s": max(0.5, float(timeout_s) - 0.5)}}


def builtin_fn_spec(rm: Any, manager: str) -> RewardFnSpec | None:
    """The built-in score function of reward manager ``manager`` ("prime": PURE's, else the
    data-source dispatch) with ``rm.sandbox_fusion``'s settings bound (``rm``: the
    ``reward_model`` config section); None when ``rm.sandbox_fusion.url`` is unset (the
    manager's own default then). verl hands the sandbox to its built-in functions only, never
    to a custom reward function."""
    sbx = rm.sandbox_fusion
    kwargs = fn_kwargs(sbx.url, sbx.max_concurrent, sbx.memory_limit_mb, rm.timeout_s)
    if not kwargs:
        return None
    return RewardFnSpec(kind="prime" if manager == "prime" else "default", kwargs=kwargs)
