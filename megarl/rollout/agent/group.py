"""The agent loop on a tensor-parallel engine: one engine spread over a group of ranks.

Every rank of an engine group must submit the same prompts to each generation. The group's
first rank runs the agent loop (and so the tools and interactions: once per trajectory) against
a `GroupLeader`, which broadcasts each turn's request (prompts, sampling, keys) to the group
before generating; the other ranks `follow_group`: they generate each broadcast request with
the group and drop the outputs, until the leader says the loop has ended.

    group, leader = engine_group(tp_size)       # every rank, the same calls
    on the leader:   engine = GroupLeader(engine, group, leader); ...run_agent_loop(engine)...;
                     engine.end(ok)
    on the others:   follow_group(engine, group, leader)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from megarl.rollout.protocol import Completion, RolloutEngine, SamplingParams
from megarl.utils import dist as mdist

_GROUPS: dict[tuple[int, int, int], Any] = {}


def engine_group(tp_size: int) -> tuple[Any, int]:
    """(the process group of this rank's engine, the global rank of its first rank): groups
    of ``tp_size`` consecutive ranks. Collective on first use (every rank creates every
    group, in the same order); None as the group in a world without process groups."""
    rank, world = mdist.rank(), mdist.world_size()
    leader = rank - rank % tp_size
    if not dist.is_initialized() or tp_size == 1:
        return None, leader
    key = (id(dist.group.WORLD), world, tp_size)
    if key not in _GROUPS:
        mine = None
        for first in range(0, world, tp_size):
            ranks = list(range(first, first + tp_size))
            group = dist.new_group(ranks)
            if rank in ranks:
                mine = group
        _GROUPS[key] = mine
    return _GROUPS[key], leader


class GroupLeader:
    """The group's first rank's engine: each generation is first broadcast to the group."""

    def __init__(self, engine: RolloutEngine, group: Any, leader: int):
        self.engine, self.group, self.leader = engine, group, leader

    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 prompt_keys: Sequence[int] | None = None) -> list[Completion]:
        keys = None if prompt_keys is None else [int(k) for k in prompt_keys]
        mdist.broadcast_object(("turn", prompts, sampling, keys), src=self.leader,
                               group=self.group)
        return self.engine.generate(prompts, sampling, prompt_keys=keys)

    def end(self, ok: bool) -> None:
        """Tell the group the loop has ended (``ok``: without an error)."""
        mdist.broadcast_object(("end", ok), src=self.leader, group=self.group)


def follow_group(engine: RolloutEngine, group: Any, leader: int) -> int:
    """Generate every request the group's first rank broadcasts, until it ends the loop;
    returns the number of generations. RuntimeError when the first rank's loop failed."""
    count = 0
    while True:
        msg = mdist.broadcast_object(None, src=leader, group=group)
        if msg[0] == "end":
            if not msg[1]:
                raise RuntimeError(f"rank {leader}, the first rank of this rank's rollout engine "
                                   "group, failed in the multi-turn agent loop (its error is in "
                                   "its own log)")
            return count
        _, prompts, sampling, keys = msg
        engine.generate(prompts, sampling, prompt_keys=keys)
        count += 1
