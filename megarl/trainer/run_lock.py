"""One writer per run directory: a lease file held by rank 0 for the run's life.

``<trainer.default_local_dir>/.megarl.lock`` is a small JSON file naming its holder (host, pid,
the process's start time, when the run started and when the lease was last renewed). A second
run on the same directory is refused at start-up with a message naming the holder. A lock whose
holder is gone is taken over with a warning: on the same host when its pid is no longer that
process (a pid is matched with its start time, so a reused pid does not count), on another host
(a shared file system, multi-node) when the lease has not been renewed for ``lease_s``. The
holder renews it every ``lease_s / 4`` from a daemon thread, so the lock works where ``flock``
does not reach (NFS, Lustre); it is a lease, not only an advisory lock.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from megarl.errors import UserInputError

log = logging.getLogger(__name__)

LOCK_NAME = ".megarl.lock"
LEASE_S = 60.0  # another host takes a lock over after this long without a renewal


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    pid_started: float  # the process's start time (s since the epoch), to tell a reused pid
    run_started: float
    renewed: float

    @classmethod
    def me(cls) -> Holder:
        now = time.time()
        return cls(socket.gethostname(), os.getpid(), psutil.Process().create_time(), now, now)

    def same_process(self, other: Holder) -> bool:
        return (self.host, self.pid, self.pid_started) == (other.host, other.pid,
                                                           other.pid_started)

    def describe(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.run_started))
        return f"pid {self.pid} on host {self.host}, started {started}"


def _process_alive(holder: Holder) -> bool:
    try:
        proc = psutil.Process(holder.pid)
        return (proc.status() != psutil.STATUS_ZOMBIE
                and abs(proc.create_time() - holder.pid_started) < 1.0)
    except psutil.NoSuchProcess:
        return False


def _read(path: Path) -> Holder | None:
    try:
        return Holder(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None  # gone, or half-written by a writer that died: not a live holder


def _write(path: Path, holder: Holder) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(holder)))
    os.replace(tmp, path)


def _create(path: Path, holder: Holder) -> None:
    """Create the lock whole or raise FileExistsError: the holder is written to a file of its
    own, then hard-linked to the lock's name (atomic, also on NFS), so no reader ever sees the
    lock half-written and takes it for a dead writer's."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.new")
    tmp.write_text(json.dumps(asdict(holder)))
    try:
        os.link(tmp, path)
    except OSError as err:
        if isinstance(err, FileExistsError):
            raise
        # a file system without hard links: exclusive creation, then the content
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(asdict(holder)))
    finally:
        tmp.unlink(missing_ok=True)


def holder_gone(holder: Holder | None, lease_s: float = LEASE_S) -> str | None:
    """Why ``holder``'s lock may be taken over (None: it is live)."""
    if holder is None:
        return "the lock file is unreadable"
    if holder.host == socket.gethostname():
        if holder.pid == os.getpid() or not _process_alive(holder):
            return f"{holder.describe()} is no longer running"
        return None
    age = time.time() - holder.renewed
    if age > lease_s:
        return f"{holder.describe()} has not renewed it for {age:.0f} s (lease {lease_s:.0f} s)"
    return None


class RunDirLock:
    """The run directory's lease, held from `acquire` to `release`.

    run_dir: trainer.default_local_dir (created if missing).
    lease_s: seconds without a renewal after which another host takes the lock over.
    """

    def __init__(self, run_dir: str | os.PathLike, lease_s: float = LEASE_S):
        self.path = Path(run_dir) / LOCK_NAME
        self.lease_s = lease_s
        self.me = Holder.me()
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def acquire(self) -> RunDirLock:
        """Take the lock, or raise UserInputError naming the live holder."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            _create(self.path, self.me)
        except FileExistsError:
            holder = _read(self.path)
            why = holder_gone(holder, self.lease_s)
            if why is None:
                raise UserInputError(self._refusal(holder)) from None
            if holder is None or not holder.same_process(self.me):
                log.warning("%s: taking the run directory's lock over: %s", self.path, why)
            _write(self.path, self.me)
            time.sleep(0.2)  # two runs taking over at once: the last write wins, the other sees it
            now = _read(self.path)
            if now is None or not now.same_process(self.me):
                raise UserInputError(self._refusal(now)) from None
        self._renewer = threading.Thread(target=self._renew, name="megarl-run-lock", daemon=True)
        self._renewer.start()
        return self

    def _refusal(self, holder: Holder | None) -> str:
        who = holder.describe() if holder else "another run"
        return (f"trainer.default_local_dir={self.path.parent} is in use by a live run: {who} "
                f"(its lock: {self.path}). Stop that run first (it keeps writing checkpoints "
                f"and metrics here), or give this run another trainer.default_local_dir. A run "
                f"on another host that stopped without removing the lock is taken over "
                f"{self.lease_s:.0f} s after its last renewal.")

    def _renew(self) -> None:
        while not self._stop.wait(self.lease_s / 4):
            holder = _read(self.path)
            if holder is None or not holder.same_process(self.me):
                log.error("%s: the run directory's lock was taken by %s; this run no longer "
                          "holds it", self.path, holder.describe() if holder else "someone")
                return
            try:
                _write(self.path, Holder(**{**asdict(self.me), "renewed": time.time()}))
            except OSError as err:
                log.warning("%s: could not renew the lock: %s", self.path, err)

    def release(self) -> None:
        """Stop renewing and remove the lock if this run still holds it."""
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join(timeout=5)
        holder = _read(self.path)
        if holder is not None and holder.same_process(self.me):
            self.path.unlink(missing_ok=True)
