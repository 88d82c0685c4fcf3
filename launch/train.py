"""The RL training entry point.

    torchrun [--nproc_per_node N] launch/train.py --config NAME_OR_PATH [key=value ...]
    python launch/train.py --config NAME_OR_PATH [key=value ...]        # one process
    megarl-train --config NAME_OR_PATH [key=value ...]                  # installed entry point

A bare config name (``pure_prm_vr`` or ``pure_prm_vr.yaml``) resolves in configs/ (or the
recipes packaged with megarl). Rank 0 prints the startup report first: the config's layers,
whether the embedded demo's overlay applies, and every value that differs from the schema
default with where it came from. Every rank runs the same loop (SPMD); there is no driver.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

# Runnable as a plain script from any directory: make the repo root importable.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="megarl RL trainer (PPO / GRPO / RLOO / REINFORCE++ / PURE / PACS)")
    parser.add_argument("--config", required=True,
                        help="recipe name in configs/ (e.g. pure_prm_vr) or a YAML path")
    parser.add_argument("--demo", choices=["auto", "on", "off"], default="auto",
                        help="the embedded demo's overlay (configs/demo/): auto = iff the policy "
                             "is embedded:// or unset")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, as in verl")
    return parser.parse_args(argv)


def torchrun_world() -> tuple[int, int] | None:
    """(nodes, processes per node) of the job torchrun started; None outside torchrun."""
    if "WORLD_SIZE" not in os.environ or "LOCAL_WORLD_SIZE" not in os.environ:
        return None
    world, local = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    return world // local, local


SIZE_KEYS = ("launch.nnodes", "launch.nproc_per_node", "trainer.nnodes",
             "trainer.n_gpus_per_node")


def _sizes_written(overrides: list[str]) -> bool:
    return any(o.lstrip("+").split("=", 1)[0] in SIZE_KEYS for o in overrides)


def _resolve_quietly(config: str, overrides: list[str], demo):
    """resolve_config, or None where it raises ConfigError."""
    from megarl.config import ConfigError
    from megarl.config.loader import resolve_config

    try:
        return resolve_config(config, overrides, demo)
    except ConfigError:
        return None


def main(argv: list[str] | None = None) -> int:
    """Run; a stop signal (SIGTERM, SIGINT, SIGHUP) unwinds the run (megarl.utils.stop_signals:
    the reward pool and engine process closed, the run directory's lock released, a checkpoint
    being written abandoned), says where it stopped, then ends this process by that signal."""
    args = parse_args(argv)
    if torchrun_world() is not None:  # a rank dies with its torchrun agent, however it dies
        from megarl.utils.lifetime import die_with_parent

        die_with_parent()
    from megarl.utils.stop_signals import StopRequested, StopSignals

    stop = StopSignals().install()
    run_dir: list[str] = []  # set once the config is known
    try:
        return _main(args, run_dir)
    except BaseException as err:
        # StopRequested, or what it became on its way up (torch's checkpoint writer, for one,
        # gathers the ranks' exceptions into its own)
        signum = err.signum if isinstance(err, StopRequested) else stop.received
        if signum is None:
            raise
        _report_stop(signum, run_dir)
        stop.die_by(signum)
        raise
    finally:
        stop.uninstall()


def _report_stop(signum: int, run_dir: list[str]) -> None:
    """One line on stderr: which signal stopped this rank and the newest complete checkpoint."""
    where = ""
    if run_dir:
        from megarl.trainer.checkpoint import CheckpointManager

        latest = CheckpointManager(Path(run_dir[0]) / "checkpoints").latest()
        where = (f"; newest complete checkpoint: {latest} (continue with trainer.resume=auto)"
                 if latest else "; no complete checkpoint yet")
    rank = os.environ.get("RANK")
    print(f"{'rank ' + rank + ': ' if rank else ''}stopped by {signal.Signals(signum).name}{where}",
          file=sys.stderr, flush=True)


def _main(args: argparse.Namespace, run_dir: list[str]) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from megarl.config import ConfigError
    from megarl.config.loader import resolve_config
    from megarl.errors import UserInputError

    demo = {"auto": None, "on": True, "off": False}[args.demo]
    started = torchrun_world()
    try:
        resolved = resolve_config(args.config, args.overrides, demo)
    except ConfigError as err:
        # a layout that needs more ranks than the default world of one (ulysses 2, TP 2):
        # without sizes of its own, the config takes the world torchrun started
        resolved = None if started is None or _sizes_written(args.overrides) else \
            _resolve_quietly(args.config, [*args.overrides, f"launch.nnodes={started[0]}",
                                           f"launch.nproc_per_node={started[1]}"], demo)
        if resolved is None:
            print(f"config error:\n{err}", file=sys.stderr)
            return 2
    asked = (resolved.config.launch.nnodes, resolved.config.launch.nproc_per_node)
    if started is not None and asked != started:
        wrote = [k for k in ("launch.nnodes", "launch.nproc_per_node") if resolved.sources.written(k)]
        if wrote:
            print(f"config error:\n{' and '.join(f'{k} (from {resolved.sources.written(k)})' for k in wrote)}"
                  f" ask for {asked[0]} node(s) x {asked[1]} process(es), but torchrun started "
                  f"{started[0]} x {started[1]}; make them agree (trainer.nnodes / "
                  "trainer.n_gpus_per_node are the same keys in verl's spelling) or leave them out "
                  "(the run then takes torchrun's world)", file=sys.stderr)
            return 2
        try:  # nothing asked for a size: the world torchrun started is the config's
            resolved = resolve_config(args.config, [*args.overrides, f"launch.nnodes={started[0]}",
                                                    f"launch.nproc_per_node={started[1]}"], demo)
        except ConfigError as err:
            print(f"config error:\n{err}", file=sys.stderr)
            return 2
    cfg = resolved.config
    run_dir.append(str(cfg.trainer.default_local_dir))
    from megarl.config.preflight import model_keys
    from megarl.utils import hub

    # hub ids download (verl's behaviour) unless HF_HUB_OFFLINE=1; a run that reads no hub id
    # (the embedded demo, local folders) goes offline. Before huggingface_hub is imported.
    hub.decide_offline(value for _, value, _ in model_keys(cfg))
    if os.environ.get("RANK", "0") == "0":
        print(resolved.report(), flush=True)
    from megarl.trainer import run

    try:
        run(cfg)
    except UserInputError as err:  # bad data, model or checkpoint: the message names the fix
        if os.environ.get("MEGARL_DEBUG", "0") not in ("", "0"):
            raise  # the traceback, under MEGARL_DEBUG=1
        if os.environ.get("RANK", "0") == "0":  # every rank finds the same problem
            print(f"error ({type(err).__name__}):\n{err}\n(MEGARL_DEBUG=1 prints the traceback)",
                  file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
