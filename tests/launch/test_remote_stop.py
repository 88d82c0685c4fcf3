"""megarl-launch in ssh mode stops the remote nodes when it is stopped (SIGTERM) or killed
(SIGKILL: the kernel sends its ssh clients SIGTERM, PR_SET_PDEATHSIG).

There is no second host nor ssh server here, so ``ssh`` is a stand-in (first on PATH) that plays
both ends the way OpenSSH does: the remote command runs under the user's shell (``bash -c``) in
a session of its own, away from the launcher's process group; with ``-tt`` on a new pseudo
terminal whose master the client side holds, as sshd holds it for the connection. When the client
dies, the master closes and the kernel hangs the terminal up: SIGHUP to the remote torchrun,
which stops its ranks. Without ``-tt`` nothing tells the remote side (as with sshd, which leaves
a command without a terminal running until it writes to the closed connection). Beyond this
boundary (not tested): sshd closing the pty when the TCP connection drops.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from free_ports import free_port
from test_two_nodes import HELLO, HELLO_CONFIG, REPO, _processes_mentioning

pytestmark = pytest.mark.dist

STAND_IN = '''#!{python}
"""ssh stand-in: [-o OPT]... [-tt] HOST COMMAND... -> bash -c COMMAND as sshd would run it."""
import os, pty, subprocess, sys

args, tty = sys.argv[1:], False
while args and args[0].startswith("-"):
    opt = args.pop(0)
    if opt == "-o":
        args.pop(0)
    tty = tty or opt == "-tt"
host, command = args[0], " ".join(args[1:])
print(f"ssh stand-in: {{host}} tty={{tty}}", file=sys.stderr, flush=True)
if not tty:
    remote = subprocess.Popen(["bash", "-c", command], stdin=subprocess.DEVNULL,
                              start_new_session=True)
    sys.exit(remote.wait())
pid, master = pty.fork()  # the child: a new session whose controlling terminal is the pty
if pid == 0:
    os.execvp("bash", ["bash", "-c", command])
while True:  # relay the terminal's output; dying closes the master (a hang-up)
    try:
        data = os.read(master, 65536)
    except OSError:
        break
    if not data:
        break
    os.write(1, data)
sys.exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
'''


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_stopping_the_launcher_stops_the_remote_nodes(tmp_path, sig):
    """Two ssh nodes (one rank each, the hello job sleeping 60 s per step): once both ranks
    run, the launcher gets ``sig``; within 60 s no process of the run is left (stand-in
    clients, remote shells, torchrun agents, ranks). Passed on the code as it was (the ssh
    command already had -tt). Planted, the ssh command without -tt: fails on the "tty=True"
    check; with that check off too, both signals: "left: ... torch.distributed.run ... |
    ... torch.distributed.run ... | ... hello_dist.py ..." (2 agents, 2 ranks alive 60 s on)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(STAND_IN.format(python=sys.executable))
    (bin_dir / "ssh").chmod(0o755)
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "NCCL_"))}
    env.update(OMP_NUM_THREADS="1", HELLO_STEP_SECONDS="60", PATH=f"{bin_dir}:{env['PATH']}")
    launcher = subprocess.Popen(
        [sys.executable, "launch/multinode.py", "--mode", "ssh", "--hosts", "localhost,127.0.0.1",
         "--rdzv-host", "127.0.0.1", "--rdzv-port", str(free_port()), "--backend", "gloo",
         "--config", HELLO_CONFIG, "--script", HELLO, "--run-dir", str(run_dir)],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        logs = [run_dir / f"logs/node{i}.log" for i in (0, 1)]
        deadline = time.monotonic() + 180
        while not all(p.exists() and "hello step=1" in p.read_text() for p in logs):
            assert launcher.poll() is None, f"the launcher exited {launcher.returncode}"
            assert time.monotonic() < deadline, "the two ranks did not both run a step in 180 s"
            time.sleep(0.3)
        assert all("tty=True" in p.read_text() for p in logs)
        started = _processes_mentioning(str(run_dir))
        assert len(started) >= 6, started  # 2 stand-ins, 2 shells or agents, 2 ranks at least
        launcher.send_signal(getattr(signal, sig))
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 60
        while left := _processes_mentioning(str(run_dir)):
            assert time.monotonic() < deadline, "left: " + " | ".join(
                Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")
                .replace("\0", " ")[:120] for p in left if Path(f"/proc/{p}").exists())
            time.sleep(0.3)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for pid in _processes_mentioning(str(run_dir)):  # on failure: what this test started
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
