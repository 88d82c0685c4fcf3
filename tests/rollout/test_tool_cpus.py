"""Where the python tool's programs run, and how many at once (issue: an asynchronous engine
process pinned to one core ran every sandbox it started on that core, up to 64 at once, and
their wall clocks ran out while they waited for it).

- a program runs on `place_programs`' CPUs, not on the one core its (pinned) parent has;
- at most ``max_running`` programs run at once, and a program's wall clock starts when it
  starts, so programs that wait for their turn do not time out;
- the asynchronous trainer's engine spec places the programs on the node's cores apart from
  the engines' (`cores_apart`), and the engine process's agent worker applies it.
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

import megarl.rollout.process as process_module
from megarl.errors import UserInputError
from megarl.rollout.agent import PythonTool
from megarl.rollout.agent.tools import place_programs, program_cpus
from megarl.rollout.engine_process import cores_apart

AFFINITY = "import os\nprint(sorted(os.sched_getaffinity(0)))"


@pytest.fixture
def restored_affinity():
    before = os.sched_getaffinity(0)
    yield sorted(before)
    place_programs([])
    os.sched_setaffinity(0, before)


def test_programs_run_on_the_tool_cpus_not_on_the_pinned_parent_core(restored_affinity):
    cpus = restored_affinity
    if len(cpus) < 2:
        pytest.skip("needs two CPUs: one for the pinned parent, one for the programs")
    os.sched_setaffinity(0, {cpus[0]})  # the engine process's one core
    tool = PythonTool({"timeout_s": 20})
    out, _, _ = asyncio.run(tool.execute("inherited", {"code": AFFINITY}))
    assert out.text == f"{[cpus[0]]}\n"  # without a placement: the parent's core
    place_programs(cpus[1:])
    assert program_cpus() == cpus[1:]
    out, _, _ = asyncio.run(tool.execute("placed", {"code": AFFINITY}))
    assert out.text == f"{cpus[1:]}\n"


BUSY = ("import time\nt0 = time.monotonic()\nwhile time.monotonic() - t0 < 0.7:\n    pass\n"
        "print(t0, time.monotonic())")


def test_programs_take_turns_and_their_clock_starts_with_their_turn():
    """Seven programs of 0.7 s each with one turn: they run one after another (no two overlap)
    and none times out, though together they take longer than the 4 s timeout (each has its
    4 s from its own start: room for a slow start on a loaded machine)."""
    tool = PythonTool({"timeout_s": 4, "max_running": 1})

    async def seven():
        return await asyncio.gather(*(tool.execute(str(i), {"code": BUSY}) for i in range(7)))

    results = asyncio.run(seven())
    assert all(m["exit_code"] == 0 and not m["timed_out"] for _, _, m in results), results
    spans = sorted(tuple(map(float, out.text.split())) for out, _, _ in results)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans
    assert spans[-1][1] - spans[0][0] > 4.0
    # the same tool in a second event loop (each asyncio.run is one) takes turns there too
    again = asyncio.run(tool.execute("again", {"code": "print(1)"}))
    assert again[0].text == "1\n"


SHORT = BUSY.replace("< 0.7", "< 0.3")


def _spans(tool: PythonTool, n: int, code: str = SHORT) -> list[tuple[float, float]]:
    async def run():
        return await asyncio.gather(*(tool.execute(str(i), {"code": code}) for i in range(n)))

    return sorted(tuple(map(float, out.text.split())) for out, _, _ in asyncio.run(run()))


def test_the_default_is_one_turn_per_program_cpu(restored_affinity):
    """Without max_running, programs placed on one CPU run one at a time, and on two CPUs
    two run at once (their 1.5 s spans overlap: both start together, give or take a start-up)."""
    place_programs(restored_affinity[:1])
    spans = _spans(PythonTool({"timeout_s": 20}), 3)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans
    if len(restored_affinity) >= 2:
        place_programs(restored_affinity[:2])
        spans = _spans(PythonTool({"timeout_s": 20}), 2, BUSY.replace("< 0.7", "< 1.5"))
        assert spans[0][1] > spans[1][0], spans  # the second started before the first ended


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "4"])
def test_max_running_must_be_a_positive_int(value):
    with pytest.raises(UserInputError, match="max_running"):
        PythonTool({"max_running": value})


def test_cores_apart_leaves_the_engine_cores_to_the_engines(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert cores_apart([0, 1]) == [2, 3]
    assert cores_apart([]) == []  # no engine pinned: programs inherit
    assert cores_apart([0, 1, 2, 3]) == [0, 1, 2, 3]  # nothing left: shared (and a warning)


def test_the_async_engine_spec_places_tool_programs_apart(monkeypatch, tiny_folder):
    """`run_engine` with engine_cpus [0, 1] on a 4-CPU trainer: rank 0's engine is pinned to
    CPU 0 and its tool programs go to CPUs 2 and 3. Before: no placement (the programs ran on
    the engine's core)."""
    from megarl.config.loader import resolve_config
    from megarl.trainer.parts import run_engine

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setenv("LOCAL_RANK", "0")
    specs = []
    monkeypatch.setattr(process_module, "ProcessRolloutEngine",
                        lambda spec, **kw: specs.append(spec))
    cfg = resolve_config("grpo", ["async_training.staleness_threshold=1",
                                  "async_training.engine_cpus=[0,1]"]).config
    run_engine(cfg, str(tiny_folder("qwen2")), torch.device("cpu"))
    assert specs[0].cpus == [0] and specs[0].tool_cpus == [2, 3]


def test_the_engine_process_agent_worker_places_its_programs(restored_affinity):
    from megarl.rollout.agent.loop import AgentLoopSettings
    from megarl.rollout.agent.remote import AgentSetup, AgentWorker

    AgentWorker(AgentSetup(AgentLoopSettings(), tokenizer=None, tools={}), program_cpus=[0])
    assert program_cpus() == [0]
    AgentWorker(AgentSetup(AgentLoopSettings(), tokenizer=None, tools={}))
    assert program_cpus() == restored_affinity
