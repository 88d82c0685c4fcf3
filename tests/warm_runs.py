"""Single-process training runs forked from a warm interpreter (the tests' start-up saver).

A run of ``python launch/train.py ...`` spends about 4.5 s importing torch, transformers and
megarl before it does anything; the suite starts about a hundred of them. `run_script` instead
asks a server process that has imported those once (and started no thread) to fork a child
that runs the script as ``__main__`` exactly as ``python script args`` would: its own
environment, working directory, ``sys.argv``, ``sys.path[0]``, stdout and stderr, atexit
handlers and non-daemon threads at exit, exit code (or ``-signal``). Every run is a fresh fork
of the untouched server, so runs never see each other's state.

The server runs in the run's environment (but for `VOLATILE` names): when a run's environment
differs, a new server is started in it (what modules read at import time is then the same).
With ``MEGARL_TEST_FRESH=1``, or when the server cannot fork safely (a thread was started while
importing), the run is a plain subprocess. ``tests/trainer/test_warm_runs.py`` checks that a
run gives the same bits both ways.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

# What a training run imports before its first step (the start-up the server pays once).
PRELOAD = ("torch", "torch.distributed", "transformers", "megarl.trainer", "megarl.trainer.trainer",
           "megarl.trainer.async_rollout", "megarl.config.loader", "megarl.data",
           "megarl.backends.torch", "megarl.rollout.torch", "megarl.rollout.process",
           "megarl.rewards.local_pool", "megarl.logging", "megarl.demo.assets",
           "matplotlib.pyplot")  # curves.png at the end of every run (megarl.logging.plots)


class _Server:
    def __init__(self, env: dict[str, str], cwd: Path):
        self.env = dict(env)
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve"], cwd=cwd, env=self.env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     bufsize=1)
        hello = json.loads(self.proc.stdout.readline() or '{"ok": false}')
        self.ok = bool(hello.get("ok"))
        self.lock = threading.Lock()

    def run(self, argv: list[str], env: dict[str, str], cwd: Path,
            timeout: float) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory(prefix="warm-run-") as tmp, self.lock:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            self.proc.stdin.write(json.dumps({"argv": argv, "cwd": str(cwd), "env": env,
                                              "out": str(out), "err": str(err)}) + "\n")
            self.proc.stdin.flush()
            pid = json.loads(self.proc.stdout.readline())["pid"]
            done: dict = {}
            reader = threading.Thread(target=lambda: done.update(
                json.loads(self.proc.stdout.readline() or '{"rc": null}')), daemon=True)
            reader.start()
            reader.join(timeout)
            if reader.is_alive():
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
                reader.join(30)
                raise subprocess.TimeoutExpired([sys.executable, *argv], timeout,
                                                out.read_text(errors="replace"),
                                                err.read_text(errors="replace"))
            return subprocess.CompletedProcess([sys.executable, *argv], done["rc"],
                                               out.read_text(errors="replace"),
                                               err.read_text(errors="replace"))

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except Exception:
            self.proc.kill()


_server: _Server | None = None
atexit.register(lambda: _server is not None and _server.close())
# Set per test by pytest, read by nothing at import time (the child gets the run's own value).
VOLATILE = frozenset({"PYTEST_CURRENT_TEST"})


def _same_env(a: dict[str, str], b: dict[str, str]) -> bool:
    return ({k: v for k, v in a.items() if k not in VOLATILE}
            == {k: v for k, v in b.items() if k not in VOLATILE})


def run_script(argv: list[str], cwd: Path, env: dict[str, str],
               timeout: float) -> subprocess.CompletedProcess:
    """``python *argv`` in ``cwd`` with ``env`` (stdout and stderr captured as text), forked from
    the warm server where it can be (module doc)."""
    global _server
    if os.environ.get("MEGARL_TEST_FRESH") != "1" and sys.platform.startswith("linux"):
        if _server is None or not _same_env(_server.env, env) or _server.proc.poll() is not None:
            # a test changed the environment for good (e.g. an engine sets its variables in
            # the test process): a server started in the new one
            if _server is not None:
                _server.close()
            _server = _Server(env, cwd)
        if _server.ok:
            return _server.run(argv, env, cwd, timeout)
    return subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


# ------------------------------------------------------------------------------ server side


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _child(req: dict) -> None:
    """In the forked child: become ``python argv`` and never return."""
    import runpy
    import traceback

    for fd, path in ((1, req["out"]), (2, req["err"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
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
    ok = ok and _threads() == 1  # forking a threaded process is unsafe
    reply.write(json.dumps({"ok": ok}) + "\n")
    reply.flush()
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(req)
        reply.write(json.dumps({"pid": pid}) + "\n")
        reply.flush()
        _, status = os.waitpid(pid, 0)
        rc = os.waitstatus_to_exitcode(status)
        reply.write(json.dumps({"rc": rc}) + "\n")
        reply.flush()


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    _serve()
