"""The README's and docs' ``python -m MODULE`` lines name modules that run (a module, or a
package with a ``__main__``), and the run folder the README names is the one a demo config
resolves to. Planted: ``python -m megarl.demo`` (a package without ``__main__``) fails."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from megarl.config.loader import resolve_config

REPO = Path(__file__).resolve().parents[2]
COMMAND = re.compile(r"python -m ([A-Za-z_][\w.]*)")


def _runnable(module: str) -> bool:
    spec = importlib.util.find_spec(module)
    if spec is None:
        return False
    if spec.submodule_search_locations is None:
        return True  # a plain module
    return importlib.util.find_spec(f"{module}.__main__") is not None


def test_python_dash_m_lines_run():
    texts = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    named = {m for path in texts for m in COMMAND.findall(path.read_text())}
    assert "megarl.demo.run" in named and "megarl.config" in named
    assert [m for m in sorted(named) if not _runnable(m)] == []


def test_readme_run_folder_is_the_demos():
    readme = (REPO / "README.md").read_text()
    run_dir = resolve_config("grpo").config.trainer.default_local_dir
    assert run_dir == "runs/megarl_demo/grpo"
    assert f"`{run_dir}`" in readme and "runs/<project>/<experiment>" in readme
