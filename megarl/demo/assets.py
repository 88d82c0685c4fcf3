"""Build and locate the embedded demo assets (``embedded://...``).

    python -m megarl.demo.assets            # build everything missing, print accuracies/times
    python -m megarl.demo.assets --force    # rebuild

Layout under the assets root (``$MEGARL_ASSETS``, default ``<repo>/assets``)::

    tokenizer/   HF tokenizer folder (byte-level BPE, digits single, "\\n\\n" one token)
    arith/       train.parquet (3-op RL prompts), val.parquet (held-out 3-op),
                 sft.parquet (1-3 ops, with a "response" column), metadata.json
    policy/      Qwen2ForCausalLM after the SFT warm start (+ tokenizer files)
    policy_moe/  Qwen2MoeForCausalLM upcycled from policy/ (4 experts, top-2, a shared expert;
                 `megarl.models.upcycle`): the mixture-of-experts demo policy
    critic/      the policy body as a 1-label token classifier, score head zero
    prm/         Qwen2ForTokenClassification, 2 labels (1 = correct step)
    policy_tools/ policy/ after a short SFT on traces that call the calculator tool (hermes
                 format; `megarl.demo.tool_sft`): the multi-turn demo policy (grpo_tools)

Every component is built in a staging folder and renamed into place with its metadata.json
written last, under an exclusive file lock (``.build.lock``), so ranks that resolve the same
URI at once build it once and never see a half-written folder.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from megarl.demo.recipe import (
    ARITH_FILES,
    ASSETS_VERSION,
    COMPONENTS,
    DEPENDS,
    THREADED,
    BuildConfig,
    default_threads,
    read_meta,
)

SCHEME = "embedded://"


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def assets_root(root: str | os.PathLike | None = None) -> Path:
    if root is not None:
        return Path(root)
    return Path(os.environ.get("MEGARL_ASSETS") or repo_root() / "assets")


def is_built(component: str, root: str | os.PathLike | None = None,
             threads: int | None = None) -> bool:
    """Built with this ASSETS_VERSION, from the dependency builds that are present now and,
    for THREADED components when `threads` is given, with that many torch threads."""
    base = assets_root(root)
    meta = read_meta(base / component)
    if meta is None or meta.get("version") != ASSETS_VERSION:
        return False
    built_with = meta.get("build_threads", meta.get("threads"))
    if (component in THREADED and threads is not None and built_with is not None
            and built_with != threads):
        return False
    for dep in DEPENDS[component]:
        dep_meta = read_meta(base / dep) or {}
        if meta.get("deps", {}).get(dep) != dep_meta.get("build_id"):
            return False
    return True


@contextlib.contextmanager
def _lock(root: Path):
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".build.lock", "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def ensure(
    component: str,
    root: str | os.PathLike | None = None,
    config: BuildConfig | None = None,
    force: bool = False,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Path of a built component, building it (and what it needs) first if missing. With an
    explicit `config`, a policy or PRM built with another thread count is rebuilt; without one
    (a training run resolving embedded://), any present build is used."""
    if component not in COMPONENTS:
        raise ValueError(f"unknown demo asset {component!r}; one of {COMPONENTS}")
    base = assets_root(root)
    threads = config.threads if config is not None else None
    config = config or BuildConfig()
    if not force and is_built(component, base, threads):
        return base / component
    with _lock(base):
        _ensure_locked(component, base, config, threads, {component} if force else set(), log,
                       set())
    return base / component


@contextlib.contextmanager
def torch_threads(n: int):
    """torch.set_num_threads(n) inside the block, the caller's setting restored after it."""
    import torch

    if n < 1:
        raise ValueError(f"BuildConfig.threads={n}; set MEGARL_ASSETS_THREADS to 1 or more")
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _ensure_locked(component, base, config, threads, forced, log, done) -> None:
    for dep in DEPENDS[component]:
        if dep not in done:
            _ensure_locked(dep, base, config, threads, forced, log, done)
    done.add(component)
    if component not in forced and is_built(component, base, threads):
        return  # present (possibly built by another rank while we waited for the lock)
    from megarl.demo.build import BUILDERS  # heavy imports only when something must be built

    staging = base / f".staging-{component}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    t0 = time.perf_counter()
    (log or _quiet)(f"[assets] building {component} in {base}")
    try:
        with torch_threads(config.threads):
            meta = BUILDERS[component](staging, base, config, log or _quiet)
        meta.setdefault("build_id", uuid.uuid4().hex)  # a builder may name its content
        meta.update(
            build_threads=config.threads, version=ASSETS_VERSION,
            build_seconds=round(time.perf_counter() - t0, 1), build_config=asdict(config),
            deps={d: (read_meta(base / d) or {}).get("build_id") for d in DEPENDS[component]},
        )
        staging.mkdir(parents=True, exist_ok=True)
        with open(staging / "metadata.json", "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=2, sort_keys=True)
        target = base / component
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    (log or _quiet)(f"[assets] {component} done in {time.perf_counter() - t0:.1f}s")


def _quiet(msg: str) -> None:
    pass


def resolve_uri(uri: str, root: str | os.PathLike | None = None) -> str:
    """``embedded://policy|policy_moe|policy_tools|critic|prm|tokenizer`` or
    ``embedded://arith/<file>.parquet`` -> a local path (built on first use); any other string
    is returned unchanged."""
    if not isinstance(uri, str) or not uri.startswith(SCHEME):
        return uri
    name = uri[len(SCHEME):].strip("/")
    component, _, rest = name.partition("/")
    if component in ("policy", "policy_moe", "policy_tools", "critic", "prm",
                     "tokenizer") and not rest:
        return str(ensure(component, root))
    if component == "arith" and (not rest or rest in ARITH_FILES):
        return str(ensure("arith", root) / rest) if rest else str(ensure("arith", root))
    raise ValueError(
        f"unknown embedded asset {uri!r}; use embedded://policy, embedded://policy_moe, "
        f"embedded://policy_tools, embedded://critic, "
        f"embedded://prm, embedded://tokenizer or embedded://arith/{{{','.join(ARITH_FILES)}}}"
    )


def build_all(root: str | os.PathLike | None = None, config: BuildConfig | None = None,
              force: bool = False, only: tuple[str, ...] = COMPONENTS,
              log: Callable[[str], None] = print) -> dict[str, dict]:
    """Build (or find) the components in ``only``; returns their metadata."""
    base = assets_root(root)
    threads = config.threads if config is not None else None
    config = config or BuildConfig()
    with _lock(base):
        done: set[str] = set()
        for c in only:
            _ensure_locked(c, base, config, threads, set(only) if force else set(), log, done)
    return {c: read_meta(base / c) or {} for c in only}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megarl.demo.assets", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default=None, help="assets folder (default $MEGARL_ASSETS or "
                   "<repo>/assets)")
    p.add_argument("--threads", type=int, default=default_threads(),
                   help="torch threads for the build (default $MEGARL_ASSETS_THREADS or 2)")
    p.add_argument("--force", action="store_true", help="rebuild even if present")
    p.add_argument("--only", nargs="+", choices=COMPONENTS, default=list(COMPONENTS))
    p.add_argument("--sft-max-steps", type=int, default=None)
    p.add_argument("--prm-steps", type=int, default=None)
    args = p.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    config = BuildConfig(threads=args.threads)
    if args.sft_max_steps is not None:
        config.sft_max_steps = args.sft_max_steps
    if args.prm_steps is not None:
        config.prm_steps = args.prm_steps
    t0 = time.perf_counter()
    metas = build_all(args.root, config, args.force, tuple(args.only))
    base = assets_root(args.root)
    print(f"[assets] root {base} ({time.perf_counter() - t0:.1f}s, {args.threads} threads)")
    for c, meta in metas.items():
        print(f"  {SCHEME}{c:<10} {base / c}  {summary(c, meta)}")
    return 0


def summary(component: str, meta: dict) -> str:
    if component == "policy_moe":
        return (f"{meta.get('num_experts')} experts, top-{meta.get('top_k')}, greedy held-out "
                f"accuracy {meta.get('val_accuracy')} (dense: {meta.get('dense_val_accuracy')})")
    if component == "policy_tools":
        s = meta.get("sft", {})
        return (f"SFT {s.get('steps')} steps in {s.get('seconds')}s, held-out accuracy "
                f"{meta.get('val_accuracy')} (agent loop), calculator called in "
                f"{meta.get('val_tool_share')} of the trajectories")
    if component == "policy":
        s = meta.get("sft", {})
        return (f"SFT {s.get('steps')} steps in {s.get('seconds')}s, greedy held-out accuracy "
                f"{meta.get('val_accuracy')}")
    if component == "prm":
        e = meta.get("eval_corrupted", {})
        pol = meta.get("eval_policy_samples", {})
        return (f"step accuracy {e.get('step_accuracy')} (corrupted/clean held-out), "
                f"{pol.get('step_accuracy')} (policy samples), train {meta.get('train_seconds')}s")
    if component == "arith":
        return ", ".join(f"{k} {v}" for k, v in meta.get("rows", {}).items())
    return f"built in {meta.get('build_seconds')}s"


if __name__ == "__main__":
    sys.exit(main())
