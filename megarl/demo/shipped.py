"""The demo's trained checkpoints as they ship in the package (``megarl/demo/checkpoints/``).

Training the tiny policy, PRM and tool-using policy takes minutes, and the same seeds give
another model on another CPU (fp32 sums round differently). So the trained components ship,
built once with `megarl.demo.assets --build` and copied here by ``--ship``: safetensors,
config, tokenizer files and the component's metadata.json, with ``manifest.json`` holding the
sha256 of every file, the build settings, the commit and CPU that built them and their measured
held-out accuracy. A run resolving ``embedded://policy`` installs the shipped copy (checked
against the manifest) into the assets folder; components derived in seconds (the critic, the
MoE upcycle, the arithmetic data) are built there from it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import time
from pathlib import Path

from megarl.errors import UserInputError

SHIPPED_DIR = Path(__file__).resolve().parent / "checkpoints"
MANIFEST = "manifest.json"
# the trained components (every one whose build takes more than a few seconds), and the
# tokenizer they were trained with
SHIPPED = ("tokenizer", "policy", "prm", "policy_tools")


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def manifest(shipped_dir: Path = SHIPPED_DIR) -> dict | None:
    """The shipped set's manifest; None when this installation ships none."""
    try:
        return json.loads((shipped_dir / MANIFEST).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None


def shipped_build_id(component: str, shipped_dir: Path = SHIPPED_DIR) -> str | None:
    """The build id of the shipped ``component`` (None: not shipped)."""
    entry = (manifest(shipped_dir) or {}).get("components", {}).get(component)
    return None if entry is None else entry["build_id"]


def install(component: str, staging: Path, shipped_dir: Path = SHIPPED_DIR) -> dict:
    """Copy the shipped ``component`` into ``staging`` (created), each file checked against the
    manifest's sha256; returns its metadata (metadata.json, with ``source: shipped``)."""
    entry = (manifest(shipped_dir) or {}).get("components", {}).get(component)
    if entry is None:
        raise UserInputError(f"no shipped demo checkpoint {component!r} in {shipped_dir}; "
                             "build it with: python -m megarl.demo.assets --build")
    src = shipped_dir / component
    staging.mkdir(parents=True, exist_ok=True)
    for name, want in sorted(entry["files"].items()):
        if not (src / name).is_file():
            raise UserInputError(
                f"{src / name} is missing from the shipped demo checkpoint {component!r}: "
                "restore it (git checkout -- megarl/demo/checkpoints) or rebuild the assets "
                "(python -m megarl.demo.assets --build, then point MEGARL_ASSETS at them)")
        shutil.copyfile(src / name, staging / name)
        got = sha256(staging / name)
        if got != want:
            raise UserInputError(
                f"{src / name}: sha256 {got[:12]}... is not the manifest's {want[:12]}... "
                "(a damaged or hand-edited checkpoint): restore it (git checkout -- "
                "megarl/demo/checkpoints) or rebuild with python -m megarl.demo.assets --build")
    meta = json.loads((src / "metadata.json").read_text(encoding="utf-8"))
    meta["source"] = "shipped"
    return meta


def _git_commit(repo: Path) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def cpu_name() -> str:
    """The CPU's model name and torch's SIMD level, e.g. "Intel(R) Xeon(R) Processor (AVX512)"."""
    import torch

    from megarl.utils.host import cpu_model

    return f"{cpu_model()} ({torch.backends.cpu.get_cpu_capability()})"


def ship(root: Path, shipped_dir: Path = SHIPPED_DIR, repo: Path | None = None) -> dict:
    """Copy the built components of ``SHIPPED`` from the assets folder ``root`` into
    ``shipped_dir`` and write its manifest. Returns the manifest."""
    from megarl.demo.recipe import read_meta

    components = {}
    for component in SHIPPED:
        meta = read_meta(root / component)
        if meta is None:
            raise UserInputError(f"{root / component} is not built: run python -m "
                                 f"megarl.demo.assets --build --root {root} first")
        target = shipped_dir / component
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        files = {}
        for path in sorted((root / component).iterdir()):
            if path.is_file():
                shutil.copyfile(path, target / path.name)
                if path.name != "metadata.json":
                    files[path.name] = sha256(target / path.name)
        components[component] = {
            "build_id": meta["build_id"], "files": files,
            "build_seconds": meta.get("build_seconds"),
            "val_accuracy": meta.get("val_accuracy"),
            **({"step_accuracy": {k: meta[k]["step_accuracy"] for k in
                                  ("eval_corrupted", "eval_policy_samples")}}
               if component == "prm" else {}),
        }
    first = read_meta(root / "policy") or {}
    out = {
        "what": "the embedded demo's trained checkpoints (megarl.demo.shipped)",
        "assets_version": first.get("version"),
        "built": time.strftime("%Y-%m-%d", time.gmtime()),
        "commit": _git_commit(repo or Path(__file__).resolve().parents[2]),
        "cpu": cpu_name(),
        "build_threads": first.get("build_threads"),
        "build_config": first.get("build_config"),
        "components": components,
    }
    (shipped_dir / MANIFEST).write_text(json.dumps(out, indent=2, sort_keys=True) + "\n",
                                        encoding="utf-8")
    return out
