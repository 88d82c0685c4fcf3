"""End-of-run PNG: the reward the algorithm trains on, the validation scores and the non-zero
loss terms against step (``curves_data`` says what each panel draws, for tests to read)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from megarl.logging.jsonl import read_jsonl

# the reward the advantage is computed from (scores + PRM rewards + in-reward KL), then the
# ones drawn beside it where their values differ: the task's verifiable reward (PURE adds PRM
# rewards to it) and the score before the in-reward KL penalty
TRAINED_REWARD = "critic/rewards/mean"
OTHER_REWARDS = ("critic/verifiable_reward/mean", "critic/score/mean")
LOSS_KEYS = ("actor/pg_loss", "actor/kl_loss", "actor/reward_kl_penalty", "critic/vf_loss",
             "actor/entropy_loss")

Series = list[tuple[int, float]]


def _series(rows: list[dict], key: str) -> Series:
    return [(r["step"], float(r[key])) for r in rows
            if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]


def curves_data(rows: list[dict]) -> dict[str, dict[str, Series]]:
    """Panel title -> {metric: [(step, value)]}: ``training reward`` (critic/rewards/mean, plus
    the verifiable reward and the score where they differ from every series drawn already),
    ``validation`` (every val/... metric), ``loss terms`` (those of ``LOSS_KEYS`` non-zero in
    some row)."""
    reward: dict[str, Series] = {}
    for key in (TRAINED_REWARD, *OTHER_REWARDS):
        pts = _series([r for r in rows if r.get("step", 0) > 0], key)
        if pts and all(pts != drawn for drawn in reward.values()):
            reward[key] = pts
    val_keys = sorted({k for r in rows for k in r if k.startswith("val/")})
    val = {k: pts for k in val_keys if (pts := _series(rows, k))}
    loss = {k: pts for k in LOSS_KEYS if (pts := _series(rows, k)) and any(v for _, v in pts)}
    return {"training reward": reward, "validation": val, "loss terms": loss}


def plot_curves(rows: list[dict], path: str | os.PathLike, title: str = "") -> str | None:
    """Draw ``curves_data(rows)``, one panel each, into ``path``; returns path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = curves_data(rows)
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4))
    for ax, (name, series) in zip(axes, panels.items()):
        for key, pts in series.items():
            ax.plot(*zip(*pts), marker="o" if name == "validation" else None, label=key)
        ax.set_xlabel("step")
        ax.set_title(name)
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
