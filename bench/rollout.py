"""Rollout speed: TorchRolloutEngine vs HF ``generate`` on the same model and settings, and
weight-sync time vs a plain copy of the model's bytes.

    .venv/bin/python bench/rollout.py [--repeats 5] [--no-write]

Models are the tiny random Qwen2-architecture models of the CPU peer notes, built under the
temp dir by the team's peer scripts ($MEGARL_PEER_SCRIPTS, default ../shared/bench/peers
relative to the repository: make_tokenizers.py --qwen, create_tiny_model.py): the
Qwen-vocabulary one (V = 151,680, 9.78M params, the real Qwen2.5 tokenizer rebuilt offline) and
the tiny-vocabulary one (trained byte-level BPE). Settings as hf_generate_bench.py: batch 16
chat prompts, exactly 64 new tokens (HF: min_new_tokens = max_new_tokens; ours: ignore_eos),
sampling at T=1 with no top-k/top-p, fp32, 1 thread. One warm-up call each; the timed calls of
HF and ours alternate so both see the same load; reported: median tokens/s (wall) and tokens
per CPU-second of this process (load-independent as long as the process is single-threaded).

Weight sync: ``engine.update_weights`` from the full export stream of a second model (HF names,
bucketed by megarl.rollout.reshard at the config default of 512 MiB), versus copying the same
number of bytes between two contiguous buffers, and versus a per-tensor ``copy_`` loop.
Appends / replaces the "## Rollout" section of bench/RESULTS.md (other sections are kept).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
PEERS = Path(os.environ.get("MEGARL_PEER_SCRIPTS", REPO.parent / "shared" / "bench" / "peers"))
BATCH, NEW = 16, 64

import torch  # noqa: E402

from bench.results import write_section as _write_section  # noqa: E402

torch.set_num_threads(1)


def build_models(root: Path) -> dict[str, Path]:
    """The two peer models (built once, cached in the temp dir; never committed)."""
    root.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    if not (root / "qwen25_tok" / "tokenizer.json").is_file():
        subprocess.run([py, str(PEERS / "make_tokenizers.py"), "--out", str(root), "--qwen"],
                       check=True, capture_output=True)
    models = {"tiny_qwen2_qvocab": root / "qwen25_tok", "tiny_qwen2": root / "tiny_tok"}
    out = {}
    for name, tok in models.items():
        path = root / name
        if not (path / "config.json").is_file():
            subprocess.run([py, str(PEERS / "create_tiny_model.py"), "--tokenizer", str(tok),
                            "--out", str(path)], check=True, capture_output=True)
        out[name] = path
    return out


def chat_prompts(tok) -> list[list[int]]:
    texts = [tok.apply_chat_template([{"role": "user", "content": f"What is {i}+{2 * i + 1}?"}],
                                     tokenize=False, add_generation_prompt=True)
             for i in range(BATCH)]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def timed(fn) -> tuple[float, float, int]:
    """(wall s, CPU s of this process, generated tokens)."""
    c0, t0 = time.process_time(), time.perf_counter()
    n = fn()
    return time.perf_counter() - t0, time.process_time() - c0, n


def bench_generate(path: Path, repeats: int) -> dict[str, object]:
    import transformers

    from megarl.rollout.protocol import SamplingParams
    from megarl.rollout.torch import TorchRolloutEngine

    transformers.logging.set_verbosity_error()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    prompts = chat_prompts(tok)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    width = max(map(len, prompts))  # the same token ids, left-padded for HF
    ids = torch.full((BATCH, width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros((BATCH, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    enc = {"input_ids": ids, "attention_mask": mask}
    gen_kw = dict(do_sample=True, temperature=1.0, top_k=None, top_p=1.0, max_new_tokens=NEW,
                  min_new_tokens=NEW, pad_token_id=tok.pad_token_id, use_cache=True)

    def run_hf() -> int:
        with torch.inference_mode():
            out = hf.generate(**enc, **gen_kw)
        return (out.shape[1] - enc["input_ids"].shape[1]) * out.shape[0]

    engine = TorchRolloutEngine.from_pretrained(path, max_num_seqs=BATCH)
    seed = [0]

    def run_ours() -> int:
        seed[0] += 1
        out = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=NEW,
                                                      ignore_eos=True, seed=seed[0]))
        return sum(len(c.token_ids) for c in out)

    run_hf(), run_ours()  # warm-up
    res_hf, res_ours, loads = [], [], []
    for _ in range(repeats):
        res_hf.append(timed(run_hf))
        res_ours.append(timed(run_ours))
        loads.append(os.getloadavg()[0])

    def summary(res):
        return {"tok_s": statistics.median(n / w for w, _, n in res),
                "tok_cpu_s": statistics.median(n / c for _, c, n in res),
                "all": [round(n / w) for w, _, n in res]}

    params = sum(p.numel() for p in hf.parameters())
    return {"hf": summary(res_hf), "ours": summary(res_ours), "params": params,
            "vocab": hf.config.vocab_size, "prompt_len": [min(map(len, prompts)),
                                                          max(map(len, prompts))],
            "load": loads}


def bench_weight_sync(path: Path, repeats: int) -> dict[str, float]:
    from megarl.models import load_model
    from megarl.models.state_dict_adapter import model_state_for_export
    from megarl.rollout.reshard import weight_buckets
    from megarl.rollout.torch import TorchRolloutEngine

    engine = TorchRolloutEngine.from_pretrained(path)
    src = load_model(path)
    with torch.no_grad():
        for p in src.parameters():
            p.add_(0.01)
    nbytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    a = torch.empty(nbytes, dtype=torch.uint8)
    b = torch.ones(nbytes, dtype=torch.uint8)
    pairs = list(zip(engine.model.parameters(), src.parameters()))

    def sync():
        engine.update_weights(weight_buckets(model_state_for_export(src), 512 * 2**20))

    def flat():
        a.copy_(b)

    def loop():
        with torch.no_grad():
            for d, s in pairs:
                d.copy_(s)

    from megarl.backends.torch import TorchBackend
    from megarl.utils.dist import init_distributed

    init_distributed(torch.device("cpu"))  # a world of one (gloo)
    backend = TorchBackend("actor", str(path), device="cpu")

    def sync_backend():  # the trainer's side too: gather (here: clone) + stream + copy in
        engine.update_weights(weight_buckets(backend.export_weights(), 512 * 2**20))

    out = {}
    for name, fn in (("update_weights", sync), ("flat_copy", flat), ("per_tensor_copy", loop),
                     ("backend_update_weights", sync_backend)):
        fn()
        ts = []
        for _ in range(repeats * 4):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        out[name] = statistics.median(ts)
    sync()  # the engine holds exactly the streamed weights
    assert all(torch.equal(d, s) for d, s in pairs)
    out["bytes"] = nbytes
    return out


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores (shared), Python {platform.python_version()}, " \
           f"torch {torch.__version__}"


def render(gen: dict, sync: dict, repeats: int, load0: float) -> str:
    lines = [
        "## Rollout",
        "",
        f"`bench/rollout.py`, {datetime.date.today().isoformat()}. Machine: {machine()}; load avg {load0:.1f} at start "
        "(other helpers' tests running). 1 thread, fp32.",
        f"Batch {BATCH} chat prompts, exactly {NEW} new tokens, sampling T=1 (no top-k/top-p). "
        f"{repeats} timed calls each after one warm-up, HF and ours alternating; median.",
        "",
        "| model | params | vocab | HF generate tok/s | TorchRolloutEngine tok/s | speed-up |"
        " HF tok/CPU-s | ours tok/CPU-s | CPU speed-up | load avg during |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in gen.items():
        h, o = r["hf"], r["ours"]
        lines.append(
            f"| {name} | {r['params'] / 1e6:.2f}M | {r['vocab']:,} | {h['tok_s']:,.0f} | "
            f"{o['tok_s']:,.0f} | **{o['tok_s'] / h['tok_s']:.1f}x** | {h['tok_cpu_s']:,.0f} | "
            f"{o['tok_cpu_s']:,.0f} | {o['tok_cpu_s'] / h['tok_cpu_s']:.1f}x | "
            f"{min(r['load']):.1f}-{max(r['load']):.1f} |")
    lines += ["", "Per call tok/s: " + "; ".join(
        f"{n}: HF {r['hf']['all']}, ours {r['ours']['all']}" for n, r in gen.items()) + "."]
    mb = sync["bytes"] / 2**20
    lines += [
        "",
        f"Weight sync (tiny_qwen2_qvocab, {mb:.1f} MiB fp32, tied embeddings; median of "
        f"{repeats * 4}):",
        "",
        "| operation | ms | vs flat copy |",
        "|---|---|---|",
    ]
    for name, label in (
        ("update_weights", "`engine.update_weights(weight_buckets(model export stream, 512 MiB))`"),
        ("backend_update_weights", "same, stream from `TorchBackend.export_weights()` (world of "
         "one: each tensor cloned by the export)"),
        ("per_tensor_copy", "per-parameter `copy_` loop"),
        ("flat_copy", "one contiguous buffer `copy_` (the model's bytes)"),
    ):
        lines.append(f"| {label} | {sync[name] * 1e3:.2f} | "
                     f"{sync[name] / sync['flat_copy']:.2f}x |")
    lines += [
        "",
        "Targets: >= 3x HF generate tokens/s on the Qwen-vocabulary model; weight sync <= 3x the "
        "plain copy. The Qwen-vocabulary case is dominated by sampling over 151,680 logits: HF "
        "calls torch.multinomial (~90-115 ms per step for 16 rows on this box); the engine draws "
        "one counter-hash uniform per row and inverts the CDF from 1024-token block sums. On the "
        "tiny vocabulary the per-step overhead of both dominates (ours: ~1 ms CPU per decode "
        "step of 16 rows, ~0.8 ms of it the forward's ~60 small ops of megarl's model); the "
        "3x target is not met there.",
        "The `TorchBackend.export_weights()` row includes the backend's export, which clones "
        "every tensor into fresh memory (page faults dominate); the engine side of the sync is "
        "the first row.",
    ]
    return "\n".join(lines) + "\n"


def write_section(section: str) -> None:
    _write_section("Rollout", section)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--models", default=str(Path(tempfile.gettempdir()) / "megarl-rollout-bench"))
    a = ap.parse_args()
    load0 = os.getloadavg()[0]
    models = build_models(Path(a.models))
    gen = {name: bench_generate(path, a.repeats) for name, path in models.items()}
    sync = bench_weight_sync(models["tiny_qwen2_qvocab"], a.repeats)
    section = render(gen, sync, a.repeats, load0)
    print(section)
    if not a.no_write:
        write_section(section)


if __name__ == "__main__":
    main()
