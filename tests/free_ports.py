"""A free TCP port for a server a test starts (a torchrun world's store, a launcher's
rendezvous), chosen below the kernel's ephemeral range.

A port taken by binding port 0 comes from the ephemeral range, and once the probe socket is
closed the kernel may hand the same number to any client socket it opens before the server
binds it: the server then fails with EADDRINUSE (seen in CI: a megatron world's store lost
its port to a connection opened meanwhile). Ports below the range are never handed out that
way; only another explicit bind could take one, and the random choice among thousands makes
that as unlikely as two tests picking alike."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_LOW_DEFAULT = 32768  # Linux's default start of net.ipv4.ip_local_port_range


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _LOW_DEFAULT


def free_port(host: str = "127.0.0.1") -> int:
    """A port no socket on ``host`` holds now, outside the ephemeral range."""
    high = min(_ephemeral_low(), 65536)
    low = max(1024, high - 12000)
    for _ in range(200):
        port = random.SystemRandom().randrange(low, high)
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [{low}, {high}) on {host} after 200 tries")
