"""The process `PythonTool` runs a program in: ``python -I _sandbox.py DIR SETTINGS_JSON``.

Standalone on purpose (no megarl import: it starts in milliseconds and reads nothing of the
trainer). Order matters: limits first; then the namespaces and the filesystem view (they need
the privileges the process still has): a mount namespace whose root is a fresh tmpfs holding
read-only binds of the system libraries and the interpreter, the program's folder (the only
writable place, at /work), a private /tmp and four device files, or, where the kernel refuses
namespaces, a Landlock domain with the same reach; the stdlib modules the program may use;
the drop to the private uid with RLIMIT_NPROC 1, after which the parent-death signal is set
again (a uid change clears it); and last the program itself, compiled and run in this process
(the only place megarl runs model-written code). What it guarantees is listed in
`megarl.rollout.agent.tools.PythonTool`.
"""

import ctypes
import json
import os
import platform
import resource
import signal
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT = 1, 2, 4, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
MNT_DETACH = 2
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
# Landlock (Linux >= 5.13): syscall numbers (the same on x86-64 and arm64) and access bits
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_RULE_PATH_BENEATH = 1
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1, 2, 4, 8
FS_READ = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
FS_FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | (1 << 14) | (1 << 15)
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1, 2
# the program's own folder as it sees it under the mount namespace
WORK = "/work"
DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")


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


def _die_with_parent(libc, parent):
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)  # the parent died before the death signal was set


def readable_paths():
    """What a program may read: the system's libraries and the interpreter's (its stdlib and
    site-packages: ``<prefix>/lib`` of each prefix, not the folders around them)."""
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    paths = ["/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc/ld.so.cache",
             "/etc/localtime", *sorted(os.path.join(p, "lib") for p in prefixes)]
    return [p for p in paths if os.path.lexists(p)]


def _mount(libc, source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    if libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def _bind(libc, source, target, writable=False):
    """Bind ``source`` at ``target`` (created), read-only unless ``writable``; the flags the
    source's own mount locks (nosuid, nodev, noexec) are kept, as a user namespace requires."""
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    _mount(libc, source, target, None, MS_BIND | MS_REC)
    locked = os.statvfs(source).f_flag & (os.ST_NOSUID | os.ST_NODEV | os.ST_NOEXEC)
    flags = MS_BIND | MS_REMOUNT | MS_NOSUID | locked | (0 if writable else MS_RDONLY)
    if source not in DEVICES:
        flags |= MS_NODEV
    _mount(libc, None, target, None, flags)


def _map_ids_to_self(uid, gid):
    """In a new user namespace: the caller's uid / gid map to themselves, so files keep their
    owners and the namespace's capabilities allow the mounts below."""
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"{uid} {uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"{gid} {gid} 1")


def private_root(libc, folder, tmp_mb):
    """Make this mount namespace's root a fresh tmpfs that holds only `readable_paths` (read
    only), the devices of DEVICES, a private /tmp of ``tmp_mb`` MB and ``folder`` at WORK (the
    only writable place), then move into it for good (pivot_root; the old root detached)."""
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)  # nothing leaks back to the host
    new = os.path.join(folder, ".root")
    os.mkdir(new, 0o755)
    _mount(libc, "tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for path in readable_paths():
        target = new + path
        if os.path.islink(path):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.symlink(os.readlink(path), target)
        else:
            _bind(libc, path, target)
    for dev in DEVICES:
        if os.path.exists(dev):
            _bind(libc, dev, new + dev, writable=True)
    os.mkdir(new + "/tmp")
    _mount(libc, "tmpfs", new + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={tmp_mb}m,mode=1777")
    _bind(libc, folder, new + WORK, writable=True)
    os.chdir(new)
    number = SYS_PIVOT_ROOT.get(platform.machine())
    if number is None or libc.syscall(number, b".", b".") != 0:
        raise OSError(ctypes.get_errno(), "pivot_root")
    if libc.umount2(b".", MNT_DETACH) != 0:
        raise OSError(ctypes.get_errno(), "umount2 of the old root")
    os.chdir("/")
    _mount(libc, None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(WORK)


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def landlock(libc, folder):
    """Restrict this process and its children with Landlock (no privilege needed): read the
    `readable_paths`, read and write the devices and ``folder``, nothing else of the file
    system; no TCP bind or connect (ABI 4+); no signal to, nor abstract socket of, a process
    outside (ABI 6+). Raises OSError where the kernel has no Landlock."""
    abi = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0),
                       ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION))
    if abi < 1:
        raise OSError(ctypes.get_errno(), "Landlock is not available")
    handled = (1 << 13) - 1 | (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0) | (
        1 << 15 if abi >= 5 else 0)
    attr = _RulesetAttr(handled, 3 if abi >= 4 else 0,
                        SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0)
    size = ctypes.sizeof(ctypes.c_uint64) * (3 if abi >= 6 else 2 if abi >= 4 else 1)
    ruleset = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size),
                           ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset")
    rules = [(p, FS_READ) for p in readable_paths()]
    rules += [(d, FS_READ | FS_WRITE_FILE) for d in DEVICES if os.path.exists(d)]
    rules.append((folder, handled))
    try:
        for path, access in rules:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                if not os.path.isdir(path):
                    access &= FS_FILE_RIGHTS
                rule = _PathBeneath(access & handled, fd)
                if libc.syscall(SYS_LANDLOCK_ADD_RULE, ruleset, LANDLOCK_RULE_PATH_BENEATH,
                                ctypes.byref(rule), ctypes.c_uint32(0)) != 0:
                    raise OSError(ctypes.get_errno(), f"landlock_add_rule {path}")
            finally:
                os.close(fd)
        if libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, ctypes.c_uint32(0)) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self")
    finally:
        os.close(ruleset)


def isolate_files(libc, folder, settings, mount_ns):
    """The program's view of the file system: "mount_namespace", "landlock" or "none" (the
    kernel refused both), as ``settings["filesystem"]`` asks ("auto": the first that works)."""
    want = settings.get("filesystem", "auto")
    if mount_ns and want in ("auto", "mount_namespace"):
        try:
            private_root(libc, folder, int(settings["file_mb"]))
            return "mount_namespace"
        except OSError as e:
            if want == "mount_namespace":
                raise
            sys.stderr.write(f"megarl sandbox: no private root ({e}); trying Landlock\n")
    if want in ("auto", "landlock"):
        libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        try:
            landlock(libc, folder)
            os.environ["TMPDIR"] = folder  # tempfile: the only writable place
            return "landlock"
        except OSError:
            if want == "landlock":
                raise
    return "none"


def main(folder, settings):
    libc = ctypes.CDLL(None, use_errno=True)
    _die_with_parent(libc, settings["parent"])
    if settings.get("cpus"):  # the tool's CPUs, not the (pinned) parent's
        try:
            os.sched_setaffinity(0, settings["cpus"])
        except OSError:
            pass
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    _limit(resource.RLIMIT_CPU, int(settings["cpu_s"]))
    _limit(resource.RLIMIT_FSIZE, int(settings["file_mb"]) << 20)
    _limit(resource.RLIMIT_NOFILE, 64)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the cap fails, not the process
    root = os.geteuid() == 0
    uid, gid = os.getuid(), os.getgid()
    base = CLONE_NEWNET if root else CLONE_NEWUSER | CLONE_NEWNET
    mount_ns = settings.get("filesystem", "auto") in ("auto", "mount_namespace") and (
        libc.unshare(base | CLONE_NEWNS) == 0)
    netns = mount_ns or libc.unshare(base) == 0
    if mount_ns and not root:
        try:
            _map_ids_to_self(uid, gid)
        except OSError:
            mount_ns = False
    with open(os.path.join(folder, "main.py")) as f:
        source = f.read()
    status = os.path.join(folder, ".status")
    fs = isolate_files(libc, folder, settings, mount_ns)
    if fs == "mount_namespace":
        status = os.path.join(WORK, ".status")
    with open(status, "w") as f:
        f.write(f"netns={int(netns)}\nfilesystem={fs}\n")
    for name in settings["preload"]:
        try:
            __import__(name)
        except ImportError:
            pass
    if root:
        uid = int(settings["uid"])
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        _limit(resource.RLIMIT_NPROC, 1)  # after setuid: this process is the uid's only one
    else:
        _limit(resource.RLIMIT_NPROC, max(1, _own_process_count(os.getuid())))
    _die_with_parent(libc, settings["parent"])  # setuid cleared the parent-death signal
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
