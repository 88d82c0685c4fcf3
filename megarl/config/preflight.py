"""The start-up checks of a run that need the file system, shared by ``python -m megarl.config
check`` (the preflight) and the trainer's start (`megarl.trainer.parts.build_run`), so that the
check passes exactly the configs whose start-up passes these.

``path_problems(cfg, sources)``: one line per problem, starting with the dotted key, naming
where the value came from and the fix: the model / tokenizer / critic / PRM folders (a local
folder, a hub id that downloads or is cached, or a ``scheme://`` location such as the embedded
demo's), the data files, the reward-function and tool files, and a writable run directory.
Nothing is built or downloaded here.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from megarl.config.schema import Config
from megarl.config.schema_judge import judge_enabled
from megarl.utils import hub

MODEL_HINT = "give a local HF model folder, a hub id (org/name) or embedded://policy"


def _scheme(path: str) -> bool:
    scheme, sep, _ = path.partition("://")
    return bool(sep) and scheme.isidentifier()


def model_keys(cfg: Config) -> list[tuple[str, Any, str]]:
    """(key, value, the file a folder must hold) of every model folder the run reads."""
    arr = cfg.actor_rollout_ref
    out = [("actor_rollout_ref.model.path", arr.model.path, "config.json")]
    if arr.model.tokenizer_path != arr.model.path:
        out.append(("actor_rollout_ref.model.tokenizer_path", arr.model.tokenizer_path,
                    "tokenizer_config.json"))
    if cfg.critic.enable and cfg.critic.model.path != arr.model.path:
        out.append(("critic.model.path", cfg.critic.model.path, "config.json"))
    if cfg.reward_model.enable or judge_enabled(cfg.reward_model):
        out.append(("reward_model.model.path", cfg.reward_model.model.path, "config.json"))
    return out


def _files(value: Any) -> list[str]:
    if not value:
        return []
    return [value] if isinstance(value, str) else [str(v) for v in value]


def path_problems(cfg: Config, sources: Callable[[str], str] | None = None) -> list[str]:
    """One line per path of ``cfg`` the run could not read (module doc). ``sources(key)``: the
    " (from LAYER)" text of a loaded config's provenance."""
    src = sources or (lambda key: "")
    out: list[str] = []
    for key, path, marker in model_keys(cfg):
        if not isinstance(path, str) or not path or _scheme(path):
            continue  # unset: the config's validation says so; scheme://: resolved at start
        if os.path.isdir(path):
            if not os.path.isfile(os.path.join(path, marker)) and marker == "config.json":
                out.append(f"{key}: no {marker} in {path!r}{src(key)}: not an HF model folder; "
                           f"{MODEL_HINT}")
        elif os.path.exists(path):
            out.append(f"{key}: {path!r} is a file{src(key)}; give the folder that holds it")
        elif hub.is_hub_id(path):
            if hub.offline() and not hub.in_cache(path):
                out.append(f"{key}: {path!r} is a hub id that is not in the local HF cache"
                           f"{src(key)}, and {hub.HOW_TO_DOWNLOAD}")
        else:
            out.append(f"{key}: no folder {path!r}{src(key)}; {MODEL_HINT}")
    data_hint = "give .parquet, .jsonl or .json files of verl's rows (prompt, reward_model, ...)"
    for key in ("data.train_files", "data.val_files"):
        for f in _files(getattr(cfg.data, key.split(".")[1])):
            if not _scheme(f) and not os.path.isfile(f):
                out.append(f"{key}: no file {f!r}{src(key)}; {data_hint}")
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    for key, f in (("custom_reward_function.path", cfg.custom_reward_function.path),
                   ("actor_rollout_ref.rollout.multi_turn.tool_config_path",
                    mt.tool_config_path if mt.enable else None),
                   ("actor_rollout_ref.rollout.multi_turn.interaction_config_path",
                    mt.interaction_config_path if mt.enable else None)):
        if f and not _scheme(f) and not os.path.isfile(f):
            out.append(f"{key}: no file {f!r}{src(key)}")
    out += _dir_problem("trainer.default_local_dir", str(cfg.trainer.default_local_dir), src)
    return out


def _dir_problem(key: str, path: str, src: Callable[[str], str]) -> list[str]:
    """The run directory: a folder, or creatable below its closest existing parent."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        return [f"{key}: {probe!r} is not a folder{src(key)}; give a folder for the run's "
                f"checkpoints and logs"]
    if not os.access(probe, os.W_OK | os.X_OK):
        return [f"{key}: {probe!r} is not writable{src(key)}; give a folder you can write"]
    return []
