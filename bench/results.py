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


def print_table(rows: list[dict]) -> None:
    """Rows of one kind as ``a | b | c`` lines under a header of their keys (the first row's)."""
    keys = list(rows[0])
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(str(r[k]) for k in keys))


# What a launch/train.py run really ran, read from its resolved config (run_dir/config.yaml),
# so a benchmark labels its rows by the run, not by the script's intent.
RAN_KEYS = {"engine": "actor_rollout_ref.rollout.name", "backend": "actor_rollout_ref.actor.strategy",
            "dtype": "actor_rollout_ref.model.dtype", "device": "trainer.device"}


def resolved_run(run_dir: Path) -> dict[str, str]:
    """{engine, backend, dtype, device} of the run in ``run_dir`` (its config.yaml)."""
    import yaml

    cfg = yaml.safe_load((Path(run_dir) / "config.yaml").read_text())
    out = {}
    for label, dotted in RAN_KEYS.items():
        node = cfg
        for part in dotted.split("."):
            node = node[part]
        out[label] = str(node)
    return out


def check_ran(run_dir: Path, **expected: str) -> dict[str, str]:
    """`resolved_run`, raising when it differs from what the benchmark meant to measure."""
    ran = resolved_run(run_dir)
    wrong = {k: (v, ran[k]) for k, v in expected.items() if ran[k] != v}
    if wrong:
        raise RuntimeError(
            f"{run_dir}: the run did not run what the benchmark labels it as: "
            + ", ".join(f"{k} meant {a!r} but the run's config says {b!r} ({RAN_KEYS[k]})"
                        for k, (a, b) in wrong.items()))
    return ran
