"""The SGLang adapter's contract with SGLang itself, read from the released source.

SGLang cannot be imported here (its wheel pins a CUDA torch), so this test reads the pinned
wheel as a zip file and parses its Python source with `ast`, never importing it. The wheel is
taken from ``.venv/engine-wheels/`` (``make install`` puts it there) or else downloaded with
``pip download --no-deps`` into pytest's cache; without either the tests skip.

What the adapter sends is not listed here by hand: the adapter is run against a recording
stand-in for the ``sglang`` module (`adapter_calls`), and every keyword it passed, every
sampling-parameter key and every output key it read is then looked up in the source:
``sglang.Engine(...)`` keywords among the ``ServerArgs`` fields, each engine method's keywords
in that method's signature (and its required parameters among them), the sampling keys among
the fields of ``SamplingParams``, the memory tags among the ``GPU_MEMORY_TYPE_*`` constants,
and the output keys among those SGLang's tokenizer manager writes.

Checked on the pinned release and on the lower bound of `SUPPORTED_SGLANG`. The checks are
precise to the name: renaming the adapter's ``sampling_seed`` key to ``seed`` fails
test_sampling_keys_are_sglang_fields with "SamplingParams has no field(s) ['seed']", and
renaming ``release_memory_occupation(tags=...)`` to ``tag=`` fails
test_engine_methods_take_the_adapters_keywords (both planted once, by hand, while writing it).
"""

from __future__ import annotations

import ast
import sys
import types
import zipfile
from pathlib import Path

import pytest
import torch
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from released_wheels import cache_folder, released_wheel

from megarl.config import Config
from megarl.rollout.protocol import SamplingParams
from megarl.rollout.sglang import engine as adapter
from megarl.trainer.settings import rollout_settings

PINNED = "0.5.23"  # the newest release; the adapter is checked against it
LOWER = "0.5.5"  # the lower bound of SUPPORTED_SGLANG
# One wheel for every machine (the Python source is the same in each platform's wheel).
PIP_ARGS = ["--no-deps", "--only-binary=:all:", "--platform", "manylinux_2_34_x86_64",
            "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311"]


# ----------------------------------------------------------------------------- the wheel


class Source:
    """The Python modules of a wheel, parsed on demand (never imported)."""

    def __init__(self, wheel: Path) -> None:
        self.zip = zipfile.ZipFile(wheel)
        self.names = set(self.zip.namelist())
        self.trees: dict[str, ast.Module] = {}

    def module(self, dotted: str) -> ast.Module:
        if dotted not in self.trees:
            base = dotted.replace(".", "/")
            path = next(p for p in (f"{base}.py", f"{base}/__init__.py") if p in self.names)
            self.trees[dotted] = ast.parse(self.zip.read(path).decode())
        return self.trees[dotted]

    def class_def(self, dotted: str, name: str) -> ast.ClassDef:
        return find_class(self.module(dotted), name)


# ----------------------------------------------------------------------------- ast helpers


def find_class(tree: ast.Module, name: str) -> ast.ClassDef:
    found = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    assert found, f"no class {name}"
    return found[0]


def find_method(cls: ast.ClassDef, name: str) -> ast.FunctionDef | None:
    return next((n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and n.name == name), None)


def keyword_params(func: ast.FunctionDef) -> tuple[set[str], set[str]]:
    """(names a caller may pass by keyword, the required ones) of a method (self dropped)."""
    a = func.args
    positional = (a.posonlyargs + a.args)[1:]
    defaulted = {x.arg for x in positional[len(positional) - len(a.defaults):]} if a.defaults \
        else set()
    names = {x.arg for x in a.args[1:] if x not in a.posonlyargs} | {x.arg for x in a.kwonlyargs}
    required = {x.arg for x in positional if x.arg not in defaulted}
    required |= {x.arg for x, d in zip(a.kwonlyargs, a.kw_defaults) if d is None}
    return names, required


def fields(cls: ast.ClassDef) -> set[str]:
    """Annotated class attributes: the fields of a dataclass or msgspec.Struct."""
    return {n.target.id for n in cls.body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def constructor_params(cls: ast.ClassDef) -> set[str]:
    """Keyword names of ``cls(...)``: its own ``__init__``, else its fields."""
    init = find_method(cls, "__init__")
    return keyword_params(init)[0] if init is not None else fields(cls)


def module_value(tree: ast.Module, name: str) -> ast.expr | None:
    """The expression a module-level ``name = ...`` assigns (the last one), or None."""
    value = None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            value = node.value
    return value


def imported_from(tree: ast.Module, name: str) -> str:
    """The module a ``from M import name`` of ``tree`` takes ``name`` from."""
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and any(a.name == name for a in node.names):
            return node.module
    raise AssertionError(f"{name} is not imported by name")


def server_args_fields(src: Source) -> set[str]:
    """The ``ServerArgs`` fields, i.e. the keywords ``sglang.Engine(**kwargs)`` accepts. Up to
    0.5.19 ServerArgs is a dataclass; later releases assemble it from the namespace classes
    listed in ``_INPUT_NAMESPACES``."""
    tree = src.module("sglang.srt.server_args")
    names = fields(find_class(tree, "ServerArgs"))
    namespaces = module_value(tree, "_INPUT_NAMESPACES")
    for ns in namespaces.elts if namespaces is not None else []:
        names |= fields(src.class_def(imported_from(tree, ns.id), ns.id))
    return names


def keys_written(tree: ast.Module, target: str) -> set[str]:
    """String keys stored into a variable ``target``: ``target["k"] = ...`` and the keys of
    a dict literal assigned to it."""
    keys: set[str] = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name) and node.value.id == target
                and isinstance(node.slice, ast.Constant)):
            keys.add(node.slice.value)
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict) and any(
            isinstance(t, ast.Name) and t.id == target for t in node.targets
        ):
            keys |= {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
    return keys


def dict_literals_with(tree: ast.AST, key: str) -> list[dict[str, ast.expr]]:
    """Every dict literal under ``tree`` that has the string key ``key``, as {key: value}."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            d = {k.value: v for k, v in zip(node.keys, node.values)
                 if isinstance(k, ast.Constant) and isinstance(k.value, str)}
            if key in d:
                found.append(d)
    return found


def attributes(tree: ast.AST) -> set[str]:
    """Every attribute name read or written under ``tree`` (``x.name``)."""
    return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}


def string_constants(tree: ast.AST) -> set[str]:
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
            and isinstance(n.value, str)}


# ----------------------------------------------------------------------------- what the adapter does


class KeysRead(dict):
    """A dict that notes each key read from it in ``seen``."""

    def __init__(self, seen: set[str], data: dict) -> None:
        super().__init__(data)
        self.seen = seen

    def __getitem__(self, key):
        self.seen.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.seen.add(key)
        return super().get(key, default)


class RecordingEngine:
    """Stands in for ``sglang.Engine``: records the keywords of its construction and of each
    method call (positional arguments too, which the contract forbids)."""

    calls: list[tuple[str, tuple, dict]] = []
    read: dict[str, set[str]] = {}

    def __init__(self, *args, **kwargs) -> None:
        RecordingEngine.calls.append(("__init__", args, kwargs))

    def __getattr__(self, method: str):
        def call(*args, **kwargs):
            RecordingEngine.calls.append((method, args, kwargs))
            if method == "generate":
                return [self.output(ids) for ids in kwargs["input_ids"]]
            return (True, "") if method == "update_weights_from_tensor" else None
        return call

    def output(self, input_ids: list[int]) -> dict:
        top, meta, finish = (self.read.setdefault(k, set()) for k in ("out", "meta", "finish"))
        token = input_ids[-1]
        return KeysRead(top, {"output_ids": [token], "meta_info": KeysRead(meta, {
            "output_token_logprobs": [(-0.5, token, None)],
            "finish_reason": KeysRead(finish, {"type": "stop"})})})


@pytest.fixture(scope="module")
def adapter_calls() -> tuple[list[tuple[str, tuple, dict]], dict[str, set[str]]]:
    """Every call the adapter makes on ``sglang.Engine`` in one run of the trainer's cycle
    (build, generate with every sampling option, sleep, weight sync, wake, close), and the
    output keys it read."""
    RecordingEngine.calls, RecordingEngine.read = [], {}
    fake = types.SimpleNamespace(__version__=PINNED, Engine=RecordingEngine)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "sglang", fake)
        mp.delenv(adapter.ORIGINAL_LOGPROB_ENV, raising=False)
        eng = adapter.SGLangEngine.from_rollout_settings(rollout_settings(Config()), "/model",
                                                         env={"LOCAL_RANK": "0"})
    sampling = SamplingParams(n=2, temperature=0.7, top_k=5, top_p=0.9, stop=["\n"],
                              stop_token_ids=[2], seed=3, ignore_eos=True)
    eng.generate([[1, 7]], sampling, prompt_keys=[4])
    eng.sleep()
    eng.update_weights([("model.w", torch.zeros(2))])
    eng.wake()
    eng.close()
    return RecordingEngine.calls, RecordingEngine.read


@pytest.fixture(scope="module", params=[PINNED, LOWER])
def src(request, tmp_path_factory) -> Source:
    folder = cache_folder(request, tmp_path_factory, "sglang-wheels")
    return Source(released_wheel("sglang", request.param, folder, PIP_ARGS))


# ----------------------------------------------------------------------------- the contract


def test_tested_releases_are_the_supported_range():
    spec = SpecifierSet(adapter.SUPPORTED_SGLANG)
    assert Version(PINNED) in spec and Version(LOWER) in spec
    lower = [s.version for s in spec if s.operator == ">="]
    assert lower == [LOWER], "test the lower bound of SUPPORTED_SGLANG"


def test_module_exports_engine_and_version(src):
    tree = src.module("sglang")
    names = {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
             if isinstance(t, ast.Name)}
    names |= {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom)
              for a in n.names}
    assert {"Engine", "__version__"} <= names


def test_engine_keywords_are_server_args_fields(src, adapter_calls):
    calls, _ = adapter_calls
    (_, args, kwargs), = [c for c in calls if c[0] == "__init__"]
    assert not args, "pass sglang.Engine arguments by keyword"
    unknown = sorted(set(kwargs) - server_args_fields(src))
    assert not unknown, f"ServerArgs has no field(s) {unknown}"
    # what makes per-request seeds count, and what lets the engine release its memory
    assert kwargs["enable_deterministic_inference"] is True
    assert kwargs["enable_memory_saver"] is True


def test_engine_methods_take_the_adapters_keywords(src, adapter_calls):
    calls, _ = adapter_calls
    engine_cls = src.class_def("sglang.srt.entrypoints.engine", "Engine")
    used = [c for c in calls if c[0] != "__init__"]
    assert {m for m, _, _ in used} == {"generate", "update_weights_from_tensor", "flush_cache",
                                       "release_memory_occupation", "resume_memory_occupation",
                                       "shutdown"}
    for method, args, kwargs in used:
        func = find_method(engine_cls, method)
        assert func is not None, f"sglang.Engine has no method {method}"
        assert not args, f"{method}: pass arguments by keyword"
        names, required = keyword_params(func)
        assert set(kwargs) <= names, f"Engine.{method} takes no {sorted(set(kwargs) - names)}"
        assert required <= set(kwargs), f"Engine.{method} also needs {sorted(required)}"


def test_sampling_keys_are_sglang_fields(src, adapter_calls):
    calls, _ = adapter_calls
    (_, _, kwargs), = [c for c in calls if c[0] == "generate"]
    keys = {k for params in kwargs["sampling_params"] for k in params}
    sglang_params = src.class_def("sglang.srt.sampling.sampling_params", "SamplingParams")
    unknown = sorted(keys - constructor_params(sglang_params))
    assert not unknown, f"SamplingParams has no field(s) {unknown}"
    assert len(keys) == 9, "every sampling option the adapter maps was exercised"


def test_memory_tags_are_all_of_sglangs(src, adapter_calls):
    calls, _ = adapter_calls
    tree = src.module("sglang.srt.constants")
    sglang_tags = {ast.literal_eval(module_value(tree, name)) for name in
                   ("GPU_MEMORY_TYPE_WEIGHTS", "GPU_MEMORY_TYPE_KV_CACHE",
                    "GPU_MEMORY_TYPE_CUDA_GRAPH")}
    every = module_value(tree, "GPU_MEMORY_ALL_TYPES")
    assert {e.id for e in every.elts} == {"GPU_MEMORY_TYPE_WEIGHTS", "GPU_MEMORY_TYPE_KV_CACHE",
                                          "GPU_MEMORY_TYPE_CUDA_GRAPH"}, "a new memory type"
    assert set(adapter.MEMORY_TAGS) == sglang_tags
    released = [t for m, _, kw in calls if m == "release_memory_occupation" for t in kw["tags"]]
    resumed = [t for m, _, kw in calls if m == "resume_memory_occupation" for t in kw["tags"]]
    assert sorted(released) == sorted(resumed) == sorted(sglang_tags)


def test_output_keys_are_written_by_sglang(src, adapter_calls):
    _, read = adapter_calls
    tree = src.module("sglang.srt.managers.tokenizer_manager")
    outputs = dict_literals_with(tree, "meta_info")
    assert any(read["out"] <= set(d) for d in outputs), f"no output dict with {read['out']}"
    meta = keys_written(tree, "meta_info") | {k for d in dict_literals_with(tree, "finish_reason")
                                              for k in d}
    assert read["meta"] <= meta, f"meta_info lacks {sorted(read['meta'] - meta)}"
    assert read["finish"] == {"type"}
    finish = src.module("sglang.srt.managers.schedule_batch")
    types_ = {d["type"].value for d in dict_literals_with(finish, "type")
              if isinstance(d["type"], ast.Constant)}
    assert {"stop", "length"} <= types_  # what check_finish accepts


def test_seeds_need_deterministic_inference(src):
    """SGLang builds a batch's seeds from the requests' sampling_seed only under
    enable_deterministic_inference (which the adapter turns on: a ServerArgs field)."""
    assert "enable_deterministic_inference" in server_args_fields(src)
    batch_info = src.module("sglang.srt.sampling.sampling_batch_info")
    assert {"enable_deterministic_inference", "sampling_seed"} <= attributes(batch_info)


def test_sampler_reads_the_refused_logprob_variable(src):
    sampler = src.module("sglang.srt.layers.sampler")
    assert adapter.ORIGINAL_LOGPROB_ENV in string_constants(sampler)
