"""The CPU peer environment of bench/step.py: TRL + transformers in their own venv, the tiny
random Qwen2-architecture models, and a TRL GRPOTrainer run that reports every step's time.

Everything is built by the team's peer scripts (``../shared/bench/peers`` relative to the repo:
setup.sh, make_tokenizers.py, create_tiny_model.py, trl_grpo.py) into a folder under the temp
dir; nothing of it belongs in the repository. ``trl_grpo.py`` runs unchanged: a tiny driver
executes it with ``runpy`` inside the peer venv and reads its own ``StepTimer`` (wall time from
``on_step_begin`` to ``on_step_end``: generation, rewards, loss, backward and the optimizer
step) and the trainer's log history when it is done.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

MODEL_DIRS = {"tiny": "tiny_qwen2", "qvocab": "tiny_qwen2_qvocab"}

_TRL_DRIVER = r"""
import json, runpy, sys
script = sys.argv[1]
sys.argv = [script] + sys.argv[2:]
g = runpy.run_path(script, run_name="__main__")
hist = [h for h in g["trainer"].state.log_history if "completions/mean_length" in h]
import torch, transformers, trl
print("STEPBENCH " + json.dumps({
    "step_s": g["timer"].times,
    "mean_length": [h["completions/mean_length"] for h in hist],
    "reward": [h.get("reward") for h in hist],
    "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                 "trl": trl.__version__},
}))
"""


@dataclass
class Peers:
    scripts: Path  # the peer scripts (setup.sh, trl_grpo.py, ...)
    root: Path  # the built environment (venv/, tiny_qwen2/, tiny_qwen2_qvocab/)

    @property
    def python(self) -> Path:
        return self.root / "venv" / "bin" / "python"

    def model(self, name: str) -> Path:
        return self.root / MODEL_DIRS[name]

    def ready(self) -> bool:
        return self.python.is_file() and all(
            (self.model(m) / "config.json").is_file() for m in MODEL_DIRS
        )


def default_root() -> Path:
    return Path(os.environ.get("PEERS") or Path(tempfile.gettempdir()) / "megarl-peers")


def ensure_peers(scripts: Path, root: Path, build: bool = True) -> Peers:
    """The peer environment under ``root``, built with ``scripts/setup.sh`` when missing
    (pip installs trl/transformers into its own venv; a few minutes on a cold cache)."""
    peers = Peers(Path(scripts).resolve(), Path(root).resolve())
    if peers.ready():
        return peers
    setup = peers.scripts / "setup.sh"
    if not setup.is_file():
        raise FileNotFoundError(
            f"--peers {scripts}: no setup.sh there; point --peers at the team's peer scripts "
            "(default ../shared/bench/peers relative to the repository)"
        )
    if not build:
        raise FileNotFoundError(
            f"the peer environment {peers.root} is incomplete (venv or models missing); run "
            f"PEERS={peers.root} bash {setup} or drop --no-setup"
        )
    print(f"building the peer environment under {peers.root} (bash {setup}) ...", flush=True)
    env = dict(os.environ, PEERS=str(peers.root))
    subprocess.run(["bash", str(setup)], env=env, check=True, stdout=subprocess.DEVNULL)
    if not peers.ready():
        raise RuntimeError(f"{setup} finished but {peers.root} still lacks the venv or models")
    return peers


def thread_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """One intra-op thread, offline hubs, no tokenizer thread pool."""
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false", "WANDB_DISABLED": "true"})
    env.update(extra or {})
    return env


def run_trl(peers: Peers, model: str, steps: int, out_dir: Path, *, batch: int,
            generations: int, completion_len: int, lr: float, timeout_s: float) -> dict:
    """TRL GRPOTrainer through trl_grpo.py (--shaped reward, beta 0, 1 thread, fp32).

    Returns {"step_s": [s per optimizer step], "mean_length": [...], "reward": [...],
    "versions": {...}, "wall_s": process wall time}."""
    cmd = [str(peers.python), "-c", _TRL_DRIVER, str(peers.scripts / "trl_grpo.py"),
           "--model", str(peers.model(model)), "--steps", str(steps), "--batch", str(batch),
           "--generations", str(generations), "--completion-len", str(completion_len),
           "--lr", str(lr), "--threads", "1", "--shaped", "--out", str(out_dir)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=thread_env(), capture_output=True, text=True,
                          timeout=timeout_s)
    wall = time.perf_counter() - t0
    line = next((x for x in proc.stdout.splitlines() if x.startswith("STEPBENCH ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"TRL run failed ({proc.returncode}): {' '.join(cmd[:1] + cmd[3:])}\n"
                           f"{proc.stderr[-3000:]}")
    res = json.loads(line[len("STEPBENCH "):])
    res["wall_s"] = wall
    return res
