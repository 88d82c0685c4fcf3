"""A real, throw-away SLURM cluster on this machine: munged + slurmctld + N slurmd ("nodes"
n1..nN, all on 127.0.0.1, free ports), everything in one temp folder. Used by test_slurm.py and
handy for trying the sbatch templates on a laptop:

    python tests/launch/slurm_cluster.py up runs/slurm-cluster --nodes 2   # prints export SLURM_CONF=...
    SLURM_CONF="$PWD/runs/slurm-cluster/slurm.conf" sbatch --nodes=2 launch/slurm/train_multinode.sbatch
    python tests/launch/slurm_cluster.py down runs/slurm-cluster

Needs Debian/Ubuntu's slurmctld, slurmd, slurm-client and munge; ``ensure_installed`` runs
``apt-get install`` for them when they are missing and this user is root (set
MEGARL_TEST_NO_APT=1 to forbid that). Daemons run as the current user (root for a real test).
Auth is munge with a fresh key and a private socket, so no one else can submit to the cluster.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: free_ports
from free_ports import free_port  # noqa: E402

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "scontrol", "scancel", "srun")
SBIN_PATH = "/usr/local/sbin:/usr/sbin:/sbin"
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE", "PREEMPTED"}


class SlurmUnavailable(Exception):
    """SLURM cannot run on this machine (the reason is the message)."""


def _which(name: str) -> str | None:
    return shutil.which(name, path=os.environ.get("PATH", "") + ":" + SBIN_PATH)


def ensure_installed(timeout: float = 900) -> float:
    """Install the SLURM and munge packages if a binary is missing; returns the seconds spent.
    Raises SlurmUnavailable when they are missing and cannot be installed."""
    missing = [b for b in BINARIES if _which(b) is None]
    if not missing:
        return 0.0
    what = f"SLURM/munge binaries missing ({', '.join(missing)})"
    if os.environ.get("MEGARL_TEST_NO_APT"):
        raise SlurmUnavailable(f"{what} and MEGARL_TEST_NO_APT is set")
    if os.geteuid() != 0:
        raise SlurmUnavailable(f"{what} and not root, so `apt-get install {' '.join(PACKAGES)}` "
                               f"cannot run; install them to run this test")
    if shutil.which("apt-get") is None:
        raise SlurmUnavailable(f"{what} and apt-get is not available (not Debian/Ubuntu)")
    start = time.monotonic()
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    with open(os.path.join(tempfile.gettempdir(), "megarl-slurm-apt.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # pytest-xdist workers: one apt-get at a time
        if all(_which(b) for b in BINARIES):
            return time.monotonic() - start
        r = subprocess.run(install, env=env, capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0:  # stale package lists: refresh once and retry
            subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=timeout)
            r = subprocess.run(install, env=env, capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0:
            tail = " | ".join((r.stdout + r.stderr).strip().splitlines()[-3:])
            raise SlurmUnavailable(f"{what}; `{' '.join(install)}` failed: {tail}")
    return time.monotonic() - start




class LocalSlurm:
    """``start()`` the daemons, ``sbatch`` jobs, ``wait`` for them, ``stop()`` everything.

    ``root`` holds slurm.conf, state, spool, logs and the munge key; munge's socket lives in a
    separate world-traversable folder (munged insists on that) removed by ``stop``."""

    def __init__(self, root: str | Path, nodes: int = 2):
        self.root = Path(root).resolve()
        self.nodes = [f"n{i}" for i in range(1, nodes + 1)]
        self.conf = self.root / "slurm.conf"
        self.sock_dir: Path | None = None
        self.procs: dict[str, subprocess.Popen] = {}
        self.jobs: list[str] = []

    # ---- environment -------------------------------------------------------------------------
    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env["PATH"] = env.get("PATH", "") + ":" + SBIN_PATH
        env["SLURM_CONF"] = str(self.conf)
        env.update(extra or {})
        return env

    def _run(self, *argv: str, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run(argv, env=self.env(), capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({r.returncode}): {r.stderr.strip()}")
        return r

    # ---- lifecycle ---------------------------------------------------------------------------
    def _write_conf(self) -> None:
        r, cpus = self.root, os.cpu_count() or 1
        ports = [free_port() for _ in range(len(self.nodes) + 1)]
        lines = [
            "ClusterName=megarltest",
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={ports[0]}",
            f"SlurmUser={_user()}",
            f"SlurmdUser={_user()}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire: a requeued job may start again after this many seconds (default 120).
            f"AuthInfo=socket={self.sock_dir}/munge.sock,cred_expire=5",
            "CommunicationParameters=NoInAddrAny",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "MpiDefault=none",
            "MailProg=/bin/true",
            "ReturnToService=2",
            "SlurmdParameters=config_overrides",
            "SchedulerParameters=sched_interval=1,bf_interval=1",
            "KillWait=5",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/slurmctld.pid",
            f"SlurmdPidFile={r}/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/slurmctld.log",
            f"SlurmdLogFile={r}/slurmd-%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
        ]
        for node, port in zip(self.nodes, ports[1:]):
            lines.append(f"NodeName={node} NodeAddr=127.0.0.1 Port={port} CPUs={cpus} RealMemory=1000")
        lines.append(f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES "
                     "MaxTime=INFINITE State=UP OverSubscribe=FORCE")
        self.conf.write_text("\n".join(lines) + "\n")

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / f"{name}.stderr", "ab")
        self.procs[name] = subprocess.Popen(argv, env=self.env(), stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()

    def _start_munge(self) -> None:
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.sock_dir = Path(tempfile.mkdtemp(prefix="megarl-munge-"))
        self.sock_dir.chmod(0o755)  # munged requires a traversable socket folder
        self._spawn("munged", [_which("munged"), "-F", f"--socket={self.sock_dir}/munge.sock",
                               f"--key-file={key}", f"--pid-file={self.root}/munged.pid",
                               f"--seed-file={self.root}/munged.seed"])
        self._until(lambda: (self.sock_dir / "munge.sock").exists(), 10, "munged to create its socket")

    def start(self, timeout: float = 60) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        for sub in ("state", "spool", *(f"spool/{n}" for n in self.nodes)):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self._start_munge()
        self._write_conf()
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        for node in self.nodes:
            self._spawn(f"slurmd-{node}", [_which("slurmd"), "-D", "-N", node, "-f", str(self.conf)])

        def all_idle() -> bool:
            r = self._run("sinfo", "-h", "-N", "-o", "%N %t", check=False, timeout=10)
            states = dict(line.split() for line in r.stdout.splitlines() if line.strip())
            return r.returncode == 0 and all(states.get(n) == "idle" for n in self.nodes)

        self._until(all_idle, timeout, "every node to be idle")

    def _until(self, cond, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                reason = f"{', '.join(dead)} exited" if dead else f"timed out after {timeout:g}s"
                raise SlurmUnavailable(f"waiting for {what}: {reason}; {self.log_tail()}")
            time.sleep(0.2)

    def log_tail(self, lines: int = 8) -> str:
        out = []
        for path in sorted(self.root.glob("*.log")) + sorted(self.root.glob("*.stderr")):
            text = path.read_text(errors="replace").strip().splitlines()[-lines:]
            if text:
                out.append(f"[{path.name}] " + " | ".join(text))
        return " ".join(out)

    def stop(self) -> None:
        """Cancel our jobs, stop the daemons we started (by pid), remove munge's socket folder."""
        if self.jobs and _which("scancel"):
            self._run("scancel", *self.jobs, check=False, timeout=15)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and any(self.state(j) not in TERMINAL | {"", "UNKNOWN"}
                                                      for j in self.jobs):
                time.sleep(0.3)
        for name in sorted(self.procs, key=lambda n: n != "munged"):  # munged last
            p = self.procs[name]
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        if self.sock_dir is not None:
            shutil.rmtree(self.sock_dir, ignore_errors=True)

    # ---- jobs --------------------------------------------------------------------------------
    def sbatch(self, script: str | Path, options: list[str], env: dict[str, str], cwd: str | Path,
               args: list[str] = ()) -> str:
        r = subprocess.run(["sbatch", "--parsable", *options, str(script), *args], env=self.env(env),
                           cwd=cwd, capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise RuntimeError(f"sbatch failed: {r.stderr.strip()}")
        job = r.stdout.strip().split(";")[0]
        self.jobs.append(job)
        return job

    def show(self, job: str) -> dict[str, str]:
        r = self._run("scontrol", "show", "job", "-o", job, check=False, timeout=10)
        fields = {}
        for item in r.stdout.split():
            key, sep, value = item.partition("=")
            if sep and key not in fields:
                fields[key] = value
        return fields

    def state(self, job: str) -> str:
        return self.show(job).get("JobState", "")

    def wait(self, job: str, timeout: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.show(job)
            if info.get("JobState") in TERMINAL:
                return info
            time.sleep(0.3)
        raise TimeoutError(f"job {job} still {self.state(job)} after {timeout:g}s; {self.log_tail()}")


def _user() -> str:
    import pwd

    return pwd.getpwuid(os.geteuid()).pw_name


def _cli(argv: list[str]) -> int:
    import argparse
    import json

    p = argparse.ArgumentParser(description="a local SLURM cluster for trying the templates")
    p.add_argument("action", choices=("up", "down"))
    p.add_argument("root")
    p.add_argument("--nodes", type=int, default=2)
    a = p.parse_args(argv)
    root = Path(a.root).resolve()
    state = root / "cluster.json"
    if a.action == "up":
        ensure_installed()
        cluster = LocalSlurm(root, a.nodes)
        cluster.start()
        pids = {n: p.pid for n, p in cluster.procs.items()}
        state.write_text(json.dumps({"pids": pids, "sock_dir": str(cluster.sock_dir)}))
        print(f"export SLURM_CONF={cluster.conf}")
        return 0
    info = json.loads(state.read_text())
    for pid in info["pids"].values():
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    shutil.rmtree(info["sock_dir"], ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(_cli(sys.argv[1:]))
