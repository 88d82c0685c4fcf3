"""megarl's dotted config keys: is a key in the schema, which key an alias spelling is read as.

Shared by the loader (``~key`` deletions) and the verl rules table
(``megarl.config.verl_compat``), which both sit above this module.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from megarl.config.aliases import canonical_keys, set_path
from megarl.config.errors import ConfigError
from megarl.config.provenance import walk
from megarl.config.schema import Config
from megarl.config.typecheck import type_hints, unknown_key_message


@functools.cache
def schema_problem(dotted: str) -> str | None:
    """An unknown-key message if ``dotted`` is not a key of the schema, else None (also for a
    key inside a free-form mapping such as ``reward_kwargs``)."""
    cls: Any = Config
    done: list[str] = []
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(cls):
            return None  # inside a free-form mapping (reward_kwargs)
        names = [f.name for f in dataclasses.fields(cls)]
        if part not in names:
            return unknown_key_message(".".join(done), part, names)
        cls = type_hints(cls)[part]
        done.append(part)
    return None


_MARK = "\0megarl-mark\0"


@functools.cache
def canonical_path(dotted: str) -> str:
    """The megarl key that an (alias) dotted key is read as; ``dotted`` itself when it is no
    alias or cannot be read alone."""
    single: dict = {}
    set_path(single, dotted, _MARK)
    try:
        canon = canonical_keys(single, "override")
    except ConfigError:
        return dotted
    return next((p for p, v in walk(canon) if v == _MARK), dotted)
