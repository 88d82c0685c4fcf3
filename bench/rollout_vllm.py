"""vLLM's columns of bench/rollout.py, one engine per process (vLLM keeps process-global
parallel state; a fresh process also keeps one configuration's compile caches and memory out of
the next one's timings).

    .venv/bin/python bench/rollout_vllm.py --model DIR --tokenizer DIR --prompts FILE
        [--eager] [--repeats 5] [--sync]

Builds megarl's `VLLMEngine` (the adapter the trainer uses: fp32, max_num_seqs = the batch,
``kv_cache_memory_bytes`` 256 MiB, seed 0) on ``--model``, generates the prompts of ``--prompts``
(a JSON list of token-id lists) exactly as bench/rollout.py's other engines do (T=1, no
top-k/top-p, exactly 64 new tokens, one seed per call), one warm-up call then ``--repeats``
timed calls. With ``--sync`` it also times ``update_weights`` from a second copy of the model
(the export stream, bucketed at the config default of 512 MiB) against a flat copy of the same
number of bytes in this process. Prints one line ``VLLMBENCH {json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

NEW = 64


def timed_calls(fn, repeats: int) -> list[tuple[float, float, int]]:
    """(wall s, CPU s of this process, generated tokens) of each timed call, after a warm-up."""
    fn()
    out = []
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        n = fn()
        out.append((time.perf_counter() - t0, time.process_time() - c0, n))
    return out


def bench_sync(engine, model: str, repeats: int) -> dict[str, float]:
    from megarl.models import load_model
    from megarl.models.state_dict_adapter import model_state_for_export
    from megarl.rollout.reshard import weight_buckets

    src = load_model(model)
    with torch.no_grad():
        for p in src.parameters():
            p.add_(0.01)
    nbytes = sum(p.numel() * p.element_size() for p in src.parameters())
    a = torch.empty(nbytes, dtype=torch.uint8)
    b = torch.ones(nbytes, dtype=torch.uint8)

    def sync():
        engine.update_weights(weight_buckets(model_state_for_export(src), 512 * 2**20))

    def flat():
        a.copy_(b)

    res = {}
    for name, fn in (("vllm_update_weights", sync), ("flat_copy", flat)):
        fn()
        ts = []
        for _ in range(repeats * 4):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        res[name] = statistics.median(ts)
    res["bytes"] = nbytes
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--prompts", required=True, help="JSON file: a list of token-id lists")
    ap.add_argument("--eager", action="store_true", help="enforce_eager (no torch.compile)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sync", action="store_true", help="also time update_weights")
    a = ap.parse_args()
    torch.set_num_threads(1)

    from megarl.rollout.protocol import SamplingParams
    from megarl.rollout.vllm import VLLMEngine

    prompts = json.loads(Path(a.prompts).read_text())
    t0 = time.perf_counter()
    engine = VLLMEngine(a.model, tokenizer=a.tokenizer, dtype="float32",
                        max_num_seqs=len(prompts),
                        max_model_len=max(map(len, prompts)) + NEW,
                        kv_cache_memory_bytes=256 * 2**20, enforce_eager=a.eager, seed=0)
    start_s = time.perf_counter() - t0
    seed = [0]

    def run() -> int:
        seed[0] += 1
        out = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=NEW,
                                                      ignore_eos=True, seed=seed[0]))
        return sum(len(c.token_ids) for c in out)

    calls = timed_calls(run, a.repeats)
    res = {"calls": calls, "start_s": start_s}
    if a.sync:
        res["sync"] = bench_sync(engine, a.model, a.repeats)
    engine.close()
    import vllm

    res["version"] = vllm.__version__
    print("VLLMBENCH " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
