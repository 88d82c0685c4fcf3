"""Console progress with ETA and the key metrics of the last step.

On a terminal: a tqdm bar. Redirected to a file (torchrun node logs, SLURM): one plain line per
step, ``step 3/150 | score=0.41 pg=-0.012 ... | eta 2m13s``, so logs stay greppable. A sink
(`megarl.logging.sink.Sink`) that also carries the run's text lines (``write``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping

from tqdm import tqdm

# (metric, column): a column is shown when the step's row has its metric, so the columns follow
# what the recipe computes. ``kl`` is the KL to the reference policy that the run trains with:
# ``actor/kl_loss`` (actor.use_kl_loss) and ``kl_rwd`` the in-reward penalty's
# ``actor/reward_kl_penalty`` (algorithm.use_kl_in_reward). ``actor/ppo_kl`` (the current policy
# against the one that sampled, 0 on an on-policy step) is not a console column: a verl user
# would read ``kl=0`` as "the policy has not moved from the reference"; it stays in the record.
KEY_METRICS = (
    ("critic/score/mean", "score"),
    ("actor/pg_loss", "pg"),
    ("actor/kl_loss", "kl"),
    ("actor/reward_kl_penalty", "kl_rwd"),
    ("critic/vf_loss", "vf"),
    ("actor/entropy", "ent"),
    ("response_length/mean", "len"),
    ("timing_s/step", "s/step"),
)


def _eta(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    m, s = divmod(seconds, 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class ConsoleProgress:
    """The progress of ``total_steps`` steps from ``initial_step`` (a resumed run's)."""

    def __init__(self, total_steps: int, initial_step: int = 0) -> None:
        self.total = total_steps
        self.start_step = initial_step
        self.start_time = time.perf_counter()
        self.tty = sys.stdout.isatty()
        self.bar = (
            tqdm(total=total_steps, initial=initial_step, desc="train", dynamic_ncols=True,
                 file=sys.stdout, mininterval=0.0)
            if self.tty
            else None
        )

    @staticmethod
    def summary(metrics: Mapping[str, float]) -> dict[str, str]:
        return {short: f"{metrics[k]:.4g}" for k, short in KEY_METRICS if k in metrics}

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        shown = self.summary(metrics)
        if self.bar is not None:
            self.bar.set_postfix(shown, refresh=False)
            self.bar.update(step - self.bar.n)
            return
        done = step - self.start_step
        if done <= 0:  # e.g. the validation before training: printed by the trainer itself
            return
        elapsed = time.perf_counter() - self.start_time
        eta = elapsed / done * (self.total - step) if done > 0 else 0.0
        body = " ".join(f"{k}={v}" for k, v in shown.items())
        print(f"step {step}/{self.total} | {body} | eta {_eta(eta)}", flush=True)

    def write(self, text: str) -> None:
        if self.bar is not None:
            tqdm.write(text, file=sys.stdout)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
