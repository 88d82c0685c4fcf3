"""Local reward workers and the zygote that forks them.

Worker protocol over two pipes (pickled messages, `multiprocessing.connection.Connection`):
  parent -> worker: ("score", [(index, RewardRequest), ...]) | ("stop",)
  worker -> parent: ("ready", pid) | ("failed", message)
                    | ("result", index, score, extra, status)   one per item, in order
                    | ("crash", index, message)   then the worker exits (memory bound hit)
Scoring runs in the worker's main thread (math-verify's SIGALRM timeouts need it) under an
RLIMIT_AS bound.

The zygote (`python -m megarl.rewards._worker --zygote CTRL_FD`) imports and warms up
math-verify once, then forks a ready worker per request, so replacing a killed worker costs
milliseconds instead of an interpreter start. Control protocol on a SOCK_SEQPACKET socket:
  parent -> zygote: b"spawn MEMORY_MB" + two fds (worker inbox, worker outbox) -> b"pid PID"
                    b"reap PID" -> b"status WAITSTATUS"  (blocks until PID has exited)
  zygote -> parent: b"ready" once, after the warm-up.
Direct start without a zygote: `python -m megarl.rewards._worker INBOX_FD OUTBOX_FD MEMORY_MB`.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from multiprocessing.connection import Connection

from megarl.utils.lifetime import PARENT_PID_ENV, die_with_parent

EXIT_CRASH = 3


def serve(inbox_fd: int, outbox_fd: int, memory_mb: int) -> None:
    """Worker main loop; never returns (always os._exit)."""
    try:
        inbox = Connection(inbox_fd, writable=False)
        outbox = Connection(outbox_fd, readable=False)
    except BaseException:  # noqa: BLE001
        os._exit(2)
    try:
        from megarl.rewards.execute import WorkerCrash, limit_address_space, run_request, warm_up

        limit_address_space(memory_mb * 2**20)
        warm_up()
        outbox.send(("ready", os.getpid()))
    except BaseException as e:  # noqa: BLE001
        try:
            outbox.send(("failed", f"{type(e).__name__}: {e}"[:500]))
        finally:
            os._exit(2)
    while True:
        try:
            msg = inbox.recv()
        except (EOFError, OSError):
            os._exit(0)  # parent went away
        except BaseException:  # noqa: BLE001 - e.g. MemoryError unpickling the chunk
            os._exit(EXIT_CRASH)
        if msg[0] == "stop":
            os._exit(0)
        for index, request in msg[1]:
            try:
                score, extra, status = run_request(request)
            except WorkerCrash as e:
                try:
                    outbox.send(("crash", index, str(e)))
                finally:
                    os._exit(EXIT_CRASH)
            except BaseException:  # noqa: BLE001 - SystemExit etc. from a custom function
                os._exit(EXIT_CRASH)
            try:
                outbox.send(("result", index, score, extra, status))
            except BaseException:  # noqa: BLE001
                os._exit(EXIT_CRASH)


def zygote(ctrl_fd: int) -> None:
    ctrl = socket.socket(fileno=ctrl_fd)
    try:
        from megarl.rewards.execute import warm_up

        warm_up()
    except BaseException:  # noqa: BLE001 - workers then import on their own
        pass
    ctrl.send(b"ready")
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(ctrl, 256, 2)
        except OSError:
            os._exit(0)
        if not msg:
            os._exit(0)  # parent went away
        cmd, arg = msg.decode().split(" ", 1)
        if cmd == "spawn":
            zygote_pid = os.getpid()
            pid = os.fork()
            if pid == 0:
                try:
                    die_with_parent(zygote_pid)  # a fork does not inherit the death signal
                    ctrl.close()
                    os.setsid()  # own session: own CPU share under Linux autogroup, as Ray's workers
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    serve(fds[0], fds[1], int(arg))
                finally:
                    os._exit(2)
            for fd in fds:
                os.close(fd)
            ctrl.send(f"pid {pid}".encode())
        elif cmd == "reap":
            try:
                _, status = os.waitpid(int(arg), 0)
            except ChildProcessError:
                status = -1
            ctrl.send(f"status {status}".encode())


def main(argv: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent owns shutdown
    parent = os.environ.get(PARENT_PID_ENV)
    die_with_parent(int(parent) if parent else None)
    if argv[0] == "--zygote":
        zygote(int(argv[1]))
    else:
        serve(int(argv[0]), int(argv[1]), int(argv[2]))


if __name__ == "__main__":
    main(sys.argv[1:])
