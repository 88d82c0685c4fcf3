"""Where each value of a loaded config came from, and the startup report that says so.

The loader stacks layers, later wins: schema defaults < recipe files (``extends:`` chain, base
first) < the demo overlay (``configs/demo/NAME.yaml`` for each recipe NAME in the chain, only on
the embedded demo) < the user's own files < ``key=value`` overrides. ``Sources`` records, for
every dotted key, the last layer that wrote it; ``report`` lists every value that differs from
the schema default with that layer's name (or "derived" for the documented "None = X" fills and
interpolated defaults).
"""

from __future__ import annotations

import dataclasses
import json
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

DERIVED = "derived from other keys (schema rule or interpolation)"


def walk(tree: dict, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every node of a nested dict, parents before children."""
    for k, v in tree.items():
        path = f"{prefix}.{k}" if prefix else str(k)
        yield path, v
        if isinstance(v, dict):
            yield from walk(v, path)


def leaves(tree: dict, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value of the leaves (lists and empty mappings are leaves)."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        path = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and v:
            out.update(leaves(v, path))
        else:
            out[path] = v
    return out


class Sources:
    """Which layer set each key: ``record`` the layers in order (later wins); calling an instance
    with a key gives " (from LAYER)" for error messages, ``of`` gives the layer name."""

    def __init__(self) -> None:
        self.source: dict[str, str] = {}  # every node a layer wrote, mappings included
        self.leaf: dict[str, str] = {}  # values a layer wrote (not a mapping merged into)
        self.demo_layers: set[str] = set()  # names of the demo overlay's layers, when applied

    def record(self, layer: dict, source: str) -> None:
        for path, value in walk(layer):
            self.source[path] = source
            if not isinstance(value, dict) or not value:
                self.leaf[path] = source

    def written(self, key: str) -> str | None:
        """The layer that wrote the value of ``key`` itself (or a whole list / free-form mapping
        holding it); None when no layer did (a default, or filled from other keys)."""
        while key:
            if key in self.leaf:
                return self.leaf[key]
            key = key.rpartition(".")[0]
        return None

    def user_set(self, key: str) -> bool:
        """Whether the value of ``key`` is the user's: written by a recipe file, the user's own
        file or an override (not a schema default, a derived fill or the demo overlay)."""
        src = self.written(key)
        return src is not None and src not in self.demo_layers

    def of(self, key: str) -> str | None:
        """The layer that set ``key`` or its closest enclosing mapping; None if none did."""
        key = key.split("[", 1)[0]
        while key:
            if key in self.source:
                return self.source[key]
            key = key.rpartition(".")[0]
        return None

    def __call__(self, key: str) -> str:
        src = self.of(key)
        return f" (from {src})" if src else ""


@dataclass
class Resolved:
    """A loaded config with its provenance.

    config:      the validated, filled ``Config``.
    sources:     dotted key -> the layer that set it (only keys some layer wrote).
    layers:      layer names in the order applied (schema defaults first, overrides last).
    demo:        whether the demo overlay was applied; demo_reason says why (or why not).
    notices:     one line per verl key set to a non-default value that has no effect here.
    """

    config: Any
    sources: Sources
    layers: list[str] = field(default_factory=list)
    demo: bool = False
    demo_reason: str = ""
    name: str = ""
    notices: list[str] = field(default_factory=list)  # verl keys accepted without effect

    def non_defaults(self) -> list[tuple[str, Any, str]]:
        """(dotted key, value, source) of every leaf whose value differs from the schema's
        default. A value no layer wrote that equals what the schema fills in for an all-default
        config (critic.strategy = the actor's, ...) counts as a default."""
        from megarl.config.schema import Config
        from megarl.config.validate import fill_derived

        now = leaves(dataclasses.asdict(self.config))
        default = leaves(dataclasses.asdict(Config()))
        filled = leaves(dataclasses.asdict(fill_derived(Config(), set())[0]))
        out = []
        for key, value in now.items():
            src = self.sources.written(key)
            if default.get(key, _MISSING) == value:
                continue
            if src is None and filled.get(key, _MISSING) == value:
                continue
            out.append((key, value, src or DERIVED))
        return out

    def report(self) -> str:
        """The startup report: the layers, whether the demo overlay applies, and every value that
        differs from the schema default with the layer it came from. Values of keys this run
        does not read (``megarl.config.unused``: a critic's settings without a critic, ...) are
        named together on one line, with why, after the rest."""
        from megarl.config.unused import unused_reason, unused_reasons

        reasons = unused_reasons(self.config)
        rows, unused = [], {}  # unused: why -> keys
        for key, value, src in self.non_defaults():
            why = unused_reason(reasons, key)
            if why is None:
                rows.append((key, value, src))
            else:
                unused.setdefault(why, []).append(key)
        width = min(max((len(k) for k, _, _ in rows), default=0), 60)
        lines = [
            f"config {self.name}: layers, later wins: " + " < ".join(self.layers),
            f"demo overlay: {'applied' if self.demo else 'not applied'} ({self.demo_reason})",
            f"{len(rows)} values this run reads differ from the schema defaults "
            "(key = value  <- source):",
        ]
        for key, value, src in rows:
            lines.append(f"  {key.ljust(width)} = {_fmt(value)}  <- {src}")
        if unused:
            count = sum(map(len, unused.values()))
            lines.append(f"  {UNUSED} ({count}): " + "; ".join(
                f"{', '.join(keys)} ({why})" for why, keys in unused.items()))
        lines += [f"notice: {text}" for text in self.notices]
        return "\n".join(lines)


UNUSED = "set but not read by this run"
_MISSING = object()

# id(config) -> (a weak reference to it, its Sources): the provenance of the Config objects the
# loader returned, for code that is handed the Config alone (the trainer's startup notices)
_KNOWN: dict[int, tuple[weakref.ref, Sources]] = {}


def remember(config: Any, sources: Sources) -> None:
    """Record ``sources`` as the provenance of the Config object ``config`` (while it lives)."""
    key = id(config)
    _KNOWN[key] = (weakref.ref(config), sources)
    weakref.finalize(config, _KNOWN.pop, key, None)


def sources_of(config: Any) -> Sources | None:
    """The provenance recorded for this very Config object by the loader; None for a Config
    built or copied elsewhere."""
    entry = _KNOWN.get(id(config))
    if entry is None or entry[0]() is not config:
        return None
    return entry[1]


def _fmt(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=str)
