"""Load a config: YAML files (with ``extends:`` chains) + verl/Hydra ``key=value`` overrides ->
a validated, filled ``Config``.

Order of layers, later wins: schema defaults < recipe files (base first) < the demo overlay <
the user's own files < overrides. Mappings merge key by key; any other value (scalar, list)
replaces the earlier one. ``${a.b}`` interpolations are resolved over the merged tree (defaults
included) by OmegaConf; ``${megarl.not:${a.b}}`` negates a boolean.

The recipes (``config_dir()``) carry settings for real models. The embedded CPU demo's
small-scale settings live in ``config_dir()/demo/NAME.yaml``, one overlay per recipe NAME; they
are applied, for every recipe of the ``extends:`` chain that has one, right after the last such
recipe, when the policy is the embedded one (``actor_rollout_ref.model.path`` unset or
``embedded://...`` once every file and override is read), or when asked (``demo=True``).
``resolve_config`` also returns where each value came from (``megarl.config.provenance``).
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megarl.config import fsdp_size, global_micro, verl_async
from megarl.config.aliases import canonical_keys, get_path, set_path
from megarl.config.errors import ConfigError
from megarl.config.keys import canonical_path, schema_problem
from megarl.config.provenance import Resolved, Sources, remember, walk
from megarl.config.schema import Config
from megarl.config.typecheck import build
from megarl.config.validate import check, fill_derived
from megarl.config.verl_compat import (
    apply_verl_mappings,
    flatten,
    take_verl_only,
    verl_only_findings,
)

_YAML_SUFFIXES = (".yaml", ".yml")
DEMO_DIR = "demo"  # config_dir()/demo/NAME.yaml: the embedded demo's overlay of recipe NAME
EMBEDDED = "embedded://"


def _not(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"megarl.not takes true or false, got {value!r}")
    return not value


if not OmegaConf.has_resolver("megarl.not"):
    try:  # omegaconf >= 2.4 (register_resolver took strings before 2.4)
        from omegaconf.version import __version__ as _oc_version

        _new_api = tuple(int(x) for x in _oc_version.split(".")[:2]) >= (2, 4)
    except (ImportError, ValueError):
        _new_api = False
    if _new_api:
        OmegaConf.register_resolver("megarl.not", _not)
    else:
        OmegaConf.register_new_resolver("megarl.not", _not)


def config_dir() -> Path:
    """The recipes folder: ``$MEGARL_CONFIG_DIR`` if set, else ``configs/`` of the source tree
    (a checkout or an editable install), else the copy packaged as ``megarl/configs`` (a
    non-editable install: ``pip install .``)."""
    env = os.environ.get("MEGARL_CONFIG_DIR")
    if env:
        return Path(env)
    source = Path(__file__).resolve().parents[2] / "configs"
    if (source / "base.yaml").is_file():
        return source
    return Path(str(importlib.resources.files("megarl") / "configs"))


def available_configs() -> list[str]:
    """Names (relative to ``config_dir()``, no suffix) of the recipe files (the demo overlays
    in ``demo/`` are not recipes)."""
    root = config_dir()
    names = (p.relative_to(root) for p in root.rglob("*.yaml"))
    return sorted(str(p.with_suffix("")) for p in names if p.parts[0] != DEMO_DIR)


def _recipe_name(path: Path) -> str | None:
    """``path``'s name relative to ``config_dir()`` (no suffix), None outside it."""
    try:
        rel = Path(path).resolve().relative_to(config_dir().resolve())
    except ValueError:
        return None
    return str(rel.with_suffix(""))


def demo_overlay(path: Path) -> Path | None:
    """The demo overlay of recipe file ``path`` (``config_dir()/demo/NAME.yaml``), if any."""
    name = _recipe_name(path)
    if name is None or Path(name).parts[0] == DEMO_DIR:
        return None
    cand = config_dir() / DEMO_DIR / (name + ".yaml")
    return cand.resolve() if cand.is_file() else None


def _label(path: Path) -> str:
    name = _recipe_name(path)
    if name is None:
        return f"file {_show(path)}"
    if Path(name).parts[0] == DEMO_DIR:
        return f"demo overlay {name}"
    return f"recipe {name}"


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


def _file_layers(path: Path, stack: tuple[Path, ...] = ()) -> list[tuple[Path, dict]]:
    """[(file, layer)] for ``path`` and the files it extends, base first."""
    if path in stack:
        chain = " -> ".join(_show(p) for p in (*stack, path))
        raise ConfigError(f"extends: cycle {chain}")
    data = _read_yaml(path)
    bases = data.pop("extends", None)
    if isinstance(bases, str):
        bases = [bases]
    if bases is not None and not (isinstance(bases, list) and all(isinstance(b, str) for b in bases)):
        raise ConfigError(f"extends: expected a file name or a list of them, got {bases!r} ({_show(path)})")
    layers: list[tuple[Path, dict]] = []
    for base in bases or []:
        found = _find(base, [path.parent, config_dir()])
        if found is None:
            raise ConfigError(
                f"extends: cannot find {base!r} (in {_show(path)}); looked next to it and in "
                f"{_show(config_dir())}; available: {', '.join(available_configs())}"
            )
        layers += _file_layers(found, (*stack, path))
    layers.append((path, data))
    return layers


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


def _resolve(tree: dict) -> dict:
    try:
        return OmegaConf.to_container(OmegaConf.create(tree), resolve=True)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "config"
        first = str(e).splitlines()[0]
        raise ConfigError(f"{key}: cannot resolve interpolation: {first}") from None


def _canonical(layer: dict, source: str) -> dict:
    """One layer in megarl's keys: verl's mapped keys moved, then the alias spellings read."""
    return canonical_keys(apply_verl_mappings(layer, source), source)


def _demo_decision(files: list[tuple[str, dict]], over: dict, deletions: list[str],
                   demo: bool | None, have_overlay: bool) -> tuple[bool, str]:
    """(apply the demo overlay?, why) from the policy path every file and override gives."""
    key = "actor_rollout_ref.model.path"
    if not have_overlay:
        return False, "no recipe of the chain has one"
    if demo is not None:
        return demo, "asked for" if demo else "turned off"
    raw: dict = {}
    for _, layer in files:
        raw = _merge(raw, layer)
    if key in deletions:
        _delete(raw, key)
    path = get_path(_merge(raw, over), key)
    if path is None:
        return True, f"{key} is not set: the embedded CPU demo"
    if isinstance(path, str) and path.startswith(EMBEDDED):
        return True, f"{key} is {path}: the embedded CPU demo"
    return False, f"{key} is {path}: the recipes' real-model settings"


def _pipeline(files: list[tuple[str, dict]], overrides: Sequence[str],
              overlays: Sequence[tuple[int, str, dict]] = (), demo: bool | None = None,
              name: str = "") -> Resolved:
    """``files``: [(layer name, raw layer)], base first. ``overlays``: [(position, name, layer)],
    inserted before files[position] when the demo overlay applies."""
    files = [(source, _canonical(layer, source)) for source, layer in files]
    over: dict = {}
    deletions: list[str] = []
    over_sources: list[tuple[dict, str]] = []
    for text in overrides:
        op, key, value = parse_override(text)
        if op == "del":
            deletions.append(key)
            continue
        set_path(over, key, value)
        try:
            single: dict = {}
            set_path(single, key, value)
            over_sources.append((_canonical(single, "override"), f"override {text.strip()}"))
        except ConfigError:
            pass  # reported below, when the whole override layer is read
    over = _canonical(over, "overrides")
    deletions = [canonical_path(key) for key in deletions]

    use_demo, reason = _demo_decision(files, over, deletions, demo, bool(overlays))
    if use_demo:
        at = overlays[-1][0]
        demo_layers = [(source, _canonical(layer, source)) for _, source, layer in overlays]
        files = files[:at] + demo_layers + files[at:]

    # verl's keys without a megarl key: out of the tree, judged on their last value
    verl_only: dict[str, tuple[Any, str]] = {}
    for source, layer in files:
        verl_only.update((k, (v, source)) for k, v in take_verl_only(layer).items())
    for layer, source in over_sources:
        verl_only.update((k, (v, source)) for k, v in take_verl_only(layer).items())
    take_verl_only(over)

    prov = Sources()
    if use_demo:
        prov.demo_layers = {source for _, source, _ in overlays}
    raw: dict = {}
    for source, layer in files:
        prov.record(layer, source)
        raw = _merge(raw, layer)
    problems: list[str] = []
    for key, text in zip(deletions, [o for o in overrides if o.strip().startswith("~")]):
        msg = schema_problem(key)
        if msg:
            problems.append(msg + f" (from override {text.strip()})")
        _delete(raw, key)
        prov.source[key] = f"override {text.strip()}"
    for layer, source in over_sources:
        prov.record(layer, source)
    raw = _merge(raw, over)

    defaults = dataclasses.asdict(Config())
    resolved = _resolve(_merge(defaults, raw))
    micro_notices, micro_problems = global_micro.convert(verl_only, resolved, raw, prov)
    problems += micro_problems
    problems += fsdp_size.convert(verl_only, resolved, raw, prov)
    problems += verl_async.convert(verl_only, resolved, raw, prov)
    cfg = build(Config, resolved, "", problems, prov)
    bad = {p.split(":", 1)[0].split("[", 1)[0] for p in problems}
    explicit = {path for path, _ in walk(raw)}
    cfg, sync = fill_derived(cfg, explicit)
    problems += [f"{keys[0]}: {text}" for keys, text in sync]
    problems += check(cfg, bad)
    flat = flatten(resolved)
    _, refused = verl_only_findings(verl_only, flat)
    problems += refused
    # notices only for the user's values: the demo overlay's are its own business
    notices, _ = verl_only_findings(
        {k: v for k, v in verl_only.items() if v[1] not in prov.demo_layers}, flat)
    notices += micro_notices
    layers = ["schema defaults", *(source for source, _ in files)]
    if overrides:
        layers.append("overrides")
    out = Resolved(cfg, prov, layers, use_demo, reason, name, notices)
    remember(cfg, prov)
    if problems:
        err = ConfigError(problems)
        err.resolved = out  # the config as far as it resolved: `config show` prints it
        raise err
    return out


def _delete(tree: dict, dotted: str) -> None:
    *parents, last = dotted.split(".")
    node: Any = tree
    for part in parents:
        if not isinstance(node, dict) or part not in node:
            return
        node = node[part]
    if isinstance(node, dict):
        node.pop(last, None)


def resolve_config(path_or_name: str | os.PathLike, overrides: Sequence[str] = (),
                   demo: bool | None = None) -> Resolved:
    """``load_config`` that also returns where each value came from (``Resolved.report()`` is
    the startup report). ``demo``: None = apply the demo overlay iff the policy is embedded
    (``actor_rollout_ref.model.path`` unset or ``embedded://...``); True / False forces it."""
    name = os.fspath(path_or_name)
    path = _find(name, [Path.cwd(), config_dir()])
    if path is None:
        raise ConfigError(
            f"config: no file {name!r} (looked in {_show(Path.cwd())} and {_show(config_dir())}); "
            f"available: {', '.join(available_configs())}"
        )
    chain = _file_layers(path)
    files = [(_label(p), data) for p, data in chain]
    overlays = []
    for i, (p, _) in enumerate(chain):
        ov = demo_overlay(p)
        if ov is not None:
            overlays.append((i, _label(ov), _read_yaml(ov)))
    if overlays:  # all overlays go right after the last recipe that has one
        at = overlays[-1][0] + 1
        overlays = [(at, source, layer) for _, source, layer in overlays]
    return _pipeline(files, overrides, overlays, demo, _recipe_name(path) or _show(path))


def load_config(path_or_name: str | os.PathLike, overrides: Sequence[str] = (),
                demo: bool | None = None) -> Config:
    """Load, merge, override, resolve, type-check, fill and validate a config.

    ``path_or_name``: a YAML path, or a name in ``config_dir()`` ("pure_prm_vr",
    "pure_prm_vr.yaml", "real/grpo_qwen25_7b"). ``overrides``: verl/Hydra ``key=value`` strings
    (also ``+key=value``; ``~key`` resets a key to its default). ``demo``: see
    ``resolve_config`` (default: the demo overlay iff the policy is the embedded one). Raises
    ``ConfigError`` listing every problem, one per line.
    """
    return resolve_config(path_or_name, overrides, demo).config


def validate(cfg: Config, overrides: Sequence[str] = ()) -> Config:
    """Run a Config built in Python through the same checks (and filling) as ``load_config``."""
    return _pipeline([("Config object", to_dict(cfg))], overrides).config


def to_dict(cfg: Config) -> dict:
    """The config as plain nested dicts/lists (the YAML structure)."""
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Config) -> str:
    """The config as YAML; ``load_config`` of this text gives an equal Config."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False, allow_unicode=True, width=100)
