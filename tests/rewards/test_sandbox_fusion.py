"""The SandboxFusion code reward (`megarl.rewards.sandbox_fusion`), up to the HTTP boundary.

SandboxFusion itself (a service in a Docker image) does not run here. A loopback HTTP server
(127.0.0.1, ephemeral port, in a thread) answers ``/run_code`` in SandboxFusion's response shape
and records every request. The shapes checked are SandboxFusion's own, read from
bytedance/SandboxFusion ``sandbox/server/sandbox_api.py`` (RunCodeRequest, RunStatus,
RunCodeResponse) and ``sandbox/runners/types.py`` (CommandRunStatus, CommandRunResult); the
scoring rules are verl's ``verl/utils/reward_score/sandbox_fusion/{__init__,utils}.py``, restated
in each test as the expected value.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megarl.config.loader import resolve_config
from megarl.rewards import RewardFnSpec, RewardRequest, make_reward_manager, make_reward_pool
from megarl.rewards import sandbox_fusion as sf
from megarl.rewards.scoring import code_score, compute_score, has_builtin_rule, prime_compute_score

# RunCodeRequest's fields (sandbox/server/sandbox_api.py)
RUN_CODE_REQUEST_FIELDS = {"compile_timeout", "run_timeout", "memory_limit_MB", "code", "stdin",
                           "language", "files", "fetch_files"}


def finished(stdout: str = "", return_code: int = 0, status: str = "Finished") -> dict:
    """A CommandRunResult (sandbox/runners/types.py)."""
    return {"status": status, "execution_time": 0.01, "return_code": return_code,
            "stdout": stdout, "stderr": ""}


def response(status: str, run: dict | None = None, compile_: dict | None = None) -> dict:
    """A RunCodeResponse (sandbox/server/sandbox_api.py)."""
    return {"status": status, "message": "", "compile_result": compile_, "run_result": run,
            "executor_pod_name": None, "files": {}}


def doubler(body: dict) -> tuple[int, dict]:
    """A server that 'runs' a program printing twice its integer stdin: stdout by a table, not
    by running anything."""
    return 200, response("Success", finished(f"{2 * int(body['stdin'])}\n"))


class FakeSandbox:
    """A loopback /run_code server; `behave(body) -> (http status, JSON reply)`; counts the
    requests in flight (`peak`)."""

    def __init__(self, behave: Callable[[dict], tuple[int, dict | bytes]], hold_s: float = 0.0):
        self.behave, self.hold_s = behave, hold_s
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        self.in_flight = self.peak = 0
        self.release = threading.Event()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    fake.requests.append({"path": self.path, "body": body,
                                          "content_type": self.headers["Content-Type"]})
                    fake.in_flight += 1
                    fake.peak = max(fake.peak, fake.in_flight)
                try:
                    if fake.hold_s:
                        fake.release.wait(fake.hold_s)
                    code, reply = fake.behave(body)
                finally:
                    with fake.lock:
                        fake.in_flight -= 1
                data = reply if isinstance(reply, bytes) else json.dumps(reply).encode()
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:
                    pass  # the client gave up (its deadline)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/run_code"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def serve():
    servers: list[FakeSandbox] = []

    def start(behave=doubler, hold_s: float = 0.0) -> FakeSandbox:
        servers.append(FakeSandbox(behave, hold_s))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


CODE = "n = int(input())\nprint(2 * n)\n"
ANSWER = f"Here:\n```python\n{CODE}```\n"


def cases(inputs, outputs, **more) -> str:
    return json.dumps({"inputs": inputs, "outputs": outputs, **more})


def test_request_is_sandboxfusions_run_code_request(serve):
    srv = serve()
    s = sf.SandboxSettings(url=srv.url, memory_limit_mb=512)
    r = sf.sandbox_score(ANSWER, cases(["3\n"], ["6\n"]), s)
    assert r.score == 1.0 and r.results == [True]
    [req] = srv.requests
    assert req["path"] == "/run_code" and req["content_type"] == "application/json"
    assert set(req["body"]) == RUN_CODE_REQUEST_FIELDS
    assert req["body"] == {"compile_timeout": 10.0, "run_timeout": 10.0, "memory_limit_MB": 512,
                           "code": "\n" + CODE + "\n\n", "stdin": "3\n", "language": "python",
                           "files": {}, "fetch_files": []}
    assert s.request_timeout_s == 30.0  # compile + run + verl's 10 s API margin


def test_code_extraction_as_verl():
    assert sf.extract_code("a\n```python\nx=1\n```\nb\n```python\ny=2\n```") == "\ny=2\n"
    assert sf.extract_code("```cpp\nint main(){}\n```") == "int main(){}\n"  # language line
    assert sf.extract_code("```\nprint(1)\n```") == "\nprint(1)\n"  # no language line
    assert sf.extract_code("```x = 1; y = 2```") == "x = 1; y = 2"
    assert sf.extract_code("print(1)") is None


def test_no_code_block_scores_zero_without_a_request(serve):
    srv = serve()
    r = sf.sandbox_score("print(1)", cases(["1"], ["2"]), sf.SandboxSettings(url=srv.url))
    assert (r.score, r.error, srv.requests) == (0.0, "no code block in the response", [])


def test_stdout_comparison_strips_trailing_newlines_only(serve):
    # verl: str(stdout).rstrip("\n") == str(expected).rstrip("\n"); expected None = any success
    outs = {"1": "2", "2": "4\n\n", "3": "6 ", "4": None, "5": "11"}
    srv = serve(doubler)
    r = sf.sandbox_score(ANSWER, cases(list(outs), list(outs.values())),
                         sf.SandboxSettings(url=srv.url))
    assert r.results == [True, True, False, True, False]
    assert [d["status"] for d in r.details] == ["success", "success", "wrong_answer", "success",
                                                "wrong_answer"]
    assert r.score == pytest.approx(3 / 5)
    assert sorted(req["body"]["stdin"] for req in srv.requests) == ["1", "2", "3", "4", "5"]


def test_failure_kinds_and_compile_error_propagation(serve):
    replies = {
        "0": response("Success", finished("0\n")),
        "1": response("Failed", finished("", return_code=1)),  # runtime error
        "2": response("Failed", finished("", return_code=None, status="TimeLimitExceeded")),
        "3": response("SandboxError", finished("", status="Error")),
        "4": response("Failed", None, finished("", return_code=1)),  # compile error
        "5": response("Success", finished("10\n")),  # after a compile error: counted as one
    }
    srv = serve(lambda body: (200, replies[body["stdin"]]))
    r = sf.sandbox_score(ANSWER, cases(list(replies), ["0", "2", "4", "6", "8", "10"]),
                         sf.SandboxSettings(url=srv.url))
    assert r.results == [True, -2, -3, -1, -4, -4]
    assert [d["status"] for d in r.details] == ["success", "runtime_error", "timeout",
                                                "sandbox_error", "compile_error",
                                                "compile_error_skipped"]
    assert r.score == pytest.approx(1 / 6)


def test_continuous_counts_the_first_ten_cases(serve):
    srv = serve(doubler)
    n = 14
    outputs = [str(2 * i) if i < 6 else "wrong" for i in range(10)] + [str(2 * i) for i in range(10, n)]
    gt = cases([str(i) for i in range(n)], outputs)
    s = sf.SandboxSettings(url=srv.url)
    assert sf.sandbox_score(ANSWER, gt, s, continuous=True).score == pytest.approx(6 / 10)
    assert len(srv.requests) == 10  # the score depends on no later case: none is sent
    assert sf.sandbox_score(ANSWER, gt, s, continuous=False).score == pytest.approx(10 / 14)
    assert len(srv.requests) == 10 + 14
    # verl's default_compute_score: code sources always continuous
    kw = sf.fn_kwargs(srv.url, 64, 1024, timeout_s=10.0)
    assert compute_score("taco", ANSWER, gt, None, **kw) == pytest.approx(0.6)
    assert prime_compute_score("codeforces", ANSWER, gt, None, **kw) == pytest.approx(0.6)


def test_bad_test_cases_score_zero(serve):
    srv = serve()
    s = sf.SandboxSettings(url=srv.url)
    assert sf.sandbox_score(ANSWER, "not json", s).error.startswith("test cases are not JSON")
    assert sf.sandbox_score(ANSWER, {"inputs": ["1"]}, s).error == "test cases have no inputs/outputs"
    r = sf.sandbox_score(ANSWER, cases(["1", "2"], ["2"]), s)
    assert (r.score, r.results) == (0.0, [-1, -1])
    assert srv.requests == []


def test_assert_cases_are_appended_to_the_program(serve):
    srv = serve(lambda body: (200, response("Success", finished(""))))
    gt = {"assert_case": ["assert f(1) == 2", "assert f(2) == 4"]}
    r = sf.sandbox_score("```python\ndef f(x):\n    return 2 * x\n```", gt,
                         sf.SandboxSettings(url=srv.url))
    assert r.results == [True, True]
    assert sorted(q["body"]["code"] for q in srv.requests) == [
        "\ndef f(x):\n    return 2 * x\n\n\nassert f(1) == 2", "\ndef f(x):\n    return 2 * x\n\n\nassert f(2) == 4"]
    assert {q["body"]["stdin"] for q in srv.requests} == {""}


@pytest.mark.parametrize("solution", [
    "def add_up(a, b):\n    return [a + b, Counter('aab')['a']]\n",  # a global; star-imports given
    "class Solution:\n    def add_up(self, a, b):\n        return [a + b, 2]\n",  # a method
])
def test_call_based_program(serve, solution):
    """fn_name cases: the program the server receives calls the function with one JSON argument
    per stdin line and prints JSON. The program here is the test's own (trusted) code, run
    with this interpreter to check what the sandbox would print."""
    srv = serve(lambda body: (200, response("Success", finished("[5, 2]\n"))))
    gt = cases(["2\n3"], [[5, 2]], fn_name="add_up")
    r = sf.sandbox_score(f"```python\n{solution}```", gt, sf.SandboxSettings(url=srv.url))
    assert r.results == [True]  # str([5, 2]) == "[5, 2]", as verl compares
    [req] = srv.requests
    assert req["body"]["stdin"] == "2\n3"
    run = subprocess.run([sys.executable, "-I", "-c", req["body"]["code"]], input="2\n3",
                         capture_output=True, text=True, timeout=30)
    assert (run.returncode, run.stdout) == (0, "[5, 2]\n"), run.stderr


def test_gateway_timeout_is_retried_other_errors_are_not(serve, monkeypatch):
    monkeypatch.setattr(sf, "RETRY_DELAY_S", 0.05)
    seen: list[int] = []

    def flaky(body):
        seen.append(1)
        return (504, {"detail": "gateway"}) if len(seen) < 3 else doubler(body)

    srv = serve(flaky)
    assert sf.sandbox_score(ANSWER, cases(["2"], ["4"]), sf.SandboxSettings(url=srv.url)).score == 1.0
    assert len(srv.requests) == 3

    srv = serve(lambda body: (504, {}))
    t0 = time.monotonic()
    r = sf.sandbox_score(ANSWER, cases(["2"], ["4"]), sf.SandboxSettings(url=srv.url))
    assert len(srv.requests) == sf.MAX_ATTEMPTS == 3
    assert time.monotonic() - t0 >= 0.05 * (1 + 2)  # linear back-off, none after the last
    assert r.details[0]["status"] == "api_error" and "504" in r.details[0]["error"]

    srv = serve(lambda body: (500, {}))
    r = sf.sandbox_score(ANSWER, cases(["2"], ["4"]), sf.SandboxSettings(url=srv.url))
    assert len(srv.requests) == 1 and r.details[0]["error"] == "HTTP 500 Internal Server Error"
    with pytest.raises(RuntimeError, match="judged none of the 1 cases: HTTP 500"):
        code_score(ANSWER, cases(["2"], ["4"]), {"url": srv.url})


def test_unreachable_server_is_an_error_not_a_zero(serve):
    srv = serve()
    url = srv.url
    srv.close()
    with pytest.raises(RuntimeError, match="judged none of the 2 cases: request failed"):
        code_score(ANSWER, cases(["1", "2"], ["2", "4"]), {"url": url})


def test_stalled_server_is_bounded_by_the_deadline(serve):
    srv = serve(doubler, hold_s=30.0)
    s = sf.SandboxSettings(url=srv.url, deadline_s=0.5)
    t0 = time.monotonic()
    r = sf.sandbox_score(ANSWER, cases(["1", "2", "3"], ["2", "4", "6"]), s)
    assert time.monotonic() - t0 < 10.0  # the server holds 30 s: the deadline ended it
    assert r.timed_out and r.score == 0.0 and r.results == [-1, -1, -1]
    with pytest.raises(TimeoutError, match="deadline_s=0.5 reached with none of 1 cases judged"):
        code_score(ANSWER, cases(["1"], ["2"]), {"url": srv.url, "deadline_s": 0.5})


def test_cases_without_a_verdict_count_as_failed_and_are_said(serve):
    """One case stalls past the deadline, one gets a SandboxError: not passed (verl: -1), the
    other two are judged; the result says how many had no verdict."""
    gate = threading.Event()

    def behave(body):
        if body["stdin"] == "3":
            gate.wait(30)
        if body["stdin"] == "4":
            return 200, response("SandboxError", finished("", status="Error"))
        return doubler(body)

    srv = serve(behave)
    t0 = time.monotonic()
    out = code_score(ANSWER, cases(["1", "2", "3", "4"], ["2", "4", "6", "8"]),
                     {"url": srv.url, "deadline_s": 0.6})
    gate.set()
    assert time.monotonic() - t0 < 10.0  # the server holds 30 s: the deadline ended it
    assert out == {"score": 0.5, "sandbox_unjudged": 2.0}
    srv2 = serve(lambda body: (200, response("SandboxError", finished("", status="Error"))))
    with pytest.raises(RuntimeError, match="judged none of the 1 cases: sandbox_error"):
        code_score(ANSWER, cases(["1"], ["2"]), {"url": srv2.url})


def test_oversized_response_is_refused(serve, monkeypatch):
    monkeypatch.setattr(sf, "MAX_RESPONSE_BYTES", 1000)
    srv = serve(lambda body: (200, response("Success", finished("x" * 5000))))
    r = sf.sandbox_score(ANSWER, cases(["1"], [None]), sf.SandboxSettings(url=srv.url))
    assert r.details[0]["error"] == "response larger than 1000 bytes"


def test_kept_output_is_cut(serve):
    srv = serve(lambda body: (200, response("Success", finished("y" * 50_000))))
    r = sf.sandbox_score(ANSWER, cases(["1"], ["y" * 50_000]), sf.SandboxSettings(url=srv.url))
    assert r.results == [True] and len(r.details[0]["stdout"]) == sf.KEPT_CHARS


def test_requests_in_flight_are_bounded_per_process(serve):
    srv = serve(doubler, hold_s=0.15)
    s = sf.SandboxSettings(url=srv.url, max_concurrent=3)
    gt = cases([str(i) for i in range(8)], [str(2 * i) for i in range(8)])
    scores: list[float] = []
    callers = [threading.Thread(target=lambda: scores.append(sf.sandbox_score(ANSWER, gt, s).score))
               for _ in range(3)]
    for t in callers:
        t.start()
    for t in callers:
        t.join(30)
    assert scores == [1.0, 1.0, 1.0] and len(srv.requests) == 24
    assert srv.peak == 3  # three callers x 8 cases, never more than max_concurrent at once


def test_settings_problems_name_the_key():
    assert sf.settings_problems(None, 0, 0) == []
    assert sf.settings_problems("http://h:8080/run_code", 1, 1) == []
    bad = sf.settings_problems("ftp://h/run_code", 0, -1)
    assert [p.split(":", 1)[0] for p in bad] == [
        "reward_model.sandbox_fusion.url", "reward_model.sandbox_fusion.max_concurrent",
        "reward_model.sandbox_fusion.memory_limit_mb"]
    with pytest.raises(ValueError, match="reward_model.sandbox_fusion.url: must be an http"):
        sf.SandboxSettings(url="localhost:8080")


def test_code_sources_without_a_url_name_the_fix():
    assert not has_builtin_rule("taco") and has_builtin_rule("taco", sf.fn_kwargs("http://h/x", 1, 1, 5))
    assert has_builtin_rule("openai/gsm8k")
    with pytest.raises(ValueError, match="set reward_model.sandbox_fusion.url="):
        compute_score("apps", ANSWER, cases(["1"], ["2"]))
    pool = make_reward_pool("local", num_workers=1, timeout_s=5.0, memory_mb=512)
    try:
        manager = make_reward_manager("naive", pool)
        with pytest.raises(ValueError, match="'codecontests' needs a code sandbox.*sandbox_fusion.url"):
            manager([ANSWER], ["codecontests"], [cases(["1"], ["2"])])
    finally:
        pool.close()


def test_reward_workers_reach_the_server(serve):
    """Through the local pool's worker processes: the spec's kwargs reach the built-in score
    functions there; math rows beside code rows keep their verifier. The server holds each
    request 0.2 s so that a call's threads are alive together (10 of them did not start in a
    256 MiB worker)."""
    srv = serve(doubler, hold_s=0.2)
    kw = sf.fn_kwargs(srv.url, max_concurrent=64, memory_limit_mb=256, timeout_s=5.0)
    gt = cases(["1", "2"], ["2", "5"])
    many = cases([str(i) for i in range(20)], [str(2 * i) for i in range(20)])
    with make_reward_pool("local", num_workers=2, timeout_s=5.0, memory_mb=256) as pool:
        out = pool.score([
            RewardRequest("taco", ANSWER, gt, None, RewardFnSpec(kind="default", kwargs=kw)),
            RewardRequest("apps", ANSWER, gt, None, RewardFnSpec(kind="prime", kwargs=kw)),
            RewardRequest("openai/gsm8k", "#### 4", "4", None, RewardFnSpec(kind="default", kwargs=kw)),
            RewardRequest("taco", "no code", gt, None, RewardFnSpec(kind="default", kwargs=kw)),
            # several threads per call must start under the worker's RLIMIT_AS
            RewardRequest("taco", ANSWER, many, None, RewardFnSpec(kind="default", kwargs=kw)),
        ])
    assert [(r.score, r.status) for r in out] == [(0.5, "ok"), (0.5, "ok"), (1.0, "ok"), (0.0, "ok"),
                                                  (1.0, "ok")]
    # 2 + 2 cases, and the first 10 of 20 (continuous)
    assert {q["body"]["memory_limit_MB"] for q in srv.requests} == {256} and len(srv.requests) == 14


def test_a_stalled_server_inside_the_pool_scores_zero_as_timeout(serve):
    srv = serve(doubler, hold_s=30.0)
    kw = sf.fn_kwargs(srv.url, max_concurrent=4, memory_limit_mb=256, timeout_s=1.5)
    with make_reward_pool("local", num_workers=1, timeout_s=1.5, memory_mb=512) as pool:
        t0 = time.monotonic()
        [r] = pool.score([RewardRequest("taco", ANSWER, cases(["1"], ["2"]), None,
                                        RewardFnSpec(kind="default", kwargs=kw))])
        assert time.monotonic() - t0 < 10.0  # the server holds 30 s
        assert pool.stats["reward/worker_restarts"] == 0  # ended by its deadline, not killed
    assert (r.score, r.status) == (0.0, "timeout") and "deadline_s=1.0" in r.extra["error"]


def test_verl_sandbox_script_line_resolves():
    """verl's examples/ppo_trainer/run_deepseek7b_llm_sandbox_fusion.sh sets these; verl 0.9.1's
    reward.sandbox_fusion.* spelling is read as the same keys."""
    url = "https://xxxxxxxxx.apigateway-cn-beijing.volceapi.com/run_code"
    cfg = resolve_config("ppo", [f"reward_model.sandbox_fusion.url={url}",
                                 "reward_model.sandbox_fusion.max_concurrent=128",
                                 "reward_model.reward_manager=prime"]).config
    sfc = cfg.reward_model.sandbox_fusion
    assert (sfc.url, sfc.max_concurrent, sfc.memory_limit_mb) == (url, 128, 1024)
    cfg = resolve_config("ppo", ["reward.sandbox_fusion.url=http://h:8080/run_code",
                                 "reward.sandbox_fusion.memory_limit_mb=2048"]).config
    sfc = cfg.reward_model.sandbox_fusion
    assert (sfc.url, sfc.max_concurrent, sfc.memory_limit_mb) == ("http://h:8080/run_code", 64, 2048)


def test_builtin_fn_spec_from_the_config():
    url = "http://127.0.0.1:1/run_code"
    rm = resolve_config("ppo", [f"reward_model.sandbox_fusion.url={url}", "reward_model.timeout_s=20",
                                "reward_model.sandbox_fusion.max_concurrent=8"]).config.reward_model
    want = {"sandbox_fusion": {"url": url, "max_concurrent": 8, "memory_limit_mb": 1024,
                               "deadline_s": 19.5}}
    assert sf.builtin_fn_spec(rm, "prime") == RewardFnSpec(kind="prime", kwargs=want)
    assert sf.builtin_fn_spec(rm, "dapo") == RewardFnSpec(kind="default", kwargs=want)
    assert sf.builtin_fn_spec(resolve_config("ppo").config.reward_model, "naive") is None
