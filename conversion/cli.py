"""``python -m conversion`` / ``megarl-convert``: argument parsing, process launch, error lines.

Layout decision for ``hf-to-megatron --tp N --pp M`` (``--ep E`` / ``--etp T`` for experts): megatron's torch_dist checkpoints are
layout-independent (global tensor keys and shapes; the loader reshards), so the written
checkpoint loads at any TP/PP. The tool still *writes* it from the asked layout, launching
itself under ``torchrun --standalone`` with N x M processes (gloo on CPU; NCCL when there are
enough GPUs), because that exercises exactly the sharded load/save path training will use and
records the layout in ``megarl_meta.json``. ``megatron-to-hf`` and ``verify`` run in one process
(any checkpoint loads at TP = PP = 1). Every output is written to a temp sibling directory,
checked (tensor names and shapes against what the model must have), then renamed into place.

Errors: one line ``megarl-convert: error: ...`` on stderr, exit status 2. ``verify`` exits 1
when the outputs differ by more than ``--tol``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from conversion.fsutil import ConversionError, check_output, swap_into_place, temp_sibling

PROG = "megarl-convert"
_ERROR_PREFIX = f"{PROG}: error: "
_WORKER_FLAG = "--_worker-dir"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse's own convention)
        raise ConversionError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Convert checkpoints between HF and megarl's megatron.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    a = sub.add_parser("hf-to-megatron", help="HF folder -> megatron dist checkpoint")
    a.add_argument("--hf", required=True, type=Path, help="HF model folder (config.json)")
    a.add_argument("--out", required=True, type=Path,
                   help="checkpoint directory to write (a megatron dist checkpoint, read by "
                        "megatron-to-hf --ckpt, verify and MegatronBackend.from_checkpoint; no "
                        "run config key loads it: a training run starts from the HF folder at "
                        "actor_rollout_ref.model.path, sharded at load for any TP/PP with "
                        "actor_rollout_ref.actor.strategy=megatron)")
    a.add_argument("--tp", type=int, default=1, help="tensor parallel size the written checkpoint is sharded for")
    a.add_argument("--pp", type=int, default=1, help="pipeline parallel size the written checkpoint is sharded for")
    a.add_argument("--ep", type=int, default=1,
                   help="expert parallel size the written checkpoint is sharded for (mixture-of-experts models)")
    a.add_argument("--etp", type=int, default=None,
                   help="expert tensor parallel size (default: --tp)")
    a.add_argument("--role", choices=("actor", "critic", "prm"), default="actor")
    a.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="parameter dtype stored (fp32 keeps bf16 sources bit-exact)")
    a.add_argument("--force", action="store_true", help="replace a non-empty --out")
    a.add_argument(_WORKER_FLAG, dest="worker_dir", type=Path, help=argparse.SUPPRESS)

    b = sub.add_parser("megatron-to-hf", help="megatron checkpoint -> HF folder")
    b.add_argument("--ckpt", required=True, type=Path, help="checkpoint directory")
    b.add_argument("--out", required=True, type=Path, help="HF folder to write")
    b.add_argument("--dtype", choices=("fp32", "bf16"), default=None,
                   help="dtype of the written tensors (default: the source model's)")
    b.add_argument("--force", action="store_true", help="replace a non-empty --out")

    c = sub.add_parser("verify", help="compare an HF folder and a checkpoint on a fixed batch")
    c.add_argument("--hf", required=True, type=Path, help="HF model folder")
    c.add_argument("--ckpt", required=True, type=Path, help="checkpoint directory")
    c.add_argument("--tol", type=float, default=1e-5, help="max abs difference allowed")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``megarl-convert``; returns the exit status (0 ok, 1 verify mismatch,
    2 error)."""
    try:
        args = build_parser().parse_args(argv)
        return _run(args)
    except KeyboardInterrupt:
        print(f"{_ERROR_PREFIX}interrupted", file=sys.stderr)
        return 130
    except SystemExit as e:  # --help
        return int(e.code or 0)
    except BaseException as e:  # noqa: BLE001 - the tool's contract: one line, no traceback
        print(_ERROR_PREFIX + _one_line(e), file=sys.stderr, flush=True)
        return 2


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    if not isinstance(e, ConversionError | ValueError | FileNotFoundError | FileExistsError):
        text = f"{type(e).__name__}: {text}"
    return text


def _need_hf(path: Path) -> None:
    if not (path / "config.json").is_file():
        raise ConversionError(f"--hf {path}: no config.json (not an HF model folder)")


def _need_ckpt(path: Path) -> None:
    if not (path / "megarl_meta.json").is_file():
        raise ConversionError(
            f"--ckpt {path}: not a megarl megatron checkpoint (no megarl_meta.json)"
        )


def _run(args: argparse.Namespace) -> int:
    if args.command == "hf-to-megatron":
        return _hf_to_megatron(args)
    if args.command == "megatron-to-hf":
        _need_ckpt(args.ckpt)
        check_output(args.out, args.force)
        from conversion import ops

        print(ops.megatron_to_hf(args.ckpt, args.out, dtype=args.dtype, force=args.force))
        return 0
    _need_hf(args.hf)
    _need_ckpt(args.ckpt)
    if not args.tol >= 0:
        raise ConversionError(f"--tol must be >= 0, got {args.tol}")
    from conversion import ops

    passed, line = ops.verify(args.hf, args.ckpt, tol=args.tol)
    print(line)
    return 0 if passed else 1


def _hf_to_megatron(args: argparse.Namespace) -> int:
    if args.tp < 1 or args.pp < 1:
        raise ConversionError(f"--tp and --pp must be >= 1, got {args.tp} and {args.pp}")
    if args.ep < 1 or (args.etp is not None and args.etp < 1):
        raise ConversionError(f"--ep and --etp must be >= 1, got {args.ep} and {args.etp}")
    _need_hf(args.hf)
    if args.worker_dir is not None:  # one of the TP x PP processes launched below
        return _worker(args)
    check_output(args.out, args.force)
    tmp = temp_sibling(args.out)
    try:
        from conversion import ops  # torch: both the in-process and the launched path need it

        n = ops.world_size(args.tp, args.pp, args.ep, args.etp)
        if n == 1:
            summary = ops.hf_to_megatron(
                args.hf, tmp, role=args.role, tp=1, pp=1, dtype=args.dtype
            )
        else:
            summary = _launch(args, tmp, n)
        swap_into_place(tmp, args.out, force=args.force)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{summary} -> {args.out}")
    return 0


def _launch(args: argparse.Namespace, tmp: Path, n: int) -> str:
    """Run this command under torchrun with ``n`` processes writing into ``tmp``."""
    import torch

    gpus_ok = torch.cuda.is_available() and torch.cuda.device_count() >= n
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    if not gpus_ok:
        env["CUDA_VISIBLE_DEVICES"] = ""
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
        "-m", "conversion", "hf-to-megatron", "--hf", str(args.hf), "--out", str(args.out),
        "--tp", str(args.tp), "--pp", str(args.pp), "--ep", str(args.ep), "--role", args.role,
        "--dtype", args.dtype, _WORKER_FLAG, str(tmp),
    ]
    if args.etp is not None:
        cmd[-2:-2] = ["--etp", str(args.etp)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    out = proc.stdout + "\n" + proc.stderr
    if proc.returncode != 0:
        found = re.findall(re.escape(_ERROR_PREFIX) + r"(.*)", out)
        if found:
            raise ConversionError(found[0].strip())
        tail = [line for line in out.splitlines() if line.strip()][-1:] or ["no output"]
        raise ConversionError(
            f"hf-to-megatron workers exited with status {proc.returncode}: {tail[0].strip()}"
        )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("wrote ")]
    return lines[0] if lines else f"wrote a checkpoint at TP={args.tp} PP={args.pp}"


def _worker(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from conversion import ops

    summary = ops.hf_to_megatron(
        args.hf, args.worker_dir, role=args.role, tp=args.tp, pp=args.pp, dtype=args.dtype,
        ep=args.ep, etp=args.etp,
    )
    if summary:
        print(summary, flush=True)
    dist.destroy_process_group()
    return 0
