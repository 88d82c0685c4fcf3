"""The package layout keeps its layers: lower layers never import the ones above them (checked
on the source with ast, so a lazy import inside a function counts too)."""

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


@pytest.mark.parametrize("package, forbidden", [
    ("data", ("megarl.demo", "megarl.trainer", "megarl.rollout", "megarl.backends")),
    ("algos", ("megarl.trainer", "megarl.backends", "megarl.rollout", "megarl.demo")),
    ("models", ("megarl.trainer", "megarl.backends", "megarl.demo")),
    ("rewards", ("megarl.trainer", "megarl.demo", "megarl.backends")),
])
def test_lower_layers_do_not_import_upper_ones(package, forbidden):
    bad = {f"{f.relative_to(ROOT.parent)}: {m}" for f in (ROOT / package).rglob("*.py")
           for m in imported_modules(f) if m.startswith(forbidden)}
    assert not bad, sorted(bad)


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
