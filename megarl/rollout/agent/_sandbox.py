"""The process `PythonTool` runs a program in: ``python -I _sandbox.py DIR SETTINGS_JSON``.

Standalone on purpose (no megarl import: it starts in milliseconds and reads nothing of the
trainer). Order matters: limits first, then the network namespace (needs the privileges the
process still has), the stdlib modules the program may use (read while the interpreter's files
are still readable), then the drop to the private uid with RLIMIT_NPROC 1, and last the
program itself, compiled and run in this process (the only place megarl runs model-written
code). What it guarantees is listed in `megarl.rollout.agent.tools.PythonTool`.
"""

import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38


def _limit(which, value):
    _, hard = resource.getrlimit(which)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(which, (value, value))


def _own_process_count(uid):
    n = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/status") as f:
                    for line in f:
                        if line.startswith("Uid:"):
                            n += int(line.split()[1]) == uid
                            break
            except OSError:
                pass
    return n


def main(folder, settings):
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != settings["parent"]:
        os._exit(1)  # the parent died before the death signal was set
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    _limit(resource.RLIMIT_CPU, int(settings["cpu_s"]))
    _limit(resource.RLIMIT_FSIZE, int(settings["file_mb"]) << 20)
    _limit(resource.RLIMIT_NOFILE, 64)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the cap fails, not the process
    root = os.geteuid() == 0
    flags = CLONE_NEWNET if root else CLONE_NEWUSER | CLONE_NEWNET
    netns = libc.unshare(flags) == 0
    with open(os.path.join(folder, ".status"), "w") as f:
        f.write(f"netns={int(netns)}\n")
    for name in settings["preload"]:
        try:
            __import__(name)
        except ImportError:
            pass
    with open(os.path.join(folder, "main.py")) as f:
        source = f.read()
    if root:
        uid = int(settings["uid"])
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        _limit(resource.RLIMIT_NPROC, 1)  # after setuid: this process is the uid's only one
    else:
        _limit(resource.RLIMIT_NPROC, max(1, _own_process_count(os.getuid())))
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    # the memory bound last: everything above stays outside the program's budget
    _limit(resource.RLIMIT_AS, int(settings["memory_mb"]) << 20)
    sys.argv = ["main.py"]
    sys.path[:] = [p for p in sys.path if p and os.path.isdir(p)]
    try:
        code = compile(source, "main.py", "exec")
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__})  # noqa: S102 - sandboxed
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - the program's error, without this file's frame
        import traceback

        tb = e.__traceback__.tb_next if e.__traceback__ is not None else None
        traceback.print_exception(type(e), e, tb)
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
