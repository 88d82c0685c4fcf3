"""End-of-run PNG: training reward and validation accuracy against step."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from megarl.logging.jsonl import read_jsonl

REWARD_KEYS = ("critic/score/mean", "critic/rewards/mean")


def plot_curves(rows: list[dict], path: str | os.PathLike, title: str = "") -> str | None:
    """Plot reward (left) and every ``val/...`` metric (right) from metrics rows; returns path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_v) = plt.subplots(1, 2, figsize=(11, 4))
    for key in REWARD_KEYS:
        pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        if pts:
            ax_r.plot(*zip(*pts), label=key)
    ax_r.set_xlabel("step")
    ax_r.set_title("training reward")
    val_keys = sorted({k for r in rows for k in r if k.startswith("val/")})
    for key in val_keys:
        pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        if pts:
            ax_v.plot(*zip(*pts), marker="o", label=key)
    ax_v.set_xlabel("step")
    ax_v.set_title("validation")
    for ax in (ax_r, ax_v):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


class CurvesSink:
    """A sink drawing ``path`` (curves.png) at ``close`` from the run's record ``record`` (its
    metrics.jsonl, so a resumed run's curves include the steps before the resume); nothing per
    step."""

    def __init__(self, record: str | os.PathLike, path: str | os.PathLike, title: str = "") -> None:
        self.record, self.path, self.title = Path(record), Path(path), title

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        pass

    def close(self) -> str | None:
        rows = read_jsonl(self.record) if self.record.exists() else []
        return plot_curves(rows, self.path, title=self.title) if rows else None
