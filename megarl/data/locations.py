"""Where models and data files are: a plain path, or ``scheme://name`` for a location some
package knows how to produce (megarl's embedded demo assets are ``embedded://...``).

Schemes are plugins: a package names its resolver under the ``megarl.path_schemes`` entry-point
group (megarl's own: ``embedded = megarl.demo.assets:resolve_uri`` in setup.py), or calls
`register_scheme` at run time. This layer never imports a resolver before a path asks for it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from importlib.metadata import entry_points

from megarl.errors import UserInputError

ENTRY_POINT_GROUP = "megarl.path_schemes"
_resolvers: dict[str, Callable[[str], str]] = {}


def register_scheme(scheme: str, resolver: Callable[[str], str]) -> None:
    """``resolver(location) -> local path`` for locations written ``scheme://...``."""
    _resolvers[scheme] = resolver


def _resolver(scheme: str) -> Callable[[str], str] | None:
    if scheme not in _resolvers:
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if ep.name == scheme:
                _resolvers[scheme] = ep.load()
                break
    return _resolvers.get(scheme)


def resolve_path(path: str | os.PathLike) -> str:
    """A local path for ``path``: plain paths pass through, ``scheme://...`` goes to the
    scheme's resolver (which may build what it names, e.g. the demo assets)."""
    text = os.fspath(path)
    scheme, sep, _ = text.partition("://")
    if not sep or not scheme.isidentifier():
        return text
    resolver = _resolver(scheme)
    if resolver is None:
        known = sorted({*_resolvers, *(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))})
        raise UserInputError(
            f"{text}: no resolver for {scheme}:// locations (known: {', '.join(known) or 'none'}; "
            "megarl's own are registered when it is installed: pip install -e .)"
        )
    return resolver(text)
