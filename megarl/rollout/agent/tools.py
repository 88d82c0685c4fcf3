"""Tools for multi-turn rollouts: verl's tool protocol, its YAML config, and two built-ins.

A tool is a `BaseTool` (verl's names and signatures, so a verl tool class ports by changing its
import from ``verl.tools.base_tool`` / ``verl.tools.schemas`` to ``megarl.rollout.agent.tools``):

    async create(instance_id=None, **kwargs) -> (instance_id, ToolResponse)   once per trajectory
    async execute(instance_id, parameters: dict, **kwargs)
          -> (ToolResponse | str, step reward: float, metrics: dict)          once per call
    async calc_reward(instance_id, **kwargs) -> float                         at the end
    async release(instance_id, **kwargs) -> None                              at the end

The tool config file (verl's ``multi_turn.tool_config_path``)::

    tools:
      - class_name: megarl.rollout.agent.tools.CalculatorTool   # any importable dotted path
        config: {type: native}                                   # passed to the constructor
        tool_schema:                                             # OpenAI function schema
          type: function
          function: {name: calculator, description: ..., parameters: {type: object, ...}}

``tool_schema`` may be left out where the class has a default schema (both built-ins do).

Built-ins: `CalculatorTool` (countdown's safe evaluator, no eval), `PythonTool` (a program
run in a separate, bounded, unprivileged process: see `megarl.rollout.agent._sandbox`) and
`Gsm8kTool` (verl's gsm8k answer checker). verl's own class names of built-ins
(`VERL_BUILTINS`: ``verl.tools.gsm8k_tool.Gsm8kTool``) load megarl's, with a warning.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import math
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

from megarl.errors import UserInputError

logger = logging.getLogger(__name__)

# --- schema (verl.tools.schemas) ---------------------------------------------------------------


@dataclass
class OpenAIFunctionSchema:
    name: str
    description: str = ""
    parameters: dict[str, Any] = field(
        default_factory=lambda: {"type": "object", "properties": {}, "required": []})
    strict: bool = False


@dataclass
class OpenAIFunctionToolSchema:
    """An OpenAI function-tool schema (verl's pydantic model of the same name, as a dataclass;
    ``model_validate`` / ``model_dump`` keep verl's spelling)."""

    type: str
    function: OpenAIFunctionSchema

    @classmethod
    def model_validate(cls, obj: Any) -> OpenAIFunctionToolSchema:
        if isinstance(obj, cls):
            return obj
        if not isinstance(obj, dict):
            raise ValueError(f"a tool schema must be a mapping, got {type(obj).__name__}")
        fn = obj.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError("tool_schema.function.name (a non-empty string) is missing")
        params = fn.get("parameters", {"type": "object", "properties": {}, "required": []})
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise ValueError("tool_schema.function.parameters must be a JSON schema of type object")
        if not isinstance(params.get("properties", {}), dict):
            raise ValueError("tool_schema.function.parameters.properties must be a mapping")
        unknown = set(fn) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise ValueError(f"unknown keys in tool_schema.function: {sorted(unknown)}")
        return cls(type=str(obj.get("type", "function")),
                   function=OpenAIFunctionSchema(fn["name"], str(fn.get("description", "")),
                                                 params, bool(fn.get("strict", False))))

    def model_dump(self, **_: Any) -> dict[str, Any]:
        """The plain dict chat templates take (``apply_chat_template(tools=[...])``)."""
        return asdict(self)


@dataclass
class ToolResponse:
    """What a tool call returns to the model (verl's ``ToolResponse``; text only here)."""

    text: str | None = None
    image: Any = None
    video: Any = None


# --- the protocol (verl.tools.base_tool.BaseTool) ----------------------------------------------


class BaseTool:
    """verl's tool base class. Subclasses override `execute` (and the others as needed)."""

    def __init__(self, config: dict | None, tool_schema: OpenAIFunctionToolSchema | None):
        self.config = dict(config or {})
        self.tool_schema = tool_schema or self.get_openai_tool_schema()
        if self.tool_schema is None:
            raise ValueError(f"{type(self).__name__} needs a tool_schema")
        self.tool_schema = OpenAIFunctionToolSchema.model_validate(self.tool_schema)
        self.name = self.tool_schema.function.name

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema | None:
        return getattr(self, "tool_schema", None)

    async def create(self, instance_id: str | None = None, **kwargs) -> tuple[str, ToolResponse]:
        return (instance_id or str(uuid.uuid4())), ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs
                      ) -> tuple[ToolResponse | str, float, dict]:
        return ToolResponse(text="Updated the tool state."), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        return None


def tool_schemas(tools: dict[str, BaseTool] | list[BaseTool]) -> list[dict[str, Any]]:
    """The tools' schemas as chat templates take them (``tools=`` of apply_chat_template)."""
    values = tools.values() if isinstance(tools, dict) else tools
    return [t.tool_schema.model_dump() for t in values]


# --- the config file ---------------------------------------------------------------------------


def _import_class(dotted: str):
    module, _, name = dotted.rpartition(".")
    if not module:
        raise ValueError(f"class_name {dotted!r} is not a dotted path (package.module.Class)")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        hint = (" (a verl tool ports by importing BaseTool, OpenAIFunctionToolSchema and "
                "ToolResponse from megarl.rollout.agent.tools instead of verl)"
                if module.startswith("verl.") or "verl" in str(e) else "")
        raise ValueError(f"cannot import {module}: {e}{hint}") from None
    cls = getattr(mod, name, None)
    if not isinstance(cls, type):
        raise ValueError(f"{module} has no class {name}")
    return cls


def config_entries(path: str | os.PathLike, what: str, key: str,
                   fields: tuple[str, ...]) -> list[tuple[str, dict, dict]]:
    """The entries of verl's ``key:`` list in the YAML file ``path`` (a tool or interaction
    config), checked: each a mapping with a dotted ``class_name``, only ``fields``, a mapping
    ``config``. Returns (where, entry, config) per entry, ``where`` naming the file, the entry
    and its class for error messages (UserInputError on bad input)."""
    import yaml

    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as e:
        raise UserInputError(f"{what} config {path}: cannot read it ({e})") from None
    except yaml.YAMLError as e:
        raise UserInputError(f"{what} config {path}: not valid YAML ({e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get(key), list):
        raise UserInputError(f"{what} config {path}: needs a top-level '{key}:' list of "
                             f"{{{', '.join(fields)}}} entries")
    out = []
    for i, entry in enumerate(doc[key]):
        where = f"{what} config {path}: {key}[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
            raise UserInputError(f"{where}: each entry needs a class_name (a dotted path)")
        where += f" ({entry['class_name']})"
        unknown = set(entry) - set(fields)
        if unknown:
            raise UserInputError(f"{where}: unknown keys {sorted(unknown)}; an entry has "
                                 f"{', '.join(fields)}")
        config = entry.get("config") or {}
        if not isinstance(config, dict):
            raise UserInputError(f"{where}: config must be a mapping")
        out.append((where, entry, config))
    return out


def load_tools(path: str | os.PathLike) -> dict[str, BaseTool]:
    """The tools of verl's tool config YAML at ``path``, by name (a UserInputError names the
    file and the entry on bad input)."""
    tools: dict[str, BaseTool] = {}
    for where, entry, config in config_entries(path, "tool", "tools",
                                               ("class_name", "config", "tool_schema")):
        kind = config.get("type", "native")
        if kind != "native":
            raise UserInputError(f"{where}: config.type={kind!r} is not supported (only "
                                 "native tools; MCP tools are not implemented)")
        try:
            builtin = VERL_BUILTINS.get(entry["class_name"])
            if builtin is not None:
                logger.warning("tool config %s: verl's %s runs as megarl's built-in %s", path,
                               entry["class_name"], builtin)
            cls = _import_class(builtin or entry["class_name"])
            if not issubclass(cls, BaseTool):
                raise ValueError(f"{entry['class_name']} is not a subclass of "
                                 "megarl.rollout.agent.tools.BaseTool")
            schema = entry.get("tool_schema")
            schema = None if schema is None else OpenAIFunctionToolSchema.model_validate(schema)
            tool = cls(config=config, tool_schema=schema)
        except UserInputError:
            raise
        except Exception as e:  # noqa: BLE001 - a user class failing in any way
            raise UserInputError(f"{where}: {type(e).__name__}: {e}") from None
        if tool.name in tools:
            raise UserInputError(f"{where}: a second tool named {tool.name!r}")
        tools[tool.name] = tool
    return tools


# --- built-in: calculator ----------------------------------------------------------------------


def _schema(name: str, description: str, arg: str, arg_description: str) -> OpenAIFunctionToolSchema:
    return OpenAIFunctionToolSchema("function", OpenAIFunctionSchema(name, description, {
        "type": "object", "properties": {arg: {"type": "string", "description": arg_description}},
        "required": [arg]}))


def format_number(value: Fraction, digits: int = 12) -> str:
    """An integer as is; another rational as p/q with a decimal approximation."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{value.numerator}/{value.denominator} (~{float(value):.{digits}g})"


class CalculatorTool(BaseTool):
    """Exact arithmetic over integers with + - * / and parentheses: countdown's evaluator
    (`megarl.rewards.countdown.evaluate_equation`: no eval, at most 512 characters, nesting
    100, values bounded by 10**100). config: none."""

    def __init__(self, config: dict | None = None, tool_schema=None):
        super().__init__(config, tool_schema or _schema(
            "calculator", "Evaluate an arithmetic expression over integers with + - * / and "
            "parentheses exactly.", "expression", "e.g. (3 + 5) * 7 / 2"))

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs):
        from megarl.rewards.countdown import EquationError, evaluate_equation

        expr = parameters.get("expression")
        if not isinstance(expr, str):
            return ToolResponse(text='Error: the argument "expression" (a string) is missing'), 0.0, {}
        try:
            value, _ = evaluate_equation(expr)
        except EquationError as e:
            return ToolResponse(text=f"Error: {e}"), 0.0, {}
        return ToolResponse(text=format_number(value)), 0.0, {}


# --- built-in: gsm8k (verl's Gsm8kTool) ---------------------------------------------------------


class Gsm8kTool(BaseTool):
    """verl's ``verl.tools.gsm8k_tool.Gsm8kTool``: the model submits an answer; the tool says
    whether it parses to the ground truth (create_kwargs ``ground_truth``, verl's "flexible"
    GSM8K scoring: the last number), and rewards each submission with 0.0 when it improves on
    the previous one, -0.05 when not; `calc_reward` is the last answer's score."""

    def __init__(self, config: dict | None = None, tool_schema=None):
        super().__init__(config, tool_schema or _schema(
            "calc_gsm8k_reward", "A tool for calculating the reward of gsm8k. (1.0 if parsed "
            "answer is correct, 0.0 if parsed answer is incorrect or not correctly parsed)",
            "answer", "The model's answer to the GSM8K math problem, must be a digits"))
        self._instances: dict[str, dict[str, Any]] = {}

    async def create(self, instance_id: str | None = None, ground_truth: str | None = None,
                     **kwargs) -> tuple[str, ToolResponse]:
        instance_id = instance_id or str(uuid.uuid4())
        if ground_truth is None:
            ground_truth = (kwargs.get("create_kwargs") or {}).get("ground_truth")
        self._instances[instance_id] = {"response": "", "ground_truth": ground_truth,
                                        "reward": 0.0}
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs):
        answer = parameters.get("answer", "")
        answer = answer if isinstance(answer, str) else str(answer)
        state = self._instances[instance_id]
        state["response"] = answer if answer.startswith("#### ") else "#### " + answer
        reward = await self.calc_reward(instance_id)
        tool_reward = 0.0 if reward > state["reward"] else -0.05
        state["reward"] = reward
        return ToolResponse(text=f"Current parsed {answer=} {reward=}"), tool_reward, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        from megarl.rewards.gsm8k import gsm8k_score

        state = self._instances[instance_id]
        if state["ground_truth"] is None:
            return 0.0
        return gsm8k_score(state["response"], state["ground_truth"], method="flexible",
                           format_score=0.0, score=1.0)

    async def release(self, instance_id: str, **kwargs) -> None:
        self._instances.pop(instance_id, None)


# verl's dotted class names that megarl reads as its own built-ins (with a notice)
VERL_BUILTINS: dict[str, str] = {
    "verl.tools.gsm8k_tool.Gsm8kTool": "megarl.rollout.agent.tools.Gsm8kTool",
}


# --- built-in: python --------------------------------------------------------------------------

_RUNNER = str(Path(__file__).with_name("_sandbox.py"))
OUTPUT_FILE = "output.txt"
_program_cpus: list[int] = []  # where python tool programs run; []: this process's CPUs


def place_programs(cpus: list[int]) -> None:
    """Run this process's python tool programs on ``cpus`` ([]: on this process's own CPUs).
    An engine process pinned to its core calls it with the node's cores apart from the
    engines' (`megarl.rollout.engine_process.cores_apart`), so its programs neither inherit
    that one core nor take it from the engine."""
    _program_cpus[:] = [int(c) for c in cpus]


def program_cpus() -> list[int]:
    """The CPUs python tool programs run on (`place_programs`, else this process's)."""
    if _program_cpus:
        return list(_program_cpus)
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of ``uid`` (root only; the sandbox's private uid)."""
    for _ in range(20):
        found = False
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                if os.stat(entry.path).st_uid == uid:
                    found = True
                    os.kill(int(entry.name), signal.SIGKILL)
            except (OSError, ValueError):
                continue
        if not found:
            return


def _fresh_uid() -> int:
    """A private uid for one sandboxed program, drawn from the OS's entropy: never from the
    ``random`` module, which runs seed alike (every rank of a world, a resumed run) and would
    give two concurrent programs one uid, so that one's clean-up (`_kill_uid`) kills the other."""
    return 1_500_000_000 + secrets.randbelow(100_000_000)


class PythonTool(BaseTool):
    """Runs a Python program in a separate process and returns what it printed.

    Bounds (config keys, defaults): ``timeout_s`` 10 (wall clock, then the process group is
    killed), ``cpu_s`` = timeout_s + 1 (RLIMIT_CPU), ``memory_mb`` 512 (RLIMIT_AS), ``max_output_bytes``
    16384 (stdout + stderr returned; the file it goes to is capped by RLIMIT_FSIZE at
    ``max_file_mb`` 8), ``max_code_chars`` 20000. The process starts in a fresh temporary
    directory (removed after), its own session, with an empty environment, no core files, and
    dies with its parent (the parent-death signal is set again after the uid drop, which
    clears it).

    Files (``filesystem``: auto | mount_namespace | landlock): the program sees only the
    system's libraries and the interpreter's (read-only), /dev/null, zero, random and urandom,
    a private /tmp (a tmpfs of ``max_file_mb``, gone with the program) and its own folder at
    /work, the only writable place: no repository, no data or run folder, no /proc, no
    /dev/shm. That is a mount namespace whose root is a fresh tmpfs (needs root with
    CAP_SYS_ADMIN, or unprivileged user namespaces); where the kernel refuses namespaces (a
    container without CAP_SYS_ADMIN), a Landlock domain (Linux >= 5.13, no privilege needed)
    allows the same reads and writes only in its folder (TMPDIR points there), and from
    Landlock ABI 4 / 6 also denies TCP and signals or abstract sockets outside it. "auto" takes
    the first that works; ``filesystem_isolation`` says which ran ("none": neither: a warning
    is logged).

    Run as root (as here), it also: enters a new network namespace (no interface but a down
    loopback: no network), then drops to a private unprivileged uid with RLIMIT_NPROC 1 (no
    fork: no shell, no subprocess, no fork bomb) and no_new_privs, after pre-importing
    ``preload`` modules. Not root: a new user + network namespace where the kernel allows it
    (``network_isolated`` says whether it did), RLIMIT_NPROC at the user's current process
    count, and the program runs as the user (no uid separation). Not a defence against kernel
    exploits; for hostile-at-scale code use a container or gVisor around the trainer.
    """

    FILESYSTEM = ("auto", "mount_namespace", "landlock")

    PRELOAD = ("math", "cmath", "json", "re", "itertools", "functools", "collections",
               "fractions", "decimal", "statistics", "random", "string", "heapq", "bisect",
               "datetime", "operator", "copy", "numbers", "array", "textwrap", "typing",
               "dataclasses", "traceback", "io", "linecache")

    def __init__(self, config: dict | None = None, tool_schema=None):
        super().__init__(config, tool_schema or _schema(
            "python", "Run a Python program and return what it prints (stdout and stderr).",
            "code", "a complete Python program; print the results you need"))
        c = self.config
        self.timeout_s = float(c.get("timeout_s", 10.0))
        # CPU seconds above the wall clock, so that the wall clock is what stops a busy loop
        self.cpu_s = int(c.get("cpu_s", math.ceil(self.timeout_s) + 1))
        self.memory_mb = int(c.get("memory_mb", 512))
        self.max_output_bytes = int(c.get("max_output_bytes", 16384))
        self.max_file_mb = int(c.get("max_file_mb", 8))
        self.max_code_chars = int(c.get("max_code_chars", 20000))
        self.preload = list(c.get("preload", self.PRELOAD))
        self.filesystem = str(c.get("filesystem", "auto"))
        if self.filesystem not in self.FILESYSTEM:
            raise UserInputError(f"python tool: filesystem={self.filesystem!r}; use one of "
                                 f"{', '.join(self.FILESYSTEM)}")
        self.max_running = c.get("max_running")
        if self.max_running is not None and (isinstance(self.max_running, bool) or not
                                             isinstance(self.max_running, int) or
                                             self.max_running < 1):
            raise UserInputError(f"python tool: max_running={self.max_running!r}; expected an "
                                 "int >= 1 (programs at once) or null (one per program CPU)")
        self._turns: dict[Any, asyncio.Semaphore] = {}  # per event loop
        self.network_isolated: bool | None = None  # known after the first run
        self.filesystem_isolation: str | None = None  # likewise

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs):
        code = parameters.get("code")
        if not isinstance(code, str):
            return ToolResponse(text='Error: the argument "code" (a string) is missing'), 0.0, {}
        if len(code) > self.max_code_chars:
            return ToolResponse(text=f"Error: the program is longer than {self.max_code_chars} "
                                "characters"), 0.0, {}
        text, metrics = await self.run(code)
        return ToolResponse(text=text), 0.0, metrics

    def _read_status(self, text: str) -> None:
        self.network_isolated = "netns=1" in text
        fs = next((line.split("=", 1)[1] for line in text.splitlines()
                   if line.startswith("filesystem=")), None)
        if fs == "none" and self.filesystem_isolation != "none":
            logger.warning("python tool: the kernel refused both a mount namespace and Landlock: "
                        "programs can read every file their uid can")
        self.filesystem_isolation = fs

    def _turn(self, cpus: list[int]) -> asyncio.Semaphore:
        """This event loop's bound on programs running at once."""
        loop = asyncio.get_running_loop()
        if loop not in self._turns:
            self._turns = {lp: sem for lp, sem in self._turns.items() if not lp.is_closed()}
            self._turns[loop] = asyncio.Semaphore(self.max_running or max(1, len(cpus)))
        return self._turns[loop]

    async def run(self, code: str) -> tuple[str, dict[str, Any]]:
        """(what the program printed, bounded; metrics) for one program, once one of the
        ``max_running`` turns is free."""
        cpus = program_cpus()
        async with self._turn(cpus):
            return await self._run(code, cpus)

    async def _run(self, code: str, cpus: list[int]) -> tuple[str, dict[str, Any]]:
        tmp = tempfile.mkdtemp(prefix="megarl_py_")
        root = os.geteuid() == 0
        uid = _fresh_uid() if root else -1
        settings = {"parent": os.getpid(), "uid": uid, "memory_mb": self.memory_mb,
                    "cpu_s": self.cpu_s, "file_mb": self.max_file_mb, "preload": self.preload,
                    "filesystem": self.filesystem, "cpus": cpus}
        out_path = os.path.join(tmp, OUTPUT_FILE)
        timed_out = False
        rc: int | None = None
        deadline = time.monotonic() + self.timeout_s  # from the spawn: a late resume counts
        try:
            Path(tmp, "main.py").write_text(code)
            if root:
                os.chown(tmp, uid, uid)
            with open(out_path, "wb") as out:
                if root:
                    os.chown(out_path, uid, uid)
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-I", _RUNNER, tmp, json.dumps(settings),
                    stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out, cwd=tmp,
                    env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1",
                         "OPENBLAS_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"},
                    start_new_session=True)
            try:
                rc = await asyncio.wait_for(proc.wait(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                timed_out = True
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                if root:
                    _kill_uid(uid)
                if rc is None:
                    rc = await proc.wait()
            # RLIMIT_CPU (cpu_s > timeout_s) ends a busy program only after its wall-clock time
            # ran out; a loaded host can deliver that kill before the timer: one cause, one text.
            if rc in (-signal.SIGKILL, -signal.SIGXCPU):
                timed_out = timed_out or time.monotonic() >= deadline
            status = Path(tmp, ".status")
            if status.exists():
                self._read_status(status.read_text())
            with open(out_path, "rb") as f:
                data = f.read(self.max_output_bytes + 1)
                size = os.fstat(f.fileno()).st_size
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        text = data[: self.max_output_bytes].decode("utf-8", errors="replace")
        if size > self.max_output_bytes:
            text += f"\n...(output truncated: {size} bytes, the first {self.max_output_bytes} shown)"
        if timed_out:
            text += f"\nError: the program did not finish within {self.timeout_s:g} s and was killed"
        elif rc is not None and rc < 0:
            try:
                name = signal.Signals(-rc).name
            except ValueError:
                name = f"signal {-rc}"
            text += f"\nError: the program was killed by {name}" + (
                " (CPU time limit)" if name == "SIGXCPU" else "")
        return text, {"timed_out": timed_out, "exit_code": rc, "output_bytes": size}
