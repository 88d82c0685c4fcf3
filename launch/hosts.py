"""Node lists for the multi-node launcher: ``--hosts``, ``--hostfile`` and SLURM's compressed
host lists (``SLURM_JOB_NODELIST``)."""

from __future__ import annotations

import re
from pathlib import Path


class LaunchError(Exception):
    """A problem the user fixes. The launcher prints ``megarl-launch: error: <message>`` (one line
    that names the problem and the fix) and exits with status 2."""


_BRACKET = re.compile(r"^([^\[\]]*)\[([^\[\]]*)\](.*)$")


def _split_top_level(text: str) -> list[str]:
    """Split on the commas that are outside brackets: ``a[1,2],b`` -> ``['a[1,2]', 'b']``."""
    items, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise LaunchError(f"bad SLURM node list {text!r}: unbalanced ']'")
        if ch == "," and depth == 0:
            items.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise LaunchError(f"bad SLURM node list {text!r}: unbalanced '['")
    items.append("".join(cur))
    return [s.strip() for s in items if s.strip()]


def _expand_range_list(spec: str, whole: str) -> list[str]:
    """``01-03,7`` -> ``['01', '02', '03', '7']``; zero padding follows the lower bound."""
    out = []
    for part in spec.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise LaunchError(f"bad SLURM node list {whole!r}: {part!r} is not N or N-M")
        if not sep:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise LaunchError(f"bad SLURM node list {whole!r}: range {part!r} runs backwards")
        out.extend(str(i).zfill(len(lo)) for i in range(int(lo), int(hi) + 1))
    return out


def _expand_item(item: str, whole: str) -> list[str]:
    m = _BRACKET.match(item)
    if m is None:
        return [item]
    prefix, spec, rest = m.groups()
    tails = _expand_item(rest, whole)
    return [prefix + v + t for v in _expand_range_list(spec, whole) for t in tails]


def expand_nodelist(text: str) -> list[str]:
    """SLURM's compressed host list -> host names, in order, duplicates kept (as
    ``scontrol show hostnames``): ``node[01-03,07],gpu5`` -> node01 node02 node03 node07 gpu5;
    ``a[1-2]b[3-4]`` -> a1b3 a1b4 a2b3 a2b4."""
    hosts = [h for item in _split_top_level(text) for h in _expand_item(item, text)]
    if not hosts:
        raise LaunchError(f"bad SLURM node list {text!r}: no hosts in it")
    return hosts


def read_hostfile(path: str | Path) -> list[str]:
    """One host per line; ``#`` starts a comment; anything after the host name (``slots=8``) is
    ignored; blank lines are skipped."""
    p = Path(path)
    if not p.is_file():
        raise LaunchError(f"hostfile {str(p)!r} does not exist; pass a file with one host per line")
    hosts = []
    for line in p.read_text().splitlines():
        words = line.split("#", 1)[0].split()
        if words:
            hosts.append(words[0])
    if not hosts:
        raise LaunchError(f"hostfile {str(p)!r} lists no hosts; write one host name per line")
    return hosts


def parse_hosts(text: str) -> list[str]:
    """``--hosts a,b,c`` (SLURM brackets allowed: ``node[1-4]``)."""
    hosts = expand_nodelist(text) if "[" in text else [h.strip() for h in text.split(",") if h.strip()]
    if not hosts:
        raise LaunchError("--hosts is empty; pass host names separated by commas, e.g. --hosts a,b")
    return hosts


def is_this_machine(host: str) -> bool:
    """True for loopback names and this machine's own host name (no DNS lookup)."""
    import socket

    own = {socket.gethostname(), socket.gethostname().split(".")[0]}
    return host in ("localhost", "::1") or host.startswith("127.") or host in own
