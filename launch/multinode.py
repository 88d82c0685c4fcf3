"""megarl-launch: one ``torchrun`` per node, c10d rendezvous on the first host. No Ray.

    megarl-launch --hosts a,b --nproc-per-node 8 --config grpo trainer.total_training_steps=100
    megarl-launch --mode local --nnodes 2 --config grpo --dry-run     # print the commands only
    (inside sbatch/salloc)  megarl-launch --nproc-per-node 8 --config grpo   # nodes from SLURM

Nodes come from ``--hosts`` / ``--hostfile`` or, inside a SLURM allocation, from
``SLURM_JOB_NODELIST``. Every node runs::

    env NCCL_DEBUG=WARN OMP_NUM_THREADS=1 ... python -m torch.distributed.run --nnodes=N
        --rdzv-backend=c10d --rdzv-endpoint=HOST0:PORT --rdzv-id=RUN_ID --rdzv-conf=is_host=0|1
        --nproc-per-node=M --max-restarts=0 launch/train.py --config NAME [key=value ...]
        launch.nnodes=N launch.nproc_per_node=M trainer.default_local_dir=RUN_DIR

``node{i}`` is the i-th host of the list; its agent hosts the rendezvous store when i == 0
(``is_host=1``), so the rendezvous never depends on host-name matching. torchrun's own node (group)
rank is assigned by the c10d rendezvous in join order and is not passed. One node uses
``--standalone`` (a free local port, so one-node jobs sharing a machine never collide).

``--mode local`` runs every node as a local process (a loopback multi-node run); ``--mode ssh``
runs ``ssh HOST 'cd WORKDIR && env ... torchrun ...'``; ``--mode srun`` runs one
``srun --nodes=1 --ntasks=1 --nodelist=HOST`` step per node inside an allocation. In every mode
each node's output goes to ``<log-dir>/node{i}.log`` on the machine running the launcher, and
``--dry-run`` prints exactly the shell line that would run, one per node.

The launcher says which world it starts and where each size came from (``--hosts``,
``--hostfile``, the SLURM allocation, ``--nnodes``, ``--nproc-per-node`` or the defaults). A
config that runs the embedded CPU demo (no model named: ``configs/demo/`` applies) is started,
when no size is given, as ``make demo`` runs it: one node of ``DEMO_NPROC`` ranks; with sizes
given the launcher says that the tiny demo runs on that world.

Exit status: 2 for a problem found before starting (one line naming it and the fix), otherwise
the first non-zero exit status of a node (the other nodes are then stopped), else 0.
"""

from __future__ import annotations

import argparse
import errno
import functools
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # `python launch/multinode.py`: make `launch` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from launch import layout as config_probe  # noqa: E402
from launch.hosts import LaunchError, expand_nodelist, is_this_machine, parse_hosts, read_hostfile  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PROG = "megarl-launch"
DEMO_NPROC = 2  # the embedded demo's world: one node of 2 CPU ranks (python -m megarl.demo.run)
MODES = ("auto", "local", "ssh", "srun")


@dataclass(frozen=True)
class NodeCommand:
    """What runs for node ``index``: ``argv`` in ``cwd`` (local mode; None = anywhere), output
    appended to ``log``."""

    index: int
    host: str
    argv: list[str]
    cwd: str | None
    log: Path

    def shell_line(self) -> str:
        line = f"{shlex.join(self.argv)} >> {shlex.quote(str(self.log))} 2>&1"
        return f"cd {shlex.quote(self.cwd)} && {line}" if self.cwd else line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        allow_abbrev=False,
        description="Start one torchrun per node (c10d rendezvous on the first host) running "
        "the megarl trainer; print the commands with --dry-run.",
        epilog="Overrides are the trainer's key=value strings, e.g. trainer.total_training_steps=2.",
    )
    nodes = p.add_argument_group("nodes")
    nodes.add_argument("--hosts", help="comma-separated host names (SLURM brackets allowed: n[1-4])")
    nodes.add_argument("--hostfile", help="file with one host per line (# comments)")
    nodes.add_argument("--nnodes", type=int, help="node count; with --mode local and no hosts: that "
                       "many local nodes; in SLURM: the first N nodes of the allocation")
    nodes.add_argument("--nproc-per-node", type=int, help="ranks per node (one per GPU; default 1, "
                       f"or {DEMO_NPROC} for a config that runs the embedded CPU demo)")
    p.add_argument("--mode", choices=MODES, default="auto",
                   help="auto: srun inside SLURM, ssh for --hosts/--hostfile, local otherwise")
    p.add_argument("--config", required=True, help="recipe name in configs/ or a YAML path")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    p.add_argument("--script", default="launch/train.py", help="entry point run by torchrun "
                   "(relative to --workdir)")
    rdzv = p.add_argument_group("rendezvous")
    rdzv.add_argument("--rdzv-port", type=int, default=29500)
    rdzv.add_argument("--rdzv-host", help="address of the FIRST host to rendezvous on "
                      "(default: the first host's name)")
    rdzv.add_argument("--run-id", help="rendezvous id (default: $SLURM_JOB_ID or a new one)")
    rdzv.add_argument("--max-restarts", type=int, default=0, help="torchrun restarts of a failed "
                      "worker group (0: fail fast; resume with trainer.resume=auto instead)")
    rdzv.add_argument("--preflight-timeout", type=float, default=5.0,
                      help="seconds for the TCP check of the rendezvous host before starting")
    rdzv.add_argument("--no-preflight", action="store_true", help="skip that check")
    env = p.add_argument_group("environment")
    env.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto",
                     help="collective backend; auto: the trainer picks (nccl on GPU, gloo on CPU)")
    env.add_argument("--socket-ifname", help="network interface for NCCL/gloo "
                     "(NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME), e.g. ib0 or eth0")
    env.add_argument("--omp-threads", type=int, help="OMP_NUM_THREADS per rank (default: "
                     "$OMP_NUM_THREADS or 1)")
    env.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                     help="extra environment variable for every node (repeatable)")
    out = p.add_argument_group("paths")
    out.add_argument("--run-dir", help="run folder: checkpoints, metrics, logs (default: "
                     "trainer.default_local_dir of the config, else runs/<run-id>)")
    out.add_argument("--log-dir", help="per-node logs (default: <run-dir>/logs)")
    out.add_argument("--workdir", default=str(REPO), help="repository root on every node "
                     "(default: this checkout)")
    out.add_argument("--python", default=sys.executable, help="python on every node "
                     "(default: the one running the launcher)")
    p.add_argument("--dry-run", action="store_true", help="print one shell line per node and exit")
    return p


def resolve_hosts(args: argparse.Namespace, environ: dict[str, str]) -> tuple[list[str], str]:
    """(hosts, where they came from: "hosts" | "hostfile" | "slurm" | "local")."""
    if args.hosts and args.hostfile:
        raise LaunchError("give --hosts or --hostfile, not both")
    if args.nnodes is not None and args.nnodes < 1:
        raise LaunchError(f"--nnodes must be >= 1, got {args.nnodes}")
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if args.hosts:
        hosts, source = parse_hosts(args.hosts), "hosts"
    elif args.hostfile:
        hosts, source = read_hostfile(args.hostfile), "hostfile"
    elif nodelist and args.mode in ("auto", "srun"):
        hosts, source = expand_nodelist(nodelist), "slurm"
        if args.nnodes is not None:
            if args.nnodes > len(hosts):
                raise LaunchError(f"--nnodes {args.nnodes} but the SLURM allocation has "
                                  f"{len(hosts)} node(s) ({nodelist}); request more nodes or lower --nnodes")
            hosts = hosts[: args.nnodes]
    elif args.mode in ("auto", "local"):
        hosts, source = ["127.0.0.1"] * (args.nnodes or 1), "local"
    else:
        raise LaunchError(f"--mode {args.mode} needs nodes: pass --hosts a,b or --hostfile FILE, "
                          f"or run inside a SLURM allocation (sbatch/salloc)")
    if args.nnodes is not None and len(hosts) != args.nnodes:
        raise LaunchError(f"--nnodes {args.nnodes} but {len(hosts)} host(s) given "
                          f"({','.join(hosts)}); drop --nnodes or list {args.nnodes} hosts")
    return hosts, source


def resolve_mode(mode: str, source: str, hosts: list[str]) -> str:
    if mode == "auto":
        if source == "slurm":
            return "srun"
        return "local" if all(is_this_machine(h) for h in hosts) else "ssh"
    if mode == "local":
        far = [h for h in hosts if not is_this_machine(h)]
        if far:
            raise LaunchError(f"--mode local starts every node on this machine, but host {far[0]!r} "
                              f"is not this machine; use --mode ssh (or srun inside SLURM)")
    if mode == "srun" and len(set(hosts)) != len(hosts):
        raise LaunchError(f"--mode srun runs one step per node, but hosts repeat ({','.join(hosts)}); "
                          f"list each node once or use --mode local")
    return mode


def node_env(args: argparse.Namespace, environ: dict[str, str]) -> dict[str, str]:
    """Environment set on every node (values already in the launcher's environment win over
    the defaults so that e.g. ``NCCL_DEBUG=INFO megarl-launch ...`` reaches every node)."""
    env = {
        "OMP_NUM_THREADS": str(args.omp_threads or environ.get("OMP_NUM_THREADS") or 1),
        "PYTHONUNBUFFERED": "1",
    }
    if args.backend in ("auto", "nccl"):
        env["NCCL_DEBUG"] = environ.get("NCCL_DEBUG", "WARN")
        env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        if args.socket_ifname:
            env["NCCL_SOCKET_IFNAME"] = args.socket_ifname
    if args.backend in ("auto", "gloo") and args.socket_ifname:
        env["GLOO_SOCKET_IFNAME"] = args.socket_ifname
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise LaunchError(f"--env {item!r} is not KEY=VALUE; write e.g. --env HF_HOME=/data/hf")
        env[key] = value
    return env


def _abs(path: str, workdir: str) -> str:
    return os.path.normpath(os.path.join(workdir, path))


def _endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def torchrun_argv(args: argparse.Namespace, n: int, index: int, run_id: str, rdzv_host: str) -> list[str]:
    argv = [args.python, "-m", "torch.distributed.run"]
    if n == 1:
        argv += ["--standalone", "--nnodes=1"]
    else:
        argv += [f"--nnodes={n}", "--rdzv-backend=c10d",
                 f"--rdzv-endpoint={_endpoint(rdzv_host, args.rdzv_port)}", f"--rdzv-id={run_id}",
                 f"--rdzv-conf=is_host={int(index == 0)}"]
    return argv + [f"--nproc-per-node={args.nproc_per_node}", f"--max-restarts={args.max_restarts}"]


def build_commands(args: argparse.Namespace, hosts: list[str], mode: str, trainer_args: list[str],
                   env: dict[str, str], run_id: str, log_dir: str, cpus: str | None = None
                   ) -> list[NodeCommand]:
    """One command per host; ``cpus``: --cpus-per-task for each srun step (SLURM_CPUS_PER_TASK
    of the job: srun 22.05+ does not inherit it by itself)."""
    rdzv_host = args.rdzv_host or hosts[0]
    env_argv = ["env", *(f"{k}={v}" for k, v in sorted(env.items()))]
    commands = []
    for i, host in enumerate(hosts):
        inner = [*env_argv, *torchrun_argv(args, len(hosts), i, run_id, rdzv_host),
                 args.script, *trainer_args]
        cwd = None
        if mode == "local":
            argv, cwd = inner, args.workdir
        elif mode == "ssh":
            # -tt: the remote torchrun gets SIGHUP (and stops its ranks) when the launcher stops ssh.
            remote = f"cd {shlex.quote(args.workdir)} && {shlex.join(inner)}"
            argv = ["ssh", "-o", "BatchMode=yes", "-tt", host, remote]
        else:
            argv = ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={host}", f"--chdir={args.workdir}",
                    *([f"--cpus-per-task={cpus}"] if cpus else []), *inner]
        commands.append(NodeCommand(i, host, argv, cwd, Path(log_dir) / f"node{i}.log"))
    return commands


def preflight(host: str, port: int, timeout: float) -> None:
    """Fail early when the rendezvous host cannot be reached. A refused connection is the good
    case (the host answered, the port is free); an accepted one means the port is taken."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise LaunchError(f"rendezvous host {host!r} does not resolve ({e.strerror}); fix --hosts / "
                          f"the hostfile or pass --rdzv-host with a reachable name or IP") from None
    last = "no address"
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as s:
            s.settimeout(timeout)
            try:
                s.connect(addr)
            except ConnectionRefusedError:
                return
            except OSError as e:
                last = "timed out" if isinstance(e, socket.timeout) else (e.strerror or errno.errorcode.get(e.errno, str(e)))
                continue
        raise LaunchError(f"rendezvous port {port} on {host} is already in use (another run?); "
                          f"pick a free one with --rdzv-port")
    raise LaunchError(f"rendezvous host {host} port {port} is unreachable from here ({last} after "
                      f"{timeout:g}s); check that the host is up and that TCP {port} is open "
                      f"between the nodes, pass --rdzv-host/--rdzv-port, or skip with --no-preflight")


class _Stop(Exception):
    def __init__(self, signum: int):
        self.signum = signum


def _raise_stop(signum, _frame):
    raise _Stop(signum)


def _stop_all(procs: list[subprocess.Popen], grace: float = 10.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [p for p in procs if p.poll() is None]
        for p in alive:
            try:
                os.killpg(p.pid, sig)  # torchrun and its ranks (own session, see _child_setup)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while any(p.poll() is None for p in alive) and time.monotonic() < deadline:
            time.sleep(0.1)


def _log(msg: str) -> None:
    print(f"{PROG}: {msg}", file=sys.stderr, flush=True)


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _child_setup(parent: int) -> None:
    """Runs in each node process before exec: its own session (so the launcher can signal the
    whole torchrun tree) and, on Linux, SIGTERM when the launcher dies, even by SIGKILL."""
    os.setsid()
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the launcher died before prctl took effect
        os._exit(1)


def run_nodes(commands: list[NodeCommand]) -> int:
    """Start every node, wait; on the first failure (or a signal) stop the others."""
    procs: list[subprocess.Popen] = []
    old = {s: signal.signal(s, _raise_stop) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        for c in commands:
            c.log.parent.mkdir(parents=True, exist_ok=True)
            with open(c.log, "ab") as log:
                procs.append(subprocess.Popen(
                    c.argv, cwd=c.cwd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    preexec_fn=functools.partial(_child_setup, os.getpid())))
            _log(f"node{c.index} ({c.host}) started, pid {procs[-1].pid}, log {c.log}")
        while True:
            codes = [p.poll() for p in procs]
            failed = [(c, rc) for c, rc in zip(commands, codes) if rc not in (None, 0)]
            if failed:
                c, rc = failed[0]
                _log(f"node{c.index} ({c.host}) exited with {rc}; stopping the other nodes; "
                     f"last lines of {c.log}:\n{_tail(c.log)}")
                _stop_all(procs)
                return rc if rc > 0 else 128 - rc
            if all(rc == 0 for rc in codes):
                _log(f"all {len(procs)} node(s) finished")
                return 0
            time.sleep(0.2)
    except _Stop as stop:
        _log(f"got signal {stop.signum}; stopping the nodes")
        _stop_all(procs)
        return 128 + stop.signum
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def plan(argv: list[str] | None = None, environ: dict[str, str] | None = None
         ) -> tuple[argparse.Namespace, list[NodeCommand], config_probe.Layout]:
    """Parse ``argv`` and build every node's command (raises LaunchError)."""
    environ = dict(os.environ if environ is None else environ)
    args = build_parser().parse_intermixed_args(argv)
    if args.nproc_per_node is not None and args.nproc_per_node < 1:
        raise LaunchError(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}")
    if not 1 <= args.rdzv_port <= 65535:
        raise LaunchError(f"--rdzv-port must be a TCP port in 1..65535, got {args.rdzv_port}")
    hosts, source = resolve_hosts(args, environ)
    mode = resolve_mode(args.mode, source, hosts)
    args.workdir = os.path.abspath(args.workdir)
    sized = args.nproc_per_node is not None
    info = config_probe.load(args.config, Path.cwd(), args.overrides, len(hosts),
                             args.nproc_per_node or 1)
    demo_world = info.demo is not None and not sized and source == "local" and args.nnodes is None
    if demo_world:  # no size given: the world make demo runs the embedded demo on
        info = config_probe.load(args.config, Path.cwd(), args.overrides, 1, DEMO_NPROC)
    args.nproc_per_node = DEMO_NPROC if demo_world else args.nproc_per_node or 1
    args.world_why = world_reasons(args, source, len(hosts), sized, demo_world, info.demo)

    # The trainer runs in --workdir: name the config as given when it finds the same file there.
    found_there = config_probe.find_config(args.config, Path(args.workdir))
    config_arg = args.config if found_there == info.path else str(info.path)
    run_id = args.run_id or environ.get("SLURM_JOB_ID") or (
        f"megarl-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}")
    user_dir = config_probe.override_value(args.overrides, "trainer.default_local_dir")
    run_dir = args.run_dir or user_dir or info.run_dir or f"runs/{run_id}"
    log_dir = _abs(args.log_dir or os.path.join(run_dir, "logs"), args.workdir)
    extra = [f"launch.nnodes={len(hosts)}", f"launch.nproc_per_node={args.nproc_per_node}"]
    if args.backend != "auto":
        extra.append(f"launch.backend={args.backend}")
    if args.run_dir or not user_dir:
        extra.append(f"trainer.default_local_dir={_abs(run_dir, args.workdir)}")
    trainer_args = ["--config", config_arg, *args.overrides, *extra]
    env = node_env(args, environ)
    commands = build_commands(args, hosts, mode, trainer_args, env, run_id, log_dir,
                              environ.get("SLURM_CPUS_PER_TASK"))
    args.resolved_mode, args.run_id = mode, run_id
    return args, commands, info.layout


_NODES_FROM = {"hosts": "--hosts", "hostfile": "--hostfile",
               "slurm": "the SLURM allocation (SLURM_JOB_NODELIST)"}


def world_reasons(args: argparse.Namespace, source: str, nnodes: int, sized: bool,
                  demo_world: bool, demo: str | None) -> list[str]:
    """Lines that say where the world's sizes came from and, for the embedded demo's config,
    what runs (module doc)."""
    if source in _NODES_FROM:
        nodes = f"{nnodes} node(s) from {_NODES_FROM[source]}"
    elif args.nnodes is not None:
        nodes = f"{nnodes} local node(s) from --nnodes"
    else:
        nodes = "1 local node (no --hosts, --hostfile, --nnodes or SLURM allocation)"
    if sized:
        ranks = f"{args.nproc_per_node} rank(s) per node from --nproc-per-node"
    elif demo_world:
        ranks = f"{DEMO_NPROC} ranks per node, the embedded demo's world (as make demo runs it)"
    else:
        ranks = "1 rank per node (the default; --nproc-per-node sets it, one per GPU)"
    out = [f"world of {nnodes * args.nproc_per_node} rank(s): {nodes}, {ranks}"]
    if demo is not None:
        why = demo.removesuffix(": the embedded CPU demo")
        what = (f"config {args.config!r} runs the embedded CPU demo ({why}): a tiny policy "
                f"made for 1 node x {DEMO_NPROC} CPU ranks")
        if not demo_world:
            what += (f"; this job runs it on {nnodes} node(s) x {args.nproc_per_node} rank(s) "
                     "as given; name a model (actor_rollout_ref.model.path=...) to train a real one")
        out.append(what)
    return out


def main(argv: list[str] | None = None, environ: dict[str, str] | None = None) -> int:
    """The ``megarl-launch`` command; ``environ`` (default ``os.environ``) is what SLURM_* and
    NCCL_* defaults are read from."""
    environ = dict(os.environ if environ is None else environ)
    try:
        args, commands, layout = plan(argv, environ)
        n = len(commands)
        rdzv = "standalone" if n == 1 else _endpoint(args.rdzv_host or commands[0].host, args.rdzv_port)
        _log(f"{n} node(s), mode {args.resolved_mode}, {layout.describe()}, rendezvous {rdzv}, "
             f"run id {args.run_id}")
        for line in args.world_why:
            _log(line)
        if args.dry_run:
            for c in commands:
                print(c.shell_line())
            return 0
        if args.resolved_mode == "srun" and not environ.get("SLURM_JOB_ID"):
            raise LaunchError("--mode srun must run inside a SLURM allocation (sbatch or salloc); "
                              "SLURM_JOB_ID is not set; use --mode ssh or --mode local")
        if args.resolved_mode in ("local", "srun") and not (Path(args.workdir) / args.script).is_file():
            raise LaunchError(f"{args.script} not found in {args.workdir}; pass --script PATH "
                              f"(relative to --workdir) or --workdir REPO")
        if n > 1 and not args.no_preflight:
            preflight(args.rdzv_host or commands[0].host, args.rdzv_port, args.preflight_timeout)
    except LaunchError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    return run_nodes(commands)


if __name__ == "__main__":
    sys.exit(main())
