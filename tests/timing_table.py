"""A pytest plugin: where the suite's time goes, printed after the summary.

Every test report carries the seconds of its phase (set-up, call, tear-down); under xdist the
controller receives them all. At the end this prints, per test folder and for the slowest
files, the test-seconds spent (the sum over tests, not wall time: with ``-n 2`` two tests run
at once) and the set-up share (fixtures: a module-scoped engine or model is charged to the
first test that uses it) and the CPU-seconds spent (the test process's and its reaped
children's user + system time: a 2-rank world can spend 2 per test-second, a test that waits
on a timeout or a server spends less than 1). ``MEGARL_TIMINGS=path.json`` also writes the
per-file numbers and each test's seconds there, the source of the tables in docs/testing.md.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from collections import defaultdict

import pytest

FILES_SHOWN = 15
CPU_KEY = "cpu_s"


def _cpu_seconds() -> float:
    """User + system seconds of this process, of its children reaped so far and of the runs
    forked for it by the warm server (tests/warm_runs.py, which reaps those)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    warm = sys.modules.get("warm_runs")
    return (own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime
            + (warm.CHILD_CPU_S if warm is not None else 0.0))


class CpuClock:
    """On each process that runs tests (an xdist worker, or the only one): the CPU-seconds of
    each phase, put in its report's ``user_properties``, which xdist carries to the controller."""

    def __init__(self) -> None:
        self.phase_cpu: dict[tuple[str, str], float] = {}

    def _timed(self, item: pytest.Item, when: str):
        start = _cpu_seconds()
        yield
        self.phase_cpu[(item.nodeid, when)] = _cpu_seconds() - start

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(self, item):
        yield from self._timed(item, "setup")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        yield from self._timed(item, "call")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(self, item):
        yield from self._timed(item, "teardown")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        cpu = self.phase_cpu.pop((item.nodeid, call.when), None)
        if cpu is not None:
            outcome.get_result().user_properties.append((CPU_KEY, cpu))


def _folder(path: str) -> str:
    parts = path.split("/")
    return "/".join(parts[:2]) if len(parts) > 2 else parts[0]


class TimingTable:
    def __init__(self) -> None:
        # file -> [setup s, call s, teardown s, tests, cpu s]
        self.files: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0, 0.0])
        self.tests: dict[str, float] = defaultdict(float)  # test id -> seconds, all phases

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        row = self.files[report.nodeid.split("::")[0]]
        row[("setup", "call", "teardown").index(report.when)] += report.duration
        self.tests[report.nodeid] += report.duration
        if report.when == "call" or (report.when == "setup" and not report.passed):
            row[3] += 1
        row[4] += sum(v for k, v in report.user_properties if k == CPU_KEY)

    def _rows(self, key) -> list[tuple[str, float, float, int, float]]:
        groups: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0, 0.0])
        for path, (setup, call, teardown, tests, cpu) in self.files.items():
            g = groups[key(path)]
            g[0] += setup + call + teardown
            g[1] += setup
            g[2] += tests
            g[3] += cpu
        return sorted(((k, t, s, int(n), c) for k, (t, s, n, c) in groups.items()),
                      key=lambda r: -r[1])

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.files:
            return
        write = terminalreporter.write_line
        total = sum(sum(r[:3]) for r in self.files.values())
        cpu_total = sum(r[4] for r in self.files.values())
        terminalreporter.section("test-seconds per folder (sum over tests; set-up = fixtures; "
                                 "cpu/s = CPU-seconds per test-second)")
        write(f"{'folder':<34} {'tests':>6} {'test-s':>8} {'share':>6} {'set-up':>7} {'cpu/s':>6}")
        for name, secs, setup, n, cpu in self._rows(_folder):
            write(f"{name:<34} {n:>6} {secs:>8.1f} {secs / total:>6.1%} "
                  f"{setup / max(secs, 1e-9):>7.1%} {cpu / max(secs, 1e-9):>6.2f}")
        write(f"{'all':<34} {sum(r[3] for r in self.files.values()):>6.0f} {total:>8.1f} "
              f"{'':>6} {'':>7} {cpu_total / max(total, 1e-9):>6.2f}")
        terminalreporter.section(f"the {FILES_SHOWN} slowest files (test-seconds)")
        for name, secs, setup, n, cpu in self._rows(lambda p: p)[:FILES_SHOWN]:
            write(f"{name:<58} {n:>4} {secs:>8.1f} set-up {setup / max(secs, 1e-9):>6.1%} "
                  f"cpu/s {cpu / max(secs, 1e-9):.2f}")
        out = os.environ.get("MEGARL_TIMINGS")
        if out:
            with open(out, "w") as f:
                json.dump({"files": {p: dict(zip(("setup", "call", "teardown", "tests", "cpu"), r))
                                     for p, r in sorted(self.files.items())},
                           "tests": dict(sorted(self.tests.items(), key=lambda kv: -kv[1]))},
                          f, indent=1)


def pytest_configure(config: pytest.Config) -> None:
    # The clock where tests run: each xdist worker, or the only process.
    if hasattr(config, "workerinput") or not config.getoption("numprocesses", None):
        config.pluginmanager.register(CpuClock(), "megarl-cpu-clock")
    # The table where reports end up: the xdist controller, or a run without xdist.
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(TimingTable(), "megarl-timing-table")
