"""What the launcher needs from a config before it starts anything: that it exists, that it is
valid, its parallel layout (TP x PP must divide the world size) and its run folder.

It uses ``megarl.config`` (full validation, ``extends:`` chains, aliases, interpolation) when that
imports; otherwise a minimal YAML read of the two parallel keys (following ``extends:``) keeps the
launcher and its dry run working.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from launch.hosts import LaunchError

REPO = Path(__file__).resolve().parents[1]
TP_KEY = "actor_rollout_ref.actor.parallel.tensor_model_parallel_size"
PP_KEY = "actor_rollout_ref.actor.parallel.pipeline_model_parallel_size"
# verl's spelling, read into parallel.* by megarl.config (megarl/config/aliases.py).
_ALIASES = {
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": TP_KEY,
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size": PP_KEY,
}
_SUFFIXES = ("", ".yaml", ".yml")


@dataclass(frozen=True)
class Layout:
    """Ranks: ``world = nnodes x nproc_per_node = TP x PP x DP``."""

    tp: int
    pp: int
    nnodes: int
    nproc_per_node: int

    @property
    def world(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)

    def describe(self) -> str:
        return (f"TP={self.tp} PP={self.pp} DP={self.dp} world={self.world} "
                f"({self.nnodes} node(s) x {self.nproc_per_node})")


@dataclass(frozen=True)
class ConfigInfo:
    path: Path  # the YAML file found
    layout: Layout
    run_dir: str | None  # trainer.default_local_dir when known (resolved), else None
    source: str  # "megarl.config" | "yaml"
    demo: str | None = None  # why the embedded demo's overlay applies; None when it does not


def _megarl_config():
    try:
        import megarl.config as mc
    except ImportError:
        return None
    return mc


def config_dir() -> Path:
    mc = _megarl_config()
    if mc is not None:
        return Path(mc.config_dir())
    env = os.environ.get("MEGARL_CONFIG_DIR")
    return Path(env) if env else REPO / "configs"


def available_configs() -> list[str]:
    root = config_dir()
    if not root.is_dir():
        return []
    mc = _megarl_config()
    if mc is not None:
        return mc.available_configs()
    names = (p.relative_to(root) for p in root.rglob("*.y*ml"))
    return sorted({str(p.with_suffix("")) for p in names if p.parts[0] != "demo"})  # overlays


def find_config(name: str, base: Path) -> Path | None:
    """``name`` as a path relative to ``base`` (or absolute), else as a recipe in configs/."""
    for folder in (base, config_dir()):
        for suffix in _SUFFIXES:
            cand = folder / (name + suffix)
            if cand.is_file():
                return cand.resolve()
    return None


def missing_config(name: str, base: Path) -> LaunchError:
    names = available_configs()
    listed = ", ".join(names) if names else f"none ({config_dir()} has no *.yaml)"
    return LaunchError(f"config {name!r} not found (looked in {base} and {config_dir()}); "
                       f"available: {listed}; pass one of these names or a YAML path to --config")


def check_layout(layout: Layout) -> None:
    tp, pp, world = layout.tp, layout.pp, layout.world
    if tp < 1 or pp < 1:
        raise LaunchError(f"parallel layout TP={tp} PP={pp} is invalid: both must be >= 1; "
                          f"fix {TP_KEY} / {PP_KEY}")
    if world % (tp * pp):
        raise LaunchError(
            f"parallel layout does not fit: TP={tp} x PP={pp} = {tp * pp} ranks per model "
            f"replica, but {layout.nnodes} node(s) x {layout.nproc_per_node} proc(s) per node = "
            f"world size {world} is not a multiple of {tp * pp} (DP would be "
            f"{world / (tp * pp):.3g}); use a node count and --nproc-per-node whose product is a "
            f"multiple of {tp * pp}, or change {TP_KEY} / {PP_KEY}")


def _override_map(overrides: list[str]) -> dict[str, str]:
    out = {}
    for text in overrides:
        key, sep, value = text.strip().lstrip("+").partition("=")
        if sep and not key.startswith("~"):
            out[_ALIASES.get(key.strip(), key.strip())] = value.strip()
    return out


def override_value(overrides: list[str], key: str) -> str | None:
    return _override_map(overrides).get(key)


def _yaml_tree(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    """The merged YAML of ``path`` and the files it ``extends:`` (base first)."""
    import yaml

    if path in seen:
        raise LaunchError(f"config {path}: extends: cycle through {path.name}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise LaunchError(f"config {path} is not valid YAML ({str(e).splitlines()[0]}); fix the file") from None
    if not isinstance(data, dict):
        raise LaunchError(f"config {path}: the top level must be a mapping of sections")
    bases = data.pop("extends", None) or []
    merged: dict = {}
    for base in [bases] if isinstance(bases, str) else bases:
        found = find_config(str(base), path.parent)
        if found is None:
            raise missing_config(str(base), path.parent)
        merged = _merge(merged, _yaml_tree(found, (*seen, path)))
    return _merge(merged, data)


def _merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(out.get(k), dict) and isinstance(v, dict) else v
    return out


def _lookup(tree: dict, dotted: str):
    node = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def yaml_layout(path: Path, overrides: list[str], nnodes: int, nproc: int) -> tuple[Layout, str | None]:
    """(layout, trainer.default_local_dir or None) from the raw YAML plus the overrides."""
    tree = _yaml_tree(path)
    for alias, key in _ALIASES.items():
        value = _lookup(tree, alias)
        if value is not None and _lookup(tree, key) is None:
            tree = _merge(tree, _nest(key, value))
    over = _override_map(overrides)
    sizes = []
    for key in (TP_KEY, PP_KEY):
        raw = over.get(key, _lookup(tree, key))
        try:
            sizes.append(1 if raw is None else int(raw))
        except (TypeError, ValueError):
            raise LaunchError(f"{key} must be an integer, got {raw!r}; fix the config or the override") from None
    run_dir = over.get("trainer.default_local_dir", _lookup(tree, "trainer.default_local_dir"))
    if not isinstance(run_dir, str) or "${" in run_dir:
        run_dir = None  # interpolations need megarl.config
    return Layout(sizes[0], sizes[1], nnodes, nproc), run_dir


def _nest(dotted: str, value) -> dict:
    node: dict = {}
    cur = node
    *parents, last = dotted.split(".")
    for part in parents:
        cur[part] = {}
        cur = cur[part]
    cur[last] = value
    return node


def load(name: str, base: Path, overrides: list[str], nnodes: int, nproc: int) -> ConfigInfo:
    """Find, validate and read the config ``name`` for ``nnodes x nproc`` ranks.

    Raises LaunchError for a missing config, a layout that does not fit the world size (checked
    on the raw YAML first, so the message names TP, PP, DP and the world size) or any other
    problem megarl.config reports."""
    path = find_config(name, base)
    if path is None:
        raise missing_config(name, base)
    layout, run_dir = yaml_layout(path, overrides, nnodes, nproc)
    mc = _megarl_config()
    if mc is None:
        check_layout(layout)
        return ConfigInfo(path, layout, run_dir, "yaml")
    launch_keys = [f"launch.nnodes={nnodes}", f"launch.nproc_per_node={nproc}"]
    from megarl.config.loader import resolve_config

    try:
        resolved = resolve_config(path, [*overrides, *launch_keys])
    except mc.ConfigError as e:
        check_layout(layout)  # the clearer message when the layout is the problem
        raise LaunchError(f"config {name!r} is invalid for {nnodes} node(s) x {nproc} proc(s): "
                          + "; ".join(e.problems)) from None
    cfg = resolved.config
    par = cfg.actor_rollout_ref.actor.parallel
    layout = Layout(par.tensor_model_parallel_size, par.pipeline_model_parallel_size, nnodes, nproc)
    check_layout(layout)
    return ConfigInfo(path, layout, cfg.trainer.default_local_dir, "megarl.config",
                      resolved.demo_reason if resolved.demo else None)
