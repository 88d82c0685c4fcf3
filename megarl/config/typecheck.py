"""Plain nested dict -> typed dataclass tree, collecting every problem instead of stopping at one.

Rules (strict on purpose, so a typo never silently becomes a different number):
- unknown keys are errors that name the closest valid key (difflib) or list the valid ones;
- ``int`` takes ints only (no bools, no floats, not even 32.0);
- ``float`` takes floats, ints, and strings that parse as floats ("1e-6", which YAML 1.1 reads
  as a string);
- ``str`` takes strings, and ints/floats converted with ``str`` (``experiment_name=2024``);
- ``bool`` takes booleans only;
- ``Literal[...]`` takes one of its values (an int whose ``str`` is a value also counts, so
  PACS's ``reward_method=1`` reads as ``"1"``); a field's ``metadata["aliases"]`` maps other
  spellings to a canonical value before the check;
- ``list[X]`` takes a list, or one plain value read as a one-element list (verl accepts
  ``trainer.logger=console`` as well as ``[console]``);
- ``X | None`` takes null; unions try their members in order.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import logging
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, Union

log = logging.getLogger("megarl.config")

Where = Callable[[str], str]  # dotted key -> " (from ...)" suffix, or ""


class _Fail(Exception):
    """Internal: a value does not fit a type (the message is the 'expected ...' part)."""


def _join(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def describe(tp: Any) -> str:
    """Human name of a type annotation: ``int or null``, ``one of 'a', 'b'``, ``list of str``."""
    origin = typing.get_origin(tp)
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any value"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(describe(a) for a in typing.get_args(tp))
    if origin is list:
        (arg,) = typing.get_args(tp) or (Any,)
        return f"list of {describe(arg)}"
    if origin is dict:
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _convert(tp: Any, value: Any, path: str, errors: list[str], where: Where) -> Any:
    """Convert ``value`` to ``tp``; raise _Fail when it does not fit at this level. Problems
    inside nested containers/dataclasses are appended to ``errors`` (they are located deeper)."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise _Fail("a mapping (a config section)")
        return build(tp, value, path, errors, where)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise _Fail(describe(tp))
        for arg in args:
            if arg is type(None):
                continue
            sub: list[str] = []
            try:
                out = _convert(arg, value, path, sub, where)
            except _Fail:
                continue
            if not sub:
                return out
        raise _Fail(describe(tp))
    if value is None:
        raise _Fail(describe(tp))
    if origin is Literal:
        choices = typing.get_args(tp)
        for c in choices:
            if type(c) is type(value) and c == value:
                return value
        if isinstance(value, int) and not isinstance(value, bool) and str(value) in choices:
            return str(value)
        raise _Fail(describe(tp))
    if origin is list:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            value = [value]  # verl's plain-string spelling: logger=console is [console]
        if not isinstance(value, (list, tuple)):
            raise _Fail(describe(tp))
        (arg,) = typing.get_args(tp) or (Any,)
        return [_convert_reported(arg, v, f"{path}[{i}]", errors, where) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise _Fail("a mapping")
        _, arg = typing.get_args(tp) or (str, Any)
        return {k: _convert_reported(arg, v, _join(path, k), errors, where) for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _Fail("bool (true or false)")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _Fail("int")
    if tp is float:
        if isinstance(value, bool):
            raise _Fail("float")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise _Fail("float") from None
        raise _Fail("float")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise _Fail("str")
    raise TypeError(f"{path}: unsupported annotation {tp!r} in the schema")  # a schema bug


def _convert_reported(
    tp: Any, value: Any, path: str, errors: list[str], where: Where, aliases: dict | None = None
) -> Any:
    """Like _convert, but a misfit becomes an error line (and the value is returned as is)."""
    if aliases and isinstance(value, str) and value in aliases:
        log.info("%s: %r read as %r", path, value, aliases[value])
        value = aliases[value]
    try:
        return _convert(tp, value, path, errors, where)
    except _Fail as fail:
        expected = str(fail)
        if typing.get_origin(tp) is Literal or _is_optional_literal(tp):
            msg = f"{path}: invalid choice {value!r}; expected {expected}"
        else:
            msg = f"{path}: expected {expected}, got {_type_name(value)} {value!r}"
        if aliases:
            msg += " (also accepted: " + ", ".join(f"{a!r} = {c!r}" for a, c in aliases.items()) + ")"
        errors.append(msg + where(path))
        return value


def _is_optional_literal(tp: Any) -> bool:
    if typing.get_origin(tp) not in (Union, types.UnionType):
        return False
    rest = [a for a in typing.get_args(tp) if a is not type(None)]
    return len(rest) == 1 and typing.get_origin(rest[0]) is Literal


def unknown_key_message(path: str, key: str, valid: list[str]) -> str:
    """``a.b.nn: unknown key; did you mean n?`` or ``...; valid keys: ...``."""
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if not close and len(key) >= 3:  # 'log_prob_micro' -> 'log_prob_micro_batch_size_per_gpu'
        close = [v for v in valid if v.startswith(key) or (len(v) >= 3 and key.startswith(v))][:1]
    full = _join(path, key)
    if close:
        return f"{full}: unknown key; did you mean {close[0]}?"
    return f"{full}: unknown key; valid keys: {', '.join(valid)}"


@functools.cache
def type_hints(cls: type) -> dict[str, Any]:
    """``typing.get_type_hints(cls)``, computed once per schema class."""
    return typing.get_type_hints(cls)


def build(cls: type, data: dict, path: str, errors: list[str], where: Where) -> Any:
    """Instantiate dataclass ``cls`` from ``data``; problems are appended to ``errors``.
    Missing keys take the dataclass defaults; values that do not fit are reported and replaced
    by the default so that checking can go on."""
    hints = type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    names = [f.name for f in fields]
    for key in data:
        if key not in names:
            errors.append(unknown_key_message(path, str(key), names) + where(_join(path, key)))
    kwargs = {}
    for f in fields:
        if f.name not in data:
            continue
        sub = _join(path, f.name)
        n_before = len(errors)
        value = _convert_reported(hints[f.name], data[f.name], sub, errors, where, f.metadata.get("aliases"))
        bad_here = any(e.startswith(sub + ":") for e in errors[n_before:])
        if not bad_here:
            kwargs[f.name] = value
    return cls(**kwargs)
