"""A loopback-only network namespace for tests that start servers binding every interface
(a local Ray cluster): ``unshare --net`` plus ``ip link set lo up``."""

import os
import shutil
import subprocess


def unshare_prefix() -> list[str] | None:
    """The command prefix that runs a process in a fresh network namespace, or None where
    namespaces are not permitted (or ``unshare`` / ``ip`` are missing)."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return None
    candidates = [["unshare", "--net", "--map-root-user"]]
    if os.geteuid() == 0:
        candidates.append(["unshare", "--net"])
    for prefix in candidates:
        r = subprocess.run([*prefix, "ip", "link", "set", "lo", "up"], capture_output=True, timeout=30)
        if r.returncode == 0:
            return prefix
    return None


def ray_netns_or_skip() -> list[str]:
    """``unshare_prefix()`` for a test that runs a local Ray in the namespace; skips the test,
    saying why, where Ray is not installed or namespaces are not permitted."""
    import pytest

    pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'megarl[ray]'")
    prefix = unshare_prefix()
    if prefix is None:
        pytest.skip("network namespaces are not permitted here (unshare --net failed or no "
                    "`ip`); a local Ray would bind the machine's external address")
    return prefix
