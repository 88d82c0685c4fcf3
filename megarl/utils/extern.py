"""Load a user's Python object named by configuration, the way verl names them.

    load_object("pkg://my_pkg.samplers", "Curriculum", key="data.sampler")  # an importable module
    load_object("file:///abs/path/samplers.py", "Curriculum", key="data.sampler")
    load_object("samplers.py", "Curriculum", key="data.sampler")  # a file, relative to the cwd

``pkg://a.b`` and ``pkg://a/b`` import module ``a.b``; anything else is a file path (with or
without ``file://``), imported once per process under a name derived from its absolute path.
The code is the user's own configuration and runs with the run's rights (as verl runs it); it is
never model output. Every failure is a `UserInputError` naming the configuration key.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from megarl.errors import UserInputError

PKG_PREFIX = "pkg://"
FILE_PREFIX = "file://"


def load_module(module_path: str, *, key: str) -> ModuleType:
    """The module ``module_path`` names (see the module docstring); ``key`` is the config key
    that holds it, named in every error."""
    if not module_path:
        raise UserInputError(f"{key}: empty module path; give pkg://<module> or a .py file")
    if module_path.startswith(PKG_PREFIX):
        name = module_path[len(PKG_PREFIX):].replace("/", ".").strip(".")
        try:
            return importlib.import_module(name)
        except ImportError as err:
            raise UserInputError(f"{key}={module_path!r}: module {name!r} cannot be imported "
                                 f"({err}); check the name and that it is on PYTHONPATH") from err
    path = Path(module_path[len(FILE_PREFIX):] if module_path.startswith(FILE_PREFIX)
                else module_path).expanduser()
    if not path.is_file():
        raise UserInputError(f"{key}={module_path!r}: no such file; give a .py file or "
                             "pkg://<importable.module>")
    path = path.resolve()
    name = "megarl_extern_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UserInputError(f"{key}={module_path!r} cannot be imported as a Python module; "
                             "use a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # pickling and dataclasses in the file look it up there
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        sys.modules.pop(name, None)
        raise UserInputError(f"{key}={module_path!r}: importing it failed with "
                             f"{type(err).__name__}: {err}") from err
    return module


def load_object(module_path: str, name: str, *, key: str) -> Any:
    """``getattr(load_module(module_path), name)``; an error naming ``key`` and the module's
    public names when it has no such attribute."""
    if not name:
        raise UserInputError(f"{key}: no object name given next to the module path")
    module = load_module(module_path, key=key)
    if not hasattr(module, name):
        public = sorted(k for k in vars(module) if not k.startswith("_"))[:20]
        raise UserInputError(f"{key}: {module_path!r} has no {name!r}; it defines {public}")
    return getattr(module, name)
