"""A one-line console progress bar with ETA and the key metrics of the last step."""

from __future__ import annotations

import sys

from tqdm import tqdm

KEY_METRICS = (
    ("critic/score/mean", "score"),
    ("actor/pg_loss", "pg"),
    ("actor/ppo_kl", "kl"),
    ("actor/entropy", "ent"),
    ("response_length/mean", "len"),
    ("timing_s/step", "s/step"),
)


class ConsoleProgress:
    def __init__(self, total_steps: int, initial_step: int = 0, enabled: bool = True) -> None:
        self.enabled = enabled
        self.bar = (
            tqdm(total=total_steps, initial=initial_step, desc="train", dynamic_ncols=True,
                 file=sys.stdout, mininterval=0.0)
            if enabled
            else None
        )

    def update(self, step: int, metrics: dict[str, float]) -> None:
        if self.bar is None:
            return
        shown = {short: f"{metrics[k]:.3g}" for k, short in KEY_METRICS if k in metrics}
        self.bar.set_postfix(shown, refresh=False)
        self.bar.update(step - self.bar.n)

    def write(self, text: str) -> None:
        if self.enabled:
            tqdm.write(text, file=sys.stdout)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
