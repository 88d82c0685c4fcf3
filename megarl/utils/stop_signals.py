"""A run that is told to stop (SIGTERM, SIGINT, SIGHUP) stops cleanly, and within a bound.

`StopSignals.install` (launch/train.py, every rank) turns the first of those signals into a
`StopRequested` exception in the main thread. It derives from BaseException, so no
``except Exception`` swallows it: the run unwinds through its ``finally`` blocks, which close
the reward pool and the asynchronous engine process and release the run directory's lock
(megarl.trainer.parts.Parts.close), and the entry point then dies by the same signal (the exit
status torchrun reports is unchanged). A checkpoint being written is abandoned: its temporary
folder is never published and the next save removes it (megarl.trainer.checkpoint), so the
newest complete checkpoint stays the one ``trainer.resume=auto`` takes.

The bound: Python runs a signal handler only when the main thread next executes Python code,
which a call blocked in C++ (a collective waiting for a dead peer) can delay. So the C-level
handler's wakeup byte (`signal.set_wakeup_fd`) is read by a watcher thread, which starts the
clock at once: ``grace_s`` after the first signal, or at a second one, the process exits
(``os._exit(128 + signum)``); its children then die with it (megarl.utils.lifetime).
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
GRACE_S = 10.0  # torchrun's agent SIGKILLs its workers 30 s after its SIGTERM


class StopRequested(BaseException):
    """The process got a stop signal; raised once, in the main thread."""

    def __init__(self, signum: int):
        super().__init__(signum)  # args = (signum,): a pickled copy (torch's DCP gathers
        self.signum = signum      # a rank's exception on rank 0) is rebuilt the same

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    def __str__(self) -> str:
        return f"stopped by {self.name}"


class StopSignals:
    """Install with `install` (main thread only), undo with `uninstall`.

    grace_s: seconds the process has, after the first signal, to unwind before it exits.
    """

    def __init__(self, grace_s: float = GRACE_S, signals: tuple[int, ...] = SIGNALS):
        self.grace_s = grace_s
        self.signals = tuple(int(s) for s in signals)
        self.received: int | None = None
        self._old: dict[int, object] = {}
        self._old_wakeup = -1
        self._pipe: tuple[int, int] | None = None
        self._watcher: threading.Thread | None = None

    def install(self) -> StopSignals:
        r, w = os.pipe()
        os.set_blocking(w, False)  # set_wakeup_fd needs it; a full pipe drops bytes, not blocks
        self._pipe = (r, w)
        self._old_wakeup = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        self._old = {s: signal.signal(s, self._handler) for s in self.signals}
        self._watcher = threading.Thread(target=self._watch, args=(r,),
                                         name="megarl-stop-signals", daemon=True)
        self._watcher.start()
        return self

    def uninstall(self) -> None:
        if self._pipe is None:
            return
        for s, old in self._old.items():
            signal.signal(s, old)
        signal.set_wakeup_fd(self._old_wakeup)
        r, w = self._pipe
        self._pipe = None
        os.close(w)  # the watcher reads EOF and returns
        if self._watcher is not None:
            self._watcher.join(timeout=5.0)
        os.close(r)

    def _handler(self, signum: int, _frame) -> None:
        if self.received is None:
            self.received = signum
            raise StopRequested(signum)
        # a later signal while unwinding: the watcher exits the process now

    def _watch(self, r: int) -> None:
        first: int | None = None
        deadline = None
        while True:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([r], [], [], timeout)
            if not ready:
                _exit(first, f"still running {self.grace_s:g} s after "
                             f"{signal.Signals(first).name}; exiting now")
            data = os.read(r, 64)
            if not data:
                return
            for signum in data:
                if signum not in self.signals:
                    continue
                if first is None:
                    first, deadline = signum, time.monotonic() + self.grace_s
                else:
                    _exit(first, f"{signal.Signals(signum).name} after "
                                 f"{signal.Signals(first).name}; exiting now")

    @staticmethod
    def die_by(signum: int) -> None:
        """End this process by ``signum`` with its default action (main thread), so the exit
        status says which signal stopped it."""
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        time.sleep(5.0)  # the signal is delivered before kill returns; a guard only
        os._exit(128 + signum)


def _exit(signum: int, why: str) -> None:
    try:
        print(f"megarl: pid {os.getpid()}: {why}", file=sys.stderr, flush=True)
    finally:
        os._exit(128 + signum)
