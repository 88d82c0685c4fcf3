"""How `megarl.rollout.agent.loop.run_agent_loop` puts turns to the engine: turn by turn (one
``generate`` per turn over every live trajectory) or continuously (each trajectory's turns as
requests of one engine session). Both hand each finished turn to the loop's ``advance``, which
appends it, runs its tool calls and says which trajectories go on; ``trajs`` are the loop's
`Trajectory` objects (their ids so far: ``prompt_ids``, ``response_ids``; ``turns``)."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from megarl.rollout.protocol import Completion, RolloutEngine, SamplingParams


def turn_seed(seed: int | None, turn: int) -> int | None:
    """A seed per turn (a turn's noise must not repeat the previous turn's positions)."""
    if seed is None or turn == 0:
        return seed
    return zlib.crc32(repr((seed, "agent_turn", turn)).encode()) & 0x7FFFFFFF


def turn_by_turn(engine: RolloutEngine, trajs: list[Any], keys: list[int],
                 sampling: SamplingParams, budget: int,
                 advance: Callable[[list[tuple[int, Completion]]], list[int]]) -> None:
    """One ``engine.generate`` per turn over every live trajectory (engines without a
    session): the slowest trajectory of a turn holds the others' next turns."""
    live = list(range(len(trajs)))
    turn = 0
    while live:
        left = {j: budget - len(trajs[j].response_ids) for j in live}
        sp = replace(sampling, n=1, max_new_tokens=max(left.values()),
                     seed=turn_seed(sampling.seed, turn))
        completions = engine.generate(
            [trajs[j].prompt_ids + trajs[j].response_ids for j in live], sp,
            prompt_keys=[keys[j] for j in live])
        if len(completions) != len(live):
            raise RuntimeError(f"the engine returned {len(completions)} completions for "
                               f"{len(live)} prompts")
        live = advance([(live[c.prompt_index], c) for c in completions])
        turn += 1


def continuously(engine: Any, trajs: list[Any], keys: list[int],
                 sampling: SamplingParams, budget: int,
                 advance: Callable[[list[tuple[int, Completion]]], list[int]]) -> None:
    """Every trajectory's turns as requests of one engine session (`open_session`): a turn
    finished at a decode step has its tool calls run, and its next turn joins the running
    batch before the next step, while the other trajectories go on decoding. Each turn draws
    the noise the turn-by-turn loop gives it (the trajectory's key, the seed of its turn), and
    the schedule depends only on when turns finish, so a run repeats bit for bit."""
    seed = sampling.seed
    if seed is None:  # one draw for the whole loop, as generate draws one per call
        seed = int(torch.randint(0, 2**62, (1,)).item())
    longest = max(len(t.prompt_ids) for t in trajs) + budget
    limit = getattr(engine, "max_model_len", None)
    session = engine.open_session(replace(sampling, n=1),
                                  max_len=longest if limit is None else min(longest, limit))
    owner: dict[int, int] = {}  # request id -> trajectory

    def submit(j: int) -> None:
        t = trajs[j]
        rid = session.submit(t.prompt_ids + t.response_ids, prompt_key=keys[j],
                             seed=turn_seed(seed, t.turns),
                             max_new_tokens=budget - len(t.response_ids))
        owner[rid] = j

    for j in range(len(trajs)):
        submit(j)
    while session.busy:
        done = session.step()
        if done:
            for j in advance([(owner.pop(c.prompt_index), c) for c in done]):
                submit(j)
