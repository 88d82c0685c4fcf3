"""The agent loop: multi-turn rollouts with tool calls, over any `RolloutEngine`, exact ids.

    trajectories = run_agent_loop(engine, prompts, sampling, tokenizer, tools, settings)

Each turn, every live trajectory's prompt + response so far goes to ONE ``engine.generate``
call (the engine batches them). The engine's ids are appended as they are (response_mask 1,
the engine's logprobs); only the new turn's ids are decoded, to find its tool calls. The calls
run (asyncio; at most ``max_parallel_calls`` per turn of a trajectory, each under
``tool_timeout_s``), and their responses are appended as the chat template renders them
(response_mask 0, logprob 0): what closes the assistant turn after the model's end-of-turn
token (Qwen: the ``\\n`` after ``<|im_end|>``), the tool turn(s), and the next assistant
header. Nothing the model generated is ever re-tokenized.

A trajectory ends at: a turn without a tool call (``stop``), the response budget
(``length``: ``max_response_length`` tokens in all; a tool response that would leave no room
for one more model token is not appended), ``max_assistant_turns`` or ``max_user_turns``
(a user turn is one round of tool responses, as verl counts).

The continuation text is the template's own: the rendering of [system, user, assistant X,
tool...] (generation prompt on) minus that of [system, user, assistant X], tokenized alone;
where a template renders the prefix differently once a message follows it (Qwen3's empty
think block), verl's way: [system, tool...] minus [system]. The tokenization sanity check
(``tokenization_sanity_check_mode``) compares prompt + response ids with the tokenization of
the whole conversation rendered by the template and reports where they differ.
"""

from __future__ import annotations

import asyncio
import difflib
import inspect
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from megarl.errors import UserInputError
from megarl.rollout.agent.chat import ChatContinuation
from megarl.rollout.agent.drivers import continuously, turn_by_turn
from megarl.rollout.agent.tool_parser import ParseError, get_tool_parser
from megarl.rollout.agent.tools import BaseTool, ToolResponse, tool_schemas
from megarl.rollout.protocol import (
    Completion,
    RolloutEngine,
    SamplingParams,
    resolve_prompt_keys,
)

logger = logging.getLogger(__name__)

SANITY_MODES = ("strict", "ignore_strippable", "disable")
TRUNCATE_SIDES = ("left", "right", "middle")


@dataclass
class AgentLoopSettings:
    """verl's ``actor_rollout_ref.rollout.multi_turn`` keys (same names, same defaults), plus
    megarl's per-call timeout and bound on calls running at once over the batch."""

    enable: bool = False
    max_assistant_turns: int | None = None  # None: no limit
    max_user_turns: int | None = None  # None: no limit
    tool_config_path: str | None = None
    interaction_config_path: str | None = None  # verl's interaction YAML (a simulated user)
    format: str = "hermes"
    max_parallel_calls: int = 1  # calls run per assistant turn (more are answered with an error)
    max_tool_response_length: int = 256  # CHARACTERS of one tool response (verl)
    tool_response_truncate_side: str = "middle"  # left: keep the start; right: the end
    tokenization_sanity_check_mode: str = "strict"
    tool_timeout_s: float = 30.0
    max_concurrent_calls: int = 64
    # data.apply_chat_template_kwargs: variables every chat-template rendering reads
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        for key in ("max_assistant_turns", "max_user_turns"):
            v = getattr(self, key)
            if v is not None and v < 1:
                raise UserInputError(f"multi_turn.{key}={v}: give a positive count or null")
        if self.max_parallel_calls < 1 or self.max_concurrent_calls < 1:
            raise UserInputError("multi_turn.max_parallel_calls must be >= 1")
        if self.max_tool_response_length < 1:
            raise UserInputError("multi_turn.max_tool_response_length must be >= 1")
        if self.tool_response_truncate_side not in TRUNCATE_SIDES:
            raise UserInputError(f"multi_turn.tool_response_truncate_side="
                                 f"{self.tool_response_truncate_side!r}: one of {TRUNCATE_SIDES}")
        if self.tokenization_sanity_check_mode not in SANITY_MODES:
            raise UserInputError(f"multi_turn.tokenization_sanity_check_mode="
                                 f"{self.tokenization_sanity_check_mode!r}: one of {SANITY_MODES}")

    @classmethod
    def from_config(cls, multi_turn: Any, **extra: Any) -> AgentLoopSettings:
        """From the config's ``actor_rollout_ref.rollout.multi_turn`` section (any object with
        those attributes; keys it lacks keep their defaults)."""
        names = [f for f in cls.__dataclass_fields__ if hasattr(multi_turn, f)]
        return cls(**{n: getattr(multi_turn, n) for n in names}, **extra)


@dataclass
class ToolCallRecord:
    """One answered call: ``error`` when the call was malformed, unknown, failed, timed out or
    was over ``max_parallel_calls`` (``response`` then holds the message sent)."""

    turn: int
    name: str | None
    arguments: dict[str, Any] | None
    response: str
    error: bool
    reward: float = 0.0
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass
class Trajectory:
    """One multi-turn rollout. response_ids: the model's ids and the appended template / tool
    ids in order; response_mask: 1 on the model's ids; logprobs: the engine's on the model's
    ids, 0.0 elsewhere. finish_reason: stop | length | max_assistant_turns | max_user_turns.
    messages: the conversation after the prompt (assistant text as decoded, tool responses as
    sent). sanity_mismatch: the tokenization check's report, None when it matched (or did
    not run: sanity_checked). turn_versions: the ``policy_version`` the engine stamped on each
turn's completion (None where it stamps none)."""

    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: int = 0
    user_turns: int = 0
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    tool_errors: list[str] = field(default_factory=list)
    tool_rewards: dict[str, float] = field(default_factory=dict)
    finish_reason: str = ""
    num_generated: int = 0
    num_appended: int = 0
    tool_time_s: float = 0.0  # wall time of its tool calls (each turn's calls run at once)
    interaction: str | None = None  # the interaction's name (None: no interaction)
    turn_scores: list[float] = field(default_factory=list)  # each interaction turn's score
    interaction_score: float | None = None  # its calculate_score at the end
    messages: list[dict[str, str]] = field(default_factory=list)
    sanity_checked: bool = False
    sanity_mismatch: str | None = None
    turn_versions: list[int | None] = field(default_factory=list)  # each turn's weight version
    # internal: the end of the assistant turn the loop did not append (for the sanity check)
    _open_tail: str = ""
    _instances: dict[str, str] = field(default_factory=dict)
    _interaction_id: str | None = None


# --- the chat template, incrementally --------------------------------------------------------

def truncate_tool_response(text: str, limit: int, side: str) -> str:
    """verl's truncation of a tool response longer than ``limit`` characters."""
    if len(text) <= limit:
        return text
    if side == "left":
        return text[:limit] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[-limit:]
    half = limit // 2
    return text[:half] + "...(truncated)..." + text[-half:]


# --- tools -----------------------------------------------------------------------------------


class _ToolRunner:
    def __init__(self, tools: dict[str, BaseTool], settings: AgentLoopSettings,
                 tools_kwargs: Sequence[dict | None] | None):
        self.tools, self.settings, self.tools_kwargs = tools, settings, tools_kwargs
        self.sem = asyncio.Semaphore(settings.max_concurrent_calls)
        self.locks: dict[int, asyncio.Lock] = {}  # per trajectory: one create per tool

    def _kwargs(self, traj: Trajectory, name: str, key: str) -> dict:
        if self.tools_kwargs is None:
            return {}
        row = self.tools_kwargs[traj.prompt_index] or {}
        return dict((row.get(name) or {}).get(key) or {})

    async def _instance(self, traj: Trajectory, tool: BaseTool) -> str:
        async with self.locks.setdefault(id(traj), asyncio.Lock()):
            if tool.name not in traj._instances:
                create = self._kwargs(traj, tool.name, "create_kwargs")
                instance_id, _ = await asyncio.wait_for(
                    tool.create(create_kwargs=create, **create), self.settings.tool_timeout_s)
                traj._instances[tool.name] = instance_id
        return traj._instances[tool.name]

    async def _call(self, traj: Trajectory, turn: int, entry) -> ToolCallRecord:
        s = self.settings
        if isinstance(entry, ParseError):
            return ToolCallRecord(turn, None, None, entry.message, True)
        tool = self.tools.get(entry.name)
        if tool is None:
            return ToolCallRecord(turn, entry.name, entry.arguments,
                                  f"Error: there is no tool named {entry.name[:100]!r}; the "
                                  f"tools are: {', '.join(sorted(self.tools)) or 'none'}", True)
        async with self.sem:
            try:
                instance_id = await self._instance(traj, tool)
                out, reward, metrics = await asyncio.wait_for(
                    tool.execute(instance_id, entry.arguments,
                                 **self._kwargs(traj, tool.name, "execute_kwargs")),
                    s.tool_timeout_s)
            except asyncio.TimeoutError:
                return ToolCallRecord(turn, entry.name, entry.arguments, f"Error: tool "
                                      f"{entry.name} did not answer within {s.tool_timeout_s:g} s",
                                      True)
            except Exception as e:  # noqa: BLE001 - a tool's failure is the model's message
                return ToolCallRecord(turn, entry.name, entry.arguments,
                                      f"Error: tool {entry.name} failed: {type(e).__name__}: "
                                      f"{str(e)[:300]}", True)
        text = out.text if isinstance(out, ToolResponse) else out
        text = "" if text is None else str(text)
        try:
            reward = float(reward or 0.0)
        except (TypeError, ValueError):
            reward = 0.0
        return ToolCallRecord(turn, entry.name, entry.arguments, text, False, reward,
                              dict(metrics or {}))

    async def run_turn(self, work: list[tuple[Trajectory, int, list]]) -> list[list[ToolCallRecord]]:
        """The records of each trajectory's calls, in the order they were written."""
        limit = self.settings.max_parallel_calls

        async def one(traj, turn, entries):
            run = entries[:limit]
            t0 = time.perf_counter()
            records = list(await asyncio.gather(*(self._call(traj, turn, e) for e in run)))
            traj.tool_time_s += time.perf_counter() - t0
            for e in entries[limit:]:
                name = None if isinstance(e, ParseError) else e.name
                records.append(ToolCallRecord(turn, name, getattr(e, "arguments", None),
                                              f"Error: at most {limit} tool call(s) run per "
                                              "turn; this one was not run", True))
            return records

        return list(await asyncio.gather(*(one(t, k, e) for t, k, e in work)))

    async def finish(self, trajs: list[Trajectory]) -> None:
        """calc_reward, then release, of every tool instance the trajectories created."""
        async def one(traj):
            for name, instance_id in traj._instances.items():
                tool = self.tools[name]
                try:
                    traj.tool_rewards[name] = float(await asyncio.wait_for(
                        tool.calc_reward(instance_id), self.settings.tool_timeout_s) or 0.0)
                except Exception as e:  # noqa: BLE001
                    logger.warning("tool %s: calc_reward failed: %s: %s", name, type(e).__name__, e)
                try:
                    await asyncio.wait_for(tool.release(instance_id), self.settings.tool_timeout_s)
                except Exception as e:  # noqa: BLE001
                    logger.warning("tool %s: release failed: %s: %s", name, type(e).__name__, e)
            traj._instances.clear()

        await asyncio.gather(*(one(t) for t in trajs))


# --- interactions ----------------------------------------------------------------------------


def _takes_instance_id(method) -> bool:
    """verl's BaseInteraction.calculate_score / finalize_interaction take no instance id; its
    gsm8k interaction's do."""
    try:
        params = list(inspect.signature(method).parameters.values())
    except (TypeError, ValueError):
        return True
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
               for p in params)


class _InteractionRunner:
    """Each trajectory's interaction (picked by its row's ``interaction_kwargs["name"]``,
    verl's rule; the only one when there is one and no name is given)."""

    def __init__(self, interactions: dict[str, Any], kwargs_rows: Sequence[dict | None] | None):
        self.interactions = interactions
        self.kwargs_rows = kwargs_rows

    def kwargs(self, traj: Trajectory) -> dict:
        row = None if self.kwargs_rows is None else self.kwargs_rows[traj.prompt_index]
        return dict(row or {})

    def pick(self, traj: Trajectory) -> str:
        row = None if self.kwargs_rows is None else self.kwargs_rows[traj.prompt_index]
        if row is None:
            raise UserInputError(
                f"multi_turn.interaction_config_path is set but prompt {traj.prompt_index} has "
                "no extra_info.interaction_kwargs (verl's row field: {name: <interaction>, "
                "...: its start_interaction arguments, e.g. ground_truth})")
        name = row.get("name")
        if name is None and len(self.interactions) == 1:
            name = next(iter(self.interactions))
        if name not in self.interactions:
            raise UserInputError(
                f"prompt {traj.prompt_index}: interaction_kwargs name={name!r} is not among the "
                f"configured interactions ({', '.join(sorted(self.interactions))})")
        return name

    async def start(self, trajs: list[Trajectory]) -> None:
        async def one(t):
            t.interaction = self.pick(t)
            t._interaction_id = await self.interactions[t.interaction].start_interaction(
                uuid.uuid4().hex, **self.kwargs(t))

        await asyncio.gather(*(one(t) for t in trajs))

    async def respond(self, work: list[tuple[Trajectory, list[dict]]]) -> list[tuple]:
        async def one(t, messages):
            out = await self.interactions[t.interaction].generate_response(
                t._interaction_id, messages, **self.kwargs(t))
            try:
                terminate, content, score, extra = out
            except (TypeError, ValueError):
                raise RuntimeError(f"interaction {t.interaction}: generate_response returned "
                                   f"{type(out).__name__}, not (should_terminate_sequence, "
                                   "response_content, current_turn_score, additional_data)") from None
            return bool(terminate), "" if content is None else str(content), score, extra

        return list(await asyncio.gather(*(one(t, m) for t, m in work)))

    async def finish(self, trajs: list[Trajectory]) -> None:
        async def one(t):
            inter = self.interactions[t.interaction]
            args = (t._interaction_id,)
            score = await inter.calculate_score(
                *(args if _takes_instance_id(inter.calculate_score) else ()))
            t.interaction_score = None if score is None else float(score)
            await inter.finalize_interaction(
                *(args if _takes_instance_id(inter.finalize_interaction) else ()))
            t._interaction_id = None

        await asyncio.gather(*(one(t) for t in trajs if t._interaction_id is not None))


# --- the loop --------------------------------------------------------------------------------


def run_agent_loop(
    engine: RolloutEngine,
    prompts: list[list[int]],
    sampling: SamplingParams,
    tokenizer: Any,
    tools: dict[str, BaseTool] | Sequence[BaseTool],
    settings: AgentLoopSettings,
    *,
    max_response_length: int | None = None,
    prompt_keys: Sequence[int] | None = None,
    prompt_messages: Sequence[list[dict]] | None = None,
    tools_kwargs: Sequence[dict | None] | None = None,
    interactions: dict[str, Any] | None = None,
    interaction_kwargs: Sequence[dict | None] | None = None,
) -> list[Trajectory]:
    """``sampling.n`` trajectories per prompt, prompt-major (as `RolloutEngine.generate`).

    prompts: prompt ids (the chat template applied, with the tools' schemas: `tool_schemas`).
    max_response_length: response tokens in all, model and appended (default
    sampling.max_new_tokens). prompt_keys: as `RolloutEngine.generate`; the engine sees key
    ``key * n + sample`` for each trajectory, and every turn after the first a seed derived
    from (sampling.seed, turn). prompt_messages: each prompt's chat messages, for the
    tokenization sanity check (it does not run without them). tools_kwargs: per prompt,
    {tool name: {"create_kwargs": {...}, "execute_kwargs": {...}}} (verl's row field).
    interactions: {name: `BaseInteraction`} (default: those of
    ``settings.interaction_config_path``, if set); interaction_kwargs: per prompt, verl's row
    field ``extra_info.interaction_kwargs`` ({name, ...start_interaction's arguments}). With
    interactions, an assistant turn without a tool call goes to the trajectory's interaction:
    its response is appended as a user turn (mask 0) unless it ends the conversation
    (should_terminate_sequence: finish ``stop``, nothing appended); each turn's score is kept
    (``turn_scores``) and ``calculate_score`` at the end (``interaction_score``).
    ``max_user_turns`` counts tool rounds and interaction turns alike; as in verl, the model
    answers the last user turn before the limit stops the trajectory.
    """
    if isinstance(tools, dict):
        tools = dict(tools)
    else:
        tools = {t.name: t for t in tools}
    n = max(1, sampling.n)
    budget = int(max_response_length if max_response_length is not None
                 else sampling.max_new_tokens)
    if budget < 1:
        raise ValueError(f"max_response_length must be >= 1, got {budget}")
    keys = resolve_prompt_keys(prompt_keys, len(prompts))
    parser = get_tool_parser(settings.format)
    chat = ChatContinuation(tokenizer, settings.chat_template_kwargs)
    trajs = [Trajectory(p, s, list(prompts[p])) for p in range(len(prompts)) for s in range(n)]
    traj_keys = [keys[t.prompt_index] * n + t.sample_index for t in trajs]
    if interactions is None and settings.interaction_config_path:
        from megarl.data.locations import resolve_path
        from megarl.rollout.agent.interactions import load_interactions

        interactions = load_interactions(resolve_path(settings.interaction_config_path))
    inter = _InteractionRunner(interactions, interaction_kwargs) if interactions else None
    runner_loop = asyncio.new_event_loop()
    try:
        runner = _ToolRunner(tools, settings, tools_kwargs)
        if inter is not None:
            runner_loop.run_until_complete(inter.start(trajs))
        def advance(done: list[tuple[int, Completion]]) -> list[int]:
            """Append the turn each trajectory ``j`` just generated (its completion ``c``), run
            their tool calls and interactions (at once), append the responses; returns the
            trajectories that go on, in order."""
            work, still, talk = [], [], []
            for j, c in done:
                t = trajs[j]
                left = budget - len(t.response_ids)
                ids = list(c.token_ids[:left])
                lps = ([0.0] * len(ids) if c.logprobs is None
                       else [float(x) for x in c.logprobs[:left]])
                stopped = c.finish_reason == "stop" and len(c.token_ids) <= left
                t.response_ids += ids
                t.response_mask += [1] * len(ids)
                t.logprobs += lps
                t.num_generated += len(ids)
                t.turns += 1
                t.turn_versions.append(getattr(c, "policy_version", None))
                t.messages.append({"role": "assistant",
                                   "content": chat.assistant_content(ids, stopped)})
                t._open_tail = chat.open_tail(ids, stopped)
                if not stopped:
                    t.finish_reason = "length"
                    continue
                parsed = parser.parse(tokenizer.decode(ids, skip_special_tokens=False))
                if not parsed.has_calls and inter is None:
                    t.finish_reason = "stop"
                elif settings.max_assistant_turns and t.turns >= settings.max_assistant_turns:
                    t.finish_reason = "max_assistant_turns"
                elif settings.max_user_turns and t.user_turns >= settings.max_user_turns:
                    t.finish_reason = "max_user_turns"
                elif parsed.has_calls:
                    work.append((t, t.turns - 1, parsed.entries))
                    still.append(j)
                else:
                    talk.append(j)
            results = runner_loop.run_until_complete(runner.run_turn(work)) if work else []
            live = []
            for j, (t, _, _), records in zip(still, work, results):
                contents = []
                for r in records:
                    r.response = truncate_tool_response(
                        r.response, settings.max_tool_response_length,
                        settings.tool_response_truncate_side)
                    contents.append(r.response)
                    if r.error:
                        t.tool_errors.append(r.response)
                t.tool_calls += records
                t.user_turns += 1
                ids = chat.tool_turn_ids(t._open_tail, contents)
                if len(t.response_ids) + len(ids) >= budget:
                    t.finish_reason = "length"
                    continue
                t.response_ids += ids
                t.response_mask += [0] * len(ids)
                t.logprobs += [0.0] * len(ids)
                t.num_appended += len(ids)
                t.messages += [{"role": "tool", "content": c} for c in contents]
                t._open_tail = ""
                live.append(j)
            replies = runner_loop.run_until_complete(inter.respond(
                [(trajs[j], [*(prompt_messages[trajs[j].prompt_index] if prompt_messages
                               else []), *trajs[j].messages]) for j in talk])) if talk else []
            for j, (terminate, content, score, _) in zip(talk, replies):
                t = trajs[j]
                if score is not None:
                    t.turn_scores.append(float(score))
                if terminate:
                    t.finish_reason = "stop"
                    continue
                ids = chat.tool_turn_ids(t._open_tail, [content], "user")
                if len(t.response_ids) + len(ids) >= budget:
                    t.finish_reason = "length"
                    continue
                t.user_turns += 1
                t.response_ids += ids
                t.response_mask += [0] * len(ids)
                t.logprobs += [0.0] * len(ids)
                t.num_appended += len(ids)
                t.messages.append({"role": "user", "content": content})
                t._open_tail = ""
                live.append(j)
            live.sort()
            return live

        drive = turn_by_turn if getattr(engine, "open_session", None) is None else continuously
        drive(engine, trajs, traj_keys, sampling, budget, advance)
        runner_loop.run_until_complete(runner.finish(trajs))
        if inter is not None:
            runner_loop.run_until_complete(inter.finish(trajs))
    finally:
        runner_loop.close()
    if prompt_messages is not None and settings.tokenization_sanity_check_mode != "disable":
        schemas = tool_schemas(tools) or None
        bad = 0
        for t in trajs:
            t.sanity_mismatch = sanity_check(chat, t, prompt_messages[t.prompt_index], schemas,
                                             settings.tokenization_sanity_check_mode)
            t.sanity_checked = True
            bad += t.sanity_mismatch is not None
        if bad:
            first = next(t for t in trajs if t.sanity_mismatch)
            logger.warning("multi-turn tokenization sanity check: %d of %d trajectories differ "
                           "from the re-tokenized conversation (first: %s)", bad, len(trajs),
                           first.sanity_mismatch)
    return trajs


def sanity_check(chat: ChatContinuation, traj: Trajectory, prompt_messages: list[dict],
                 tools: list[dict] | None, mode: str = "strict") -> str | None:
    """None when prompt + response ids equal the tokenization of the whole conversation as
    the template renders it (up to the end of the assistant turn the trajectory stopped in);
    else a description of the first difference. ``ignore_strippable``: differences whose
    text on both sides is whitespace only are ignored."""
    plain: dict[str, str] = {}  # tool / interaction contents with token strings: plain text
    appended = []
    for m in traj.messages:
        if m["role"] != "assistant" and chat.has_token_strings(m["content"]):
            mark = f"\u2063MEGARL_CONTENT_{len(plain)}\u2063"
            plain[mark] = m["content"]
            m = {**m, "content": mark}
        appended.append(m)
    messages = [*prompt_messages, *appended]
    ends_with_tool = bool(traj.messages) and traj.messages[-1]["role"] in ("tool", "user")
    text = chat.render(messages, ends_with_tool, tools)
    if traj._open_tail and text.endswith(traj._open_tail):
        text = text[: -len(traj._open_tail)]
    expected = chat.encode_with_plain(text, plain) if plain else chat.encode(text)
    got = traj.prompt_ids + traj.response_ids
    if expected == got:
        return None
    matcher = difflib.SequenceMatcher(a=expected, b=got, autojunk=False)
    decode = chat.tokenizer.decode
    for op, a0, a1, b0, b1 in matcher.get_opcodes():
        if op == "equal":
            continue
        want, have = decode(expected[a0:a1]), decode(got[b0:b1])
        if mode == "ignore_strippable" and not want.strip() and not have.strip():
            continue
        where = "prompt" if b0 < len(traj.prompt_ids) else f"response token {b0 - len(traj.prompt_ids)}"
        return (f"at {where}: the template's tokenization has {expected[a0:a1][:20]} "
                f"({want[:80]!r}), the rollout {got[b0:b1][:20]} ({have[:80]!r})")
    return None
