"""Entry point of one local reward worker: `python -m megarl.rewards._worker REQ_FD RES_FD MEMORY_MB`.

Runs scoring in its main thread (math-verify's SIGALRM timeouts need it) under an RLIMIT_AS
bound. Protocol over two pipes (pickled messages, `multiprocessing.connection.Connection`):
  parent -> worker: ("score", [(index, RewardRequest), ...]) | ("stop",)
  worker -> parent: ("ready", pid) | ("failed", message)
                    | ("result", index, score, extra, status)   one per item, in order
                    | ("crash", index, message)   then the worker exits (memory bound hit)
"""

from __future__ import annotations

import os
import signal
import sys
from multiprocessing.connection import Connection

EXIT_CRASH = 3


def main(argv: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent owns shutdown
    inbox = Connection(int(argv[0]), writable=False)
    outbox = Connection(int(argv[1]), readable=False)
    memory_mb = int(argv[2])
    try:
        from megarl.rewards.execute import WorkerCrash, limit_address_space, run_request, warm_up

        limit_address_space(memory_mb * 2**20)
        warm_up()
    except BaseException as e:  # noqa: BLE001
        try:
            outbox.send(("failed", f"{type(e).__name__}: {e}"[:500]))
        finally:
            os._exit(2)
    outbox.send(("ready", os.getpid()))
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
            try:
                outbox.send(("result", index, score, extra, status))
            except BaseException:  # noqa: BLE001
                os._exit(EXIT_CRASH)


if __name__ == "__main__":
    main(sys.argv[1:])
