"""Load a config: YAML files (with ``extends:`` chains) + verl/Hydra ``key=value`` overrides ->
a validated, filled ``Config``.

Order of layers, later wins: schema defaults < base file < ... < the named file < overrides.
Mappings merge key by key; any other value (scalar, list) replaces the earlier one.
``${a.b}`` interpolations are resolved over the merged tree (defaults included) by OmegaConf.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megarl.config.aliases import canonical_keys
from megarl.config.errors import ConfigError
from megarl.config.schema import Config
from megarl.config.typecheck import build, unknown_key_message
from megarl.config.validate import check, fill_derived

_YAML_SUFFIXES = (".yaml", ".yml")


def config_dir() -> Path:
    """The recipes folder: ``$MEGARL_CONFIG_DIR`` if set, else ``configs/`` of the repository."""
    env = os.environ.get("MEGARL_CONFIG_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "configs"


def available_configs() -> list[str]:
    """Names (relative to ``config_dir()``, no suffix) of the recipe files."""
    root = config_dir()
    return sorted(str(p.relative_to(root).with_suffix("")) for p in root.rglob("*.yaml"))


def _find(name: str, dirs: Sequence[Path]) -> Path | None:
    for d in dirs:
        for cand in (d / name, *(d / (name + s) for s in _YAML_SUFFIXES)):
            if cand.is_file():
                return cand.resolve()
    return None


def _show(path: Path) -> str:
    """``path`` relative to the working directory when it lies below it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _read_yaml(path: Path) -> dict:
    try:
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except (yaml.YAMLError, OmegaConfBaseException) as e:
        raise ConfigError(f"{_show(path)}: not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{_show(path)}: the top level must be a mapping of sections, got {type(data).__name__}")
    if "defaults" in data:
        raise ConfigError(f"defaults: Hydra defaults lists are not read; use `extends: <base>` ({_show(path)})")
    return data


def _file_layers(path: Path, stack: tuple[Path, ...] = ()) -> list[tuple[str, dict]]:
    """[(source name, layer)] for ``path`` and the files it extends, base first."""
    if path in stack:
        chain = " -> ".join(_show(p) for p in (*stack, path))
        raise ConfigError(f"extends: cycle {chain}")
    data = _read_yaml(path)
    bases = data.pop("extends", None)
    if isinstance(bases, str):
        bases = [bases]
    if bases is not None and not (isinstance(bases, list) and all(isinstance(b, str) for b in bases)):
        raise ConfigError(f"extends: expected a file name or a list of them, got {bases!r} ({_show(path)})")
    layers: list[tuple[str, dict]] = []
    for base in bases or []:
        found = _find(base, [path.parent, config_dir()])
        if found is None:
            raise ConfigError(
                f"extends: cannot find {base!r} (in {_show(path)}); looked next to it and in "
                f"{_show(config_dir())}; available: {', '.join(available_configs())}"
            )
        layers += _file_layers(found, (*stack, path))
    layers.append((_show(path), data))
    return layers


def _set_path(tree: dict, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    node = tree
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[last] = value


def parse_override(text: str) -> tuple[str, str, Any]:
    """``key=value`` / ``+key=value`` / ``++key=value`` -> ("set", key, parsed value);
    ``~key`` -> ("del", key, None). Values are parsed as YAML (numbers, bools, null, lists
    ``[a,b]``, mappings ``{a: 1}``; ``1e-6`` is a float); an empty value is the empty string."""
    s = text.strip()
    if s.startswith("~"):
        return "del", s[1:].split("=", 1)[0].strip(), None
    s = s.lstrip("+")
    if "=" not in s:
        raise ConfigError(f"{text}: an override must be key=value (e.g. data.train_batch_size=64)")
    key, raw = (part.strip() for part in s.split("=", 1))
    if not key or any(not p for p in key.split(".")):
        raise ConfigError(f"{text}: bad key {key!r}; write dotted keys like actor_rollout_ref.actor.optim.lr")
    if raw == "":
        return "set", key, ""
    try:
        value = OmegaConf.to_container(OmegaConf.from_dotlist([f"v={raw}"]))["v"]
    except (yaml.YAMLError, OmegaConfBaseException) as e:
        raise ConfigError(f"{key}: cannot parse the value {raw!r}: {e}") from None
    return "set", key, value


def _merge(base: Any, top: Any) -> Any:
    if isinstance(base, dict) and isinstance(top, dict):
        out = dict(base)
        for k, v in top.items():
            out[k] = _merge(base[k], v) if k in base else v
        return out
    return top


def _walk(tree: dict, prefix: str = ""):
    for k, v in tree.items():
        path = f"{prefix}.{k}" if prefix else str(k)
        yield path, v
        if isinstance(v, dict):
            yield from _walk(v, path)


def _schema_problem(dotted: str) -> str | None:
    """An unknown-key message if ``dotted`` is not a key of the schema."""
    cls: Any = Config
    done: list[str] = []
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(cls):
            return None  # inside a free-form mapping (reward_kwargs)
        names = [f.name for f in dataclasses.fields(cls)]
        if part not in names:
            return unknown_key_message(".".join(done), part, names)
        cls = typing.get_type_hints(cls)[part]
        done.append(part)
    return None


_MARK = "\0megarl-mark\0"


def _canonical_path(dotted: str) -> str:
    """The megarl key that an (alias) dotted key is read as."""
    single: dict = {}
    _set_path(single, dotted, _MARK)
    try:
        canon = canonical_keys(single, "override")
    except ConfigError:
        return dotted
    return next((p for p, v in _walk(canon) if v == _MARK), dotted)


class _Provenance:
    """Which file or override set each key, for " (from ...)" in messages."""

    def __init__(self) -> None:
        self.source: dict[str, str] = {}

    def record(self, layer: dict, source: str) -> None:
        for path, _ in _walk(layer):
            self.source[path] = source

    def __call__(self, key: str) -> str:
        key = key.split("[", 1)[0]
        while key:
            if key in self.source:
                return f" (from {self.source[key]})"
            key = key.rpartition(".")[0]
        return ""


def _resolve(tree: dict) -> dict:
    try:
        return OmegaConf.to_container(OmegaConf.create(tree), resolve=True)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "config"
        first = str(e).splitlines()[0]
        raise ConfigError(f"{key}: cannot resolve interpolation: {first}") from None


def _pipeline(file_layers: list[tuple[str, dict]], overrides: Sequence[str]) -> Config:
    prov = _Provenance()
    raw: dict = {}
    for source, layer in file_layers:
        layer = canonical_keys(layer, source)
        prov.record(layer, source)
        raw = _merge(raw, layer)

    over: dict = {}
    deletions: list[str] = []
    for text in overrides:
        op, key, value = parse_override(text)
        if op == "del":
            deletions.append(key)
            continue
        _set_path(over, key, value)
        try:
            single: dict = {}
            _set_path(single, key, value)
            prov.record(canonical_keys(single, "override"), f"override {text.strip()}")
        except ConfigError:
            pass  # reported below, when the whole override layer is read
    problems: list[str] = []
    for key in deletions:
        canon = _canonical_path(key)
        msg = _schema_problem(canon)
        if msg:
            problems.append(msg + f" (from override ~{key})")
        _delete(raw, canon)
    over = canonical_keys(over, "overrides")
    raw = _merge(raw, over)

    defaults = dataclasses.asdict(Config())
    resolved = _resolve(_merge(defaults, raw))
    cfg = build(Config, resolved, "", problems, prov)
    bad = {p.split(":", 1)[0].split("[", 1)[0] for p in problems}
    explicit = {path for path, _ in _walk(raw)}
    cfg, sync = fill_derived(cfg, explicit)
    problems += [f"{keys[0]}: {text}" for keys, text in sync]
    problems += check(cfg, bad)
    if problems:
        raise ConfigError(problems)
    return cfg


def _delete(tree: dict, dotted: str) -> None:
    *parents, last = dotted.split(".")
    node: Any = tree
    for part in parents:
        if not isinstance(node, dict) or part not in node:
            return
        node = node[part]
    if isinstance(node, dict):
        node.pop(last, None)


def load_config(path_or_name: str | os.PathLike, overrides: Sequence[str] = ()) -> Config:
    """Load, merge, override, resolve, type-check, fill and validate a config.

    ``path_or_name``: a YAML path, or a name in ``config_dir()`` ("pure_prm_vr",
    "pure_prm_vr.yaml", "real/grpo_qwen25_7b"). ``overrides``: verl/Hydra ``key=value`` strings
    (also ``+key=value``; ``~key`` resets a key to its default). Raises ``ConfigError`` listing
    every problem, one per line.
    """
    name = os.fspath(path_or_name)
    path = _find(name, [Path.cwd(), config_dir()])
    if path is None:
        raise ConfigError(
            f"config: no file {name!r} (looked in {_show(Path.cwd())} and {_show(config_dir())}); "
            f"available: {', '.join(available_configs())}"
        )
    return _pipeline(_file_layers(path), overrides)


def validate(cfg: Config, overrides: Sequence[str] = ()) -> Config:
    """Run a Config built in Python through the same checks (and filling) as ``load_config``."""
    return _pipeline([("Config object", to_dict(cfg))], overrides)


def to_dict(cfg: Config) -> dict:
    """The config as plain nested dicts/lists (the YAML structure)."""
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Config) -> str:
    """The config as YAML; ``load_config`` of this text gives an equal Config."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False, allow_unicode=True, width=100)
