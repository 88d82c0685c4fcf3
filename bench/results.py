"""bench/RESULTS.md: one "## <title>" section per benchmark, replaced in place by its bench."""

from __future__ import annotations

import fcntl
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
HEADER = "# megarl benchmark results\n"


def write_section(title: str, body: str, path: Path = RESULTS) -> None:
    """Replace (or append) the section headed ``## {title}`` with ``body``; keep the others.

    ``body`` may start with its own ``## {title}`` line; if not, the heading is added. A file
    lock keeps benches that finish at the same time from losing each other's sections."""
    heading = f"## {title}"
    section = body if body.lstrip().startswith(heading) else f"{heading}\n\n{body}"
    section = section.rstrip("\n") + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+", encoding="utf-8") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        lines = (f.read() or HEADER).splitlines(keepends=True)
        start = next((i for i, ln in enumerate(lines) if ln.rstrip() == heading), None)
        if start is None:
            text = "".join(lines).rstrip("\n") + "\n\n" + section
        else:
            end = next((j for j in range(start + 1, len(lines)) if lines[j].startswith("## ")),
                       len(lines))
            rest = "".join(lines[end:])
            text = "".join(lines[:start]) + section + ("\n" + rest if rest else "")
        f.seek(0)
        f.truncate()
        f.write(text)
        fcntl.flock(f, fcntl.LOCK_UN)
