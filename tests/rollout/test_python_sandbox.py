"""The python tool's sandbox against a hostile program (megarl/rollout/agent/_sandbox.py), under
each file-system isolation this machine offers (a mount namespace with a private root, and
Landlock, the fallback where namespaces are refused):

- it cannot read a world-readable training file or the repository, nor write outside its own
  folder (/tmp, /dev/shm, the repository): each attempt fails and leaves nothing behind;
- it cannot fork (a fork bomb ends at the first fork) and the next program runs normally;
- it dies with the process that runs the tool, even after the uid drop (which clears the
  parent-death signal: the program outlived a killed parent before it was set again).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from megarl.errors import UserInputError
from megarl.rollout.agent import PythonTool

ROOT = Path(__file__).resolve().parents[2]
MODES = ["mount_namespace", "landlock"]

DRILL = r'''
import errno, json, os
result = {"read": {}, "write": {}}
for name, path in READS.items():
    try:
        with open(path) as f:
            result["read"][name] = "read " + f.read(20)
    except OSError as e:
        result["read"][name] = errno.errorcode[e.errno]
for name, path in WRITES.items():
    try:
        with open(path, "w") as f:
            f.write("left behind")
        result["write"][name] = "wrote"
    except OSError as e:
        result["write"][name] = errno.errorcode[e.errno]
try:
    with open("mine.txt", "w") as f:
        f.write("ok")
    result["own folder"] = open("mine.txt").read()
except OSError as e:
    result["own folder"] = errno.errorcode[e.errno]
try:
    while True:
        os.fork()
except OSError as e:
    result["fork"] = errno.errorcode[e.errno]
print(json.dumps(result))
'''

# what a refused open reports: the path is absent from the program's view, access is denied,
# or (writes) the private root is read-only; which one depends on where the repository lies
# relative to the folders the view binds (the interpreter's prefix can sit inside a checkout)
REFUSED_READ = ("ENOENT", "EACCES", "EPERM")
REFUSED_WRITE = (*REFUSED_READ, "EROFS")


@pytest.fixture
def open_folder():
    """A world-readable folder in the temporary folder (pytest's tmp_path is private to
    root)."""
    path = Path(tempfile.mkdtemp(prefix="megarl_drill_"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("mode", MODES)
def test_a_hostile_program_reads_and_writes_nothing_outside_its_folder(mode, open_folder):
    data = open_folder / "data"
    data.mkdir(mode=0o755)
    train = data / "train.parquet"
    train.write_text("the answers: 42")
    os.chmod(train, 0o644)  # world-readable, as a prepared data set is
    shm = Path("/dev/shm") / f"megarl_drill_{os.getpid()}_{mode}"
    reads = {"training file": str(train), "repository": str(ROOT / "README.md"),
             "passwd": "/etc/passwd", "proc": "/proc/self/environ"}
    host_tmp = Path(tempfile.gettempdir())  # the host's shared temporary folder
    writes = {"tmp": str(host_tmp / f"megarl_drill_{os.getpid()}_{mode}"), "dev shm": str(shm),
              "repository": str(ROOT / f"megarl_drill_{mode}.txt"),
              "data folder": str(data / "written")}
    code = f"READS = {reads!r}\nWRITES = {writes!r}\n" + DRILL
    tool = PythonTool({"timeout_s": 20, "filesystem": mode})
    out, _, metrics = asyncio.run(tool.execute("drill", {"code": code}))
    assert metrics["exit_code"] == 0, out.text
    result = json.loads(out.text)
    for name in reads:
        assert result["read"][name] in REFUSED_READ, (name, result)
    for name, path in writes.items():
        # the mount namespace's /tmp is the program's own (test_a_private_tmp_is_gone...)
        private = mode == "mount_namespace" and name == "tmp"
        denied = (*REFUSED_WRITE, *(("wrote",) if private else ()))
        assert result["write"][name] in denied, (name, result)
        assert not os.path.exists(path), path
    assert result["own folder"] == "ok"
    assert tool.filesystem_isolation == mode
    if os.geteuid() == 0:  # a private uid with RLIMIT_NPROC 1
        assert result["fork"] == "EAGAIN", result
    out, _, metrics = asyncio.run(tool.execute("next", {"code": "print(sum(range(10)))"}))
    assert out.text == "45\n" and metrics["exit_code"] == 0


def test_a_private_tmp_is_gone_with_the_program():
    """Under the mount namespace /tmp is the program's own tmpfs: what it writes there is
    readable by itself and gone afterwards, and a second program does not see it."""
    tool = PythonTool({"timeout_s": 20, "filesystem": "mount_namespace"})
    name = f"/tmp/megarl_private_{os.getpid()}"  # the sandbox's own /tmp (its view's path)
    code = (f"open({name!r}, 'w').write('x')\nimport os\n"
            f"print(os.path.exists({name!r}), os.listdir('/tmp'))")
    out, _, _ = asyncio.run(tool.execute("a", {"code": code}))
    assert out.text == f"True ['{os.path.basename(name)}']\n", out.text
    out, _, _ = asyncio.run(tool.execute("b", {"code": "import os\nprint(os.listdir('/tmp'))"}))
    assert out.text == "[]\n" and not os.path.exists(name)


def test_an_unknown_filesystem_mode_is_refused_naming_the_choices():
    with pytest.raises(UserInputError, match="filesystem='chroot'; use one of auto, mount"):
        PythonTool({"filesystem": "chroot"})


PARENT = r'''
import asyncio, sys
from megarl.rollout.agent import PythonTool
tool = PythonTool({"timeout_s": 120, "filesystem": sys.argv[1]})
code = "import time\nprint('started', flush=True)\ntime.sleep(100)"
asyncio.run(tool.execute("long", {"code": code}))
'''


def _sandboxes_under(folder_prefix: str) -> list[int]:
    """Pids of sandbox processes whose command line names a folder under ``folder_prefix``."""
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                cmd = Path(f"/proc/{name}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(b"_sandbox.py" in c for c in cmd) and any(
                    c.decode(errors="replace").startswith(folder_prefix) for c in cmd):
                pids.append(int(name))
    return pids


@pytest.mark.parametrize("mode", MODES)
def test_the_program_dies_with_the_process_running_the_tool(mode, tmp_path):
    """The tool's process is killed (kill -9) while its program sleeps: the program is gone
    within 5 s. Before the death signal was set again after the uid drop, it lived on."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(tmp), OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    parent = subprocess.Popen([sys.executable, "-c", PARENT, mode], env=env, cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not any((d / "output.txt").is_file() and b"started" in (d / "output.txt")
                      .read_bytes() for d in tmp.glob("megarl_py_*")):
            assert parent.poll() is None, parent.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the program never started"
            time.sleep(0.1)
        assert _sandboxes_under(str(tmp)), "no sandbox process found"
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=30)
        deadline = time.monotonic() + 5
        while _sandboxes_under(str(tmp)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _sandboxes_under(str(tmp)), "the program outlived the tool's process"
    finally:
        parent.kill()
        parent.wait(timeout=30)
        for pid in _sandboxes_under(str(tmp)):
            os.kill(pid, signal.SIGKILL)
