"""Expand verl's example scripts into the argument lists they pass to ``verl.trainer.main_ppo``.

    python tests/config/verl_corpus/expand.py --verl-git DIR [--commit REV]

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


def scripts(git_dir: str, commit: str) -> list[str]:
    names = subprocess.run(["git", "-C", git_dir, "ls-tree", "-r", "--name-only", commit,
                            "examples"], check=True, capture_output=True, text=True).stdout
    out = []
    for name in names.split():
        if not name.endswith(".sh"):
            continue
        text = subprocess.run(["git", "-C", git_dir, "show", f"{commit}:{name}"], check=True,
                              capture_output=True, text=True).stdout
        if ENTRY.search(text):
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
    file = file if file.suffix == ".yaml" else file.with_suffix(".yaml")
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


def expand(git_dir: str, commit: str) -> tuple[list[dict], list[dict]]:
    lines: list[dict] = []
    failed: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        home = tmp / "home"
        root = home / "verl"
        root.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", git_dir, "archive", commit, "examples"],
                                 check=True, capture_output=True).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(root, filter="data")
        bindir = tmp / "bin"
        _stub_path(bindir)
        prelude = tmp / "prelude.sh"
        prelude.write_text(PRELUDE)
        for script in scripts(git_dir, commit):
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
                if args[:2] == ["-m", "verl.trainer.main_ppo"]:
                    calls.append(args[2:])
            if not calls:
                failed.append({"script": script, "why": status})
                continue
            for i, args in enumerate(calls):
                line = {"script": script, "index": i, "args": args}
                if slurm:
                    line["env"] = SLURM_ENV
                cfg = examples_config(args, root)
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
    p.add_argument("--out", default=str(HERE / "lines.jsonl"))
    a = p.parse_args(argv)
    commit = subprocess.run(["git", "-C", a.verl_git, "rev-parse", a.commit], check=True,
                            capture_output=True, text=True).stdout.strip()
    lines, failed = expand(a.verl_git, commit)
    header = {"verl_commit": commit, "entry": "python3 -m verl.trainer.main_ppo",
              "home": HOME, "cwd": ROOT, "lines": len(lines), "failed": failed}
    with open(a.out, "w") as f:
        f.write(json.dumps(header) + "\n")
        for line in lines:
            f.write(json.dumps(line) + "\n")
    print(f"{len(lines)} calls from {len({x['script'] for x in lines})} scripts; "
          f"{len(failed)} scripts did not expand", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
