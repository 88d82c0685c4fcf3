"""Generation and verifiable scoring of one step's prompts, across ranks.

Each engine generates for its share of the prompts (every engine holds the full model, so the
share is over all engines, not only data-parallel ranks; an engine is one rank, or
``rollout.tensor_model_parallel_size`` ranks for a tensor-parallel vLLM), the samples are
all-gathered so every rank holds the same ordered list, rank 0 scores them through the reward
manager's bounded pool, and the scores and reward metrics (`megarl.metrics.Metric` values, their
reduction over generation rounds declared here) are broadcast.

With ``rollout.multi_turn.enable`` (an `AgentRollout` passed to `generate`) each engine runs the
agent loop (`megarl.rollout.agent.run_agent_loop`) on its share instead of one
``engine.generate`` call (a tensor-parallel engine's first rank runs it and broadcasts each
turn's prompts to the group's other ranks; an engine in a process of its own runs it there): each sample is then a whole trajectory (the model's turns, tool
responses and template glue), with its per-token ``response_mask`` (1 = the model's token),
the engine's logprobs (0 on appended tokens) and what the reward and the metrics read about it
in ``extra_info`` (`trajectory_info`) and ``RolloutSample.multi_turn``.
"""

from __future__ import annotations

import zlib
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from megarl.metrics import Metric, merge, values
from megarl.rollout.protocol import RolloutEngine, SamplingParams
from megarl.trainer.batch import RolloutSample
from megarl.utils import dist as mdist

# Last part of a rollout seed: keeps (step, round, ROLLOUT_STREAM) apart from the mini-batch
# shuffle seeds (step, 3) and (step, 7).
ROLLOUT_STREAM = 0


def sampling_seed(base: int, *parts: int) -> int:
    """A 31-bit seed from the run seed and (step, round, rank, ...): resumes reproduce it."""
    return zlib.crc32(repr((base, *parts)).encode()) & 0x7FFFFFFF


def sampling_params(cfg: Any, eos_id: int, seed: int, *, validation: bool = False,
                    n: int | None = None, greedy: bool = False) -> SamplingParams:
    """The engine's sampling settings for the training rollout (``actor_rollout_ref.rollout``)
    or, with ``validation``, for validation (``rollout.val_kwargs``); ``cfg``: the run's
    `megarl.config.schema.Config`."""
    ro = cfg.actor_rollout_ref.rollout
    src = ro.val_kwargs if validation else ro
    do_sample = getattr(src, "do_sample", True) and not greedy
    return SamplingParams(
        n=n if n is not None else src.n,
        temperature=src.temperature if do_sample else 0.0,
        top_k=src.top_k, top_p=src.top_p, greedy=not do_sample,
        max_new_tokens=cfg.data.max_response_length,
        stop_token_ids=list(ro.stop_token_ids) + [eos_id],
        stop=list(ro.stop), seed=seed)


def local_share(num_items: int, tp_size: int = 1) -> tuple[list[int], int]:
    """(positions of the items this rank's engine generates, this rank's place in its engine
    group): the items are dealt round-robin to the engine groups of ``tp_size`` ranks."""
    rank, world = mdist.rank(), mdist.world_size()
    if world % tp_size:
        raise ValueError(f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp_size} must "
                         f"divide the number of ranks ({world})")
    engine_index, member = divmod(rank, tp_size)
    return list(range(engine_index, num_items, world // tp_size)), member


@dataclass
class AgentRollout:
    """What `generate` needs to run the agent loop: the tools (by name), the loop's settings
    (`AgentLoopSettings`), the tokenizer (the chat template's continuations) and the
    interactions (a simulated user answering turns without a tool call), by name."""

    tools: dict[str, Any]
    settings: Any
    tokenizer: Any
    interactions: dict[str, Any] | None = None  # by name (multi_turn.interaction_config_path)


def generate(
    engine: RolloutEngine,
    items: list[Any],
    sampling: SamplingParams,
    group_offset: int,
    tp_size: int = 1,
    agent: AgentRollout | None = None,
) -> list[RolloutSample]:
    """Generate ``sampling.n`` responses for each item on this rank's share; gather all.

    ``items`` are dataset items (prompt_ids, data_source, ground_truth, extra_info), the same
    list on every rank. Group ids are ``group_offset + position in items``. The engines are
    groups of ``tp_size`` consecutive ranks (one tensor-parallel engine each: its ranks submit
    the same prompts); the items are dealt to the groups round-robin. Each prompt's sampling
    noise is keyed by its group id, so a prompt yields the same tokens whichever engine, rank
    or world size it lands on.
    """
    mine, member = local_share(len(items), tp_size)
    if agent is not None:
        if tp_size == 1:
            local = _agent_share(engine, items, mine, sampling, group_offset, agent)
        else:
            local = _agent_share_in_group(engine, items, mine, sampling, group_offset, agent,
                                          tp_size, member)
        gathered = [x for part in mdist.all_gather_objects(local) for x in part]
        gathered.sort(key=lambda x: (x[0], x[1]))
        return [s for _, _, s in gathered]
    completions = engine.generate([items[k].prompt_ids for k in mine], sampling,
                                  prompt_keys=[group_offset + k for k in mine]) if mine else []
    local: list[tuple[int, int, RolloutSample]] = []
    seen: dict[int, int] = defaultdict(int)
    for c in completions if member == 0 else []:  # one copy per engine group
        k = mine[c.prompt_index]
        item = items[k]
        local.append((k, seen[k], RolloutSample(
            prompt_ids=list(item.prompt_ids),
            response_ids=list(c.token_ids),
            rollout_logprobs=c.logprobs.tolist() if c.logprobs is not None else None,
            finish_reason=c.finish_reason,
            group=group_offset + k,
            data_source=item.data_source,
            ground_truth=item.ground_truth,
            extra_info=dict(item.extra_info or {}),
            policy_version=getattr(c, "policy_version", None),
            routed_experts=getattr(c, "routed_experts", None),
        )))
        seen[k] += 1
    gathered = [x for part in mdist.all_gather_objects(local) for x in part]
    gathered.sort(key=lambda x: (x[0], x[1]))
    return [s for _, _, s in gathered]


def agent_request(items: list[Any], mine: list[int], sampling: SamplingParams,
                  group_offset: int, agent: AgentRollout) -> Any:
    """The `AgentRequest` of this rank's share ``mine`` of ``items`` (what `generate` runs,
    and what asynchronous rollout prefetches)."""
    from megarl.rollout.agent.remote import AgentRequest

    chosen = [items[k] for k in mine]
    raw = [getattr(it, "raw_prompt", None) for it in chosen]
    talks = bool(agent.interactions) or bool(agent.settings.interaction_config_path)
    return AgentRequest(
        prompts=[list(it.prompt_ids) for it in chosen],
        prompt_keys=[group_offset + k for k in mine],
        prompt_messages=raw if all(r is not None for r in raw) else None,
        tools_kwargs=[(it.extra_info or {}).get("tools_kwargs") for it in chosen],
        interaction_kwargs=[(it.extra_info or {}).get("interaction_kwargs") for it in chosen]
        if talks else None,
        max_response_length=sampling.max_new_tokens)


def _agent_share(engine: RolloutEngine, items: list[Any], mine: list[int],
                 sampling: SamplingParams, group_offset: int,
                 agent: AgentRollout) -> list[tuple[int, int, RolloutSample]]:
    """This rank's trajectories (``sampling.n`` per item of ``mine``) as samples, keyed
    (item position, sample index) like `generate`'s. An engine in a process of its own
    (asynchronous rollout) runs the agent loop there (`megarl.rollout.agent.remote`), each
    trajectory on one weight version (its samples carry it)."""
    from megarl.rollout.agent import run_agent_loop
    from megarl.rollout.agent.remote import one_version, trajectory_from_plain

    if not mine:
        return []
    request = agent_request(items, mine, sampling, group_offset, agent)
    if hasattr(engine, "generate_agent"):
        trajs = [trajectory_from_plain(d)
                 for d in engine.generate_agent(agent, request, sampling)]
    else:
        trajs = run_agent_loop(engine, request.prompts, sampling, agent.tokenizer, agent.tools,
                               agent.settings, interactions=agent.interactions or {},
                               **request.loop_kwargs())
    out = []
    for t in trajs:
        k = mine[t.prompt_index]
        item = items[k]
        out.append((k, t.sample_index, RolloutSample(
            prompt_ids=list(item.prompt_ids),
            response_ids=list(t.response_ids),
            rollout_logprobs=[float(x) for x in t.logprobs],
            finish_reason=t.finish_reason,
            group=group_offset + k,
            data_source=item.data_source,
            ground_truth=item.ground_truth,
            extra_info={**dict(item.extra_info or {}), **trajectory_info(t)},
            response_mask=list(t.response_mask),
            multi_turn=trajectory_stats(t),
            policy_version=one_version(t),
        )))
    return out


def _agent_share_in_group(engine: RolloutEngine, items: list[Any], mine: list[int],
                          sampling: SamplingParams, group_offset: int, agent: AgentRollout,
                          tp_size: int, member: int) -> list[tuple[int, int, RolloutSample]]:
    """`_agent_share` on an engine spread over ``tp_size`` ranks: the group's first rank runs
    the agent loop (tools once per trajectory) and broadcasts each turn's request to the
    others, which generate it with the group (`megarl.rollout.agent.group`); only the first
    rank returns samples."""
    from megarl.rollout.agent.group import GroupLeader, engine_group, follow_group

    group, leader = engine_group(tp_size)  # collective the first time: before any return
    if not mine:
        return []
    if member != 0:
        follow_group(engine, group, leader)
        return []
    lead = GroupLeader(engine, group, leader)
    ok = False
    try:
        out = _agent_share(lead, items, mine, sampling, group_offset, agent)
        ok = True
    finally:
        lead.end(ok)
    return out


def trajectory_info(t: Any) -> dict[str, Any]:
    """What the reward function reads about a trajectory in ``extra_info`` (plain values):
    ``turns`` (assistant turns), ``tool_calls`` (each: turn, name, arguments, response, error,
    reward), ``tool_rewards`` ({tool: calc_reward}), and verl's names ``num_turns`` (verl's
    count: the prompt's user turn + assistant turns + tool rounds and interaction turns),
    ``rollout_reward_scores`` (verl's name of the tool rewards), and with an interaction
    ``turn_scores`` (each of its turns' scores) and ``interaction_score`` (its final score)."""
    return {
        "turns": t.turns,
        "tool_calls": [{"turn": c.turn, "name": c.name, "arguments": c.arguments,
                        "response": c.response, "error": c.error, "reward": c.reward}
                       for c in t.tool_calls],
        "tool_rewards": dict(t.tool_rewards),
        "num_turns": 1 + t.turns + t.user_turns,
        "rollout_reward_scores": dict(t.tool_rewards),
        "turn_scores": list(t.turn_scores),
        "interaction_score": t.interaction_score,
    }


def trajectory_stats(t: Any) -> dict[str, float]:
    """A trajectory's numbers for the step's ``multi_turn/...`` metrics."""
    return {"turns": t.turns, "num_turns": 1 + t.turns + t.user_turns,
            "tool_calls": len(t.tool_calls), "tool_errors": len(t.tool_errors),
            "tool_time_s": t.tool_time_s, "truncated": float(t.finish_reason == "length"),
            "generated_tokens": t.num_generated, "appended_tokens": t.num_appended,
            "sanity_mismatch": float(t.sanity_checked and t.sanity_mismatch is not None)}


def multi_turn_metrics(samples: list[RolloutSample]) -> dict[str, float]:
    """The step's multi-turn metrics over its trajectories (empty for single-turn samples):
    ``num_turns/{mean,max,min}`` (verl's name and count), ``multi_turn/assistant_turns/
    {mean,max}``, ``multi_turn/tool_calls/{mean,max}``, ``multi_turn/tool_errors/mean`` (per
    trajectory) and ``multi_turn/tool_error_ratio`` (of all calls), ``multi_turn/tool_time_s/
    {mean,max}`` (per trajectory; ``multi_turn/tool_time_s/sum`` over the step),
    ``multi_turn/truncated_ratio`` (trajectories cut by the response budget),
    ``multi_turn/generated_tokens/mean`` and ``multi_turn/appended_tokens/mean`` (model tokens
    vs tool / template tokens per trajectory), ``multi_turn/sanity_mismatch_ratio``."""
    stats = [s.multi_turn for s in samples if s.multi_turn is not None]
    if not stats:
        return {}
    n = len(stats)

    def col(key):
        return [float(x[key]) for x in stats]

    def mean(v):
        return sum(v) / n

    m = {"num_turns/mean": mean(col("num_turns")), "num_turns/max": max(col("num_turns")),
         "num_turns/min": min(col("num_turns"))}
    for key in ("turns", "tool_calls", "tool_time_s"):
        name = "assistant_turns" if key == "turns" else key
        m[f"multi_turn/{name}/mean"] = mean(col(key))
        m[f"multi_turn/{name}/max"] = max(col(key))
    calls = sum(col("tool_calls"))
    m["multi_turn/tool_time_s/sum"] = sum(col("tool_time_s"))
    m["multi_turn/tool_errors/mean"] = mean(col("tool_errors"))
    m["multi_turn/tool_error_ratio"] = sum(col("tool_errors")) / calls if calls else 0.0
    m["multi_turn/truncated_ratio"] = mean(col("truncated"))
    m["multi_turn/generated_tokens/mean"] = mean(col("generated_tokens"))
    m["multi_turn/appended_tokens/mean"] = mean(col("appended_tokens"))
    m["multi_turn/sanity_mismatch_ratio"] = mean(col("sanity_mismatch"))
    return m


@dataclass
class Scorer:
    """Rank 0 scores with the reward manager; everyone receives (scores [B] float32, metrics:
    {name: `Metric`}, the manager's through `declare_reward_metrics` plus the overlong
    penalty's, MEANs over the B responses)."""

    manager: Any  # None on ranks other than 0
    tokenizer: Any
    max_response_length: int
    overlong: Any = None  # callable(lengths [B]) -> penalties [B] (<= 0), or None
    log_overlong: bool = False  # overlong_buffer.log: also reward/overlong_ratio

    def decode(self, samples: list[RolloutSample]) -> list[str]:
        return self.tokenizer.batch_decode([s.response_ids for s in samples],
                                           skip_special_tokens=True)

    def __call__(self, samples: list[RolloutSample]) -> tuple[torch.Tensor, dict[str, Metric]]:
        result = None
        if mdist.rank() == 0:
            texts = self.decode(samples)
            sources = [s.data_source for s in samples]
            scores, manager_metrics = self.manager(texts, sources,
                                                   [s.ground_truth for s in samples],
                                                   [s.extra_info for s in samples])
            scores = scores.to(torch.float32).tolist()
            metrics = declare_reward_metrics(manager_metrics, sources)
            if self.overlong is not None:
                penalties = self.overlong([len(s.response_ids) for s in samples]).tolist()
                scores = [a + b for a, b in zip(scores, penalties)]
                n = len(penalties)
                metrics["reward/overlong_penalty_mean"] = Metric.mean(
                    sum(penalties) / max(n, 1), n)
                if self.log_overlong:
                    metrics["reward/overlong_ratio"] = Metric.mean(
                        sum(x < 0 for x in penalties) / max(n, 1), n)
            result = (scores, metrics)
        scores, metrics = mdist.broadcast_object(result)
        return torch.tensor(scores, dtype=torch.float32), metrics


# The reward manager's metrics that count or time a call; every other one is a mean.
REWARD_SUMS = frozenset({"reward/timeouts", "reward/errors", "reward/missing_ground_truth",
                         "reward/time_s"})


def declare_reward_metrics(metrics: Mapping[str, float], sources: list[str]) -> dict[str, Metric]:
    """A reward manager's metrics of one call (``sources``: the data source of each response
    scored) with their reduction declared: counts and seconds (`REWARD_SUMS`) are SUMs,
    ``reward/score/{source}`` a MEAN over that source's responses, every other one
    (``reward/score/mean``, ...) a MEAN over the call's responses."""
    per_source = Counter(sources)
    out = {}
    for key, value in metrics.items():
        if key in REWARD_SUMS:
            out[key] = Metric.sum(value)
            continue
        source = key.removeprefix("reward/score/")
        weight = per_source[source] if source != key and source in per_source else len(sources)
        out[key] = Metric.mean(value, weight)
    return out


def merge_round_metrics(rounds: list[Mapping[str, Metric]]) -> dict[str, float]:
    """One step's reward metrics over all its generation rounds (dynamic sampling's refills;
    each round's from the `Scorer`), as if every response had been scored in one call: each
    metric reduced as it declares (`megarl.metrics.merge`). A single round's values are its
    own (nothing is merged)."""
    if len(rounds) == 1:
        return values(rounds[0])
    return values(merge(rounds))


def groups_with_signal(samples: list[RolloutSample], scores: torch.Tensor) -> list[int]:
    """Group ids whose responses do not all have the same score (DAPO dynamic sampling)."""
    by_group: dict[int, list[float]] = defaultdict(list)
    for s, v in zip(samples, scores.tolist()):
        by_group[s.group].append(v)
    return [g for g, vals in by_group.items() if len(vals) > 1 and max(vals) > min(vals)]


def samples_of_groups(samples: list[RolloutSample], groups: list[int], limit: int) -> list[int]:
    """Indices (in order) of the samples that belong to the first ``limit`` of ``groups``."""
    chosen = set(groups[:limit])
    return [i for i, s in enumerate(samples) if s.group in chosen]
