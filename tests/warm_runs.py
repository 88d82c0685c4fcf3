"""Training runs forked from a warm interpreter (the tests' start-up saver).

A run of ``python launch/train.py ...`` spends about 4.5 s importing torch, transformers and
megarl before it does anything; the suite starts about a hundred of them. `run_script` instead
asks a server process that has imported those once (and started no thread) to fork a child
that runs the script as ``__main__`` exactly as ``python script args`` would: its own
environment, working directory, ``sys.argv``, ``sys.path[0]``, stdout and stderr, atexit
handlers and non-daemon threads at exit, exit code (or ``-signal``). Every run is a fresh fork
of the untouched server, so runs never see each other's state. A world of ranks
(``nproc`` given) is as many children forked at once, each with the variables torchrun gives a
worker (`_rank_env`), ended as torchrun's agent ends it when a rank fails (`_wait_world`).

A server runs in the run's environment (but for `VOLATILE` names): a run goes to the server
started in its environment, or a new one is started in it (what modules read at import time is
then the same); the `MAX_SERVERS` most recently used stay up.
With ``MEGARL_TEST_FRESH=1``, or when the server cannot fork safely (a thread was started while
importing), the run is a plain subprocess. ``tests/trainer/test_warm_runs.py`` checks that a
run gives the same bits both ways.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from free_ports import free_port

# What a training run imports before its first step (the start-up the server pays once).
PRELOAD = ("torch", "torch.distributed", "transformers", "megarl.trainer", "megarl.trainer.trainer",
           "megarl.trainer.async_rollout", "megarl.config.loader", "megarl.data",
           "megarl.backends.torch", "megarl.rollout.torch", "megarl.rollout.process",
           "megarl.rewards.local_pool", "megarl.logging", "megarl.demo.assets",
           "matplotlib.pyplot")  # curves.png at the end of every run (megarl.logging.plots)
# Imported when they can be (a run of the megatron backend, a worker of tests/megatron): a
# checkout without megatron-core still gets a warm server for everything else.
OPTIONAL_PRELOAD = ("megarl.backends.megatron", "megarl.backends.megatron.backend")


class _Server:
    def __init__(self, env: dict[str, str], cwd: Path):
        self.env = dict(env)
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve"], cwd=cwd, env=self.env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     bufsize=1)
        hello = json.loads(self.proc.stdout.readline() or '{"ok": false}')
        self.ok = bool(hello.get("ok"))
        self.lock = threading.Lock()
        self.cpu_s = 0.0  # the CPU its forked runs reported (added to CHILD_CPU_S)

    def run(self, argv: list[str], env: dict[str, str], cwd: Path, timeout: float,
            nproc: int | None = None) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory(prefix="warm-run-") as tmp, self.lock:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            out.touch()
            err.touch()
            port = free_port() if nproc else 0
            self.proc.stdin.write(json.dumps({"argv": argv, "cwd": str(cwd), "env": env,
                                              "out": str(out), "err": str(err),
                                              "nproc": nproc, "port": port}) + "\n")
            self.proc.stdin.flush()
            pids = json.loads(self.proc.stdout.readline())["pids"]
            done: dict = {}
            reader = threading.Thread(target=lambda: done.update(
                json.loads(self.proc.stdout.readline() or '{"rc": null}')), daemon=True)
            reader.start()
            reader.join(timeout)
            if reader.is_alive():
                for pid in pids:
                    try:
                        os.kill(pid, 9)
                    except ProcessLookupError:
                        pass
                reader.join(30)
                raise subprocess.TimeoutExpired([sys.executable, *argv], timeout,
                                                out.read_text(errors="replace"),
                                                err.read_text(errors="replace"))
            global CHILD_CPU_S
            cpu_s = float(done.get("cpu_s") or 0.0)
            CHILD_CPU_S += cpu_s
            self.cpu_s += cpu_s
            return subprocess.CompletedProcess([sys.executable, *argv], done["rc"],
                                               out.read_text(errors="replace"),
                                               err.read_text(errors="replace"))

    def close(self) -> None:
        global CHILD_CPU_S
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except Exception:
            self.proc.kill()
            self.proc.wait()
        # reaped, the server brings its runs' CPU into this process's RUSAGE_CHILDREN: counted
        # there from now on, so it leaves CHILD_CPU_S (else tests/timing_table.py counts it twice)
        CHILD_CPU_S -= self.cpu_s
        self.cpu_s = 0.0


# CPU-seconds (user + system) of the runs forked for this process, their reaped children
# included: the server, not this process, reaps them (tests/timing_table.py adds this).
CHILD_CPU_S = 0.0
# The servers of this process, most recently used last; `_server` ran the latest run.
_servers: list[_Server] = []
_server: _Server | None = None
MAX_SERVERS = 3  # trainer runs and torchrun workers run in environments of their own
atexit.register(lambda: [s.close() for s in _servers])
# Set per test by pytest, read by nothing at import time (the child gets the run's own value).
VOLATILE = frozenset({"PYTEST_CURRENT_TEST"})


def _same_env(a: dict[str, str], b: dict[str, str]) -> bool:
    return ({k: v for k, v in a.items() if k not in VOLATILE}
            == {k: v for k, v in b.items() if k not in VOLATILE})


def _server_for(env: dict[str, str], cwd: Path) -> _Server:
    """The live server started in ``env``, else a new one (the least recently used closed
    beyond `MAX_SERVERS`)."""
    global _server
    for server in list(_servers):
        if server.proc.poll() is not None:
            _servers.remove(server)
        elif _same_env(server.env, env):
            _servers.remove(server)
            break
    else:
        # e.g. a test set a variable for good (an engine sets its variables in the test
        # process): imports may read it, so the server is started in that environment
        server = _Server(env, cwd)
        while len(_servers) >= MAX_SERVERS:
            _servers.pop(0).close()
    _servers.append(server)
    _server = server
    return server


def run_script(argv: list[str], cwd: Path, env: dict[str, str], timeout: float,
               nproc: int | None = None) -> subprocess.CompletedProcess:
    """``python *argv`` in ``cwd`` with ``env`` (stdout and stderr captured as text), forked from
    the warm server where it can be (module doc). ``nproc``: a world of that many ranks on
    this node, each given the variables torchrun gives its workers (`_rank_env`), their output
    interleaved in one stdout and one stderr as under torchrun; when a rank fails the others get
    SIGTERM (SIGKILL 30 s later) and the exit code is the first failure's. Without the server:
    ``torchrun --standalone --nproc_per_node=nproc``."""
    if os.environ.get("MEGARL_TEST_FRESH") != "1" and sys.platform.startswith("linux"):
        server = _server_for(env, cwd)
        if server.ok:
            return server.run(argv, env, cwd, timeout, nproc)
    launcher = ([] if nproc is None else
                ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"])
    return subprocess.run([sys.executable, *launcher, *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


# ------------------------------------------------------------------------------ server side


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _rank_env(rank: int, nproc: int, port: int, run_id: str) -> dict[str, str]:
    """What ``torchrun --standalone --nproc_per_node=nproc`` sets for worker ``rank`` (the
    rendezvous store hosted by rank 0, as without torchrun's agent)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
            "ROLE_NAME": "default", "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": run_id,
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_USE_AGENT_STORE": "False",
            "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT"}


def _child(req: dict) -> None:
    """In the forked child: become ``python argv`` and never return."""
    import runpy
    import traceback

    for fd, path in ((1, req["out"]), (2, req["err"])):  # O_APPEND: ranks share the files
        target = os.open(path, os.O_WRONLY | os.O_APPEND, 0o600)
        os.dup2(target, fd)
        os.close(target)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    script = req["argv"][0]
    sys.argv = list(req["argv"])
    sys.path[0] = str(Path(script).resolve().parent)
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        if exit_.code is None:
            code = 0
        elif isinstance(exit_.code, int):
            code = exit_.code
        else:
            print(exit_.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # as the interpreter does at exit: join non-daemon threads
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _serve() -> None:
    import importlib

    from megarl.utils.lifetime import die_with_parent

    die_with_parent()
    reply = sys.stdout
    ok = sys.platform.startswith("linux")
    try:
        for name in PRELOAD:
            importlib.import_module(name)
    except Exception as err:  # a missing extra: every run is a plain subprocess then
        print(f"warm_runs: preload failed ({err!r})", file=sys.stderr)
        ok = False
    for name in OPTIONAL_PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    # What the imports built lives as long as every run: a full collection in a run (megatron's
    # optimizer runs one per checkpoint) skips it instead of walking every module's objects.
    gc.freeze()
    ok = ok and _threads() == 1  # forking a threaded process is unsafe
    reply.write(json.dumps({"ok": ok}) + "\n")
    reply.flush()
    for line in sys.stdin:
        req = json.loads(line)
        nproc, run_id = req["nproc"], os.urandom(8).hex()
        pids = []
        for rank in range(nproc or 1):
            pid = os.fork()
            if pid == 0:
                if nproc:
                    req["env"] = {**req["env"], **_rank_env(rank, nproc, req["port"], run_id)}
                _child(req)
            pids.append(pid)
        reply.write(json.dumps({"pids": pids}) + "\n")
        reply.flush()
        rc, cpu_s = _wait_world(pids)
        reply.write(json.dumps({"rc": rc, "cpu_s": cpu_s}) + "\n")
        reply.flush()
    gc.unfreeze()  # the server's own exit frees its heap as usual


def _wait_world(pids: list[int], grace_s: float = 30.0) -> tuple[int, float]:
    """Reap ``pids``; once one exits non-zero, SIGTERM the others and SIGKILL them after
    ``grace_s`` (torchrun's agent does the same). Returns the first non-zero exit code (else 0)
    and the CPU-seconds the ranks and their reaped children spent."""
    import signal
    import time

    left, rc, kill_at, cpu_s = set(pids), 0, None, 0.0
    while left:
        pid, status, usage = os.wait4(-1, os.WNOHANG if kill_at is not None else 0)
        if pid == 0:
            if time.monotonic() >= kill_at:
                for p in left:
                    os.kill(p, signal.SIGKILL)
                kill_at = float("inf")
            time.sleep(0.02)
            continue
        if pid not in left:
            continue
        cpu_s += usage.ru_utime + usage.ru_stime
        left.discard(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and rc == 0:
            rc = code
            for p in left:
                os.kill(p, signal.SIGTERM)
            kill_at = time.monotonic() + grace_s
    return rc, cpu_s


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    _serve()
