"""The package layout keeps its layers: lower layers never import the ones above them, and no
modules import each other in a circle (checked on the source with ast, so a lazy import inside a
function counts too)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "megarl"


def imported_modules(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


# The packages of megarl/ in layers, bottom first (docs/design.md, "Seams"): a package imports
# only packages of lower layers, never one of its own layer or above, so the package graph has
# no loop and each layer can be read without the ones above it.
LAYERS = (
    ("errors",),
    ("metrics", "utils", "logging"),
    ("algos", "models"),
    ("config", "data"),
    ("rewards",),
    ("rollout", "backends"),
    ("judge", "demo"),
    ("trainer",),
)


def package_of(module: str) -> str | None:
    """``megarl.X...`` -> ``X`` (a top-level module or package of megarl); None for the rest."""
    parts = module.split(".")
    return parts[1] if parts[0] == "megarl" and len(parts) > 1 else None


def test_every_package_has_a_layer():
    packages = {p.name.removesuffix(".py") for p in ROOT.iterdir()
                if p.suffix == ".py" or (p / "__init__.py").exists()} - {"__init__"}
    layered = {p for layer in LAYERS for p in layer}
    assert packages == layered, (sorted(packages - layered), sorted(layered - packages))


def test_packages_import_only_lower_layers():
    """Every import (lazy ones inside functions included) goes to a lower layer. Before:
    rollout and backends imported each other (rollout/consistency.py), and so did rollout and
    rewards (the judge's engine)."""
    level = {p: i for i, layer in enumerate(LAYERS) for p in layer}
    graph = import_graph(REPO, ("megarl",))
    bad = sorted(f"{src} -> {dst}" for src, targets in graph.items() for dst in targets
                 if (a := package_of(src)) and (b := package_of(dst)) and a != b
                 and level[b] >= level[a])
    assert not bad, bad


def test_reward_pool_interface_does_not_import_its_implementations():
    mods = imported_modules(ROOT / "rewards" / "pool.py")
    assert not {m for m in mods if m.endswith(("local_pool", "ray_pool", "factory"))}


def test_embedded_scheme_is_a_registered_plugin(tmp_path):
    """embedded:// reaches the demo through the megarl.path_schemes entry point, and any
    package can add a scheme."""
    from importlib.metadata import entry_points

    from megarl.data import register_scheme, resolve_path
    from megarl.demo.assets import resolve_uri
    from megarl.errors import UserInputError

    (ep,) = [e for e in entry_points(group="megarl.path_schemes") if e.name == "embedded"]
    assert ep.load() is resolve_uri
    assert resolve_path(str(tmp_path)) == str(tmp_path)
    with pytest.raises(UserInputError, match="no resolver for nowhere://"):
        resolve_path("nowhere://x")
    register_scheme("here", lambda loc: str(tmp_path / loc.removeprefix("here://")))
    assert resolve_path("here://a/b") == str(tmp_path / "a" / "b")


# --- import circles ------------------------------------------------------------------------

REPO = ROOT.parent
GRAPH_PACKAGES = ("megarl", "conversion", "launch")


def module_files(repo: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file under ``packages`` (a package is its
    ``__init__.py``)."""
    out = {}
    for package in packages:
        for path in sorted((repo / package).rglob("*.py")):
            parts = path.relative_to(repo).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph(repo: Path = REPO, packages: tuple[str, ...] = GRAPH_PACKAGES,
                 ) -> dict[str, set[str]]:
    """Module -> the modules of ``packages`` it imports anywhere in its source (lazy imports
    inside functions count). ``from P import N`` is an import of the module ``P.N`` when that is
    a file, else of ``P``; relative imports are resolved against the importing module. Parent
    packages that Python runs first are not edges: importing ``a.b`` runs ``a/__init__.py``
    without depending on it."""
    files = module_files(repo, packages)
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # the package of `name`, then one level up per extra dot
                    package = name.split(".")[:None if path.name == "__init__.py" else -1]
                    anchor = package[:len(package) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in files else base
                               for a in node.names)
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def _shortest_cycle(graph: dict[str, set[str]], start: str, within: set[str]) -> list[str]:
    """The shortest chain start -> ... -> start inside ``within`` (breadth first)."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for succ in sorted(graph[node] & within):
                if succ == start:
                    chain = [node]
                    while chain[-1] != start:
                        chain.append(came_from[chain[-1]])
                    return [start, *reversed(chain[:-1]), start]
                if succ not in came_from:
                    came_from[succ] = node
                    nxt.append(succ)
        frontier = nxt
    return []


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every circle of ``graph`` as a chain [a, b, ..., a]: the strongly connected components of
    two or more modules (Tarjan), and in each the shortest circle through each of its modules
    (rotations of one circle counted once)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:  # node is the root of a component: pop it off the stack
            at = stack.index(node)
            component = set(stack[at:])
            del stack[at:]
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    cycles, seen = [], set()
    for component in components:
        for node in sorted(component):
            chain = _shortest_cycle(graph, node, component)
            key = frozenset(zip(chain, chain[1:]))
            if key not in seen:
                seen.add(key)
                cycles.append(chain)
    return sorted(cycles)


def test_no_import_circles():
    """The import graph of megarl/, conversion/ and launch/ has no circle (modules that import
    each other in a loop, lazy imports included): each circle found is printed as its chain.

    Before the cuts that broke them it failed naming its four circles, e.g.
    ``megarl.demo.assets -> megarl.demo.build -> megarl.demo.assets`` and
    ``megarl.trainer.async_rollout -> megarl.trainer.trainer -> megarl.trainer.parts ->
    megarl.trainer.builders -> megarl.trainer.async_rollout``. Planted after them:
    ``import megarl.config.errors`` at the end of megarl/errors.py (config/errors.py imports
    megarl.errors) fails with ``megarl.config.errors -> megarl.errors -> megarl.config.errors``."""
    cycles = import_cycles(import_graph())
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_import_graph_reads_every_kind_of_import(tmp_path):
    """The checker itself, on a planted package: absolute, relative (``.`` and ``..``), lazy
    (inside a function), ``from P import module`` and ``import P.m as x`` all make edges, and
    each circle comes back as a chain."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    sources = {
        "__init__.py": "from pkg.a import A\n",
        "a.py": "from .b import B\nA = 1\n",
        "b.py": "def f():\n    from pkg.sub import c\nB = 2\n",
        "sub/__init__.py": "",
        "sub/c.py": "import pkg.d as d\n",
        "sub/e.py": "from .. import a\nfrom . import c\n",
        "d.py": "from pkg import a\nimport os\n",
        "f.py": "from pkg import A\n",
    }
    for name, text in sources.items():
        (pkg / name).write_text(text)
    graph = import_graph(tmp_path, ("pkg",))
    assert graph == {
        "pkg": {"pkg.a"}, "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.sub.c"}, "pkg.sub": set(),
        "pkg.sub.c": {"pkg.d"}, "pkg.sub.e": {"pkg.a", "pkg.sub.c"}, "pkg.d": {"pkg.a"},
        "pkg.f": {"pkg"},
    }
    assert import_cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c", "pkg.d", "pkg.a"]]
    graph["pkg.sub.c"].add("pkg.b")  # a second, shorter circle through b
    assert import_cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c", "pkg.d", "pkg.a"],
                                    ["pkg.b", "pkg.sub.c", "pkg.b"]]
