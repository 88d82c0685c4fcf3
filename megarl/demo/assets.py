"""Build and locate the embedded demo assets (``embedded://...``).

    python -m megarl.demo.assets            # install the shipped checkpoints, derive the rest
    python -m megarl.demo.assets --build    # build all from scratch into assets-built/ (minutes)
    python -m megarl.demo.assets --build --ship   # ... and make that build the shipped set

The trained components (tokenizer, policy, prm, policy_tools) ship with the package
(`megarl.demo.shipped`): a run installs them on first use, checked against their sha256, and
derives the others from them in seconds. A rebuilt set is read with MEGARL_ASSETS=<its root>.

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
from megarl.demo.shipped import install as install_shipped
from megarl.demo.shipped import shipped_build_id

SCHEME = "embedded://"


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def assets_root(root: str | os.PathLike | None = None) -> Path:
    if root is not None:
        return Path(root)
    return Path(os.environ.get("MEGARL_ASSETS") or repo_root() / "assets")


def is_built(component: str, root: str | os.PathLike | None = None,
             threads: int | None = None, shipped: bool = False) -> bool:
    """Built with this ASSETS_VERSION, from the dependency builds that are present now and,
    for THREADED components when `threads` is given, with that many torch threads. With
    ``shipped``, an installed copy of a shipped checkpoint counts only while it is the one the
    package ships now (a newer shipped set replaces it; a local build is kept)."""
    base = assets_root(root)
    meta = read_meta(base / component)
    if meta is None or meta.get("version") != ASSETS_VERSION:
        return False
    if (shipped and meta.get("source") == "shipped"
            and meta.get("build_id") != shipped_build_id(component)):
        return False
    built_with = meta.get("build_threads", meta.get("threads"))
    if (component in THREADED and threads is not None and built_with is not None
            and built_with != threads):
        return False
    return _deps_match(meta, component, base)


def _deps_match(meta: dict, component: str, base: Path) -> bool:
    """Whether ``meta`` was built from the dependency builds present under ``base``."""
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
    """Path of a built component, making it (and what it needs) first if missing. Without a
    `config` (a training run resolving embedded://) the trained components are the shipped
    checkpoints (`megarl.demo.shipped`), installed on first use, and any present local build
    is used; with an explicit `config` everything missing is built from scratch, and a policy
    or PRM built with another thread count is rebuilt."""
    if component not in COMPONENTS:
        raise ValueError(f"unknown demo asset {component!r}; one of {COMPONENTS}")
    base = assets_root(root)
    shipped = config is None
    threads = None if shipped else config.threads
    config = config or BuildConfig()
    if not force and is_built(component, base, threads, shipped):
        return base / component
    with _lock(base):
        _ensure_locked(component, base, config, threads, {component} if force else set(), log,
                       set(), shipped)
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


def _ensure_locked(component, base, config, threads, forced, log, done, shipped) -> None:
    for dep in DEPENDS[component]:
        if dep not in done:
            _ensure_locked(dep, base, config, threads, forced, log, done, shipped)
    done.add(component)
    if component not in forced and is_built(component, base, threads, shipped):
        return  # present (possibly made by another rank while we waited for the lock)
    log = log or _quiet
    staging = base / f".staging-{component}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    t0 = time.perf_counter()
    try:
        meta = None
        if shipped and shipped_build_id(component) is not None:
            meta = install_shipped(component, staging)
            if not _deps_match(meta, component, base):
                # a local build of what it depends on (a rebuilt set stays one): build it too
                log(f"[assets] the shipped {component} was trained on other dependencies "
                    f"than those in {base}: building it")
                shutil.rmtree(staging, ignore_errors=True)
                meta = None
            else:
                log(f"[assets] {component}: the shipped checkpoint, installed in {base}")
        if meta is None:
            meta = _build(component, staging, base, config, log)
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
    log(f"[assets] {component} done in {time.perf_counter() - t0:.1f}s")


def _build(component: str, staging: Path, base: Path, config: BuildConfig,
           log: Callable[[str], None]) -> dict:
    """Run the component's build step into ``staging``; its metadata with the common fields."""
    from megarl.demo.build import BUILDERS  # heavy imports only when something must be built

    log(f"[assets] building {component} in {base}")
    t0 = time.perf_counter()
    with torch_threads(config.threads):
        meta = BUILDERS[component](staging, base, config, log)
    meta.setdefault("build_id", uuid.uuid4().hex)  # a builder may name its content
    meta.update(
        build_threads=config.threads, version=ASSETS_VERSION,
        build_seconds=round(time.perf_counter() - t0, 1), build_config=asdict(config),
        deps={d: (read_meta(base / d) or {}).get("build_id") for d in DEPENDS[component]},
    )
    return meta


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
    """Make (or find) the components in ``only``, as `ensure` does (without a ``config``:
    the shipped checkpoints, the rest derived from them); returns their metadata."""
    base = assets_root(root)
    shipped = config is None
    threads = None if shipped else config.threads
    config = config or BuildConfig()
    with _lock(base):
        done: set[str] = set()
        for c in only:
            _ensure_locked(c, base, config, threads, set(only) if force else set(), log, done,
                           shipped)
    return {c: read_meta(base / c) or {} for c in only}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megarl.demo.assets", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default=None, help="assets folder (default $MEGARL_ASSETS or "
                   "<repo>/assets; with --build, <repo>/assets-built)")
    p.add_argument("--build", action="store_true",
                   help="build every component from scratch (the trained ones included: "
                   "minutes) instead of installing the shipped checkpoints")
    p.add_argument("--ship", action="store_true",
                   help="with --build: copy the trained components into the package's shipped "
                   "set (megarl/demo/checkpoints) and write its manifest")
    p.add_argument("--threads", type=int, default=default_threads(),
                   help="torch threads for a build (default $MEGARL_ASSETS_THREADS or 2)")
    p.add_argument("--only", nargs="+", choices=COMPONENTS, default=list(COMPONENTS))
    p.add_argument("--sft-max-steps", type=int, default=None)
    p.add_argument("--prm-steps", type=int, default=None)
    args = p.parse_args(argv)
    if args.ship and not args.build:
        p.error("--ship copies a fresh build: add --build")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    config = None
    root = args.root
    if args.build:
        config = BuildConfig(threads=args.threads)
        if args.sft_max_steps is not None:
            config.sft_max_steps = args.sft_max_steps
        if args.prm_steps is not None:
            config.prm_steps = args.prm_steps
        root = root or repo_root() / "assets-built"
    t0 = time.perf_counter()
    metas = build_all(root, config, args.build, tuple(args.only))
    base = assets_root(root)
    how = f"built with {args.threads} threads" if args.build else "shipped checkpoints"
    print(f"[assets] root {base} ({time.perf_counter() - t0:.1f}s, {how})")
    for c, meta in metas.items():
        print(f"  {SCHEME}{c:<12} {base / c}  {summary(c, meta)}")
    if args.build and base != assets_root():
        print(f"[assets] a run reads these with MEGARL_ASSETS={base}")
    if args.ship:
        from megarl.demo.shipped import SHIPPED_DIR, ship

        ship(base)
        print(f"[assets] shipped set written to {SHIPPED_DIR}")
    return 0


def summary(component: str, meta: dict) -> str:
    """One line on what the component's build did and measured."""
    text = _summary(component, meta)
    return f"shipped checkpoint: {text}" if meta.get("source") == "shipped" else text


def _summary(component: str, meta: dict) -> str:
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
