"""Expand verl's example scripts into the argument lists they pass to ``verl.trainer.main_ppo``.

    python tests/config/verl_corpus/expand.py --verl-git DIR [--commit REV]
    python tests/config/verl_corpus/expand.py --verl-git DIR --set async   # the async recipes

DIR: a git directory of verl (a clone, bare or not; or ``VERL_GIT=DIR`` in the environment).

Each ``examples/**/*.sh`` of the verl commit that calls ``python3 -m verl.trainer.main_ppo`` (or
``python -m``) runs under bash, as its shell would run it, in a scratch copy of verl's
``examples/`` (the working directory is the copy's root, ``HOME`` a scratch folder, ``$@``
empty, variables at their defaults), with nothing real executed:

- ``python3`` / ``python`` are shell functions that write their arguments (NUL-separated) to a
  record file and return 0;
- every other command the script runs that is not in ``SAFE`` (downloads, ``huggingface-cli``,
  ``nvidia-smi``, ``ray``, ``srun``, ``conda``, ``pip`` ...) is not on ``PATH``: bash's
  ``command_not_found_handle`` answers it with status 0 and no output;
- ``date`` prints a fixed time, ``sleep`` returns at once; each script gets ``TIMEOUT`` seconds.

Paths are written as on the machine the scripts were written for: the scratch home is
``/home/user``, the verl checkout (the working directory) ``/home/user/verl``. A path a script
hardcodes stays as verl wrote it (``/root/data/gsm8k/train.parquet`` in
``run_deepseek671b_math_megatron_80gb.sh``): the corpus is verl's text, and nothing reads
these paths (the config check opens no data or model file; the trainer tests that run two
of verl's scripts append the embedded demo's paths after verl's). A
``--config-name`` of one of the examples' own config files (``--config-path`` under
``examples/``) is recorded with that file's keys (less ``hydra`` / ``defaults``) and
the trainer config it extends, so the corpus is complete without verl's tree.

Writes ``lines.jsonl`` next to this file: a header object (verl commit, the scripts that did not
expand and why), then one object per call: script, index (the call's number in that script),
args, and ``config`` (the examples config, when one is named).

``--set async`` expands instead the shell scripts of verl's asynchronous recipes
(``verl/experimental/fully_async_policy/shell``, ``one_step_off_policy/shell`` and their
end-to-end tests in ``tests/special_e2e``) into ``lines_async.jsonl``: each line also records
its ``entry`` (the module the script runs: ``fully_async_main``, the one-step-off ``main_ppo``
or the plain ``main_ppo`` of the colocated baselines), and ``config`` is the recipe's config
file, the one named or the entry's default (its ``@hydra.main`` config), with the trainer
config it extends.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
HOME, ROOT = "/home/user", "/home/user/verl"
TIMEOUT = 20
# a one-node SLURM job's environment, for the scripts that read it without a default (used only
# when a script stops on an unset SLURM_* variable; the line records it)
SLURM_ENV = {"SLURM_JOB_NUM_NODES": "1", "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "node0",
             "SLURM_GPUS_PER_NODE": "8", "SLURM_CPUS_PER_TASK": "64"}
ENTRY = re.compile(r"\bpython3? +-m +verl\.trainer\.main_ppo\b")
MAIN = "verl.trainer.main_ppo"
# the asynchronous recipes' entry modules and the config each loads by default
ASYNC_ENTRIES = {
    "verl.experimental.fully_async_policy.fully_async_main":
        "verl/experimental/fully_async_policy/config/fully_async_ppo_trainer.yaml",
    "verl.experimental.one_step_off_policy.main_ppo":
        "verl/experimental/one_step_off_policy/config/one_step_off_ppo_trainer.yaml",
    MAIN: None,
}
ASYNC_ENTRY = re.compile(r"\bpython3? +-m +verl\.(trainer\.main_ppo|experimental\."
                         r"(fully_async_policy\.fully_async_main|one_step_off_policy\.main_ppo))\b")
# what each set expands: (folders or files to list, the entry pattern, the tree to copy)
SETS = {
    "main": (["examples"], ENTRY, ["examples"]),
    "async": (["verl/experimental/fully_async_policy/shell",
               "verl/experimental/one_step_off_policy/shell",
               "tests/special_e2e/run_fully_async_policy.sh",
               "tests/special_e2e/run_one_step_off_policy.sh"], ASYNC_ENTRY,
              ["examples", "verl/experimental/fully_async_policy",
               "verl/experimental/one_step_off_policy", "tests/special_e2e"]),
}
# commands that compute values and touch nothing outside the scratch folder
SAFE = ("basename", "dirname", "cat", "awk", "sed", "tr", "cut", "head", "tail", "wc", "grep",
        "seq", "expr", "env", "printf", "echo", "realpath", "readlink", "mkdir", "ls", "bash",
        "sh", "true", "false", "test", "[", "sort", "uniq", "xargs")

PRELUDE = r"""
__record() { local n; n=$(ls "$__REC_DIR" | wc -l); printf '%s\0' "$@" > "$__REC_DIR/$(printf '%04d' "$n")"; }
python3() { __record python "$@"; return 0; }
python() { __record python "$@"; return 0; }
__wrap() { while (($#)); do case "$1" in python|python3) "$@"; return 0;; esac; shift; done; return 0; }
srun() { __wrap "$@"; }
ray() { __wrap "$@"; }
nohup() { __wrap "$@"; }
command_not_found_handle() { if [[ -p /dev/stdin ]]; then cat > /dev/null; fi; return 0; }
date() { "$__DATE" -u -d @0 "$@"; }
sleep() { return 0; }
ulimit() { return 0; }
source() { if [[ -f "$1" ]]; then builtin source "$@"; fi; }
"""


def scripts(git_dir: str, commit: str, where: list[str] = ("examples",),
            entry: re.Pattern = ENTRY) -> list[str]:
    names = subprocess.run(["git", "-C", git_dir, "ls-tree", "-r", "--name-only", commit,
                            *where], check=True, capture_output=True, text=True).stdout
    out = []
    for name in names.split():
        if not name.endswith(".sh"):
            continue
        text = subprocess.run(["git", "-C", git_dir, "show", f"{commit}:{name}"], check=True,
                              capture_output=True, text=True).stdout
        if entry.search(text):
            out.append(name)
    return out


def _stub_path(bindir: Path) -> None:
    bindir.mkdir()
    for tool in SAFE:
        real = shutil.which(tool)
        if real:
            (bindir / tool).symlink_to(real)


def examples_config(args: list[str], cwd: Path) -> dict | None:
    """The examples config file a call names (its keys flattened and the trainer config it
    extends), or None for verl's own trainer configs."""
    path = name = None
    for i, a in enumerate(args):
        for flag in ("--config-path", "--config-name"):
            if a == flag and i + 1 < len(args):
                val = args[i + 1]
            elif a.startswith(flag + "="):
                val = a.split("=", 1)[1]
            else:
                continue
            if flag == "--config-path":
                path = val
            else:
                name = val
    if path is None or name is None or "examples" not in path:
        return None
    file = (cwd / path.replace(ROOT, str(cwd)) / name)
    return config_file(file, cwd)


def recipe_config(args: list[str], entry: str, cwd: Path) -> dict | None:
    """The config an asynchronous recipe's call loads: ``--config-name`` in its entry's config
    folder (``--config-path=config`` is the entry's own), else the entry's default; None for
    verl's plain ``main_ppo`` (its trainer configs are read as the main set reads them)."""
    default = ASYNC_ENTRIES[entry]
    if default is None:
        return None
    name = None
    for i, a in enumerate(args):
        if a == "--config-name" and i + 1 < len(args):
            name = args[i + 1]
        elif a.startswith("--config-name="):
            name = a.split("=", 1)[1]
    file = cwd / default
    if name is not None:
        file = file.parent / name.strip("'\"")
    return config_file(file, cwd)


def config_file(file: Path, cwd: Path) -> dict:
    """A hydra config file's keys (less ``hydra`` / ``defaults``) and the configs it extends
    (``missing``: a file the verl commit does not have)."""
    file = file if file.suffix == ".yaml" else file.with_suffix(".yaml")
    if not file.exists():
        return {"file": str(file.relative_to(cwd)), "missing": True, "extends": [], "keys": {}}
    doc = yaml.safe_load(file.read_text())
    bases = [d for d in doc.get("defaults", []) if d != "_self_"]
    keys = {k: v for k, v in doc.items() if k not in ("hydra", "defaults")}
    return {"file": str(file.relative_to(cwd)), "extends": bases, "keys": keys}


def _run(script: str, root: Path, env: dict[str, str]) -> str:
    """Run ``script`` under the stubs; how it ended, in words."""
    try:
        proc = subprocess.run([shutil.which("bash"), script], cwd=root, env=env,
                              capture_output=True, text=True, timeout=TIMEOUT,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return f"no exit within {TIMEOUT} s"
    last = proc.stderr.strip().splitlines()[-1:]
    return f"exit status {proc.returncode}: {last[0] if last else ''}"


def expand(git_dir: str, commit: str, which: str = "main") -> tuple[list[dict], list[dict]]:
    where, entry_re, tree = SETS[which]
    lines: list[dict] = []
    failed: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        home = tmp / "home"
        root = home / "verl"
        root.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", git_dir, "archive", commit, *tree],
                                 check=True, capture_output=True).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(root, filter="data")
        bindir = tmp / "bin"
        _stub_path(bindir)
        prelude = tmp / "prelude.sh"
        prelude.write_text(PRELUDE)
        for script in scripts(git_dir, commit, where, entry_re):
            rec = tmp / "rec"
            shutil.rmtree(rec, ignore_errors=True)
            rec.mkdir()
            env = {"PATH": str(bindir), "HOME": str(home), "BASH_ENV": str(prelude),
                   "__REC_DIR": str(rec), "__DATE": shutil.which("date"), "LANG": "C", "TZ": "UTC"}
            status = _run(script, root, env)
            slurm = "SLURM_" in status and "unbound variable" in status
            if slurm:
                shutil.rmtree(rec)
                rec.mkdir()
                status = _run(script, root, {**env, **SLURM_ENV})
            calls = []
            for f in sorted(rec.iterdir()):
                argv = f.read_bytes().split(b"\0")[:-1]
                args = [a.decode().replace(str(root), ROOT).replace(str(home), HOME)
                        for a in argv[1:]]
                entries = [MAIN] if which == "main" else list(ASYNC_ENTRIES)
                if args[:1] == ["-m"] and args[1:2] and args[1] in entries:
                    calls.append((args[1], args[2:]))
            if not calls:
                failed.append({"script": script, "why": status})
                continue
            for i, (entry, args) in enumerate(calls):
                line = {"script": script, "index": i, "args": args}
                if which != "main":
                    line["entry"] = entry
                if slurm:
                    line["env"] = SLURM_ENV
                cfg = examples_config(args, root)
                if cfg is None and which != "main":
                    cfg = recipe_config(args, entry, root)
                if cfg is not None:
                    line["config"] = cfg
                lines.append(line)
    return lines, failed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--verl-git", default=os.environ.get("VERL_GIT"),
                   required="VERL_GIT" not in os.environ,
                   help="a git directory of verl (default: $VERL_GIT)")
    p.add_argument("--commit", default="HEAD")
    p.add_argument("--set", default="main", choices=sorted(SETS),
                   help="main: examples/ (main_ppo); async: the asynchronous recipes")
    p.add_argument("--out", default=None,
                   help="default: lines.jsonl (main) or lines_async.jsonl (async) here")
    a = p.parse_args(argv)
    out = a.out or str(HERE / ("lines.jsonl" if a.set == "main" else "lines_async.jsonl"))
    commit = subprocess.run(["git", "-C", a.verl_git, "rev-parse", a.commit], check=True,
                            capture_output=True, text=True).stdout.strip()
    lines, failed = expand(a.verl_git, commit, a.set)
    entry = ("python3 -m verl.trainer.main_ppo" if a.set == "main" else
             " | ".join(f"python3 -m {e}" for e in ASYNC_ENTRIES))
    header = {"verl_commit": commit, "entry": entry,
              "home": HOME, "cwd": ROOT, "lines": len(lines), "failed": failed}
    with open(out, "w") as f:
        f.write(json.dumps(header) + "\n")
        for line in lines:
            f.write(json.dumps(line) + "\n")
    print(f"{len(lines)} calls from {len({x['script'] for x in lines})} scripts; "
          f"{len(failed)} scripts did not expand", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
